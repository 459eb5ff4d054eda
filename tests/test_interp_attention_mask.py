"""Interpreter lane: the Triton forward under every field of ``splitsoftmax.core.mask.Mask``, alone and
combined, against a float64 oracle built from ``mask.visible``; NaN in hidden positions; empty
rows; ``(B, S, H, D)`` views with no copy; split-KV decode and in-place accumulation.

Run as ``TRITON_INTERPRET=1 python -m pytest -m interpreter``; outputs are NaN-poisoned by conftest.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

pytestmark = pytest.mark.interpreter

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter lane: set TRITON_INTERPRET=1 before importing triton", allow_module_level=True)

from splitsoftmax.core import reference as ref  # noqa: E402
from splitsoftmax.ops.attention import fwd as A  # noqa: E402
from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.ops.attention import decode  # noqa: E402
from splitsoftmax.core.mask import NO_MASK, Mask, visible  # noqa: E402

NEG_INF = float("-inf")
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}


def oracle(q, k, v, scale, causal, diag, mask):
    """float64 ``(out, lse)`` of the rule in splitsoftmax.core.mask; empty rows ``(0, -inf)``; NaN/Inf in
    hidden positions never enter (hidden scores are replaced, hidden values multiplied by nothing)."""
    b, h, sq, _ = q.shape
    g = h // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    if mask.softcap:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    vis = visible(mask, causal, diag, b, sq, k.shape[2]).unsqueeze(1)  # [B, 1, Sq, Sk]
    s = torch.where(vis, s, NEG_INF)
    p = ref.softmax(s, -1)
    out = torch.where(vis.unsqueeze(-1), p.unsqueeze(-1) * vv.unsqueeze(2), 0.0).sum(-2)
    return out, ref.logsumexp(s, -1)


def inputs(b, h, hkv, sq, sk, d, dtype, gain=1.0):
    return (torch.randn(b, h, sq, d).mul(gain).to(dtype), torch.randn(b, hkv, sk, d).to(dtype),
            torch.randn(b, hkv, sk, d).to(dtype))


def doc_rows(cu: list) -> torch.Tensor:
    """``(2, S)`` int32 row bounds of packed documents ``cu`` (cumulative lengths)."""
    rows = torch.empty(2, cu[-1], dtype=torch.int32)
    for a, e in zip(cu[:-1], cu[1:]):
        rows[0, a:e], rows[1, a:e] = a, e
    return rows


def check(got, want, dtype):
    (out, lse), (ro, rl) = got, want
    assert out.dtype == torch.float32 and not torch.isnan(out).any() and not torch.isnan(lse).any()
    scale = ro.abs().max().clamp_min(1e-30)
    assert ((out.double() - ro).abs().max() / scale).item() < TOL[dtype]
    fin = rl > NEG_INF
    assert torch.equal(lse == NEG_INF, ~fin), "empty rows must be exactly the rows that see no key"
    assert torch.equal(out[~fin], torch.zeros_like(out[~fin]))
    if fin.any():
        assert (lse[fin].double() - rl[fin]).abs().max().item() < TOL[dtype]


def kv(*rows):
    return torch.tensor(rows, dtype=torch.int32)


# name, (b, h, hkv, sq, sk, d), causal, diag, mask
CASES = [
    ("window causal", (1, 4, 2, 97, 97, 32), True, 0, Mask(lo=-5)),
    ("window only", (2, 2, 1, 17, 97, 16), False, 0, Mask(lo=40)),
    ("kv_range", (2, 4, 2, 17, 97, 32), False, 0, Mask(kv_range=kv([3, 90], [0, 17]))),
    ("kv_range empty element", (2, 2, 2, 17, 40, 16), True, 23, Mask(kv_range=kv([5, 5], [1, 39]))),
    ("q_offset", (2, 4, 2, 17, 97, 32), True, 0, Mask(q_offset=kv(80, -9))),
    ("rows causal", (1, 4, 2, 97, 97, 32), True, 0, Mask(rows=doc_rows([0, 5, 5, 40, 41, 97]))),
    ("rows full", (1, 2, 1, 129, 129, 16), False, 0, Mask(rows=doc_rows([0, 64, 65, 129]))),
    ("softcap", (1, 2, 2, 17, 97, 32), False, 0, Mask(softcap=2.0)),
    ("softcap causal", (1, 4, 1, 97, 97, 16), True, 0, Mask(softcap=1.5)),
    ("all", (2, 4, 2, 97, 97, 32), True, 0,
     Mask(lo=-30, softcap=3.0, kv_range=kv([2, 97], [0, 60]), q_offset=kv(0, 7), rows=doc_rows([0, 50, 97]))),
    ("one row", (2, 4, 2, 1, 97, 32), True, 96, Mask(lo=60, kv_range=kv([0, 97], [10, 70]))),
]


BF16 = ("window causal", "rows causal", "softcap causal", "all")


@pytest.mark.parametrize("name,shape,causal,diag,mask,dtype",
                         [(*c, torch.float32) for c in CASES] + [(*c, torch.bfloat16) for c in CASES if c[0] in BF16],
                         ids=[c[0] for c in CASES] + [f"{c[0]} bf16" for c in CASES if c[0] in BF16])
def test_forward_against_oracle(name, shape, causal, diag, mask, dtype):
    b, h, hkv, sq, sk, d = shape
    q, k, v = inputs(b, h, hkv, sq, sk, d, dtype, gain=3.0 if mask.softcap else 1.0)
    scale = 1 / math.sqrt(d)
    check(A.attn_fwd(q, k, v, scale, causal, diag, mask=mask), oracle(q, k, v, scale, causal, diag, mask), dtype)


def test_softcap_bounds_scores():
    """Scores far past the cap: ``c * tanh(s / c)`` flattens them, so every visible key counts."""
    q, k, v = inputs(1, 2, 2, 17, 33, 16, torch.float32, gain=50.0)
    m = Mask(softcap=1.0)
    out, lse = A.attn_fwd(q, k, v, 0.25, False, mask=m)
    ro, rl = oracle(q, k, v, 0.25, False, 0, m)
    check((out, lse), (ro, rl), torch.float32)
    assert (lse - math.log(33)).abs().max() < 1.0 + 1e-5  # |capped score| <= 1


NAN_CASES = [CASES[1], CASES[3],
             ("kv_range", (2, 2, 2, 17, 40, 16), False, 0, Mask(kv_range=kv([3, 35], [0, 17]))),
             ("all", (2, 2, 1, 40, 40, 16), True, 0,
              Mask(lo=-12, softcap=3.0, kv_range=kv([2, 40], [0, 30]), q_offset=kv(0, 3), rows=doc_rows([0, 21, 40])))]


@pytest.mark.parametrize("name,shape,causal,diag,mask", NAN_CASES, ids=[c[0] for c in NAN_CASES])
def test_nan_in_hidden_positions_changes_nothing(name, shape, causal, diag, mask):
    """NaN in every key and value no row may see leaves the result bit for bit; a NaN value one row
    sees reaches exactly the rows that see it."""
    b, h, hkv, sq, sk, d = shape
    q, k, v = inputs(b, h, hkv, sq, sk, d, torch.float32)
    want = A.attn_fwd(q, k, v, 0.2, causal, diag, mask=mask)
    vis = visible(mask, causal, diag, b, sq, sk)  # [B, Sq, Sk]
    hidden = ~vis.any(1)  # [B, Sk] keys no row sees
    k2, v2 = k.clone(), v.clone()
    k2.transpose(1, 2)[hidden] = float("nan")
    v2.transpose(1, 2)[hidden] = float("nan")
    got = A.attn_fwd(q, k2, v2, 0.2, causal, diag, mask=mask)
    assert hidden.any() and all(torch.equal(g, w) for g, w in zip(got, want))
    e = int(vis.flatten(1).any(1).nonzero()[-1])  # an element where some row sees a key ...
    j = int(vis[e].any(0).nonzero()[-1])  # ... and the last key some of its rows see
    v3 = v.clone()
    v3[e, :, j] = float("nan")
    out, _ = A.attn_fwd(q, k, v3, 0.2, causal, diag, mask=mask)
    sees = vis[e, :, j]  # [Sq]
    assert torch.isnan(out[e][:, sees]).all() and torch.equal(out[e][:, ~sees], want[0][e][:, ~sees])
    others = torch.arange(b) != e
    assert torch.equal(out[others], want[0][others])


def test_empty_rows():
    """Rows that see no key (shifted before every key, or an empty kv range) are exactly (0, -inf)."""
    q, k, v = inputs(2, 2, 1, 17, 20, 16, torch.float32)
    m = Mask(q_offset=kv(-10, 0), kv_range=kv([0, 20], [3, 3]))
    out, lse = A.attn_fwd(q, k, v, 0.3, True, 0, mask=m)
    empty = ~visible(m, True, 0, 2, 17, 20).any(-1)  # [B, Sq]
    assert bool(empty[0, :10].all() and empty[1].all() and not empty[0, 10:].any())
    assert bool((lse.transpose(1, 2)[empty] == NEG_INF).all())
    assert torch.equal(out.transpose(1, 2)[empty], torch.zeros_like(out.transpose(1, 2)[empty]))
    check((out, lse), oracle(q, k, v, 0.3, True, 0, m), torch.float32)


def test_decode_splits_cover_the_window():
    """Split-KV decode, GQA packed, per-element KV lengths and a window: the splits start at the
    window's first tile, and the result is the oracle's."""
    q, k, v = inputs(2, 8, 2, 1, 300, 32, torch.float32)
    m = Mask(lo=299 - 150, kv_range=kv([0, 280], [0, 300]))
    p = decode.plan(q, k, v, True, 299, m)
    assert p.pack and p.nsplit > 1 and p.start == (149 // p.tile[1]) * p.tile[1]
    assert p.start + (p.nsplit - 1) * p.chunk < 300 <= p.start + p.nsplit * p.chunk
    check(A.attn_fwd(q, k, v, 0.2, True, 299, mask=m), oracle(q, k, v, 0.2, True, 299, m), torch.float32)


@pytest.mark.parametrize("sq,sk", [(17, 40), (1, 300)])
def test_accumulate_in_place(sq, sk):
    """A ring step merged in place under a mask: two key halves, each with the mask in its own
    coordinates, give the whole (split-KV for the decode shape)."""
    q, k, v = inputs(2, 4, 2, sq, sk, 32, torch.float32)
    half = sk // 2
    kvr, off = kv([1, sk - 3], [half - 2, sk]), kv(sk - sq, sk - sq - 5)
    whole = Mask(lo=-(sk // 3), kv_range=kvr, q_offset=off, softcap=4.0)
    first = whole._replace(kv_range=kvr.clamp(0, half))
    second = whole._replace(kv_range=(kvr - half).clamp(0, sk - half), q_offset=off - half, lo=whole.lo)
    acc_out, acc_lse = A.attn_fwd(q, k[:, :, :half], v[:, :, :half], 0.25, True, 0, mask=first)
    assert (decode.plan(q, k[:, :, half:], v, True, 0, second).nsplit > 1) == (sq == 1)
    A.attn_fwd_acc(q, k[:, :, half:], v[:, :, half:], 0.25, True, 0, acc_out, acc_lse, mask=second)
    check((acc_out, acc_lse), oracle(q, k, v, 0.25, True, 0, whole), torch.float32)


def bshd(b, s, h, d, dtype):
    """A ``(B, H, S, D)`` view of a fresh ``(B, S, H, D)`` tensor."""
    return torch.randn(b, s, h, d).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("b,sq,sk,mask", [(1, 40, 40, NO_MASK), (2, 32, 48, NO_MASK), (2, 17, 33, Mask(lo=-9)),
                                          (1, 48, 48, Mask(rows=doc_rows([0, 20, 48])))])
def test_bshd_views_run_without_copies(b, sq, sk, mask, monkeypatch):
    """q, k, v as views of (B, S, H, D) tensors: TMA reads them as (B * S, H * D) rows where no tile
    crosses a batch element (or at batch 1), the output is a (B, Sq, H, Dv) tensor's view written in
    place, and the results are those of contiguous copies bit for bit."""
    q, k, v = bshd(b, sq, 4, 32, torch.bfloat16), bshd(b, sk, 2, 32, torch.bfloat16), bshd(b, sk, 2, 32, torch.bfloat16)
    copies = [t.contiguous() for t in (q, k, v)]
    p = decode.plan(q, k, v, True, 0, mask)
    out_like = A._empty_out(q, 32, torch.bfloat16)
    tma = A._tma_operands(q, k, v, out_like, p, store=True)
    whole = sq % p.tile[0] == 0 and sk % p.tile[1] == 0
    assert tma is not None and tma[4:] == (True, b == 1 or whole, b == 1 or whole)
    out, lse = A.attn_fwd(q, k, v, 0.2, True, 0, out_dtype=torch.bfloat16, mask=mask)
    assert out.transpose(1, 2).is_contiguous() and out.transpose(1, 2).contiguous().data_ptr() == out.data_ptr()
    assert lse.is_contiguous()
    want = A.attn_fwd(*copies, 0.2, True, 0, out_dtype=torch.bfloat16, mask=mask)
    assert want[0].is_contiguous() and torch.equal(out, want[0]) and torch.equal(lse, want[1])
    monkeypatch.setattr(configs, "ATTN_TMA", False)
    ptr = A.attn_fwd(q, k, v, 0.2, True, 0, out_dtype=torch.bfloat16, mask=mask)
    assert torch.equal(ptr[0], out) and torch.equal(ptr[1], lse)
    check((out.float(), lse), oracle(q, k, v, 0.2, True, 0, mask), torch.bfloat16)


def test_plain_mask_is_no_mask():
    """A Mask with every field at its default takes today's kernel: results bit for bit NO_MASK's."""
    q, k, v = inputs(1, 4, 2, 33, 40, 32, torch.bfloat16)
    a = A.attn_fwd(q, k, v, 0.2, True, 3)
    b = A.attn_fwd(q, k, v, 0.2, True, 3, mask=Mask())
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("bad,err", [(Mask(kv_range=kv([0, 3])), ValueError), (Mask(q_offset=kv(1, 2, 3)), ValueError),
                                     (Mask(rows=torch.zeros(2, 5, dtype=torch.int32)), ValueError),
                                     (Mask(kv_range=torch.zeros(2, 2)), TypeError), (Mask(softcap=-1.0), ValueError)])
def test_bad_masks_are_refused(bad, err):
    q, k, v = inputs(2, 2, 2, 7, 9, 16, torch.float32)
    with pytest.raises(err, match="mask"):
        A.attn_fwd(q, k, v, 0.2, False, mask=bad)
