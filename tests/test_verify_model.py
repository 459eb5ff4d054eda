"""``python -m splitsoftmax verify --model CONFIG``: a transformers model sequence-parallel under every
schedule against one rank, on CPU ranks; a perturbed rank and bad configs exit non-zero."""
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from splitsoftmax.tools.verify import model as vm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def run(*args, env=None, timeout=400):
    return subprocess.run([sys.executable, "-m", "splitsoftmax", "verify", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=dict(os.environ, **(env or {})))


def rows_of(out: str) -> list[list[str]]:
    """The table's lines split into cells (the line after the header up to the blank line)."""
    lines = out.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("batch "))
    end = lines.index("", start)
    return [line.split() for line in lines[start + 1:end]]


def assert_passes(r, world: int):
    """Exit 0; a passing row per candidate (schedule, mesh) and batch (plain, packed), with tolerances
    of float32's size; the summary line."""
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rows = rows_of(r.stdout)
    want = {(s, f"{m[0]}x{m[1]}") for s, m in vm.candidates(world)}
    assert {("ring", f"{world}x1"), ("allgather", f"{world}x1"), ("heads", f"1x{world}")} <= want
    for docs in (False, True):
        mine = [row for row in rows if ("docs" in row) == docs]
        assert sorted((row[-11], row[-10]) for row in mine) == sorted(want), r.stdout
    for row in rows:
        assert row[-1] == "ok", row
        loss_rel, loss_tol, _, grad_rel, grad_tol = map(float, row[-8:-3])
        assert loss_rel <= loss_tol < 1e-4 and grad_rel <= grad_tol < 1e-4  # float32 sizes, not loose
    assert f"{len(rows)}/{len(rows)} runs passed" in r.stdout
    assert "MISMATCH" not in r.stdout


def test_candidates_take_every_training_schedule_the_package_accepts(monkeypatch):
    assert vm.candidates(2) == [("ring", (2, 1)), ("allgather", (2, 1)), ("heads", (1, 2))]
    assert vm.candidates(1) == [("ring", (1, 1)), ("allgather", (1, 1)), ("heads", (1, 1))]
    # the 2-D schedules: every mesh with both degrees above 1 (none on 2 or 3 ranks)
    assert vm.candidates(3) == [("ring", (3, 1)), ("allgather", (3, 1)), ("heads", (1, 3))]
    assert vm.candidates(4)[3:] == [("heads+ring", (2, 2)), ("heads+allgather", (2, 2))]
    assert [c for c in vm.candidates(8) if c[0] == "heads+ring"] == [("heads+ring", (4, 2)), ("heads+ring", (2, 4))]
    # a schedule the package does not accept is not run, whatever MESHES says
    monkeypatch.setattr(vm, "SCHEDULES", tuple(s for s in vm.SCHEDULES if s != "heads+allgather"))
    assert [c[0] for c in vm.candidates(4)] == ["ring", "allgather", "heads", "heads+ring"]


def test_tolerance_is_float32_sized_and_catches_a_small_error():
    """Against a float64 truth: a float32 rounding of it passes, one relative 1e-5 off does not."""
    gen = torch.Generator().manual_seed(0)
    truth = [torch.randn(16, 8, generator=gen, dtype=torch.float64) * 0.05]
    peer = [t.float() for t in truth]
    loss64 = torch.tensor(4.5, dtype=torch.float64)
    ok = vm.compare_run("b", "ring", "2x1", (loss64.float(), [p * (1 + 2 ** -23) for p in peer]),
                        (loss64.float(), peer), (loss64, truth), ["w"], 2, 0.0)
    assert ok.ok and ok.grad_tol < 5e-7 and ok.loss_tol < 1e-5  # a few float32 ulps of the sizes
    bad = vm.compare_run("b", "ring", "2x1", (loss64.float(), [p + 1e-5 * p.abs().max() for p in peer]),
                         (loss64.float(), peer), (loss64, truth), ["w"], 2, 0.0)
    assert not bad.ok and bad.worst == "w"
    nan = vm.compare_run("b", "ring", "2x1", (loss64.float() * float("nan"), peer), (loss64.float(), peer),
                         (loss64, truth), ["w"], 2, 0.0)
    assert not nan.ok


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_llama_on_four_ranks_matches_one_rank():
    r = run("--model", "llama", "--nproc", "4")
    assert_passes(r, 4)
    assert "llama: 2 layers, hidden 64, 4/2 heads" in r.stdout
    assert "[10/10] llama" in r.stderr  # progress: 3 schedules and 2 on the 2 x 2 mesh x (plain, packed)


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_gpt_oss_sinks_and_window_on_two_ranks():
    if "gpt_oss" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no gpt-oss model")
    r = run("--model", "gpt-oss", "--nproc", "2")
    assert_passes(r, 2)
    assert "sinks" in r.stdout and "sliding_window=8" in r.stdout


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_config_json_path_gemma2_softcap_and_window(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY, model_type="gemma2", sliding_window=6, attn_logit_softcapping=4.0,
                                    final_logit_softcapping=10.0, query_pre_attn_scalar=16)))
    r = run("--model", str(path), "--nproc", "2")
    assert_passes(r, 2)
    assert "gemma2: 2 layers" in r.stdout and "attn_logit_softcapping=4.0" in r.stdout


@pytest.mark.distributed
@pytest.mark.once
@pytest.mark.timeout(450)
def test_a_perturbed_rank_is_a_mismatch():
    """Rank 1 adds 1e-4 to its embeddings: every run differs from one rank, far beyond the tolerance."""
    r = run("--model", "llama", "--nproc", "2", env={vm.PERTURB: "1:1e-4"})
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    rows = rows_of(r.stdout)
    assert rows and all(row[-1] == "MISMATCH" for row in rows)
    assert f"0/{len(rows)} runs passed" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "nonesuch"], "neither a built-in config"),
    (["--model", "llama", "--dtype", "bfloat16"], "float32"),
    (["--model", "nonesuch.json"], "neither a built-in config"),
])
def test_bad_model_arguments_are_usage_errors(args, message):
    r = run(*args, "--nproc", "2", timeout=120)
    assert r.returncode == 2 and message in r.stderr and "--model" in r.stderr, r.stderr


@pytest.mark.parametrize("config, message", [(TINY, "needs a \"model_type\""),
                                             (dict(TINY, model_type="no_such_model"), "cannot build model_type")])
def test_config_json_transformers_cannot_build_is_a_usage_error(tmp_path, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    r = run("--model", str(path), "--nproc", "2", timeout=120)
    assert r.returncode == 2 and message in r.stderr and str(path) in r.stderr, r.stderr
