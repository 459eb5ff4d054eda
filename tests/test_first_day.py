"""What a new user meets first: autocast, meta and DTensor inputs, replicated-argument checks, the
command line's help and refusals, ``env``, ``SPLITSOFTMAX_LOG``, importing from the clone's parent."""
import json
import logging
import os
import subprocess
import sys
from importlib import metadata

import pytest
import torch
import torch.nn.functional as F

import splitsoftmax as ss
from splitsoftmax.distributed import LoopbackWorld

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist_util import ROOT, assert_ok, spawn, worker_env  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_under_autocast_is_cast_like_sdpa(dtype):
    """RoPE gives float32 q/k while the projections give v in the autocast dtype: SDPA casts all
    three and returns the autocast dtype; so does ss.attention, gradients in the leaves' dtypes."""
    q, k = (torch.randn(2, 4, 13, 16, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, 13, 16).to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        got = ss.attention(q, k, v, causal=True)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == want.dtype == dtype
    ref = F.scaled_dot_product_attention(*(t.detach().to(dtype).double() for t in (q, k, v)), is_causal=True)
    tol = 2 * (want.double() - ref).abs().max().item() + 2 * torch.finfo(dtype).eps
    assert (got.double() - ref).abs().max().item() <= tol
    got.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == torch.float32 and v.grad.dtype == dtype
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


def test_autocast_leaves_float64_and_other_devices_alone():
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ss.attention(q, q, q).dtype == torch.float64  # not an autocast-eligible dtype, as in SDPA
    with torch.autocast("cuda", dtype=torch.float16, enabled=torch.cuda.is_available()):
        assert ss.attention(q.float(), q.float(), q.float()).dtype == torch.float32  # CPU tensors: no CPU region


def test_meta_tensors_give_shapes_without_data():
    """Deferred initialisation runs the model on meta tensors: shapes and dtypes, no .item()."""
    q = torch.empty(2, 4, 9, 16, device="meta")
    k = torch.empty(2, 2, 9, 16, device="meta")
    out, lse = ss.attention(q, k, k, causal=True, return_lse=True)
    assert out.is_meta and out.shape == (2, 4, 9, 16) and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    qg = q.clone().requires_grad_()
    ss.attention(qg, k, k).sum().backward()
    assert qg.grad.is_meta and qg.grad.shape == q.shape
    assert ss.softmax(q).is_meta and ss.logsumexp(q).shape == (2, 4, 9)


def case_dtensor(group):
    """Worker: DTensors are refused with a TypeError naming the argument and what to pass instead."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (1,))
    q = distribute_tensor(torch.randn(1, 2, 8, 4), mesh, [Shard(2)])
    for fn, name in ((lambda: ss.attention(q, q, q), "q"), (lambda: ss.softmax(q), "x"),
                     (lambda: ss.sharded_attention(q.to_local(), q, q.to_local(), group=mesh), "k")):
        with pytest.raises(TypeError, match=rf"{name} is a DTensor \(placements \[S\(2\)\]\).*{name}.to_local\(\)"):
            fn()


@pytest.mark.distributed
def test_dtensor_inputs_are_refused_clearly():
    assert_ok(spawn(1, "tests/test_first_day.py:case_dtensor", timeout=120), "DTensor inputs")


def test_tree_detects_a_q_that_differs_across_ranks():
    """The tree schedule's q must be replicated: a rank whose q differs is named on every rank."""
    q = torch.randn(1, 2, 3, 8)
    k = torch.randn(1, 2, 12, 8)

    def rank(comm):
        mine = q.clone()
        if comm.rank == 2:
            mine[0, 1, 2, 5] += 1e-3
        with pytest.raises(ValueError, match=r"q differs across ranks \(rank\(s\) \[0, 1\] hold copy 1; "
                                             r"rank\(s\) \[2\] hold copy 2\)"):
            ss.sharded_attention(mine, ss.shard(k, group=comm), ss.shard(k, group=comm), group=comm, schedule="tree")
        out = ss.sharded_attention(q, ss.shard(k, group=comm), ss.shard(k, group=comm), group=comm, schedule="tree")
        return out

    outs = LoopbackWorld(3).run(rank)
    torch.testing.assert_close(outs[0], ss.attention(q, k, k), atol=1e-6, rtol=1e-6)


def test_target_mismatch_names_ranks_not_checksums():
    logits, target = torch.randn(4, 12), torch.randint(0, 12, (4,))

    def rank(comm):
        t = target.clone()
        if comm.rank == 1:
            t[3] = (t[3] + 1) % 12
        with pytest.raises(ValueError) as err:
            ss.sharded_cross_entropy(logits[:, 6 * comm.rank:6 * comm.rank + 6], t, group=comm)
        return str(err.value)

    for msg in LoopbackWorld(2).run(rank):
        assert "target differs across ranks (rank(s) [0] hold copy 1; rank(s) [1] hold copy 2)" in msg, msg
        assert not any(len(w.strip("();,")) > 8 and w.strip("();,").isdigit() for w in msg.split()), msg


def cli(capsys, *args) -> tuple:
    """``python -m splitsoftmax *args`` in this process: ``(exit code, stdout, stderr)``."""
    from splitsoftmax.tools.cli import main
    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("command", ["trace", "env"])
def test_trace_and_env_help_explain_instead_of_running(capsys, command):
    rc, out, _ = cli(capsys, command, "--help")
    assert rc == 0 and out.startswith(f"usage: splitsoftmax {command}")
    assert "State trace" not in out and "torch.distributed" not in out
    rc, _, err = cli(capsys, command, "--bogus")
    assert rc == 2 and "unrecognized arguments: --bogus" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cuda_only_commands_say_so_without_a_gpu(capsys):
    for bench in ("attention", "softmax", "cross_entropy"):
        rc, _, err = cli(capsys, "bench", bench)
        assert rc == 2 and f"bench {bench} needs a CUDA device" in err, err
    assert cli(capsys, "bench", "attention", "--help")[0] == 0
    rc, _, err = cli(capsys, "verify", "--device", "cuda")
    assert rc == 2 and "--device cuda: no CUDA device" in err, err


def test_verify_rejects_no_ranks(capsys):
    for n in ("0", "-2"):
        rc, _, err = cli(capsys, "verify", "--nproc", n)
        assert rc == 2 and "--nproc must be at least 1" in err, err


def test_env_reports_transformers_launchers_and_settings(capsys, monkeypatch):
    monkeypatch.setenv("SPLITSOFTMAX_TIMEOUT", "17")
    monkeypatch.setenv("SPLITSOFTMAX_LOG", "info")
    monkeypatch.setenv("SPLITSOFTMAX_HOST", "node-7")
    rc, out, _ = cli(capsys, "env")
    assert rc == 0
    lines = {ln.split(None, 1)[0]: ln.split(None, 1)[1] for ln in out.splitlines() if ln.strip()}
    want = metadata.version("transformers") if _installed("transformers") else "not installed"
    assert lines["transformers"] == want
    assert "mpirun" in lines["launchers"] and "torchrun" in lines["launchers"]
    assert "SPLITSOFTMAX_TIMEOUT 17 s;" in lines["settings"] and "SPLITSOFTMAX_LOG info" in lines["settings"]
    assert "SPLITSOFTMAX_HOST node-7" in lines["settings"]
    monkeypatch.delenv("SPLITSOFTMAX_TIMEOUT")
    assert "SPLITSOFTMAX_TIMEOUT 300 s (default)" in cli(capsys, "env")[1]


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def _ring(comm):
    q = torch.randn(1, 2, 10, 8, generator=torch.Generator().manual_seed(3))
    mine = ss.shard(q, group=comm, layout="zigzag")
    return ss.sharded_attention(mine, mine, mine, causal=True, group=comm, layout="zigzag")


def test_debug_log_traces_steps_transfers_and_times(caplog):
    caplog.set_level(logging.DEBUG, logger="splitsoftmax")
    LoopbackWorld(2).run(_ring)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "splitsoftmax")
    for rank in (0, 1):
        assert f"ring forward step 1/2: rank {rank} on the K/V of rank {1 - rank}" in text, text
        assert f"rank {rank}: send 640 bytes to rank {1 - rank}" in text  # B*Hkv*5*(D+Dv) float32
    assert "ms host time" in text


def test_log_switch_from_the_environment():
    code = ("import torch, splitsoftmax as ss, sys; sys.path.insert(0, 'tests'); "
            "from test_first_day import _ring; ss.distributed.LoopbackWorld(2).run(_ring)")
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                        env=worker_env({"SPLITSOFTMAX_LOG": "debug"}))
    assert on.returncode == 0 and "splitsoftmax[rank 0] DEBUG ring forward step 0/2" in on.stderr, on.stderr
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=worker_env({"SPLITSOFTMAX_LOG": ""}))
    assert off.returncode == 0 and "splitsoftmax[" not in off.stderr


def _editable_install_of_this_checkout() -> bool:
    try:
        info = json.loads(metadata.distribution("splitsoftmax").read_text("direct_url.json") or "{}")
    except metadata.PackageNotFoundError:
        return False
    url = info.get("url", "")
    return info.get("dir_info", {}).get("editable", False) and os.path.realpath(url[7:]) == os.path.realpath(ROOT)


@pytest.mark.skipif(not _editable_install_of_this_checkout(), reason="splitsoftmax is not installed from this "
                    "checkout in editable mode (make venv does that)")
def test_import_from_the_folder_that_holds_the_clone(tmp_path):
    """A clone named ``splitsoftmax`` in the working directory must not shadow the installed package
    with an empty namespace package (the editable install is in compat mode: a path entry)."""
    (tmp_path / "splitsoftmax").symlink_to(ROOT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", "import splitsoftmax as ss; print(ss.__file__, len(ss.__all__))"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert os.path.realpath(r.stdout.split()[0]) == os.path.join(os.path.realpath(ROOT), "splitsoftmax", "__init__.py")
