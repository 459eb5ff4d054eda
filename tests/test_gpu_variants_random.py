"""GPU lane: random mixes of every attention keyword through ``ss.attention`` (bf16, head dim 128:
the Gluon forward and backward on sm_90), FlashAttention's rule against the rule written out.

Each mix draws documents of any length, a window, softcap, sinks, key ranges and int or tensor
offsets at lengths that cross several tiles and end inside one; the output, lse and every gradient
(the sinks' too) are compared with float64 (``test_variants._rule_written_out``): the error at most
2x that of torch's attention in bf16 under the same rule (the same function on bf16 inputs: scores
from bf16 products, softmax in float32, probabilities rounded to bf16 before their product with V),
plus twice the error of rounding the exact result to bf16; rows that see no key are exactly
``(0, -inf)``.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import splitsoftmax as ss  # noqa: E402
from test_variants import _rule_written_out  # noqa: E402

NEG_INF = float("-inf")
DEV = "cuda"
BF16 = torch.bfloat16


def _mix(seed):
    """``(B, H, Hkv, Sq, Sk, keywords)``: a random mix at lengths of 1-2500 rows."""
    r = random.Random(seed)
    hkv = r.choice([1, 2, 4])
    b, h = r.choice([1, 2]), hkv * r.choice([1, 2, 4])
    sq = r.choice([r.randint(1, 200), r.randint(200, 2500)])
    sk = sq if r.random() < 0.7 else r.randint(1, 2500)
    kw = dict(causal=r.random() < 0.7)
    if sq == sk and r.random() < 0.5:
        kw["cu_seqlens"] = [0, *sorted(r.randint(0, sq) for _ in range(r.randint(0, 6))), sq]
    if r.random() < 0.5:
        kw["window_size"] = (r.choice([-1, 0, 63, 64, 200, 1000]), r.choice([-1, 0, 100]))
    if r.random() < 0.3:
        kw["softcap"] = r.choice([5.0, 30.0])
    if r.random() < 0.3:
        kw["sinks"] = torch.tensor([r.gauss(0, 2) for _ in range(h)], device=DEV)
    if r.random() < 0.4:
        los = [r.randint(0, sk) for _ in range(b)]
        kw["kv_range"] = torch.tensor([[lo, r.randint(lo, sk)] for lo in los], dtype=torch.int32, device=DEV)
    if "cu_seqlens" not in kw and r.random() < 0.3:
        off = [r.randint(-50, 300) for _ in range(b)]
        kw["q_offset"] = off[0] if r.random() < 0.5 else torch.tensor(off, dtype=torch.int32, device=DEV)
    return (b, h, hkv, sq, sk), kw


def _run(fn, q, k, v, dout, kw, dtype, sinks_dtype):
    """``[out, lse, dq, dk, dv(, dsinks)]`` of ``fn`` on the inputs cast to ``dtype`` (the sinks to
    ``sinks_dtype``), the cotangents ``dout`` and 1 for every finite lse."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    kw = dict(kw)
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].to(sinks_dtype).requires_grad_()
        leaves.append(kw["sinks"])
    out, lse = fn(*leaves[:3], **kw)
    loss = (out.double() * dout.double()).sum() + lse.double().masked_fill(lse == NEG_INF, 0.0).sum()
    return [out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves)]


def _err(x, want):
    return (x.double() - want).abs().max().item() if want.numel() else 0.0


@pytest.mark.parametrize("gluon_any_length", [False, True], ids=["default", "gluon-forward-any-length"])
@pytest.mark.parametrize("seed", range(20))
def test_random_keyword_mixes_within_the_flash_rule(seed, gluon_any_length, monkeypatch):
    """A random mix (:func:`_mix`) within the rule, the forward on the kernel ``ss.attention`` picks
    for its length, or on the Gluon kernel at every length (sm_90)."""
    from splitsoftmax.ops._triton import configs
    if gluon_any_length:
        monkeypatch.setattr(configs, "ATTN_FWD_GLUON_MIN_SQ", (0, 0))
    (b, h, hkv, sq, sk), kw = _mix(seed)
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g, device=DEV).to(BF16)
               for shape in ((b, h, sq, 128), (b, hkv, sk, 128), (b, hkv, sk, 128)))
    dout = torch.randn(b, h, sq, 128, generator=g, device=DEV).to(BF16)
    scale = 1 / math.sqrt(128)
    got = _run(lambda q, k, v, **w: ss.attention(q, k, v, scale=scale, return_lse=True, **w), q, k, v, dout, kw,
               BF16, torch.float32)
    want = _run(lambda q, k, v, **w: _rule_written_out(q, k, v, scale, **w), q, k, v, dout, kw, torch.float64,
                torch.float64)
    peer = _run(lambda q, k, v, **w: _rule_written_out(q, k, v, scale, **w), q, k, v, dout, kw, BF16, torch.float32)
    seen = want[1] > NEG_INF
    what = f"seed {seed}: B={b} H={h}/{hkv} Sq={sq} Sk={sk} {sorted(kw)}"
    assert torch.equal(got[1] == NEG_INF, ~seen) and not got[0][~seen].any(), what
    for name, a, w, p in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want, peer):
        if name == "lse":
            a, w, p = a[seen], w[seen], p[seen]
        assert not a.isnan().any(), (what, name)
        bound = 2 * _err(p, w) + 2 * _err(w.to(a.dtype), w)
        assert _err(a, w) <= bound, (what, name, _err(a, w), _err(p, w))
