"""``python -m splitsoftmax bench ring`` end to end on 2 CPU ranks (Gloo): the harness, not the speed."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.once]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SS_METHODS = {"ss-ring", "ss-allgather", "ss-ring-nocomm", "ss-heads"}
CP_METHODS = {f"torch-cp-{b}-{rot}" for b in ("flash", "cudnn") for rot in ("allgather", "alltoall")}
ONE_GPU_PEERS = {"1gpu-sdpa-flash", "1gpu-sdpa-cudnn"}
ONE = "1cpu-ss"  # splitsoftmax on one device: a CPU rank here
VARIANTS = ("documents", "window")
# visible (query, key) pairs at S=64 of the CPU defaults: 4 documents of 16, a window of 16 keys
PAIRS = {"documents": 4 * 16 * 17 // 2, "window": sum(min(i + 1, 16) for i in range(64))}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("ring")
    env = dict(os.environ, OMP_NUM_THREADS="1", SPLITSOFTMAX_TIMEOUT="60")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-m", "splitsoftmax", "bench", "ring", "--nproc", "2", "--seqs", "64",
                        "--out", str(out), "--deadline", "100"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(out / "ring_p2.json") as f:
        return json.load(f), r.stdout, out


def test_gate_passed_on_every_schedule(bench):
    data, _, _ = bench
    assert data["meta"]["world"] == 2 and data["meta"]["backend"] == "gloo" and data["complete"] is True
    ops = {(g["op"], g["schedule"]) for g in data["gate"]}
    assert {s for _, s in ops} == {"ring", "allgather", "heads", "tree"}
    assert len(data["gate"]) == 14  # ring, allgather, heads x causal, non-causal x fwd, bwd; tree fwd, bwd
    for g in data["gate"]:
        assert g["ok"] and g["err"] <= g["tol"], g


def _shape(r):
    return r["S"], r["Hkv"], r["variant"], r["causal"], r["mode"]


def test_every_shape_and_method_recorded(bench):
    data, _, _ = bench
    rows = data["results"]
    modes = ("fwd", "fwd+bwd")
    assert {_shape(r) for r in rows} == ({(64, h, "plain", c, m) for h in (4, 2) for c in (True, False) for m in modes}
                                         | {(64, h, v, True, m) for h in (4, 2) for v in VARIANTS for m in modes})
    assert data["meta"]["H"] == 4 and data["meta"]["Hkv"] == [4, 2] and data["meta"]["variants"] == list(VARIANTS)
    for s, hkv, variant, causal, mode in {_shape(r) for r in rows}:
        here = {r["method"]: r for r in rows if _shape(r) == (s, hkv, variant, causal, mode)}
        for m in SS_METHODS | {ONE}:
            r = here[m]
            assert r["ms"] > 0 and r["reps"] >= 2 and r["tflops_per_gpu"] > 0, r
            assert r["P"] == (1 if m == ONE else 2)
        if variant == "plain":
            peers = CP_METHODS | ({f"{m}-nolb" for m in CP_METHODS} if not causal else set()) | ONE_GPU_PEERS
        else:
            peers = {"torch-cp-flex", "1gpu-flex"}
        for m in peers:
            assert "ms" not in here[m] and "CUDA" in here[m]["skipped"], here[m]
        ours = {"ss-ring-balanced"} if variant == "documents" else set()
        for m in ours:
            assert here[m]["ms"] > 0 and here[m]["P"] == 2 and here[m]["tflops_per_gpu"] > 0, here[m]
        assert set(here) == SS_METHODS | {ONE} | peers | ours


def test_tflops_formula(bench):
    data, _, _ = bench
    h, d = data["meta"]["H"], data["meta"]["D"]
    for r in data["results"]:
        if "ms" in r:
            pairs = PAIRS.get(r["variant"], 64 * 64 * (0.5 if r["causal"] else 1))
            flops = 4 * h * pairs * d * (3.5 if r["mode"] == "fwd+bwd" else 1)
            assert r["tflops_per_gpu"] == pytest.approx(flops / r["P"] / (r["ms"] * 1e-3) / 1e12, rel=1e-9)


def test_derived_and_decode(bench):
    data, _, _ = bench
    by = {(*_shape(r), r["method"]): r["ms"] for r in data["results"] if "ms" in r}
    assert len(data["derived"]) == 16  # 2 Hkv x (plain causal and not, 2 variants) x 2 modes
    for d in data["derived"]:
        key = _shape(d)
        ring = by[(*key, "ss-ring")]
        assert d["efficiency_vs_1cpu-ss"] == pytest.approx(by[(*key, ONE)] / (2 * ring))
        assert "efficiency_vs_1gpu-ss" not in d
        assert d["ring_over_nocomm"] == pytest.approx(ring / by[(*key, "ss-ring-nocomm")])
        assert d["ss-heads_over_ring"] == pytest.approx(by[(*key, "ss-heads")] / ring)
        assert "ring_over_torch_cp_best" not in d  # no torch CP on CPU
    dec = data["decode"]
    assert dec["keys"] == 4096 and dec["max_abs_diff_vs_1gpu"] < 1e-5
    assert {r["method"] for r in dec["rows"] if "ms" in r} == {"tree", "local-split-kv", "small-allreduce", ONE}
    assert dec["tree_over_local_plus_allreduce"] > 0


def test_table_and_plots(bench):
    _, stdout, out = bench
    assert "ss-ring-nocomm" in stdout and "decode 4096 keys" in stdout
    assert stdout.count(" ok") >= 14
    assert "1gpu-ss" not in stdout and f" {ONE} " in stdout  # no GPU ran here
    reason = "torch context parallel over FlexAttention needs CUDA and an NCCL group"
    assert any(line.endswith(reason) for line in stdout.splitlines())  # the reason whole
    pytest.importorskip("matplotlib")
    for name in ("ring_p2_time.png", "ring_p2_tflops.png", "ring_scaling.png"):
        assert (out / name).stat().st_size > 1000


def test_derived_ratios_with_torch_cp_rows():
    """The GPU-only ratios, on made-up rows shaped like a GPU run's (no GPU needed)."""
    from splitsoftmax.tools.bench.ring import derived, render, without_nproc
    base = {"S": 32768, "Hkv": 8, "variant": "plain", "causal": True, "mode": "fwd", "P": 2}
    rows = [base | {"method": "ss-ring", "ms": 6.0, "peak_gib": 1.0},
            base | {"method": "ss-ring-nocomm", "ms": 5.0, "peak_gib": 1.0},
            base | {"method": "torch-cp-flash-allgather", "ms": 10.0, "peak_gib": 2.0},
            base | {"method": "torch-cp-flash-alltoall", "ms": 9.0, "peak_gib": 3.0},
            base | {"method": "torch-cp-cudnn-allgather", "ms": 8.0, "peak_gib": 4.0},
            base | {"method": "torch-cp-cudnn-alltoall-nolb", "error": "RuntimeError: refused"},
            base | {"method": "1gpu-ss", "ms": 11.0, "P": 1},
            base | {"method": "1gpu-sdpa-flash", "ms": 9.0, "P": 1},
            base | {"method": "1gpu-sdpa-cudnn", "ms": 7.5, "P": 1}]
    both = derived(rows + [rows[0] | {"Hkv": 32}], 2)
    assert [x["Hkv"] for x in both] == [8, 32]  # shapes of other head counts kept apart
    d = both[0]
    assert d["ring_over_torch_cp_best"] == pytest.approx(6.0 / 8.0)  # the fastest backend and rotate method
    assert d["ring_peak_over_torch_cp_least"] == pytest.approx(0.5)
    assert d["efficiency_vs_1gpu-ss"] == pytest.approx(11.0 / 12.0)
    assert d["efficiency_vs_1gpu-sdpa-flash"] == pytest.approx(9.0 / 12.0)
    assert d["efficiency_vs_1gpu-sdpa-cudnn"] == pytest.approx(7.5 / 12.0)
    assert d["ring_over_nocomm"] == pytest.approx(1.2)
    text = render({"results": [r | {"tflops_per_gpu": 1.0} if "ms" in r else r for r in rows], "derived": [d]})
    assert "RuntimeError: refused" in text and "ring_over_torch_cp_best 0.750" in text
    assert without_nproc(["--nproc", "4", "--seqs", "64", "--nproc=2", "--out", "x"]) == ["--seqs", "64", "--out", "x"]


@pytest.mark.parametrize("name,s,docs,window", [("documents", 64, 4, 16), ("documents", 70, 4, 16),
                                                ("documents", 3, 4, 16), ("window", 64, 4, 16),
                                                ("window", 50, 4, 1)])
def test_variant_peer_mask_is_the_rule(name, s, docs, window):
    """A variant's FlexAttention mask_mod and visible-pair count agree with the contract's rule for
    splitsoftmax's keywords (``reference.variant_visible``), remainders and empty documents included."""
    import argparse

    from splitsoftmax.core import reference as ref
    from splitsoftmax.tools.bench.ring import Variant
    v = Variant(name, s, argparse.Namespace(docs=docs, window=window))
    i, j = torch.arange(s).view(s, 1), torch.arange(s).view(1, s)
    want = ref.variant_visible(1, s, s, causal=True, **v.kw)[0]
    assert torch.equal(v.mask_mod(0, 0, i, j), want)
    assert v.pairs == int(want.sum())


class _OneRank:
    """A world of one rank for :func:`splitsoftmax.tools.bench.ring.run` in this process (no collectives)."""
    rank, size, kind, cuda, device = 0, 1, "test", False, torch.device("cpu")

    def say(self, msg):
        print(msg)

    def barrier(self):
        pass


def test_a_stopped_run_keeps_the_shapes_it_measured(tmp_path, monkeypatch, capsys):
    """The JSON is written after every shape, ``complete`` false until the end: a run stopped in its
    second shape leaves the first shape's rows on disk, and printed."""
    from splitsoftmax.tools.bench import ring
    opts = ring.defaults(ring.parser().parse_args(["--out", str(tmp_path), "--seqs", "64", "--kv-heads", "4",
                                                   "--causal", "--fwd-only", "--variants", "window"]), False)
    shapes = []

    def bench_shape(w, s, hkv, causal, backward, opts, variant=None):
        shapes.append(variant.name if variant else "plain")
        if len(shapes) == 2:
            raise KeyboardInterrupt("stopped at the deadline")
        return [{"S": s, "Hkv": hkv, "variant": "plain", "causal": causal, "mode": "fwd", "method": "ss-ring",
                 "ms": 1.5, "tflops_per_gpu": 2.0, "P": 1}]
    monkeypatch.setattr(ring, "gate", lambda w, opts: [])
    monkeypatch.setattr(ring, "meta", lambda w, opts, argv: {"world": 1})
    monkeypatch.setattr(ring, "bench_shape", bench_shape)
    with pytest.raises(KeyboardInterrupt):
        ring.run(_OneRank(), opts, [])
    assert shapes == ["plain", "window"]
    with open(tmp_path / "ring_p1.json") as f:
        data = json.load(f)
    assert data["complete"] is False and [r["method"] for r in data["results"]] == ["ss-ring"]
    assert data["results"][0]["ms"] == 1.5
    assert "ss-ring" in capsys.readouterr().out


def test_table_keeps_a_long_reason_whole():
    """A skip's or an error's reason is printed whole, whatever its length."""
    from splitsoftmax.tools.bench.ring import row_lines
    reason = "RuntimeError: " + "a reason longer than any column width, " * 4 + "ending here"
    row = {"S": 64, "Hkv": 4, "variant": "plain", "causal": True, "mode": "fwd", "method": "torch-cp-flash-allgather"}
    lines = row_lines([row | {"error": reason}, row | {"skipped": reason}])
    assert all(line.endswith(reason) for line in lines), lines


def test_single_device_row_named_for_its_device():
    """``1gpu-ss`` on GPUs, ``1cpu-ss`` on CPU ranks; the efficiency is against whichever ran."""
    from splitsoftmax.tools.bench.ring import derived, single_ss
    assert single_ss(_OneRank()) == "1cpu-ss"
    assert single_ss(type("GpuRank", (_OneRank,), {"cuda": True})()) == "1gpu-ss"
    base = {"S": 64, "Hkv": 4, "variant": "plain", "causal": True, "mode": "fwd"}
    d, = derived([base | {"method": "ss-ring", "ms": 2.0}, base | {"method": "1cpu-ss", "ms": 3.0}], 2)
    assert d["efficiency_vs_1cpu-ss"] == pytest.approx(0.75)


def test_mesh_shapes():
    """The 2-D schedules run on every mesh with both degrees above 1; one rank runs the 1 x 1 mesh."""
    from splitsoftmax.tools.bench.ring import World
    w = object.__new__(World)
    for size, shapes in ((1, [(1, 1)]), (2, []), (3, []), (4, [(2, 2)]), (6, [(3, 2), (2, 3)]),
                         (8, [(4, 2), (2, 4)])):
        w.size = size
        assert w.mesh_shapes() == shapes


def test_one_rank_runs_every_schedule(tmp_path):
    """On one rank every splitsoftmax schedule takes its single-rank path, the 2-D ones on the 1 x 1
    mesh, and is timed beside today's ring."""
    env = dict(os.environ, OMP_NUM_THREADS="1", SPLITSOFTMAX_TIMEOUT="60")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-m", "splitsoftmax", "bench", "ring", "--nproc", "1", "--seqs", "32",
                        "--kv-heads", "2", "--causal", "--fwd-only", "--variants", "documents", "--decode-keys", "0",
                        "--out", str(tmp_path), "--deadline", "100"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "ring_p1.json") as f:
        data = json.load(f)
    assert all(g["ok"] for g in data["gate"]) and {g["schedule"] for g in data["gate"]} >= {"heads"}
    mesh = {"ss-heads+ring-1x1", "ss-heads+allgather-1x1"}
    for variant in ("plain", "documents"):
        here = {x["method"]: x for x in data["results"] if x["variant"] == variant}
        for m in SS_METHODS | mesh:
            assert here[m]["ms"] > 0 and here[m]["P"] == 1, here[m]
        d = next(x for x in data["derived"] if x["variant"] == variant)
        assert {f"{m}_over_ring" for m in mesh | {"ss-heads"}} <= set(d)
