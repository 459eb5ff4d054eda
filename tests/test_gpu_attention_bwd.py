"""GPU lane: the attention backward (five-product atomic path and deterministic path) on CUDA.

FlashAttention's rule for every gradient: the error against float64 at most 2x that of torch's SDPA
(flash backend) on the same inputs and cotangent, plus twice the error of rounding the exact
gradient to the result's dtype. Masks SDPA cannot express (softcap) take torch-op attention in the
inputs' dtype as the peer. Launch caches are checked against Triton's own lookup (conftest).
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.ops.attention import bwd as AB  # noqa: E402
from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.core.mask import NO_MASK, Mask, visible  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16


@contextlib.contextmanager
def deterministic(on: bool):
    """Deterministic algorithms on (the atomic-free pair), or off with the five-product path chosen."""
    was, atomic = torch.are_deterministic_algorithms_enabled(), configs.ATTN_BWD_ATOMIC
    torch.use_deterministic_algorithms(on, warn_only=True)
    configs.ATTN_BWD_ATOMIC = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        configs.ATTN_BWD_ATOMIC = atomic


def masked_attention(q, k, v, scale, causal, diag, mask):
    """Attention over ``mask``'s visibility in the inputs' dtype: ``(out, lse)`` (empty rows 0)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if mask.softcap:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    vis = visible(mask, causal, diag, q.shape[0], q.shape[2], k.shape[2], device=q.device).unsqueeze(1)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v, lse


def err(x, ref):
    assert not torch.isnan(x).any()
    return (x.double() - ref).abs().max().item()


def rule(got, peer, want):
    atol = 2 * err(want.to(got.dtype), want)
    return err(got, want) <= 2 * err(peer, want) + atol, (err(got, want), err(peer, want), atol / 2)


def oracle(q, k, v, dout, scale, causal, diag, mask):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = masked_attention(*leaves, scale, causal, diag, mask)
    out.backward(dout.double())
    delta = (dout.float() * out.detach().to(q.dtype).float()).sum(-1)
    return [t.grad for t in leaves], lse.detach().float(), delta


def sdpa_grads(q, k, v, dout, scale, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale, enable_gqa=True)
    out.backward(dout)
    return [t.grad for t in leaves]


def inputs(b, h, hkv, s, d, dtype=BF16, bshd=False):
    if bshd:
        q, dout = (torch.randn(b, s, h, d, device=DEV, dtype=dtype).transpose(1, 2) for _ in range(2))
        k, v = (torch.randn(b, s, hkv, d, device=DEV, dtype=dtype).transpose(1, 2) for _ in range(2))
        return q, k, v, dout
    return (torch.randn(b, h, s, d, device=DEV, dtype=dtype), torch.randn(b, hkv, s, d, device=DEV, dtype=dtype),
            torch.randn(b, hkv, s, d, device=DEV, dtype=dtype), torch.randn(b, h, s, d, device=DEV, dtype=dtype))


CASES = [
    # b, h, hkv, s, d, causal, bshd, dtype
    (2, 8, 8, 1000, 128, False, False, BF16),
    (1, 16, 4, 2048, 128, True, False, BF16),   # GQA at batch 1: the dK/dV work split by heads
    (1, 16, 4, 3000, 128, True, False, BF16),   # ... 3 ways over 4 heads (132 SMs), tiles crossing the end
    (1, 32, 8, 1111, 128, True, True, BF16),    # (B, S, H, D) views
    (1, 4, 4, 777, 64, True, False, torch.float16),
    (2, 4, 2, 513, 80, False, False, BF16),     # padded head dim: the deterministic pair
]


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", CASES)
def test_flash_rule(case, det):
    b, h, hkv, s, d, causal, bshd, dtype = case
    q, k, v, dout = inputs(b, h, hkv, s, d, dtype, bshd)
    scale = 1 / math.sqrt(d)
    want, lse, delta = oracle(q, k, v, dout, scale, causal, 0, NO_MASK)
    peers = sdpa_grads(q, k, v, dout, scale, causal)
    with deterministic(det):
        assert AB._atomic(q, k, v) == (not det and d != 80)
        got = AB.attn_bwd(q, k, v, dout, lse, delta, scale, causal, 0, out_dtype=dtype)
    for name, g, t, p, w in zip("qkv", got, (q, k, v), peers, want):
        assert g.dtype == dtype and g.stride() == t.stride()
        ok, nums = rule(g, p, w)
        assert ok, (name, nums)


MASKS = [
    ("window+documents", True, lambda s: Mask(lo=-700, rows=_docs([0, 300, 301, 1500, s], s))),
    ("softcap+kv_range+offset", True, lambda s: Mask(
        softcap=20.0, kv_range=torch.tensor([[5, s], [0, s - 333]], dtype=torch.int32, device=DEV),
        q_offset=torch.tensor([3, 0], dtype=torch.int32, device=DEV))),
]


def _docs(cu, s):
    cu = torch.tensor(cu, device=DEV)
    doc = torch.searchsorted(cu, torch.arange(s, device=DEV), right=True) - 1
    return torch.stack((cu[doc], cu[doc + 1])).to(torch.int32)


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("name,causal,make", MASKS, ids=[m[0] for m in MASKS])
def test_flash_rule_masks(name, causal, make, det):
    b, h, hkv, s, d = 2, 8, 2, 1800, 128
    mask = make(s)
    q, k, v, dout = inputs(b, h, hkv, s, d)
    scale = 1 / math.sqrt(d)
    want, lse, delta = oracle(q, k, v, dout, scale, causal, 0, mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    masked_attention(*leaves, scale, causal, 0, mask)[0].backward(dout)  # the peer in bf16
    with deterministic(det):
        got = AB.attn_bwd(q, k, v, dout, lse, delta, scale, causal, 0, mask, out_dtype=BF16)
    for gname, g, p, w in zip("qkv", got, leaves, want):
        ok, nums = rule(g, p.grad, w)
        assert ok, (gname, nums)


def test_deterministic_is_bitwise_and_atomic_agrees(monkeypatch):
    """Two runs of each deterministic pair agree bit for bit; the atomic path agrees with the pair of
    its own math (the general pair, reached through a key range covering every key) within float32
    rounding. (The plain pair, the default here, applies the scale after rounding dS to bf16, the
    other two before: with a scale no power of two they agree only to that rounding, as both agree
    with float64 by the rule of ``test_flash_rule``.) Batch 1, group 4 at 3000 rows: on 132 SMs the
    dK/dV work split 3 ways over the 4 heads, the last tiles crossing the end. (The Gluon kernels,
    which take masks on sm_90 with the plain pair's rounding, are off here.)"""
    from splitsoftmax.ops.attention import fwd as A
    q, k, v, dout = inputs(1, 16, 4, 3000, 128)
    scale = 1 / math.sqrt(128)
    every_key = Mask(kv_range=torch.tensor([[0, 3000]], dtype=torch.int32, device=DEV))
    out, lse = A.attn_fwd(q, k, v, scale, True, out_dtype=BF16)
    delta = (dout.float() * out.float()).sum(-1)
    monkeypatch.setattr(configs, "ATTN_BWD_GLUON", False)
    with deterministic(True):
        runs = [AB.attn_bwd(q, k, v, dout, lse, delta, scale, True, 0, m) for m in (NO_MASK, NO_MASK, every_key,
                                                                                    every_key)]
    with deterministic(False):
        assert AB._atomic(q, k, v)
        fast = AB.attn_bwd(q, k, v, dout, lse, delta, scale, True)
    for x, y, g, h, f in zip(*runs, fast):
        assert torch.equal(x, y) and torch.equal(g, h)
        torch.testing.assert_close(f, g, rtol=1e-4, atol=1e-4 * g.abs().max().item())


def test_deterministic_algorithms_repeat_bit_for_bit():
    """Under ``torch.use_deterministic_algorithms(True)`` (the five-product kernel chosen otherwise)
    the backward takes the atomic-free pair, on sm_90 the Gluon kernels: three forward+backward calls
    of ``ss.attention`` on the same (B, S, H, D) inputs give the same gradients bit for bit. (At this
    shape, 2k causal rows, 16 heads, batch 16, the dK/dV kernel with one barrier per Q/dO buffer gave
    other dK/dV in most calls.)"""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    from splitsoftmax.ops._triton.device import sm90
    b, s, h, d = 16, 2048, 16, 128
    leaves = [torch.randn(b, s, h, d, device=DEV, dtype=BF16, requires_grad=True) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    dout = torch.randn(b, h, s, d, device=DEV, dtype=BF16)
    runs = []
    with deterministic(True):
        assert not AB._atomic(q, k, v)
        assert all(ABP._gluon_tile(kind, q, v) for kind in ("bwd_kv_ws", "bwd_q_gluon")) == sm90(q)
        for _ in range(3):
            for t in leaves:
                t.grad = None
            ss.attention(q, k, v, causal=True).backward(dout)
            runs.append([t.grad.clone() for t in leaves])
    for run in runs[1:]:
        for name, a, b0 in zip("qkv", run, runs[0]):
            assert torch.equal(a, b0), (name, (a.float() - b0.float()).abs().max().item())


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_gluon_kernels_repeat_bit_for_bit(stages, monkeypatch):
    """The Gluon pair gives the same gradients bit for bit in 60 calls on the same operands (1k causal
    rows, 16 heads, batch 32, (B, S, H, D) views), the dK/dV kernel streaming Q and dO through 2, 3
    and 4 buffers. (With one barrier per buffer and 3 buffers a score warpgroup, which takes every
    other tile, could wait on a barrier two phases behind and pass at once: here about one call in
    five gave other dK/dV.)"""
    from splitsoftmax.ops.attention import fwd as A
    from splitsoftmax.ops.attention import bwd_plain as ABP
    from splitsoftmax.ops._triton.device import sm90
    b, s, h, d = 32, 1024, 16, 128
    q, k, v, dout = inputs(b, h, h, s, d, BF16, True)
    if not sm90(q):
        pytest.skip("the Gluon kernels run on sm_90")
    tile = ("bwd_kv_ws", 2, d)
    monkeypatch.setattr(configs, "ATTN_BWD_GLUON", True)
    monkeypatch.setitem(configs.ATTN_TILES, tile, (*configs.ATTN_TILES[tile][:3], stages))
    assert all(ABP._gluon_tile(kind, q, v) for kind in ("bwd_kv_ws", "bwd_q_gluon"))
    scale = 1 / math.sqrt(d)
    out, lse = A.attn_fwd(q, k, v, scale, True, out_dtype=BF16)
    delta = (dout.float() * out.float()).sum(-1)
    first = ABP.attn_bwd(q, k, v, dout, lse, delta, scale, True, out_dtype=torch.float32)
    for call in range(1, 60):
        again = ABP.attn_bwd(q, k, v, dout, lse, delta, scale, True, out_dtype=torch.float32)
        for name, a, f in zip("qkv", again, first):
            assert torch.equal(a, f), (name, call, (a - f).abs().max().item())


def _ds_read_and_recomputed(q, k, v, dout, lse, delta, scale, causal, mask, monkeypatch) -> dict:
    """float32 ``(dq, dk, dv)`` of the Gluon pair by ``configs.ATTN_BWD_DS`` (False: dS recomputed,
    True: the dS the dK/dV kernel wrote), each gradient buffer NaN before the call; asserts that the
    dS path was taken where asked and that its dK and dV are the recomputing pair's bit for bit."""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    grads = {}
    for ds in (False, True):
        monkeypatch.setattr(configs, "ATTN_BWD_DS", ds)
        grads[ds] = [torch.full_like(x, float("nan"), dtype=torch.float32) for x in (q, k, v)]
        run = ABP._launches(q, k, v, dout, lse, delta, *grads[ds], scale, causal, 0, mask)
        assert (run.ds is not None) == ds
        ABP._run(run, q, k, v, dout, lse, delta, *grads[ds], None if mask.plain() else ABP._mask_tensors(
            mask, q, k, lse))
    for name, a, f in zip("kv", grads[True][1:], grads[False][1:]):
        assert torch.equal(a, f), name
    return grads


@pytest.mark.parametrize("case", [c for c in CASES if c[4] == 128], ids=lambda c: f"{c[1]}/{c[2]}x{c[3]}c{int(c[5])}")
def test_dq_from_the_written_ds(case, monkeypatch):
    """Where the dK/dV kernel writes each tile's dS for the dQ kernel (``configs.ATTN_BWD_DS``), dK and
    dV are those of the pair that recomputes dS bit for bit, and dQ meets the rule, each gradient
    buffer NaN before the call."""
    from splitsoftmax.ops._triton.device import sm90
    b, h, hkv, s, d, causal, bshd, dtype = case
    q, k, v, dout = inputs(b, h, hkv, s, d, dtype, bshd)
    if not sm90(q) or dtype != BF16:
        pytest.skip("the Gluon dK/dV kernel writes dS on sm_90, in bfloat16")
    scale = 1 / math.sqrt(d)
    want, lse, delta = oracle(q, k, v, dout, scale, causal, 0, NO_MASK)
    peers = sdpa_grads(q, k, v, dout, scale, causal)
    grads = _ds_read_and_recomputed(q, k, v, dout, lse, delta, scale, causal, NO_MASK, monkeypatch)
    ok, nums = rule(grads[True][0].to(dtype), peers[0], want[0])
    assert ok, nums


PIECE_MASKS = [("plain", lambda s: NO_MASK), ("window+kv_range+offset", lambda s: Mask(
    lo=-300, kv_range=torch.tensor([[5, s], [0, s - 333]], dtype=torch.int32, device=DEV),
    q_offset=torch.tensor([3, 0], dtype=torch.int32, device=DEV)))]


@pytest.mark.parametrize("name,make", PIECE_MASKS, ids=[m[0] for m in PIECE_MASKS])
def test_ds_pieces_equal_the_whole(name, make, monkeypatch):
    """With the dS buffer's bound below the whole backward's, the pair runs in pieces (batch elements,
    or kv heads of one) whose gradients equal the one-piece run's bit for bit, each batch element
    with its own key range and offset; in parts of a kv head's query heads, dQ bit for bit and dK, dV
    (the parts' float32 sum) within float32 rounding of it."""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    from splitsoftmax.ops._triton.device import sm90
    q, k, v, dout = inputs(2, 8, 4, 1000, 128, BF16, True)
    if not sm90(q):
        pytest.skip("the Gluon dK/dV kernel writes dS on sm_90")
    scale, mask = 1 / math.sqrt(128), make(1000)
    _, lse, delta = oracle(q, k, v, dout, scale, True, 0, mask)
    monkeypatch.setattr(configs, "ATTN_BWD_DS_MIN_WAVES", 0)
    # one (batch element, kv head): 2 query heads of 1024 keys by the buffer's columns (1024, 640 under
    # the window)
    unit = 2 * 1024 * ABP._ds_cols(1000, configs.ATTN_TILES[("bwd_kv_ws", 2, 128)], 128, mask, True, 0) * 2
    grads = {}
    for cap, pieces in ((8 * unit, 1), (4 * unit, 2), (3 * unit, 4), (unit // 2, 16)):
        monkeypatch.setattr(configs, "ATTN_BWD_DS_MAX_BYTES", cap)
        plan = ABP._plan(q, k, v, dout, lse, delta, *(torch.empty_like(t) for t in (q, k, v)), scale, True, 0,
                         mask)
        assert len(plan) == pieces and all(run.ds for _, run in plan)
        grads[cap] = ABP.attn_bwd(q, k, v, dout, lse, delta, scale, True, out_dtype=torch.float32, mask=mask)
    for cap in (4 * unit, 3 * unit, unit // 2):
        for gname, a, f in zip("qkv", grads[cap], grads[8 * unit]):
            assert not a.isnan().any(), (cap, gname)
            if cap > unit or gname == "q":
                assert torch.equal(a, f), (cap / unit, gname)
            else:
                assert (a - f).abs().max() <= 1e-5 * f.abs().max(), (gname, (a - f).abs().max().item())


@pytest.mark.parametrize("sq,sk", [(92, 1021), (189, 979), (128, 1000)])
def test_causal_key_blocks_that_no_row_sees(sq, sk):
    """Top-left causal with fewer queries than keys: key blocks past the last row's band hold no
    visible pair, so the dK/dV programs walk no query tile for them (with ``Sq`` off the tile size,
    the last query block was once walked for them, its ``dS`` written at a column left of the
    buffer: an illegal instruction on sm_90). Their dK and dV are exact zeros; every gradient meets
    the rule."""
    g = torch.Generator(device=DEV).manual_seed(sq)
    q, dout = (torch.randn(2, 8, sq, 128, generator=g, device=DEV).to(BF16) for _ in range(2))
    k, v = (torch.randn(2, 2, sk, 128, generator=g, device=DEV).to(BF16) for _ in range(2))
    scale = 1 / math.sqrt(128)
    want, lse, delta = oracle(q, k, v, dout, scale, True, 0, NO_MASK)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    masked_attention(*leaves, scale, True, 0, NO_MASK)[0].backward(dout)  # the peer in bf16
    got = AB.attn_bwd(q, k, v, dout, lse, delta, scale, True, 0, out_dtype=BF16)
    for gname, gr, p, w in zip("qkv", got, leaves, want):
        ok, nums = rule(gr, p.grad, w)
        assert ok, (gname, nums)
    assert not got[1][:, :, sq:].any() and not got[2][:, :, sq:].any()


def test_public_autograd_bshd_views():
    """Hugging Face's layout through ``ss.attention``: the leaves' gradients arrive contiguous in
    (B, S, H, D), within the rule against SDPA flash."""
    b, s, h, hkv, d = 1, 2048, 16, 4, 128
    leaves = [torch.randn(b, s, n, d, device=DEV, dtype=BF16, requires_grad=True) for n in (h, hkv, hkv)]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    out = ss.attention(q, k, v, causal=True)
    g = torch.randn_like(out)
    out.backward(g)
    want, _, _ = oracle(q.detach(), k.detach(), v.detach(), g, 1 / math.sqrt(d), True, 0, NO_MASK)
    peers = sdpa_grads(q.detach(), k.detach(), v.detach(), g, 1 / math.sqrt(d), True)
    for leaf, p, w in zip(leaves, peers, want):
        assert leaf.grad.is_contiguous()
        ok, nums = rule(leaf.grad.transpose(1, 2), p, w)
        assert ok, nums


@pytest.mark.parametrize("case", [c for c in CASES if c[4] != 80], ids=lambda c: f"{c[1]}/{c[2]}x{c[3]}d{c[4]}")
def test_plain_pair_tma_reads_are_bitwise_the_pointer_reads(case, monkeypatch):
    """The plain pair with TMA reads of its streamed tiles gives the pointer path's gradients bit for
    bit, and both meet the rule."""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    b, h, hkv, s, d, causal, bshd, dtype = case
    q, k, v, dout = inputs(b, h, hkv, s, d, dtype, bshd)
    scale = 1 / math.sqrt(d)
    want, lse, delta = oracle(q, k, v, dout, scale, causal, 0, NO_MASK)
    peers = sdpa_grads(q, k, v, dout, scale, causal)
    grads = {}
    monkeypatch.setattr(configs, "ATTN_BWD_GLUON", False)  # (the Gluon dK/dV kernel sums in another order)
    for tma in (False, True):
        monkeypatch.setattr(configs, "ATTN_BWD_TMA", tma)
        assert ABP._use_tma(q, k, v, dout) == tma
        grads[tma] = ABP.attn_bwd(q, k, v, dout, lse, delta, scale, causal, out_dtype=dtype)
    for name, a, t, p, w in zip("qkv", grads[True], grads[False], peers, want):
        assert torch.equal(a, t), name
        ok, nums = rule(a, p, w)
        assert ok, (name, nums)


@pytest.mark.parametrize("case", [c for c in CASES if c[4] == 128], ids=lambda c: f"{c[1]}/{c[2]}x{c[3]}c{int(c[5])}")
def test_gluon_kernels(case, monkeypatch):
    """On sm_90 the plain pair is the Gluon kernels (the dK/dV one warp-specialized): their gradients
    meet the rule, as close to float64 as the Triton kernels', and a NaN/Inf in a row of Q or dO
    reaches exactly the gradient entries it reaches through the Triton kernels (hidden pairs give
    exact zeros)."""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    from splitsoftmax.ops._triton.device import sm90
    b, h, hkv, s, d, causal, bshd, dtype = case
    q, k, v, dout = inputs(b, h, hkv, s, d, dtype, bshd)
    if not sm90(q):
        pytest.skip("the Gluon kernels run on sm_90")
    monkeypatch.setattr(configs, "ATTN_BWD_GLUON", True)
    assert ABP._use_tma(q, k, v, dout)
    assert all(ABP._gluon_tile(kind, q, v) for kind in ("bwd_kv_ws", "bwd_q_gluon"))
    scale = 1 / math.sqrt(d)
    want, lse, delta = oracle(q, k, v, dout, scale, causal, 0, NO_MASK)
    peers = sdpa_grads(q, k, v, dout, scale, causal)
    grads = {}
    for gluon in (True, False):
        monkeypatch.setattr(configs, "ATTN_BWD_GLUON", gluon)
        grads[gluon] = ABP.attn_bwd(q, k, v, dout, lse, delta, scale, causal, out_dtype=torch.float32)
    for name, g, t, p, w in zip("qkv", grads[True], grads[False], peers, want):
        ok, nums = rule(g.to(dtype), p, w)
        assert ok, (name, nums)
        assert err(g, w) <= 1.05 * err(t, w), (name, err(g, w), err(t, w))
    q2, k2, dout2 = q.clone(), k.clone(), dout.clone()
    dout2[0, 0, s // 3] = float("nan")
    q2[0, h - 1, s // 2, 5] = float("inf")
    k2[0, 0, s - 1, 7] = float("nan")  # the last key: seen only by the last query rows when causal
    nans = {}
    for gluon in (True, False):
        monkeypatch.setattr(configs, "ATTN_BWD_GLUON", gluon)
        nans[gluon] = [g.isnan() for g in ABP.attn_bwd(q2, k2, v, dout2, lse, delta, scale, causal,
                                                          out_dtype=torch.float32)]
    for name, a, t in zip("qkv", nans[True], nans[False]):
        assert t.any() and torch.equal(a, t), name


GLUON_MASKS = MASKS + [
    ("window", True, lambda s: Mask(lo=-333)),
    ("documents, empty ones, full", False, lambda s: Mask(rows=_docs([0, 0, 64, 700, 700, 701, s], s))),
    ("softcap+window, full", False, lambda s: Mask(lo=-500, softcap=30.0)),
]


@pytest.mark.parametrize("name,causal,make", GLUON_MASKS, ids=[m[0] for m in GLUON_MASKS])
def test_gluon_kernels_masks(name, causal, make, monkeypatch):
    """On sm_90 the variants' masks take the Gluon pair: their gradients meet the rule against
    float64 (the peer: attention in bf16), as close to it as the general Triton pair's (relative
    Frobenius error: the two round ``dS`` before and after the scale, so their largest errors differ
    by more than their typical ones). A NaN/Inf in a row of Q, K or dO reaches exactly the dQ entries
    it reaches through that pair, and no dK/dV of another batch element or kv head. (Both pairs zero
    the NaN/Inf of Q and dO in tiles that some pair does not see, seen pairs included, so which dK/dV
    entries a poisoned row reaches depends on their tiles; under a softcap an Inf score saturates
    likewise: Q and K get NaN there.)"""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    from splitsoftmax.ops._triton.device import sm90
    b, h, hkv, s, d = 2, 8, 2, 1800, 128
    q, k, v, dout = inputs(b, h, hkv, s, d, BF16, True)
    if not sm90(q):
        pytest.skip("the Gluon kernels run on sm_90")
    mask = make(s)
    scale = 1 / math.sqrt(d)
    want, lse, delta = oracle(q, k, v, dout, scale, causal, 0, mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    masked_attention(*leaves, scale, causal, 0, mask)[0].backward(dout)  # the peer in bf16
    monkeypatch.setattr(configs, "ATTN_BWD_ATOMIC", False)
    grads, nans = {}, {}
    q2, k2, dout2 = q.clone(), k.clone(), dout.clone()
    bad = float("nan") if mask.softcap else float("inf")
    dout2[0, 0, s // 3] = float("nan")
    delta2 = delta.clone()
    delta2[0, 0, s // 3] = float("nan")  # rowsum(dout * out), as autograd makes it
    q2[1, h - 1, s // 2, 5] = bad
    k2[0, 0, s - 1, 7] = float("nan")
    k2[1, 1, 700, 3] = bad
    for gluon in (True, False):
        monkeypatch.setattr(configs, "ATTN_BWD_GLUON", gluon)
        assert ABP.takes(q, k, v, dout, mask) == gluon
        grads[gluon] = AB.attn_bwd(q, k, v, dout, lse, delta, scale, causal, 0, mask, out_dtype=torch.float32)
        nans[gluon] = [g.isnan() for g in AB.attn_bwd(q2, k2, v, dout2, lse, delta2, scale, causal, 0, mask,
                                                      out_dtype=torch.float32)]
    for gname, g, t, p, w in zip("qkv", grads[True], grads[False], leaves, want):
        ok, nums = rule(g.to(BF16), p.grad, w)
        assert ok, (gname, nums)
        fro = [((x.double() - w).norm() / w.norm()).item() for x in (g, t)]
        assert fro[0] <= 1.05 * fro[1], (gname, fro)
    assert nans[False][0].any() and torch.equal(nans[True][0], nans[False][0])
    untouched = torch.ones(b, hkv, dtype=torch.bool, device=DEV)
    untouched[0, 0] = untouched[1, 1] = False  # (the poisoned rows' and keys' batch elements and kv heads)
    for gname, a in zip("kv", nans[True][1:]):
        assert a.any() and not a[untouched].any(), gname


@pytest.mark.parametrize("name,causal,make", GLUON_MASKS, ids=[m[0] for m in GLUON_MASKS])
def test_dq_from_the_written_ds_masks(name, causal, make, monkeypatch):
    """The variants' masks on the dS path: dK and dV those of the pair that recomputes dS bit for
    bit, dQ within the rule and as close to float64 as the recomputing kernel's."""
    from splitsoftmax.ops._triton.device import sm90
    b, h, hkv, s, d = 2, 8, 2, 1800, 128
    q, k, v, dout = inputs(b, h, hkv, s, d, BF16, True)
    if not sm90(q):
        pytest.skip("the Gluon dK/dV kernel writes dS on sm_90")
    mask, scale = make(s), 1 / math.sqrt(d)
    want, lse, delta = oracle(q, k, v, dout, scale, causal, 0, mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    masked_attention(*leaves, scale, causal, 0, mask)[0].backward(dout)  # the peer in bf16
    grads = _ds_read_and_recomputed(q, k, v, dout, lse, delta, scale, causal, mask, monkeypatch)
    ok, nums = rule(grads[True][0].to(BF16), leaves[0].grad, want[0])
    assert ok, nums
    fro = [((g[0].double() - want[0]).norm() / want[0].norm()).item() for g in (grads[True], grads[False])]
    assert fro[0] <= 1.05 * fro[1], fro


FUSED_CASES = [
    # b, h, hkv, s, causal, bshd, dtype, mask
    (2, 8, 8, 1000, False, False, BF16, None),
    (1, 16, 4, 2048, True, False, BF16, None),   # GQA: a kv head's four query heads in one program
    (1, 32, 8, 1111, True, True, BF16, None),    # (B, S, H, D) views, tiles crossing the end
    (1, 4, 4, 777, True, False, torch.float16, None),
    (2, 8, 2, 1800, True, False, BF16, "window+kv_range+offset"),
    (1, 8, 8, 1500, False, False, BF16, "window, full"),
    (2, 8, 2, 1300, True, False, BF16, "softcap"),
    (2, 8, 2, 1500, True, False, BF16, "window+documents"),
    (1, 8, 8, 1200, False, False, BF16, "documents, empty ones, full"),
    (1, 8, 8, 1024, True, True, BF16, None),      # the NaN row of dO (341) in a tile masked for one half
]


def _fused_mask(name, s):
    if name == "window+kv_range+offset":
        return Mask(lo=-700, kv_range=torch.tensor([[5, s], [0, s - 333]], dtype=torch.int32, device=DEV),
                    q_offset=torch.tensor([3, 0], dtype=torch.int32, device=DEV))
    if name == "window, full":
        return Mask(lo=-500)
    if name == "softcap":
        return Mask(softcap=30.0)
    if name == "window+documents":
        return Mask(lo=-700, rows=_docs([0, 300, 301, 1500, s], s))
    if name == "documents, empty ones, full":
        return Mask(rows=_docs([0, 0, 64, 700, 700, 701, s], s))
    return NO_MASK


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"{c[1]}/{c[2]}x{c[3]}c{int(c[4])}-{c[7] or 'plain'}")
def test_fused_backward(case, monkeypatch):
    """The fused five-product kernel (``configs.ATTN_BWD_FUSED``, sm_90, where the Triton in use takes
    it: ``configs.ATTN_BWD_FUSED_MASKS``): its gradients, written over memory filled with NaN, meet the
    rule (dQ summed in float32 in arrival order); a NaN/Inf in a row of Q or dO or in a key reaches
    exactly the gradient entries it reaches through the pair (hidden pairs give exact zeros); under
    deterministic algorithms the pair runs."""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    from splitsoftmax.ops._triton.device import sm90
    b, h, hkv, s, causal, bshd, dtype, mname = case
    q, k, v, dout = inputs(b, h, hkv, s, 128, dtype, bshd)
    mask = _fused_mask(mname, s)
    monkeypatch.setattr(configs, "ATTN_BWD_FUSED", True)
    if sm90(q):  # these shapes are below the fewest programs per SM it takes: the pair runs them ...
        assert not ABP.fused(q, k, v, dout, causal, mask, None)
    monkeypatch.setattr(configs, "ATTN_BWD_FUSED_MIN_WAVES", 0)  # ... here the fused kernel, at any size
    if not sm90(q) or not ABP.fused(q, k, v, dout, causal, mask, None):
        pytest.skip("the fused kernel runs on sm_90 for the masks of configs.ATTN_BWD_FUSED_MASKS")
    scale = 1 / math.sqrt(128)
    want, lse, delta = oracle(q, k, v, dout, scale, causal, 0, mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    masked_attention(*leaves, scale, causal, 0, mask)[0].backward(dout)  # the peer in the inputs' dtype
    torch.empty(4 * q.numel() + 4 * k.numel(), device=DEV).fill_(float("nan"))  # (freed: the outputs' memory)
    got = AB.attn_bwd(q, k, v, dout, lse, delta, scale, causal, 0, mask, out_dtype=dtype)
    for name, g, t, p, w in zip("qkv", got, (q, k, v), leaves, want):
        assert g.dtype == dtype and g.stride() == t.stride()
        ok, nums = rule(g, p.grad, w)
        assert ok, (name, nums)
    q2, k2, dout2 = q.clone(), k.clone(), dout.clone()
    dout2[0, 0, s // 3] = float("nan")
    q2[0, h - 1, s // 2, 5] = float("inf")
    k2[0, 0, s - 1, 7] = float("nan")
    nans = {}
    for fused in (True, False):
        monkeypatch.setattr(configs, "ATTN_BWD_FUSED", fused)
        nans[fused] = [g.isnan() for g in AB.attn_bwd(q2, k2, v, dout2, lse, delta, scale, causal, 0, mask,
                                                      out_dtype=torch.float32)]
    for name, a, t in zip("qkv", nans[True], nans[False]):
        assert torch.equal(a, t), name
    monkeypatch.setattr(configs, "ATTN_BWD_FUSED", True)
    torch.use_deterministic_algorithms(True)
    try:
        assert not ABP.fused(q, k, v, dout, causal, mask, None)
    finally:
        torch.use_deterministic_algorithms(False)
