"""GPU lane: Triton attention, split-KV decode and merge against float64, FlashAttention's rule.

The kernel's error against a float64 reference may be at most 2x the error of torch's own SDPA
in the same dtype (5x for gradients, which round dS as well). Outputs are NaN-poisoned through
conftest's ``torch.empty`` fixture, so an unwritten element fails.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.core import reference as ref  # noqa: E402
from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.ops.attention import decode  # noqa: E402

NEG_INF = float("-inf")
DEV = "cuda"


def ref_attention(q, k, v, scale, causal, diag=0):
    """float64 ``(out, lse)`` from the package's oracle; empty rows ``(0, -inf)``."""
    return ref.attention(q, k, v, causal=causal, scale=scale, diag=diag)


def _mask(sq, sk, causal, diag, device):
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    return (j <= i + diag) if causal else torch.ones(sq, sk, dtype=torch.bool, device=device)


def sdpa(q, k, v, scale, causal, diag):
    """torch's attention in the inputs' dtype (the peer whose error sets the bar)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if causal and diag == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    mask = _mask(q.shape[2], k.shape[2], causal, diag, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def err(x, ref):
    assert not torch.isnan(x).any()
    return (x.double() - ref).abs().max().item()


FWD = [
    # b, h, hkv, sq, sk, d, dv, causal, diag
    (2, 8, 8, 1024, 1024, 128, 128, False, 0),
    (2, 8, 2, 1000, 1000, 128, 128, True, 0),
    (2, 8, 2, 1024, 1024, 128, 128, True, 0),     # whole tiles: TMA row views
    (1, 4, 2, 512, 1024, 128, 128, True, 512),
    (1, 8, 1, 577, 1500, 64, 64, True, 923),
    (1, 4, 4, 300, 300, 80, 80, True, 0),
    (1, 4, 2, 257, 400, 96, 64, False, 0),
]


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", FWD)
def test_forward_flash_rule(case, dtype, tma, monkeypatch):
    """16-bit inputs with unpadded head dims read through TMA descriptors, or (``tma=False``) pointers."""
    b, h, hkv, sq, sk, d, dv, causal, diag = case
    if dv != d and dtype == torch.float32:
        pytest.skip("covered in 16-bit")
    if not tma and (dtype == torch.float32 or d & (d - 1)):
        pytest.skip("the pointer path either way")
    monkeypatch.setattr(configs, "ATTN_TMA", tma)
    q = torch.randn(b, h, sq, d, device=DEV, dtype=dtype)
    k = torch.randn(b, hkv, sk, d, device=DEV, dtype=dtype)
    v = torch.randn(b, hkv, sk, dv, device=DEV, dtype=dtype)
    scale = 1 / math.sqrt(d)
    from splitsoftmax.ops.attention import fwd as A
    p = decode.plan(q, k, v, causal, diag)
    ops = A._tma_operands(q, k, v, torch.empty(b, h, sq, dv, device=DEV, dtype=dtype), p, store=True)
    assert (ops is not None) == (tma and dtype != torch.float32 and not d & (d - 1))
    if ops is not None:  # output through a descriptor; row views where no tile crosses a head's end
        assert ops[4:6] == (True, sq % p.tile[0] == 0 and sk % p.tile[1] == 0)
    out, lse = A.attn_fwd(q, k, v, scale, causal, diag, out_dtype=dtype)
    ro, rl = ref_attention(q, k, v, scale, causal, diag)
    peer = sdpa(q, k, v, scale, causal, diag)
    assert err(out, ro) <= 2 * err(peer, ro) + 1e-6
    fin = rl > NEG_INF
    assert torch.equal(lse == NEG_INF, ~fin)
    assert (lse[fin].double() - rl[fin]).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", [(2, 8, 2, 700, 700, 128, True, 0), (1, 4, 4, 513, 300, 64, False, 0),
                                  (1, 4, 2, 300, 500, 128, True, 200)])
def test_backward_flash_rule(case, dtype):
    b, h, hkv, sq, sk, d, causal, diag = case
    scale = 1 / math.sqrt(d)
    q, k, v = (torch.randn(b, n, s, d, device=DEV, dtype=dtype) for n, s in ((h, sq), (hkv, sk), (hkv, sk)))
    dout = torch.randn(b, h, sq, d, device=DEV, dtype=dtype)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    ro, rl = ref_attention(*leaves64, scale, causal, diag)
    (ro * dout.double()).sum().backward()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (sdpa(*leaves, scale, causal, diag) * dout).sum().backward()
    from splitsoftmax.ops.attention import bwd as AB
    delta = (dout.double() * ro.detach()).sum(-1).float()
    grads = AB.attn_bwd(q, k, v, dout, rl.detach().float(), delta, scale, causal, diag)
    for got, peer, want in zip(grads, leaves, leaves64):
        assert err(got.to(dtype), want.grad) <= 5 * err(peer.grad, want.grad) + 1e-6


def test_public_attention_autograd():
    q, k, v = (torch.randn(2, 8, 513, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = ss.attention(q, k, v, causal=True)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ro, _ = ref_attention(*leaves64, 1 / 8, True)
    (ro * g.double()).sum().backward()
    peers = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    (sdpa(*peers, 1 / 8, True, 0) * g).sum().backward()
    assert err(out, ro) <= 2 * err(sdpa(*peers, 1 / 8, True, 0), ro)
    for got, peer, want in zip((q, k, v), peers, leaves64):
        assert err(got.grad, want.grad) <= 5 * err(peer.grad, want.grad)


@pytest.mark.parametrize("sk,causal", [(65536, False), (40000, True)])
def test_split_kv_decode(sk, causal):
    from splitsoftmax.ops.attention import fwd as A, decode
    q = torch.randn(2, 32, 1, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, 8, sk, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(2, 8, sk, 128, device=DEV, dtype=torch.bfloat16)
    diag = sk - 1
    assert decode.plan(q, k, v, causal, diag).nsplit > 1
    out, lse = A.attn_fwd(q, k, v, 1 / math.sqrt(128), causal, diag, out_dtype=torch.bfloat16)
    ro, rl = ref_attention(q, k, v, 1 / math.sqrt(128), causal, diag)
    peer = sdpa(q, k, v, 1 / math.sqrt(128), False, 0)
    assert err(out, ro) <= 2 * err(peer, ro) + 1e-6
    assert err(lse, rl) < 1e-4


def test_launch_cache_serves_a_static_kv_cache(monkeypatch):
    """Decode over a growing prefix of a preallocated K/V cache: every prefix binds a launch to its
    geometry (``Launcher.bind``), and all of them the one compiled kernel (each launch checked
    against Triton's own lookup, conftest's ``LAUNCH_VERIFY``), matching the float64 reference. A
    misaligned query is a new kernel."""
    from splitsoftmax.ops._triton.launch import Memo
    from splitsoftmax.ops.attention import fwd as A
    bound = []
    bind = A._FWD.bind
    monkeypatch.setattr(A._FWD, "bind", lambda *a, **kw: bound.append(bind(*a, **kw)) or bound[-1])
    monkeypatch.setattr(A, "_FWD_LAUNCHES", Memo())
    scale = 1 / math.sqrt(128)
    kv = torch.randn(2, 1, 8, 9000, 128, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(1, 32, 1, 128, device=DEV, dtype=torch.bfloat16)
    buf = torch.randn(q.numel() + 1, device=DEV, dtype=torch.bfloat16)
    q_odd = buf[1:].view(q.shape)  # 2 bytes past a 16-byte boundary
    for sk, query, kernels in ((5000, q, 1), (5001, q, 1), (8999, q, 1), (8999, q_odd, 2), (6000, q_odd, 2)):
        k, v = kv[0, :, :, :sk], kv[1, :, :, :sk]
        out, lse = A.attn_fwd(query, k, v, scale, False, out_dtype=torch.bfloat16)
        ro, rl = ref_attention(query, k, v, scale, False)
        # (SDPA's kernels fault on a misaligned query: the peer gets an aligned copy)
        assert err(out, ro) <= 2 * err(sdpa(query.clone(), k, v, scale, False, 0), ro) + 1e-6
        assert err(lse, rl) < 1e-4
        assert all(b.kernel is not None for b in bound), sk  # bound to the compiled kernel, not the fallback
        assert len({id(b.kernel) for b in bound}) == kernels, (sk, [b.key for b in bound])
    A.attn_fwd(q, kv[0, :, :, :5000], kv[1, :, :, :5000], scale, False, out_dtype=torch.bfloat16)
    assert len(bound) == 5  # a geometry seen before: its bound launch again


def test_accumulate_ring_steps():
    from splitsoftmax.ops.attention import fwd as A
    q, k, v = (torch.randn(1, 8, 1024, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    scale = 1 / math.sqrt(128)
    acc_out = torch.full((1, 8, 1024, 128), float("nan"), device=DEV)
    acc_lse = torch.full((1, 8, 1024), NEG_INF, device=DEV)
    for j in range(0, 1024, 256):  # ring steps over key chunks, global causal offsets
        A.attn_fwd_acc(q, k[:, :, j:j + 256], v[:, :, j:j + 256], scale, True, -j, acc_out, acc_lse)
    ro, rl = ref_attention(q, k, v, scale, True)
    assert err(acc_out, ro) <= 2 * err(sdpa(q, k, v, scale, True, 0), ro)
    assert err(acc_lse, rl) < 1e-4


@pytest.mark.parametrize("n", [1, 2, 8])
def test_merge_fp32(n):
    from splitsoftmax.ops.merge import kernel as merge
    outs = torch.randn(n, 2, 32, 1000, 128, device=DEV)
    lses = torch.randn(n, 2, 32, 1000, device=DEV) * 4
    lses[0, :, :, :10] = NEG_INF
    outs[0, :, :, :10] = float("nan")
    out, lse = merge.merge_out_lse(outs, lses)
    from splitsoftmax.core import state
    ro, rl = state.merge_out_lse(outs.double(), lses.double())
    assert err(out, ro) < 1e-5 * ro.abs().max().item()
    assert err(lse[rl > NEG_INF], rl[rl > NEG_INF]) < 1e-5
    assert torch.equal(lse == NEG_INF, rl == NEG_INF)
