"""Triton softmax family on the GPU at real sizes (the benchmark shapes included), against float64.

Outputs are NaN-poisoned by conftest's ``torch.empty`` patch, so an unwritten element fails.
"""
from __future__ import annotations

import pytest
import torch

import splitsoftmax as ss
from splitsoftmax.ops._triton import configs

pytestmark = pytest.mark.gpu

# (atol, rtol): one unit in the last place of the output dtype, float32 statistics.
TOL = {torch.float32: (1e-6, 2e-6), torch.bfloat16: (1e-6, 2 ** -8), torch.float16: (1e-7, 2 ** -11)}
PERF_SHAPES = [(4096, 32768, torch.float32), (16384, 4096, torch.float32), (512, 262144, torch.bfloat16),
               (8, 1 << 24, torch.float32), (1, 1 << 28, torch.float32)]


def _k():
    from splitsoftmax.ops.softmax import kernel as softmax
    return softmax


def _close(got, ref, dtype, what, peer=None):
    """``got`` against the float64 ``ref``: with ``peer`` (torch's own result in the same
    precision) the error may be at most 2x torch's (FlashAttention's rule), else one output ulp."""
    assert not torch.isnan(got).any(), f"{what}: NaN in output"
    if peer is None:
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got.double(), ref.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
        return
    err = (got.double() - ref).abs().max().item()
    bound = 2 * (peer.double() - ref).abs().max().item() + 1e-7
    assert err <= bound, f"{what}: max err {err:.3e} > 2x torch's {bound:.3e}"


def _rows(t: torch.Tensor, k: int = 4) -> torch.Tensor:
    """A few rows spread over ``t`` (first, last, middle) to check against float64."""
    idx = torch.unique(torch.linspace(0, t.shape[0] - 1, min(k, t.shape[0])).long())
    return t[idx.to(t.device)]


@pytest.mark.parametrize("rows,cols,dtype", PERF_SHAPES, ids=lambda v: str(v))
def test_perf_shapes_forward(rows, cols, dtype):
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    xs = _rows(x).double()
    for log, fn, ref_fn in ((False, ss.softmax, torch.softmax), (True, ss.log_softmax, torch.log_softmax)):
        y = fn(x)
        _close(_rows(y), ref_fn(xs, -1), dtype, f"{rows}x{cols} log={log}", peer=_rows(ref_fn(x, -1)))
        del y
    _close(_rows(ss.logsumexp(x)), torch.logsumexp(xs, -1), torch.float32, f"{rows}x{cols} logsumexp",
           peer=torch.logsumexp(_rows(x).float(), -1))


@pytest.mark.parametrize("cols", [1, 17, 97, 129, 1000, 4096, 40000, 100003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lengths(cols, dtype):
    rows = max(1, (1 << 21) // cols)
    x = (torch.randn(rows, cols, device="cuda") * 4).to(dtype)
    xd = x.double()
    for fn, ref_fn in ((ss.softmax, torch.softmax), (ss.log_softmax, torch.log_softmax)):
        _close(fn(x), ref_fn(xd, -1), dtype, f"{fn.__name__} {cols}", peer=ref_fn(x, -1))
    _close(ss.logsumexp(x), torch.logsumexp(xd, -1), torch.float32, f"logsumexp {cols}",
           peer=torch.logsumexp(x.float(), -1))


@pytest.mark.parametrize("rows,cols", [(64, 4096), (300, 50000), (4, 3_000_001)])
@pytest.mark.parametrize("log", [False, True])
def test_backward(rows, cols, log):
    x = torch.randn(rows, cols, device="cuda").requires_grad_()
    dy = torch.randn(rows, cols, device="cuda")
    fn, ref_fn = (ss.log_softmax, torch.log_softmax) if log else (ss.softmax, torch.softmax)
    (g,) = torch.autograd.grad(fn(x), x, dy)
    xd = x.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(ref_fn(xd, -1), xd, dy.double())
    # float32 bound: rounding of y (relative |y| eps inside exp for log) and of the row sum
    xd = xd.detach()
    p, y = torch.softmax(xd, -1), ref_fn(xd, -1)
    dyd = dy.double()
    s_abs = dyd.abs().sum(-1, keepdim=True) if log else (dyd.abs() * p).sum(-1, keepdim=True)
    tol = 1e-6 + 1e-5 * (ref.abs() + p * (dyd.abs() + s_abs) * (1 + y.abs()))
    err = (g.double() - ref).abs()
    assert not torch.isnan(g).any() and (err <= tol).all(), f"max err {err.max().item()}"
    xl = x.detach().requires_grad_()
    gl = torch.randn(rows, device="cuda")
    (dl,) = torch.autograd.grad(ss.logsumexp(xl), xl, gl)
    _close(dl, p * gl.double()[:, None], torch.float32, "logsumexp grad",
           peer=torch.softmax(x.detach(), -1) * gl[:, None])


def test_empty_nan_and_strided_rows():
    x = torch.randn(6, 70000, device="cuda")
    x[1] = float("-inf")
    x[4, 123] = float("nan")
    y = ss.softmax(x)
    assert (y[1] == 0).all() and torch.isnan(y[4]).all()
    keep = [0, 2, 3, 5]
    _close(y[keep], torch.softmax(x[keep].double(), -1), torch.float32, "rows beside", peer=torch.softmax(x[keep], -1))
    lse = ss.logsumexp(x)
    assert lse[1] == float("-inf") and torch.isnan(lse[4])
    big = torch.randn(1000, 5000, device="cuda")
    v = big[:, 100:4196]
    _close(ss.softmax(v), torch.softmax(v.double(), -1), torch.float32, "strided rows", peer=torch.softmax(v, -1))


@pytest.mark.parametrize("path", ["two_pass", "split", "coop", "coop, siblings never waited for"])
def test_forced_paths_at_real_sizes(path, monkeypatch):
    monkeypatch.setattr(configs.SOFTMAX, "one_pass_max_cols", 1024)
    monkeypatch.setattr(configs.SOFTMAX, "split_rows_per_sm", 0.0 if path == "two_pass" else 1e9)
    if not path.startswith("coop"):
        monkeypatch.setattr(configs.SOFTMAX, "coop_max_chunks", 0)
    if path != "coop":  # every coop program short of siblings computes the row's state from x itself
        monkeypatch.setattr(configs.SOFTMAX, "coop_spin", 0)
    k = _k()
    x = torch.randn(37, 123457, device="cuda", dtype=torch.bfloat16)
    assert k._plan(x).path == path.split(",")[0]
    for log in (False, True):
        y, lse = k.softmax_fwd(x, log)
        ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
        peer = (torch.log_softmax if log else torch.softmax)(x, -1)
        _close(y, ref, torch.bfloat16, f"{path} log={log}", peer=peer)
        _close(lse, torch.logsumexp(x.double(), -1), torch.float32, f"{path} lse",
               peer=torch.logsumexp(x.float(), -1))


def test_no_recompile_per_length():
    k = _k()
    x = torch.randn(8, 200000, device="cuda")
    k.softmax_fwd(x[:, :100000], False)
    kernels = (k._normalize_fwd_kernel, k._lse_fwd_kernel, k._softmax_coop_kernel)
    before = sum(map(_cache_size, kernels))
    for n in (100016, 100032, 100048, 100000 + 4096):
        k.softmax_fwd(x[:, :n], False)
    after = sum(map(_cache_size, kernels))
    assert after == before, f"{after - before} recompiles for lengths of one bucket"


def _cache_size(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton has no device_caches")
    return sum(len(c[0]) for c in caches.values())


def _check_special_rows(x, y, lse, log):
    """Rows 7 (all ``-inf``), 8 (a NaN) and 9 (``-inf`` but for its last 5000 columns) of
    :func:`test_coop_walks_many_rows_with_special_rows`, then every other row against float64."""
    empty = float("-inf") if log else 0.0
    assert (y[7] == empty).all() and lse[7] == float("-inf")
    assert torch.isnan(y[8]).all() and torch.isnan(lse[8])
    assert (y[9, :35000] == empty).all()
    fn = torch.log_softmax if log else torch.softmax
    _close(y[9, 35000:], fn(x[9, 35000:].double(), -1), torch.float32, "row 9", peer=fn(x[9, 35000:], -1))
    keep = torch.tensor([i for i in range(x.shape[0]) if i not in (7, 8, 9)], device=x.device)
    xd = x[keep].double()
    _close(y[keep], fn(xd, -1), torch.float32, f"coop log={log}", peer=fn(x[keep], -1))
    _close(lse[keep], torch.logsumexp(xd, -1), torch.float32, "coop lse", peer=torch.logsumexp(x[keep], -1))
    _close(lse[9:10], torch.logsumexp(x[9:10].double(), -1), torch.float32, "row 9 lse",
           peer=torch.logsumexp(x[9:10], -1))


@pytest.mark.parametrize("log", [False, True])
def test_coop_walks_many_rows_with_special_rows(log):
    """fp32 rows of 3 coop chunks, ~9 rows per program (the software pipeline over rows), with an
    all ``-inf`` row, a NaN row and a row whose first chunks are all ``-inf`` (empty states)."""
    k = _k()
    x = torch.randn(400, 40000, device="cuda") * 4
    x[7] = float("-inf")
    x[8, 12345] = float("nan")
    x[9, :35000] = float("-inf")
    p = k._plan(x)
    assert p.path == "coop" and p.splits == 3
    _check_special_rows(x, *k.softmax_fwd(x, log), log)
