"""Interpreter lane: the Triton attention backward (atomic and deterministic paths) on tiny shapes.

Every gradient is held to FlashAttention's rule as its tests apply it: the error against float64 at
most 2x that of the same attention written in torch ops and run in the inputs' precision (its
``attention_ref(..., upcast=False)``: scores, softmax and products in bf16, autograd through them),
plus twice the error of rounding the exact gradient itself to the result's dtype (its ``atol``:
at these tiny sizes one rounding of the output is as large as the peer's whole error).
(The CPU's own SDPA keeps float32 inside, so its one rounding is no bar for a kernel that, like every
tensor-core kernel, rounds P and dS to bf16 before their products.) The row statistics are the
float64 forward's, and ``delta`` comes from its output rounded to bf16, as the autograd path
computes it. Outputs are NaN-poisoned by conftest.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from torch import Tensor

pytestmark = pytest.mark.interpreter

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter lane: set TRITON_INTERPRET=1 before importing triton", allow_module_level=True)

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.ops.attention import bwd as AB  # noqa: E402
from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.core.mask import NO_MASK, Mask, visible  # noqa: E402

BF16 = torch.bfloat16


def scores_attention(q, k, v, scale, causal, diag, mask, b):
    """Attention over the visibility of ``mask`` in the inputs' own dtype (float64 for the oracle):
    ``(out, lse)``; rows that see nothing give ``(0, -inf)``."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if mask.softcap:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    vis = visible(mask, causal, diag, b, q.shape[2], k.shape[2]).unsqueeze(1)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v, lse


def peer_grads(q, k, v, dout, scale, causal, diag, mask):
    """The gradients of torch-op attention run in bf16 (the rule's peer)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    scores_attention(*leaves, scale, causal, diag, mask, q.shape[0])[0].backward(dout)
    return [t.grad for t in leaves]


def oracle(q, k, v, dout, scale, causal, diag, mask):
    """float64 gradients, the rows' ``lse``, and ``delta`` from the output rounded to bf16."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = scores_attention(*leaves, scale, causal, diag, mask, q.shape[0])
    out.backward(dout.double())
    delta = (dout.float() * out.detach().to(q.dtype).float()).sum(-1)
    return [t.grad for t in leaves], lse.detach().float(), delta


def err(x, ref):
    assert not torch.isnan(x).any(), "NaN in a gradient"
    return (x.double() - ref).abs().max().item()


def rule(got, peer, want) -> tuple[bool, str]:
    """FlashAttention's rule for one result (see the module docstring), and the numbers."""
    atol = 2 * err(want.to(got.dtype), want)
    ok = err(got, want) <= 2 * err(peer, want) + atol
    return ok, f"err {err(got, want):.3e}, peer {err(peer, want):.3e}, rounding {atol / 2:.3e}"


def inputs(b, h, hkv, sq, sk, d, dtype=BF16):
    return (torch.randn(b, h, sq, d).to(dtype), torch.randn(b, hkv, sk, d).to(dtype),
            torch.randn(b, hkv, sk, d).to(dtype), torch.randn(b, h, sq, d).to(dtype))


def run(q, k, v, dout, lse, delta, scale, causal, diag, mask, det, monkeypatch, out_dtype=None):
    """``attn_bwd`` on the deterministic pair (``det``) or the five-product atomic path."""
    monkeypatch.setattr(configs, "ATTN_BWD_ATOMIC", True)
    monkeypatch.setattr(AB, "deterministic", lambda: det)
    assert AB._atomic(q, k, v) == (not det)
    return AB.attn_bwd(q, k, v, dout, lse, delta, scale, causal, diag, mask, out_dtype=out_dtype)


CASES = [
    # b, h, hkv, sq, sk, d, causal, diag
    (1, 2, 2, 1, 17, 32, False, 0),     # one query row
    (1, 4, 2, 17, 17, 32, True, 0),     # GQA group 2
    (1, 4, 1, 97, 40, 16, False, 0),    # group 4, odd length, few programs: the work is split
    (1, 4, 1, 37, 37, 32, True, 0),     # ... 3 ways over the 4 heads, causal, tiles crossing the end
    (1, 1, 1, 129, 129, 16, True, 0),   # a row past the last whole tile
    (2, 2, 1, 33, 70, 32, True, 37),    # bottom-right causal, MQA, batch 2
]


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", CASES)
def test_flash_rule_plain(case, det, monkeypatch):
    b, h, hkv, sq, sk, d, causal, diag = case
    q, k, v, dout = inputs(b, h, hkv, sq, sk, d)
    scale = 1 / math.sqrt(d)
    want, lse, delta = oracle(q, k, v, dout, scale, causal, diag, NO_MASK)
    peers = peer_grads(q, k, v, dout, scale, causal, diag, NO_MASK)
    got = run(q, k, v, dout, lse, delta, scale, causal, diag, NO_MASK, det, monkeypatch, out_dtype=BF16)
    for name, g, p, w in zip("qkv", got, peers, want):
        assert g.dtype == BF16 and g.shape == w.shape
        ok, msg = rule(g, p, w)
        assert ok, (name, msg)


def _docs(cu, sq):
    """``Mask.rows`` of packed documents ``cu`` (self-attention)."""
    cu = torch.tensor(cu)
    doc = torch.searchsorted(cu, torch.arange(sq), right=True) - 1
    return torch.stack((cu[doc], cu[doc + 1])).to(torch.int32)


MASKS = {
    "window": (True, 0, lambda b, s: Mask(lo=-6)),
    "q_offset": (True, 0, lambda b, s: Mask(q_offset=torch.tensor([5, 0][:b], dtype=torch.int32))),
    "kv_range": (False, 0, lambda b, s: Mask(kv_range=torch.tensor([[3, s - 5], [0, 31]][:b], dtype=torch.int32))),
    "documents": (True, 0, lambda b, s: Mask(rows=_docs([0, 5, 38, 39, s], s))),
    "documents_full": (False, 0, lambda b, s: Mask(rows=_docs([0, 20, 21, 34, s], s))),
    "softcap": (True, 0, lambda b, s: Mask(softcap=4.0)),
    "all": (True, 0, lambda b, s: Mask(lo=-30, softcap=6.0,
                                       kv_range=torch.tensor([[0, s], [1, s - 17]][:b], dtype=torch.int32),
                                       q_offset=torch.tensor([1, 2][:b], dtype=torch.int32),
                                       rows=_docs([0, 4, 30, s], s))),
}


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("name", list(MASKS))
def test_flash_rule_masks(name, det, monkeypatch):
    causal, diag, make = MASKS[name]
    b, h, hkv, s, d = 2, 2, 1, 57, 16
    mask = make(b, s)
    q, k, v, dout = inputs(b, h, hkv, s, s, d)
    assert visible(mask, causal, diag, b, s, s).any(-1).all(), "the rule's peer needs every row to see a key"
    scale = 1 / math.sqrt(d)
    want, lse, delta = oracle(q, k, v, dout, scale, causal, diag, mask)
    peers = peer_grads(q, k, v, dout, scale, causal, diag, mask)
    got = run(q, k, v, dout, lse, delta, scale, causal, diag, mask, det, monkeypatch)
    for gname, g, p, w in zip("qkv", got, peers, want):
        assert g.dtype == torch.float32
        ok, msg = rule(g, p, w)
        assert ok, (gname, msg)


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
def test_hidden_nan_changes_nothing_and_hidden_keys_get_zero(det, monkeypatch):
    """NaN in every K/V position no row sees (outside ``kv_range``, element 1 sees nothing at all):
    the gradients are those of clean inputs, bit for bit; hidden keys get exact zeros."""
    b, h, hkv, s, d = 2, 2, 1, 40, 16
    mask = Mask(kv_range=torch.tensor([[5, 30], [7, 7]], dtype=torch.int32), rows=_docs([0, 12, s], s))
    q, k, v, dout = inputs(b, h, hkv, s, s, d)
    scale = 1 / math.sqrt(d)
    _, lse, delta = oracle(q, k, v, dout, scale, False, 0, mask)
    clean = run(q, k, v, dout, lse, delta, scale, False, 0, mask, det, monkeypatch)
    hidden = ~visible(mask, False, 0, b, s, s).any(1)  # [B, Sk] keys no row sees
    kp, vp = k.clone(), v.clone()
    kp[hidden.unsqueeze(1).expand_as(k[..., 0])] = float("nan")
    vp[hidden.unsqueeze(1).expand_as(v[..., 0])] = float("nan")
    got = run(q, kp, vp, dout, lse, delta, scale, False, 0, mask, det, monkeypatch)
    for g, c in zip(got, clean):
        assert torch.equal(g, c)
    assert torch.equal(got[0][1], torch.zeros_like(got[0][1]))  # element 1: empty rows
    for g in got[1:]:
        assert torch.equal(g[hidden.unsqueeze(1).expand_as(g[..., 0])], torch.zeros(int(hidden.sum()) * hkv, d))


@pytest.mark.parametrize("case", [(1, 1, 1, 129, 17, 16), (1, 4, 1, 50, 20, 16), (2, 4, 2, 33, 33, 16),
                                  (1, 4, 1, 37, 37, 16)])
def test_atomic_matches_deterministic_and_splits(case, monkeypatch):
    """The five-product path against the deterministic pair of the same math (the general pair, run
    here through a key range that covers every key) within float32 rounding, where the dK/dV work is
    split by query range, by query heads (evenly and not: 3 splits of 4 heads) and not at all (4 SMs
    under the interpreter). The scale is no power of two: the plain pair (the default for plain
    visibility) applies it after rounding dS to bf16, these two before, so they agree only to that
    rounding, and a power-of-two scale would hide which pair a comparison reaches."""
    b, h, hkv, sq, sk, d = case
    q, k, v, dout = inputs(b, h, hkv, sq, sk, d)
    scale = 0.3
    _, lse, delta = oracle(q, k, v, dout, scale, True, sk - sq, NO_MASK)
    nh, nq = AB.splits(q, k, configs.ATTN_TILE_INTERPRET)
    assert (nh, nq) == {129: (1, 2), 50: (4, 1), 33: (1, 1), 37: (3, 1)}[sq]
    every_key = Mask(kv_range=torch.tensor([[0, sk]] * b, dtype=torch.int32))
    fast = run(q, k, v, dout, lse, delta, scale, True, sk - sq, NO_MASK, False, monkeypatch)
    slow = run(q, k, v, dout, lse, delta, scale, True, sk - sq, every_key, True, monkeypatch)
    again = run(q, k, v, dout, lse, delta, scale, True, sk - sq, every_key, True, monkeypatch)
    plain = run(q, k, v, dout, lse, delta, scale, True, sk - sq, NO_MASK, True, monkeypatch)
    plain_again = run(q, k, v, dout, lse, delta, scale, True, sk - sq, NO_MASK, True, monkeypatch)
    for f, s_, a, p, pa in zip(fast, slow, again, plain, plain_again):
        assert torch.equal(s_, a) and torch.equal(p, pa)  # the deterministic pairs: bitwise reproducible
        torch.testing.assert_close(f, s_, rtol=1e-5, atol=1e-5 * s_.abs().max().item())


@pytest.mark.parametrize("waves,group", [(1, 3), (4, 5)])
def test_launch_order_changes_nothing(waves, group, monkeypatch):
    """Causal grids taken heads in groups (``configs.ATTN_ORDER_WAVES``; here groups of 3 and 2 of
    the 5 kv heads, then all 5 in one) give the forward and both deterministic backward pairs
    bit for bit what the grid's own order gives: every program runs once, on the block and head
    it computed before."""
    from splitsoftmax.ops.attention import fwd as A
    from splitsoftmax.ops.attention.decode import head_group
    q, k, v, dout = inputs(1, 10, 5, 40, 40, 16)
    scale = 0.3
    _, lse, delta = oracle(q, k, v, dout, scale, True, 0, NO_MASK)
    every_key = Mask(kv_range=torch.tensor([[0, 40]], dtype=torch.int32))

    def results():
        fwd = A.attn_fwd(q, k, v, scale, True, 0)
        return [*fwd, *(t for m in (NO_MASK, every_key)
                        for t in run(q, k, v, dout, lse, delta, scale, True, 0, m, True, monkeypatch))]
    monkeypatch.setattr(configs, "ATTN_ORDER_WAVES", 0)
    assert head_group(3, 5, q, True, 4) == 1
    before = results()
    monkeypatch.setattr(configs, "ATTN_ORDER_WAVES", waves)
    assert head_group(3, 5, q, True, 4) == group and head_group(3, 5, q, False, 4) == 1
    for got, want in zip(results(), before):
        assert not torch.isnan(want).any()
        assert torch.equal(got, want)


class _Copies:
    """Counts ``Tensor.contiguous`` calls that copy."""

    def __init__(self, monkeypatch):
        self.n, orig = 0, torch.Tensor.contiguous

        def counted(t, *a, **kw):
            out = orig(t, *a, **kw)
            self.n += out.data_ptr() != t.data_ptr()
            return out
        monkeypatch.setattr(torch.Tensor, "contiguous", counted)


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
def test_bshd_views_run_in_place(det, monkeypatch):
    """q, k, v, dout as (B, H, S, D) views of (B, S, H, D) tensors: no input is copied, and each
    gradient has its input's strides (so ``grad.transpose(1, 2).contiguous()`` copies nothing)."""
    b, s, h, hkv, d = 2, 37, 4, 2, 32
    q, dout = (torch.randn(b, s, h, d).to(BF16).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(b, s, hkv, d).to(BF16).transpose(1, 2) for _ in range(2))
    scale = 1 / math.sqrt(d)
    want, lse, delta = oracle(q, k, v, dout, scale, True, 0, NO_MASK)
    copies = _Copies(monkeypatch)
    got = run(q, k, v, dout, lse, delta, scale, True, 0, NO_MASK, det, monkeypatch, out_dtype=BF16)
    assert copies.n == 0
    peers = peer_grads(q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(), scale, True, 0, NO_MASK)
    for g, t, p, w in zip(got, (q, k, v), peers, want):
        assert g.stride() == t.stride()
        assert g.transpose(1, 2).contiguous().data_ptr() == g.data_ptr()
        assert rule(g, p, w)[0]


def test_public_autograd_bshd_views():
    """Through ``ss.attention``: gradients of (B, S, H, D) leaves viewed as (B, H, S, D) arrive with the
    leaves' layout and match float64 within the 2x rule."""
    b, s, h, hkv, d = 1, 33, 4, 2, 32
    leaves = [torch.randn(b, s, n, d).to(BF16).requires_grad_() for n in (h, hkv, hkv)]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    out = ss.attention(q, k, v, causal=True)
    g = torch.randn_like(out)
    out.backward(g)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o64, _ = scores_attention(*ref, 1 / math.sqrt(d), True, 0, NO_MASK, b)
    o64.backward(g.double())
    peers = peer_grads(q.detach(), k.detach(), v.detach(), g, 1 / math.sqrt(d), True, 0, NO_MASK)
    for leaf, p, w in zip(leaves, peers, ref):
        assert leaf.grad.is_contiguous()
        assert rule(leaf.grad.transpose(1, 2), p, w.grad)[0]


def _ring_case(group, schedule, causal):
    """bf16 attention over 2 ranks (zigzag): every rank's gradients within the rule of the
    single-device float64 result."""
    from splitsoftmax.distributed.comm import as_comm
    rank = as_comm(group).rank
    torch.manual_seed(5)
    b, h, hkv, s, d = 1, 4, 2, 50, 16
    q, k, v, dout = inputs(b, h, hkv, s, s, d)
    scale = 1 / math.sqrt(d)
    want, _, _ = oracle(q, k, v, dout, scale, causal, 0, NO_MASK)
    peers = peer_grads(q, k, v, dout, scale, causal, 0, NO_MASK)
    mine = lambda t: ss.shard(t, 2, group=group, layout="zigzag")  # noqa: E731
    leaves = [mine(t).clone().requires_grad_() for t in (q, k, v)]
    out = ss.sharded_attention(*leaves, causal=causal, group=group, schedule=schedule, layout="zigzag")
    out.backward(mine(dout))
    for name, leaf, p, w in zip("qkv", leaves, peers, want):
        ok, msg = rule(leaf.grad, mine(p), mine(w))
        assert ok, (schedule, causal, rank, name, msg)


@pytest.mark.parametrize("schedule,causal", [("ring", False), ("allgather", True)])
def test_flash_rule_sharded(schedule, causal):
    """The ring and allgather schedules call this backward per block pair (float32 partials summed):
    FlashAttention's rule holds for every rank's gradients."""
    from splitsoftmax.distributed import LoopbackWorld
    LoopbackWorld(2).run(lambda g: _ring_case(g, schedule, causal))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bshd", [False, True], ids=["bhsd", "bshd views"])
def test_plain_pair_tma_reads_match_pointer_reads(causal, bshd, monkeypatch):
    """The plain pair with its streamed tiles read through TMA descriptors gives the pointer path's
    gradients bit for bit (lengths not a multiple of the tiles: the descriptors' zero padding), and
    both meet the rule."""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    b, s, h, hkv, d = 1, 37, 4, 2, 32

    def make(heads):
        t = torch.randn(b, s, heads, d) if bshd else torch.randn(b, heads, s, d)
        return t.to(BF16).transpose(1, 2) if bshd else t.to(BF16)
    q, k, v, dout = make(h), make(hkv), make(hkv), make(h)
    scale = 0.3
    want, lse, delta = oracle(q, k, v, dout, scale, causal, 0, NO_MASK)
    grads = {}
    for tma in (False, True):
        monkeypatch.setattr(configs, "ATTN_BWD_TMA", tma)
        assert ABP._use_tma(q, k, v, dout) == tma
        grads[tma] = ABP.attn_bwd(q, k, v, dout, lse, delta, scale, causal, out_dtype=BF16)
    peers = peer_grads(q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(), scale, causal, 0, NO_MASK)
    for name, a, t, p, w in zip("qkv", grads[True], grads[False], peers, want):
        assert torch.equal(a, t), name
        ok, msg = rule(a, p, w)
        assert ok, (name, msg)


def _rows(cu: list, s: int) -> Tensor:
    """``Mask.rows`` of documents ``cu`` over ``s`` rows."""
    cu = torch.tensor(cu)
    doc = torch.searchsorted(cu, torch.arange(s), right=True) - 1
    return torch.stack((cu[doc], cu[doc + 1])).to(torch.int32)


DS_MASKS = {
    "plain": lambda sq, sk: NO_MASK,
    "window": lambda sq, sk: Mask(lo=-20),
    "documents": lambda sq, sk: Mask(rows=_rows([0, 9, 9, 10, 16, sk], sq)),
    "documents+window": lambda sq, sk: Mask(lo=-12, rows=_rows([0, 20, sk], sq)),
    "kv_range+offset": lambda sq, sk: Mask(kv_range=torch.tensor([[3, sk - 4], [0, sk]], dtype=torch.int32),
                                           q_offset=torch.tensor([2, -5], dtype=torch.int32)),
}


@pytest.mark.parametrize("name,causal,sq,sk", [("plain", True, 45, 45), ("plain", False, 37, 50),
                                               ("plain", True, 30, 47), ("window", True, 80, 80),
                                               ("documents", True, 45, 45), ("documents", False, 45, 45),
                                               ("documents+window", True, 80, 80),
                                               ("kv_range+offset", True, 37, 50)])
def test_dq_from_written_ds(name, causal, sq, sk):
    """The dQ kernel that reads the ``dS^T`` tiles the Hopper dK/dV kernel writes: ``scale * dS K``
    over the pairs each row sees, from a buffer whose rows hold each causal key block's tiles from
    its first row in the band on and whose tiles no seen pair lies in hold NaN (never written there); a
    NaN key (its scores NaN, so its seen pairs' dS NaN as that kernel writes them) reaches exactly
    the rows that see it, the causal rows before it untouched. Odd lengths, GQA 4/2, the diagonal
    offset of ``Sk - Sq`` for ``Sq != Sk``; the variants' masks (a window, documents, empty ones
    included, key ranges and offsets per batch element)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from splitsoftmax.ops.attention import bwd_plain as ABP
    b, h, hkv, d, bm, bn, bmq = 2, 4, 2, 32, 16, 16, 32
    g, diag, nan_key = h // hkv, sk - sq if causal else 0, sk - 13
    mask = DS_MASKS[name](sq, sk)
    torch.manual_seed(3)
    k = torch.randn(b, hkv, sk, d).to(BF16)
    k[1, 0, nan_key, 5] = float("nan")
    seen = visible(mask, causal, diag, b, sq, sk).transpose(1, 2)[:, None]  # [B, 1, Sk, Sq]
    ds = torch.where(seen, torch.randn(b, h, sk, sq, dtype=torch.float64), 0.0).to(BF16)  # dS^T
    ds[1, :g, nan_key] = torch.where(seen[1, 0, nan_key], float("nan"), 0.0).to(BF16)
    nkb, nqb = -(-sk // bn), -(-sq // bm)
    # the tiles the dK/dV kernel visits, those holding a seen pair, a causal key block's from its
    # first row in the band (rounded down to tiles, then to the dQ kernel's) on: (b, key block, query
    # block, column)
    dg = [diag + (0 if mask.q_offset is None else int(mask.q_offset[e])) for e in range(b)]
    visits = [(e, j, i, i * bm - (max(j * bn - dg[e], 0) // bm * bm // bmq * bmq if causal else 0))
              for e in range(b) for j in range(nkb) for i in range(nqb)
              if seen[e, 0, j * bn:(j + 1) * bn, i * bm:(i + 1) * bm].any()]
    cols = max(c for *_, c in visits) + bm
    full = torch.full((b, h, nkb * bn, cols + 8), float("nan"), dtype=BF16)  # (NaN past the buffer's columns)
    for e, j, i, c in visits:
        block = ds[e, :, j * bn:(j + 1) * bn, i * bm:(i + 1) * bm]
        full[e, :, j * bn:j * bn + block.shape[1], c:c + block.shape[2]] = block
    buf = full.view(b * h * nkb * bn, cols + 8)[:, :cols]
    scale = 0.3
    dq = torch.full((b, h, sq, d), float("nan"))
    kvr, off, rows, strides, flags = AB._mask_args(mask, dq, dq)
    ABP._QDS((-(-sq // bmq), b * h), None, (TensorDescriptor(buf, list(buf.shape), list(buf.stride()), [bn, bmq]),
                                            AB._descriptor(k, bn), dq, kvr, off, rows, *dq.stride(), *strides, h,
                                            g, sq, sk, diag, mask.lo or 0, scale, 1),
             dict(D=d, BLOCK_M=bmq, BLOCK_N=bn, KV_M=bm, CAUSAL=causal, PREC="ieee",
                  **{f: flags[f] for f in ("HAS_LO", "HAS_KV", "HAS_OFF", "HAS_ROWS")}))
    kz = k.double().nan_to_num(0.0).repeat_interleave(g, 1)
    want = scale * (ds.double().nan_to_num(0.0).transpose(-1, -2) @ kz)
    hit = torch.zeros(b, h, sq, dtype=torch.bool)
    hit[1, :g] = seen[1, 0, nan_key]
    want[hit] = float("nan")
    assert hit.any() and torch.equal(dq.isnan().any(-1), hit)
    torch.testing.assert_close(dq.double(), want, rtol=1e-5, atol=1e-5, equal_nan=True)
