"""The vocabulary-statistics Triton kernels on the GPU at real sizes, against float64.

Outputs are NaN-poisoned by conftest's ``torch.empty`` patch, so an unwritten element fails.
Errors may be at most 2x torch's own in the same dtype (FlashAttention's rule) plus a float32 floor.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import splitsoftmax as ss
from splitsoftmax.core import reference as ref
from splitsoftmax.tools.bench.vocab import torch_kl, torch_stats
from splitsoftmax.distributed import LoopbackWorld

import test_vocab_sharded as cases
from _dist_util import assert_ok, spawn

pytestmark = pytest.mark.gpu
NEG_INF = float("-inf")


def make(n, v, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = torch.randn(n, v, generator=g, device="cuda", dtype=torch.float64) * 3
    q = p + torch.randn(n, v, generator=g, device="cuda", dtype=torch.float64)
    target = torch.randint(0, v, (n,), generator=g, device="cuda")
    target[torch.rand(n, generator=g, device="cuda") < 0.2] = -100
    return p.to(dtype), q.to(dtype), target


def _run(fn, inputs, rows, **kw):
    """Outputs of ``fn`` (a tuple) and the gradients of a weighted sum of the outputs at ``rows``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    w = torch.linspace(0.5, 1.5, len(rows), device="cuda", dtype=torch.float64).bfloat16()
    loss = sum((o[rows] * w.to(o.dtype)).sum() for o in outs)
    return [o.detach()[rows] for o in outs], [g[rows] for g in torch.autograd.grad(loss, leaves)]


def _within_2x_torch(ours, peer, oracle, inputs, rows, what, **kw):
    """Outputs and gradients (at ``rows``) of ``ours`` against float64: error <= 2x ``peer``'s + 2e-6."""
    got, theirs = _run(ours, inputs, rows, **kw), _run(peer, inputs, rows, **kw)
    want = _run(oracle, [t[rows].double() for t in inputs], torch.arange(len(rows), device="cuda"), **kw)
    names = [f"output {i}" for i in range(len(got[0]))] + [f"gradient {i}" for i in range(len(got[1]))]
    for a, b, c, name in zip([*got[0], *got[1]], [*theirs[0], *theirs[1]], [*want[0], *want[1]], names):
        assert not torch.isnan(a).any(), f"{what} {name}: NaN"
        err = (a.double() - c).abs().max().item()
        bound = 2 * (b.double() - c).abs().max().item() + 2e-6
        assert err <= bound, f"{what} {name}: max err {err:.3e} > 2x torch's + 2e-6 = {bound:.3e}"


@pytest.mark.parametrize("n,v", [(3, 50000), (300, 4099), (2, 128256), (1024, 128256), (2000, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64(n, v, dtype):
    """Few rows (split over programs), many short rows (batched per program), the LM-head width."""
    p, q, target = make(n, v, dtype, seed=n)
    rows = torch.unique(torch.linspace(0, n - 1, min(n, 16), device="cuda").long())
    t_rows = target[rows]
    stats = lambda a, **kw: ss.logprobs(a, target, return_entropy=True, **kw)  # noqa: E731
    peer = lambda a, **kw: torch_stats(a, target, **kw)  # noqa: E731
    oracle = lambda a, **kw: ref.vocab_stats(a, t_rows, **kw)  # noqa: E731
    for temperature in (1.0, 0.7):
        what = f"{n}x{v} {dtype} T={temperature}"
        _within_2x_torch(stats, peer, oracle, [p], rows, f"{what} logprobs", temperature=temperature)
        _within_2x_torch(ss.kl_div, torch_kl, ref.kl_div, [p, q], rows, f"{what} kl", temperature=temperature)
    h = ss.entropy(p)[rows].double()
    torch.testing.assert_close(h, ref.vocab_stats(p[rows], t_rows * 0)[1], atol=1e-5, rtol=1e-5)


def test_edge_rows():
    """All -inf row: -inf, 0, 0 and no gradient; NaN only in its own row; masked columns get no
    gradient; an ignored row gives 0; the logits are never written."""
    p, q, target = make(6, 70000, torch.bfloat16, seed=1)
    p[0], q[0] = NEG_INF, NEG_INF
    p[1, :50000], q[1, :50000] = NEG_INF, NEG_INF
    p[2, 123] = float("nan")
    target[1], target[3], target[4] = 60000, -100, 5
    x = p.clone().requires_grad_()
    lp, h = ss.logprobs(x, target, return_entropy=True)
    kl = ss.kl_div(x, q)
    keep = [0, 1, 3, 4, 5]
    (lp[keep].sum() + h[keep].sum() + kl[keep].sum()).backward()
    assert lp[0] == NEG_INF and h[0] == 0 and kl[0] == 0 and not x.grad[0].any()
    assert torch.isnan(lp[2]) and torch.isnan(h[2]) and torch.isnan(kl[2]) and not x.grad[2].any()
    assert lp[3] == 0 and h[3] == 0 and torch.isfinite(lp[[1, 4, 5]]).all()
    assert torch.isfinite(x.grad).all() and not x.grad[1, :50000].any()
    assert torch.equal(p.view(torch.int16), x.detach().view(torch.int16)), "the logits were written"


def test_memory_no_float32_copy():
    """The forward adds at most 64 MiB above 1 GiB of bf16 logits; forward + backward their gradient + 64 MiB."""
    p, q, target = make(4096, 128256, torch.bfloat16, seed=2)
    x = p.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        ss.logprobs(x, target, return_entropy=True)
        ss.kl_div(x, q)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 64 * 2**20
    torch.cuda.reset_peak_memory_stats()
    lp, h = ss.logprobs(x, target, return_entropy=True)
    torch.autograd.grad(lp.sum() + h.sum(), x)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= x.numel() * 2 + 64 * 2**20


def test_sharded_loopback_on_cuda(monkeypatch):
    """The sharded cases (odd widths, an empty slice) with CUDA tensors on 3 loopback ranks."""
    monkeypatch.setattr(cases, "DEVICE", torch.device("cuda"))
    LoopbackWorld(3).run(cases.case_all)


def test_compile_inductor():
    p, q, target = make(64, 5000, torch.bfloat16, seed=3)

    def step(a, b):
        lp, h = ss.logprobs(a, target, temperature=0.9, return_entropy=True)
        return lp, h, ss.kl_div(a, b)
    torch._dynamo.reset()
    rows = torch.arange(64, device="cuda")
    got, want = _run(torch.compile(step, fullgraph=True), [p, q], rows), _run(step, [p, q], rows)
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_bad_target_fails_on_device():
    """On CUDA a target outside [0, V) fails a device-side assertion (no host sync), like torch's
    cross-entropy; it poisons the CUDA context, so it runs in a child process."""
    code = ("import torch, splitsoftmax as ss\n"
            "x = torch.randn(4, 10, device='cuda')\n"
            "ss.logprobs(x, torch.tensor([1, 10, 3, 4], device='cuda'))\n"
            "torch.cuda.synchronize()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "assert" in (done.stderr + done.stdout).lower(), done.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_cases():
    assert_ok(spawn(2, "tests/test_vocab_sharded.py:case_all", timeout=300, env={"SPLITSOFTMAX_TIMEOUT": "60"},
                    backend="nccl"), "nccl world of 2")
