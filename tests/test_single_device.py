"""docs/API.md's single-device table on CPU tensors, against float64 oracles."""
import math

import pytest
import torch

import splitsoftmax as ss
from splitsoftmax.core import reference as ref
from splitsoftmax.ops._triton import configs

NEG_INF = float("-inf")
# (dtype, atol, rtol) of an output against the float64 oracle
TOLS = {torch.float32: (2e-6, 2e-5), torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 2e-3),
        torch.float64: (1e-12, 1e-10)}
SIZES = [1, 17, 97, 129, 1000]


def check(got, want, dtype=torch.float32, factor=1.0):
    atol, rtol = TOLS[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=atol * factor, rtol=rtol * factor,
                               equal_nan=False)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_softmax_family_forward(n, dtype):
    x = (torch.randn(7, n) * 5).to(dtype)
    y, ly, lse = ss.softmax(x), ss.log_softmax(x), ss.logsumexp(x)
    assert y.dtype == dtype and ly.dtype == dtype and lse.dtype == torch.float32
    check(y, ref.softmax(x), dtype)
    check(ly, ref.log_softmax(x), dtype, factor=4)
    torch.testing.assert_close(lse.double(), ref.logsumexp(x), atol=1e-5, rtol=1e-6)


def test_long_rows_cross_many_blocks(monkeypatch):
    monkeypatch.setattr("splitsoftmax.ops.softmax.torch.CPU_BLOCK_COLS", 64)
    x = torch.randn(5, 1000) * 10
    x[1, 900] = 80.0  # the maximum arrives late: earlier blocks must be rescaled
    check(ss.softmax(x), ref.softmax(x))
    torch.testing.assert_close(ss.logsumexp(x).double(), ref.logsumexp(x), atol=1e-5, rtol=1e-6)


def test_extreme_logits_from_the_lesson():
    x = torch.tensor([[1000.0, 999.0, 997.0]])
    y = ss.softmax(x)
    assert torch.isfinite(y).all()
    check(y, ref.softmax(x))
    assert ss.logsumexp(x).item() == pytest.approx(1000 + math.log(1 + math.exp(-1) + math.exp(-3)), abs=1e-4)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
def test_dim_and_non_contiguous(dim):
    x = torch.randn(6, 9, 11).transpose(0, 2)[::2]  # non-contiguous view
    assert not x.is_contiguous()
    check(ss.softmax(x, dim), ref.softmax(x, dim))
    check(ss.log_softmax(x, dim), ref.log_softmax(x, dim))
    torch.testing.assert_close(ss.logsumexp(x, dim).double(), ref.logsumexp(x, dim), atol=1e-5, rtol=1e-6)


def test_all_neg_inf_rows_and_empty_dim():
    x = torch.randn(4, 10)
    x[2] = NEG_INF
    x.requires_grad_(True)
    y, ly, lse = ss.softmax(x), ss.log_softmax(x), ss.logsumexp(x)
    assert torch.equal(y[2], torch.zeros(10)) and torch.equal(ly[2], torch.full((10,), NEG_INF))
    assert lse[2].item() == NEG_INF
    for out in (y, ly, lse):
        (g,) = torch.autograd.grad(torch.where(torch.isfinite(out), out, 0.0).sum() + out.clamp(min=0).sum(), x)
        assert torch.equal(g[2], torch.zeros(10)) and not torch.isnan(g).any()
    empty = torch.randn(3, 0)
    assert ss.logsumexp(empty).tolist() == [NEG_INF] * 3
    assert ss.softmax(empty).shape == (3, 0)


def test_nan_stays_in_its_row():
    x = torch.randn(3, 50)
    x[1, 7] = float("nan")
    y = ss.softmax(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


@pytest.mark.parametrize("fn,oracle", [(ss.softmax, ref.softmax), (ss.log_softmax, ref.log_softmax),
                                       (ss.logsumexp, ref.logsumexp)])
def test_softmax_family_gradients_against_float64(fn, oracle):
    x = torch.randn(5, 129) * 3
    x[0, :50] = NEG_INF
    x32, x64 = x.clone().requires_grad_(True), x.double().requires_grad_(True)
    want = oracle(x64, -1)
    proj = torch.randn(want.shape, dtype=torch.float64).masked_fill(~torch.isfinite(want), 0.0)
    (g,) = torch.autograd.grad((torch.nan_to_num(fn(x32).double(), neginf=0.0) * proj).sum(), x32)
    (g64,) = torch.autograd.grad((torch.nan_to_num(want, neginf=0.0) * proj).sum(), x64)
    torch.testing.assert_close(g.double(), g64, atol=2e-5, rtol=1e-4)


def test_gradcheck_float64_softmax():
    x = torch.randn(3, 17, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ss.softmax(t, -1), (x,))
    assert torch.autograd.gradcheck(lambda t: ss.log_softmax(t, 0), (x,))


def test_gradgradcheck_float64_softmax():
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: ss.softmax(t, -1), (x,))
    assert torch.autograd.gradgradcheck(lambda t: ss.log_softmax(t, 0), (x,))


@pytest.mark.parametrize("fn,oracle", [(ss.softmax, torch.softmax), (ss.log_softmax, torch.log_softmax),
                                       (ss.logsumexp, torch.logsumexp)], ids=["softmax", "log_softmax", "logsumexp"])
def test_second_derivatives_against_torch(fn, oracle):
    """Hessian-vector products through the backward (``create_graph=True``) equal torch's; a row of
    all ``-inf`` gets zeros, no NaN. (``logsumexp``'s float32 result rules out ``gradgradcheck``.)"""
    x = torch.randn(4, 6, dtype=torch.float64)
    x[2] = float("-inf")
    w = torch.randn(4, 6, dtype=torch.float64)

    def hvp(f):
        t = x.clone().requires_grad_()
        y = f(t, 1)
        c = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
        (g,) = torch.autograd.grad(torch.where(torch.isinf(y), 0, y * c).sum(), t, create_graph=True)
        return torch.autograd.grad((g * w).sum(), t)[0]
    got, want = hvp(fn), hvp(oracle).nan_to_num(0.0)
    assert not got.isnan().any() and torch.equal(got[2], torch.zeros(6, dtype=got.dtype))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def sdpa64(q, k, v, causal, scale=None):
    return ref.attention(q, k, v, causal=causal, scale=scale)


@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 97), (97, 17), (129, 1000), (64, 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_attention_forward(sq, sk, causal, heads, monkeypatch):
    monkeypatch.setattr("splitsoftmax.ops.attention.torch.CPU_BLOCK_KEYS", 32)
    h, hkv = heads
    q, k, v = torch.randn(2, h, sq, 32), torch.randn(2, hkv, sk, 32), torch.randn(2, hkv, sk, 24)
    out, lse = ss.attention(q, k, v, causal=causal, return_lse=True)
    want, want_lse = sdpa64(q, k, v, causal)
    assert out.shape == (2, h, sq, 24) and lse.shape == (2, h, sq) and lse.dtype == torch.float32
    check(out, want)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_low_precision_inputs(dtype):
    q, k, v = (torch.randn(1, 2, 33, 64).to(dtype) for _ in range(3))
    out, lse = ss.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    want, want_lse = sdpa64(q, k, v, True)
    err = (out.double() - want).abs().max()
    torch_err = (torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).double() - want).abs().max()
    assert err <= 2 * torch_err + 1e-6, (err, torch_err)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)


def test_attention_empty_rows_and_zero_keys():
    q = torch.randn(1, 2, 5, 16, requires_grad=True)
    k = torch.randn(1, 2, 0, 16, requires_grad=True)
    v = torch.randn(1, 2, 0, 8, requires_grad=True)
    out, lse = ss.attention(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros(1, 2, 5, 8)) and torch.equal(lse, torch.full((1, 2, 5), NEG_INF))
    (g,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(g, torch.zeros_like(q))


@pytest.mark.parametrize("qshape,kshape", [((1, 2, 0, 8), (1, 1, 4, 8)), ((0, 2, 4, 8), (0, 1, 4, 8)),
                                           ((1, 4, 0, 8), (1, 2, 0, 8))], ids=["no-queries", "no-batch", "nothing"])
@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(causal=True, window_size=(1, 0)), "sinks"],
                         ids=["plain", "causal", "window", "sinks"])
def test_attention_with_no_rows(qshape, kshape, kw):
    """No query rows (or no batch): outputs of the right shapes and dtypes, gradients of zeros."""
    q, k, v = (torch.randn(*s, requires_grad=True) for s in (qshape, kshape, kshape))
    kw = dict(sinks=torch.zeros(qshape[1], requires_grad=True)) if kw == "sinks" else kw
    out, lse = ss.attention(q, k, v, return_lse=True, **kw)
    assert out.shape == (*qshape[:3], 8) and lse.shape == qshape[:3] and lse.dtype == torch.float32
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    for g, t in zip(grads, (q, k, v)):
        assert g is None or torch.equal(g, torch.zeros_like(t))


def test_attention_causal_rows_that_see_nothing():
    """Causal with Sq > Sk is top-left aligned: every query sees key 0, so no row is empty; a
    scale of -inf is refused, so the empty rows come from Sk = 0 only or from sharding."""
    q, k, v = torch.randn(1, 1, 9, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    out, lse = ss.attention(q, k, v, causal=True, return_lse=True)
    want, want_lse = sdpa64(q, k, v, True)
    check(out, want)
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_attention_gradients_against_float64(causal, heads, monkeypatch):
    monkeypatch.setattr("splitsoftmax.ops.attention.torch.CPU_BLOCK_KEYS", 16)
    h, hkv = heads
    shapes = [(2, h, 37, 16), (2, hkv, 53, 16), (2, hkv, 53, 8)]
    xs = [torch.randn(s) for s in shapes]
    x32 = [t.clone().requires_grad_(True) for t in xs]
    x64 = [t.double().requires_grad_(True) for t in xs]
    out, lse = ss.attention(*x32, causal=causal, scale=0.3, return_lse=True)
    want, want_lse = sdpa64(*x64, causal, scale=0.3)
    go, gl = torch.randn(want.shape, dtype=torch.float64), torch.randn(want_lse.shape, dtype=torch.float64)
    got = torch.autograd.grad((out.double() * go).sum() + (lse.double() * gl).sum(), x32)
    exp = torch.autograd.grad((want * go).sum() + (want_lse * gl).sum(), x64)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=1e-4)


def test_attention_non_contiguous_inputs():
    q = torch.randn(2, 17, 4, 32).transpose(1, 2)  # (B, H, S, D) view of a (B, S, H, D) tensor
    k = torch.randn(2, 23, 2, 32).transpose(1, 2)
    v = torch.randn(2, 23, 2, 32).transpose(1, 2)
    check(ss.attention(q, k, v), sdpa64(q, k, v, False)[0])


def test_attention_memory_is_blockwise(monkeypatch):
    """No Sq x Sk score matrix: every score tile has at most CPU_BLOCK_KEYS columns."""
    seen = []
    real = torch.Tensor.__matmul__

    def spy(a, b):
        r = real(a, b)
        seen.append(r.shape[-1] if r.dim() else 0)
        return r
    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    q, k, v = torch.randn(1, 1, 300, 8), torch.randn(1, 1, 2000, 8), torch.randn(1, 1, 2000, 8)
    ss.attention(q, k, v)
    assert seen and max(seen) <= max(configs.CPU_BLOCK_KEYS, 8)


def test_attention_bad_arguments():
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="q"):
        ss.attention(q[0], k, v)
    with pytest.raises(ValueError, match="H=4.*Hkv=3"):
        ss.attention(q, torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8))
    with pytest.raises(ValueError, match="dtype"):
        ss.attention(q, k.double(), v)
    with pytest.raises(ValueError, match="head_dim"):
        ss.attention(q, torch.randn(1, 2, 6, 4), v)
    with pytest.raises(TypeError, match="k"):
        ss.attention(q, "k", v)
    with pytest.raises(TypeError, match="causal"):
        ss.attention(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="scale"):
        ss.attention(q, k, v, scale=float("nan"))


@pytest.mark.parametrize("fn", [ss.softmax, ss.log_softmax, ss.logsumexp])
def test_softmax_bad_arguments(fn):
    with pytest.raises(ValueError, match="dim=3"):
        fn(torch.randn(2, 3), dim=3)
    with pytest.raises(TypeError, match="dim"):
        fn(torch.randn(2, 3), dim=1.0)
    with pytest.raises(TypeError, match="x"):
        fn([1.0, 2.0])
    with pytest.raises(TypeError, match="floating"):
        fn(torch.arange(4))


def test_numpy_scalars_are_accepted_like_torch():
    """``dim`` may be any integer (numpy's too) and ``scale`` any real number, as in torch."""
    np = pytest.importorskip("numpy")
    x = torch.randn(3, 5)
    torch.testing.assert_close(ss.softmax(x, np.int64(0)), torch.softmax(x, 0))
    torch.testing.assert_close(ss.logsumexp(x, np.int32(-1)), torch.logsumexp(x, -1))
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    torch.testing.assert_close(ss.attention(q, k, v, scale=np.float32(0.5)), ss.attention(q, k, v, scale=0.5))


def test_forward_tiles_follow_the_configs():
    """Causal forwards over few queries take their own tile; head dims beyond its entries fall back to "fwd"."""
    from splitsoftmax.ops._triton import configs
    from splitsoftmax.ops.attention import decode

    def tile(s, causal, d=128):
        q = torch.empty(32, 16, s, d, dtype=torch.bfloat16, device="meta")
        k = torch.empty(32, 16, s, d, dtype=torch.bfloat16, device="meta")
        return decode.plan(q, k, k, causal, 0).tile

    short = configs.ATTN_TILES[("fwd_causal_short", 2, 128)]
    assert tile(1024, True) == tile(configs.ATTN_SHORT_CAUSAL_SQ, True) == short
    assert tile(1024, False) == tile(4096, True) == configs.ATTN_TILES[("fwd", 2, 128)]
    assert tile(1024, True, d=256) == configs.ATTN_TILES[("fwd", 2, 256)]


def test_host_size_helpers_match_triton():
    """``configs.next_pow2`` / ``configs.cdiv`` (launch code) give Triton's values for every size
    a launch can see (``n >= 1``)."""
    triton = pytest.importorskip("triton")
    for n in list(range(1, 4100)) + [2 ** 20 - 1, 2 ** 20, 2 ** 20 + 1, 2 ** 31 - 1]:
        assert configs.next_pow2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 64, 1000):
            assert configs.cdiv(n, d) == triton.cdiv(n, d)
