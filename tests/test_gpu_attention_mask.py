"""GPU lane: the forward kernels under ``splitsoftmax.core.mask.Mask`` variants, FlashAttention's rule.

Each test runs the Triton kernel and, in bf16 on sm_90, the Gluon one (ops/attention/gluon/fwd.py,
from any length).

The kernel's error against a float64 oracle (built from ``mask.visible``) may be at most 2x that of
torch's attention in the same dtype with the same mask (SDPA with a boolean mask; with softcap,
torch's eager scores capped in float32). Rows that see no key must be exactly ``(0, -inf)``.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the cases hold CUDA tensors)", allow_module_level=True)

from splitsoftmax.core import reference as ref  # noqa: E402
from splitsoftmax.ops.attention import fwd as A  # noqa: E402
from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.ops._triton import device  # noqa: E402
from splitsoftmax.ops.attention import decode  # noqa: E402
from splitsoftmax.core.mask import Mask, visible  # noqa: E402

NEG_INF = float("-inf")
DEV = "cuda"


def scores(q, k, scale, mask, dtype):
    """Scaled (and capped) scores of ``q`` over ``k`` in ``dtype``'s products, as float64/float32."""
    g = q.shape[1] // k.shape[1]
    s = (q.to(dtype) @ k.to(dtype).repeat_interleave(g, 1).transpose(-1, -2)).to(
        torch.float64 if dtype == torch.float64 else torch.float32) * scale
    return mask.softcap * torch.tanh(s / mask.softcap) if mask.softcap else s


def attention(q, k, v, scale, causal, diag, mask, dtype):
    """Attention under ``mask`` with products in ``dtype`` (float64: the oracle; 16-bit: the peer,
    probabilities rounded to ``dtype`` before their product with V); empty rows ``(0, -inf)``."""
    vis = visible(mask, causal, diag, q.shape[0], q.shape[2], k.shape[2], device=q.device).unsqueeze(1)
    s = torch.where(vis, scores(q, k, scale, mask, dtype), NEG_INF)
    p = ref.softmax(s, -1)
    g = q.shape[1] // k.shape[1]
    return (p.to(dtype) @ v.to(dtype).repeat_interleave(g, 1)).double(), ref.logsumexp(s, -1)


def peer(q, k, v, scale, causal, diag, mask):
    """torch in the inputs' dtype: SDPA with the boolean mask, or eager with the softcap."""
    if mask.softcap:
        return attention(q, k, v, scale, causal, diag, mask, q.dtype)[0]
    g = q.shape[1] // k.shape[1]
    vis = visible(mask, causal, diag, q.shape[0], q.shape[2], k.shape[2], device=q.device).unsqueeze(1)
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=vis,
                                         scale=scale)
    return out.double()


@pytest.fixture(params=["triton", "gluon"])
def gluon(request, monkeypatch):
    """Whether the variants run on the Gluon forward (on sm_90, from any length) or the Triton one."""
    on = request.param == "gluon"
    if on and not device.sm90(torch.empty(0, device=DEV)):
        pytest.skip("the Gluon forward runs on sm_90")
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_VARIANTS", on)
    if on:
        monkeypatch.setattr(configs, "ATTN_FWD_GLUON_MIN_SQ", (0, 0))
    return on


def takes_gluon(q, k, v, scale, causal, diag, mask):
    """Whether the forward of these operands runs the Gluon kernel."""
    p = A.plan(q, k, v, causal, diag, mask)
    out = A._empty_out(q, v.shape[-1], q.dtype)
    return configs.ATTN_FWD_GLUON_VARIANTS and A._gluon_fwd_tile(q, k, v, out, scale, causal, p, False,
                                                                  False) is not None


def err(x, want, rows):
    x = x.double().transpose(1, 2)[rows]
    assert not torch.isnan(x).any()
    return (x - want.transpose(1, 2)[rows]).abs().max().item()


def docs(cu, device=DEV):
    rows = torch.empty(2, cu[-1], dtype=torch.int32)
    for a, e in zip(cu[:-1], cu[1:]):
        rows[0, a:e], rows[1, a:e] = a, e
    return rows.to(device)


def i32(*x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


CASES = [
    # name, (b, h, hkv, sq, sk, d), causal, diag, mask, query gain
    ("window", (2, 8, 2, 1000, 1000, 128), True, 0, Mask(lo=-255), 1.0),
    ("documents", (1, 8, 2, 1000, 1000, 128), True, 0, Mask(rows=docs([0, 100, 357, 358, 1000])), 1.0),
    ("documents full", (1, 4, 4, 1024, 1024, 64), False, 0, Mask(rows=docs([0, 512, 1024])), 1.0),
    ("kv_range + q_offset", (2, 8, 2, 300, 1500, 128), True, 0,
     Mask(kv_range=i32([0, 1200], [40, 1500]), q_offset=i32(900, 1200)), 1.0),
    ("softcap 50", (2, 8, 2, 1000, 1000, 128), True, 0, Mask(softcap=50.0), 4.0),
    ("softcap 5", (1, 8, 8, 512, 700, 128), False, 0, Mask(softcap=5.0), 4.0),
    ("all", (2, 8, 2, 1024, 1024, 128), True, 0,
     Mask(lo=-300, softcap=30.0, kv_range=i32([0, 1024], [17, 1000]), rows=docs([0, 600, 1024])), 2.0),
    ("decode", (2, 32, 8, 1, 40000, 128), True, 39999, Mask(lo=39999 - 8191, kv_range=i32([0, 30000], [0, 40000])),
     1.0),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,shape,causal,diag,mask,gain", CASES, ids=[c[0] for c in CASES])
def test_variant_flash_rule(name, shape, causal, diag, mask, gain, dtype, gluon):
    b, h, hkv, sq, sk, d = shape
    if gluon and (dtype != torch.bfloat16 or d != 128):
        pytest.skip("the Gluon forward takes bf16 and head dim 128")
    q = (torch.randn(b, h, sq, d, device=DEV) * gain).to(dtype)
    k, v = (torch.randn(b, hkv, sk, d, device=DEV, dtype=dtype) for _ in range(2))
    scale = 1 / math.sqrt(d)
    if gluon and A.plan(q, k, v, causal, diag, mask).nsplit != 1:
        pytest.skip("too few query blocks: the keys are split (the Gluon forward takes one split)")
    assert takes_gluon(q, k, v, scale, causal, diag, mask) == gluon
    out, lse = A.attn_fwd(q, k, v, scale, causal, diag, out_dtype=dtype, mask=mask)
    ro, rl = attention(q, k, v, scale, causal, diag, mask, torch.float64)
    seen = (rl > NEG_INF).transpose(1, 2)  # [B, Sq, H]
    rows = seen.all(-1)
    assert torch.equal(lse.transpose(1, 2) == NEG_INF, ~seen)
    assert torch.equal(out.transpose(1, 2)[~seen], torch.zeros_like(out.transpose(1, 2)[~seen]))
    assert err(out, ro, rows) <= 2 * err(peer(q, k, v, scale, causal, diag, mask), ro, rows) + 1e-6
    fin = rl > NEG_INF
    assert (lse[fin].double() - rl[fin]).abs().max().item() < 2e-2


@pytest.mark.parametrize("b,s,tma", [(2, 1024, True), (1, 1000, True), (2, 1000, True), (2, 1000, False)])
def test_bshd_views(b, s, tma, monkeypatch):
    """q, k, v as (B, H, S, D) views of (B, S, H, D) tensors, the output a (B, S, H, Dv) tensor's
    view: results bit for bit those of contiguous copies; (B * S, H * D) row views at batch 1 or
    whole tiles."""
    monkeypatch.setattr(configs, "ATTN_TMA", tma)
    q = torch.randn(b, s, 32, 128, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(b, s, 8, 128, device=DEV, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    p = decode.plan(q, k, v, True, 0)
    ops = A._tma_operands(q, k, v, A._empty_out(q, 128, q.dtype), p, store=True)
    whole = s % p.tile[0] == 0 and s % p.tile[1] == 0
    assert (ops is not None) == tma and (not tma or ops[5:] == (b == 1 or whole,) * 2)
    out, lse = A.attn_fwd(q, k, v, 1 / math.sqrt(128), True, 0, out_dtype=q.dtype)
    assert out.transpose(1, 2).is_contiguous()
    want = A.attn_fwd(q.contiguous(), k.contiguous(), v.contiguous(), 1 / math.sqrt(128), True, 0, out_dtype=q.dtype)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_nan_in_hidden_keys_changes_nothing(gluon):
    """NaN/Inf in keys and values outside every row's interval (kv_range, documents, window)."""
    b, h, hkv, s, d = 2, 8, 2, 1000, 128
    q, k, v = (torch.randn(b, n, s, d, device=DEV, dtype=torch.bfloat16) for n in (h, hkv, hkv))
    m = Mask(lo=-200, kv_range=i32([0, 900], [100, 1000]), rows=docs([0, 500, 1000]))
    assert takes_gluon(q, k, v, 0.1, True, 0, m) == gluon
    want = A.attn_fwd(q, k, v, 0.1, True, 0, out_dtype=q.dtype, mask=m)
    hidden = ~visible(m, True, 0, b, s, s, device=DEV).any(1)  # [B, Sk]
    k2, v2 = k.clone(), v.clone()
    k2.transpose(1, 2)[hidden] = float("nan")
    v2.transpose(1, 2)[hidden] = float("inf")
    got = A.attn_fwd(q, k2, v2, 0.1, True, 0, out_dtype=q.dtype, mask=m)
    assert hidden.any() and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_nan_in_partly_hidden_blocks_reaches_only_its_rows(gluon):
    """A NaN value at a key some rows of a masked block see and others do not (a document's first
    key, inside a window's edge) reaches exactly the rows that see it, as under the oracle."""
    b, h, hkv, s, d = 2, 8, 2, 1000, 128
    q, k, v = (torch.randn(b, n, s, d, device=DEV, dtype=torch.bfloat16) for n in (h, hkv, hkv))
    m = Mask(lo=-150, rows=docs([0, 333, 1000]))
    assert takes_gluon(q, k, v, 0.1, True, 0, m) == gluon
    for key in (333, 700):
        v[0, 0, key, 7] = float("nan")
    out, lse = A.attn_fwd(q, k, v, 0.1, True, 0, out_dtype=q.dtype, mask=m)
    sees = visible(m, True, 0, 1, s, s, device=DEV)[0][:, [333, 700]].any(1)  # [Sq]
    reached = (~torch.isfinite(out)).any(-1)  # [B, H, Sq]
    assert torch.equal(reached[0, :4], sees.expand(4, s)) and sees.any() and not sees.all()
    assert not reached[0, 4:].any() and not reached[1].any()  # the other kv head, the other element
    assert not lse.isnan().any()


@pytest.mark.parametrize("off", [2 ** 32, -2 ** 32, 2 ** 31 + 5], ids=["far-right", "far-left", "past-int32"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window_size=(7, 0))], ids=["causal", "window"])
def test_offsets_past_int32(off, kw):
    """A ``q_offset`` (int or tensor) past the int32 range: every key seen or none, as on the CPU
    path, and the same for the int and the tensor (which runs with no host synchronisation)."""
    import splitsoftmax as ss
    q = torch.randn(2, 4, 64, 64, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 96, 64, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    got = ss.attention(q, k, v, q_offset=off, return_lse=True, **kw)
    want = ss.attention(q.cpu(), k.cpu(), v.cpu(), q_offset=off, return_lse=True, **kw)
    torch.testing.assert_close(got[0].cpu().float(), want[0].float(), atol=2e-2, rtol=0)
    assert torch.equal(got[1].isinf().cpu(), want[1].isinf())
    offs = torch.full((2,), off, device=DEV)
    ss.attention(q, k, v, q_offset=offs, **kw)  # (compiles and plans first)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        by_tensor = ss.attention(q, k, v, q_offset=offs, return_lse=True, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(by_tensor[1].isinf(), got[1].isinf())
    torch.testing.assert_close(by_tensor[0].float(), got[0].float(), atol=2e-2, rtol=0)
