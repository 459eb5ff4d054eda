"""Triton softmax family under ``TRITON_INTERPRET=1``: every path (one-pass, two-pass, split-row)
forced at small sizes through ``configs.SOFTMAX``, forward and backward, against float64."""
from __future__ import annotations

import pytest
import torch

import splitsoftmax as ss
from splitsoftmax.ops._triton import configs
from splitsoftmax.ops.softmax import torch as cpu

pytestmark = pytest.mark.interpreter

softmax_k = pytest.importorskip("splitsoftmax.ops.softmax.kernel")

# Config overrides that force each path at test sizes (loop tiles of 16 columns).
PATHS = {
    "one_pass": {},
    "two_pass": dict(one_pass_max_cols=16, loop_tile_bytes=32, split_rows_per_sm=0.0, coop_max_chunks=0),
    "split": dict(one_pass_max_cols=16, loop_tile_bytes=32, split_rows_per_sm=1e9,
                  split_min_tiles=1, split_programs_per_sm=4, coop_max_chunks=0),
    # (the interpreter runs programs one after another: any grid is "resident")
    "coop": dict(one_pass_max_cols=16, loop_tile_bytes=32, coop_chunk_elems=32, coop_elems_per_warp=16,
                 coop_programs_per_sm=64),
    "coop, few programs": dict(one_pass_max_cols=16, loop_tile_bytes=32, coop_chunk_elems=32,
                               coop_elems_per_warp=16, coop_programs_per_sm=8),
}
# (atol, rtol): one unit in the last place of the output dtype (the interpreter truncates to
# bf16/fp16 rather than rounding), float32 statistics.
TOL = {torch.float32: (1e-6, 2e-6), torch.bfloat16: (1e-6, 2 ** -7), torch.float16: (1e-7, 2 ** -10),
       torch.float64: (1e-6, 2e-6)}
CASES = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.float16, True)]


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    """Force one path of the softmax family; yields its name."""
    for k, v in PATHS[request.param].items():
        monkeypatch.setattr(configs.SOFTMAX, k, v)
    return request.param


def _expect_path(x: torch.Tensor, path: str) -> None:
    got = softmax_k._plan(x).path
    path = path.split(",")[0]
    if x.shape[1] > 16 or path == "one_pass":
        assert got == path, f"plan for {tuple(x.shape)} is {got}, wanted {path}"


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOL[dtype]
    assert not torch.isnan(got).any(), f"{what}: NaN (unwritten or wrong) in output"
    torch.testing.assert_close(got.double(), ref.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _ref_fwd(x: torch.Tensor, log: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax / log-softmax (rounded to x.dtype like any output) and lse."""
    xd = x.double()
    y = torch.log_softmax(xd, -1) if log else torch.softmax(xd, -1)
    return y.to(x.dtype), torch.logsumexp(xd, -1)


@pytest.mark.parametrize("n", [1, 17, 97, 129, 1000])
@pytest.mark.parametrize("dtype,log", CASES)
def test_softmax_fwd_paths(path, n, dtype, log):
    if n == 1000 and path.startswith("coop"):
        pytest.skip("coop rows of many chunks: test_many_partials (the interpreter re-reads a row per chunk)")
    x = torch.randn(2, n, dtype=torch.float32).mul(4).to(dtype)
    _expect_path(x, path)
    y, lse = softmax_k.softmax_fwd(x, log)
    ref_y, ref_lse = _ref_fwd(x, log)
    assert y.dtype == dtype and lse.dtype == torch.float32
    _close(y, ref_y, dtype, f"{path} y")
    _close(lse, ref_lse, torch.float32, f"{path} lse")
    _close(softmax_k.lse_rows(x), ref_lse, torch.float32, f"{path} lse_rows")
    if n == 1:  # x - m is exactly 0: softmax exactly 1, log-softmax exactly 0, lse exactly x
        assert (y == (0.0 if log else 1.0)).all() and (lse == x[:, 0].float()).all(), f"{path} n=1 not exact"


@pytest.mark.parametrize("log", [False, True])
def test_normalize_paths(path, log):
    x = torch.randn(4, 200)
    lse = torch.logsumexp(x.double(), -1).float()
    lse[2] = float("-inf")
    y = softmax_k.normalize(x, lse, log)
    _close(y, cpu.normalize(x.double(), lse.double(), log), torch.float32, f"{path} normalize")


def test_public_api_dispatches_through_kernels(path, monkeypatch):
    """Without a gradient to record the public calls take the launcher that makes no ``lse``
    (``softmax_out``; the paths that need one make it there), with one the launcher that does."""
    calls = []
    for name in ("softmax_fwd", "softmax_out"):
        real = getattr(softmax_k, name)
        monkeypatch.setattr(softmax_k, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    x = torch.randn(2, 3, 150, dtype=torch.float64)
    for fn, ref in ((ss.softmax, torch.softmax), (ss.log_softmax, torch.log_softmax)):
        _close(fn(x.float(), dim=-1), ref(x, -1), torch.float32, f"{path} {fn.__name__}")
        _close(fn(x.float(), dim=1), ref(x, 1), torch.float32, f"{path} {fn.__name__} dim=1")
    _close(ss.logsumexp(x.float(), dim=-1), torch.logsumexp(x, -1), torch.float32, f"{path} logsumexp")
    assert calls.count("softmax_out") == 4, "ss.softmax did not reach the Triton launcher"
    assert all(a == "softmax_out" for a, b in zip(calls, calls[1:]) if b == "softmax_fwd"), calls  # (within it)
    calls.clear()
    xg = x.float().requires_grad_()
    _close(ss.softmax(xg, dim=-1).detach(), torch.softmax(x, -1), torch.float32, f"{path} softmax with grad")
    assert calls == ["softmax_fwd"]


@pytest.mark.parametrize("dtype,log", CASES)
def test_backward_paths(path, dtype, log):
    x = torch.randn(3, 129, dtype=torch.float32).mul(3).to(dtype).requires_grad_()
    dy = torch.randn(3, 129, dtype=torch.float32).to(dtype)
    fn, ref_fn = (ss.log_softmax, torch.log_softmax) if log else (ss.softmax, torch.softmax)
    (g,) = torch.autograd.grad(fn(x), x, dy)
    xd = x.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(ref_fn(xd, -1), xd, dy.double())
    _close_grad(g, ref, torch.softmax(xd.detach(), -1), ref_fn(xd.detach(), -1), dy.double(), dtype,
                f"{path} {dtype} log={log}")


def _close_grad(g, ref, p, y, dy, dtype, what):
    """The backward reads ``y`` rounded to ``dtype`` (one ulp: ``rtol``), so its error bound is
    ``rtol * (|dx| + p (|dy| + |s|) (1 + |y|) + p max|dy|)`` (the last term: the row sum ``s``)."""
    atol, rtol = TOL[dtype]
    s = (dy * p).sum(-1, keepdim=True).abs() + dy.abs().sum(-1, keepdim=True)
    tol = atol + rtol * (ref.abs() + p * (dy.abs() + s) * (1 + y.abs()) + p * dy.abs().amax(-1, keepdim=True))
    err = (g.double() - ref).abs()
    assert not torch.isnan(g).any() and (err <= tol).all(), f"{what}: max err {err.max().item()}"


@pytest.mark.parametrize("log", [False, True])
def test_bwd_launchers_direct(path, log):
    x = torch.randn(4, 300, dtype=torch.float64)
    y, lse = cpu.softmax_fwd(x, log)
    dy = torch.randn_like(x)
    y32, dy32 = y.float(), dy.float()
    rs = softmax_k.softmax_rowsum(y32, dy32, log)
    _close(rs, cpu.softmax_rowsum(y, dy, log), torch.float32, f"{path} rowsum")
    lse32 = lse.float()
    lse32[1] = float("-inf")
    ref = cpu.softmax_bwd(y32.double(), dy, lse32.double(), log)
    _close(softmax_k.softmax_bwd(y32, dy32, lse32, log), ref, torch.float32, f"{path} bwd")
    glob = torch.randn(4, dtype=torch.float64)  # a shard's backward with the global row sum
    ref = cpu.softmax_bwd(y32.double(), dy, lse32.double(), log, rowsum=glob)
    _close(softmax_k.softmax_bwd(y32, dy32, lse32, log, rowsum=glob.float()), ref, torch.float32,
           f"{path} bwd rowsum")


def test_logsumexp_backward(path):
    x = torch.randn(3, 257, dtype=torch.float64)
    x[1] = float("-inf")
    xr = x.float().requires_grad_()
    lse = ss.logsumexp(xr)
    g = torch.randn(3)
    (dx,) = torch.autograd.grad(lse, xr, g)
    ref = cpu.logsumexp_bwd(x, torch.logsumexp(x, -1), g.double())
    _close(lse, torch.logsumexp(x, -1), torch.float32, f"{path} lse")
    _close(dx, ref, torch.float32, f"{path} logsumexp grad")
    assert (dx[1] == 0).all()


def test_empty_and_nan_rows(path):
    x = torch.randn(4, 100)
    x[1] = float("-inf")
    x[2, 7] = float("nan")
    for log in (False, True):
        y, lse = softmax_k.softmax_fwd(x, log)
        assert lse[1] == float("-inf") and torch.isnan(lse[2])
        assert (y[1] == (float("-inf") if log else 0.0)).all(), f"{path} empty row log={log}"
        assert torch.isnan(y[2]).all(), f"{path}: NaN must fill its own row"
        ref_y, ref_lse = _ref_fwd(x[[0, 3]], log)
        _close(y[[0, 3]], ref_y, torch.float32, f"{path} rows beside NaN")
        _close(lse[[0, 3]], ref_lse, torch.float32, f"{path} lse beside NaN")
    xr = torch.full((2, 40), float("-inf")).requires_grad_()
    y = ss.softmax(xr)
    (g,) = torch.autograd.grad(y, xr, torch.randn(2, 40))
    assert (y == 0).all() and (g == 0).all()
    assert (ss.logsumexp(xr) == float("-inf")).all()


def test_strided_rows_no_copy(path, monkeypatch):
    big = torch.randn(5, 400)
    x = big[:, 3:3 + 180]  # row stride 400, unit column stride
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda *a, **k: pytest.fail("copied a strided view"))
    y, lse = softmax_k.softmax_fwd(x, False)
    lse2 = softmax_k.lse_rows(x)
    monkeypatch.undo()
    ref_y, ref_lse = _ref_fwd(x, False)
    _close(y, ref_y, torch.float32, f"{path} strided y")
    _close(lse, ref_lse, torch.float32, f"{path} strided lse")
    _close(lse2, ref_lse, torch.float32, f"{path} strided lse_rows")
    xt = torch.randn(180, 5).t()  # column stride 5: falls back to a copy
    _close(softmax_k.softmax_fwd(xt, True)[0], _ref_fwd(xt, True)[0], torch.float32, f"{path} transposed")


def test_zero_sized():
    assert softmax_k.softmax_fwd(torch.randn(0, 5), False)[0].shape == (0, 5)
    y, lse = softmax_k.softmax_fwd(torch.randn(3, 0), True)
    assert y.shape == (3, 0) and (lse == float("-inf")).all()


@pytest.mark.parametrize("path", ["split", "coop", "coop, few programs"])
def test_many_partials(path, monkeypatch):
    """Rows of many partial states, most of them empty; a row of all ``-inf``; a NaN in a row."""
    for k, v in PATHS[path].items():
        monkeypatch.setattr(configs.SOFTMAX, k, v)
    monkeypatch.setattr(configs.SOFTMAX, "split_programs_per_sm", 256)
    if path.startswith("coop"):  # (wide loop tiles: the interpreter's waiting programs re-read the row)
        monkeypatch.setattr(configs.SOFTMAX, "coop_chunk_elems", 16)
        monkeypatch.setattr(configs.SOFTMAX, "coop_max_chunks", 200)
        monkeypatch.setattr(configs.SOFTMAX, "loop_tile_bytes", 4096)
        monkeypatch.setattr(configs.SOFTMAX, "coop_programs_per_sm", 64 if path == "coop" else 32)
    x = torch.randn(4, 2000) * 10
    x[0, :1500] = float("-inf")  # most partials are empty states
    x[2] = float("-inf")
    x[3, 1234] = float("nan")
    p = softmax_k._plan(x)
    assert p.path == path.split(",")[0] and p.splits > 100
    for log in (False, True):
        y, lse = softmax_k.softmax_fwd(x, log)
        ref_y, ref_lse = _ref_fwd(x, log)
        assert torch.isnan(y[3]).all() and torch.isnan(lse[3])
        assert (y[2] == (float("-inf") if log else 0.0)).all() and lse[2] == float("-inf")
        _close(y[:2], ref_y[:2], torch.float32, f"{path} many partials y")
        _close(lse[:2], ref_lse[:2], torch.float32, f"{path} many partials lse")


def test_plan_predicate():
    cfg = configs.SoftmaxConfig()
    assert configs.softmax_plan(16384, 4096, 4, 132, cfg).path == "one_pass"
    assert configs.softmax_plan(4096, 32768, 4, 132, cfg).path == "one_pass"
    assert configs.softmax_plan(512, 262144, 1, 132, cfg).path == "two_pass"
    for rows, cols, size in ((256, 131072, 4), (64, 1 << 20, 4), (8, 262144, 2), (512, 262144, 2)):
        p = configs.softmax_plan(rows, cols, size, 132, cfg)
        assert p.path == "coop" and p.splits * p.chunk >= cols and p.splits <= min(cfg.coop_max_chunks, 132)
        assert configs.softmax_plan(rows, cols, size, 132, cfg, stats_only=True).path != "coop"
    for rows, cols in ((8, 1 << 24), (1, 1 << 28)):
        p = configs.softmax_plan(rows, cols, 4, 132, cfg)
        assert p.path == "split" and p.splits * p.chunk >= cols and p.chunk % p.block_n == 0


def test_repeated_softmax_is_one_lookup(monkeypatch):
    """A softmax that records no gradient, of an input whose geometry ran whole rows before, is one
    lookup and the launch bound then (no rows, plan or launch worked out); every call equals float64.
    Another dim spelling, log-softmax, a copy off 16-byte alignment, a transposed view, a gradient to
    record or a changed config are worked out anew (a transposed view every time: its rows are a copy)."""
    made = []
    memo = softmax_k._memo
    monkeypatch.setattr(softmax_k, "_memo", lambda key, *a: made.append(key[0]) or memo(key, *a))
    x = torch.randn(2, 3, 40)

    def run(t, dim=-1, log=False):
        n = len(made)
        y = (ss.log_softmax if log else ss.softmax)(t, dim)
        d = dim % t.dim()
        want = _ref_fwd(t.movedim(d, -1).reshape(-1, t.shape[d]), log)[0].view(t.movedim(d, -1).shape).movedim(-1, d)
        _close(y, want, t.dtype, f"{tuple(t.shape)} dim={dim} log={log}")
        return made[n:]

    assert "out" in run(x) and run(x) == [] and run(x.clone()) == []
    assert run(x, 2) != [] and run(x, 2) == []
    with pytest.raises(TypeError, match="dim must be an int, got list"):
        ss.softmax(x, [2])
    assert run(x, log=True) != [] and run(x, log=True) == []
    off = torch.empty(x.numel() + 1)[1:].view(x.shape).copy_(x)
    assert off.data_ptr() % 16 != 0 and run(off) != [] and run(off) == []
    assert run(x.transpose(1, 2), 1) != [] and run(x.transpose(1, 2), 1) != []
    with torch.enable_grad():
        y = ss.softmax(x.clone().requires_grad_(), -1)
    assert y.grad_fn is not None
    monkeypatch.setattr(configs.SOFTMAX, "loop_stages", configs.SOFTMAX.loop_stages)
    assert run(x) != [] and run(x) == []
