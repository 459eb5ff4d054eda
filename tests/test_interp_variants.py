"""Interpreter lane: the attention variants through the Triton path on tiny CPU shapes.

Sinks are merged by the caller, so they run on every kernel; the masked variants run where the
kernels take ``mask`` and are refused with ``NotImplementedError`` (naming the kernel) where they
do not. Run as ``TRITON_INTERPRET=1 python -m pytest -m interpreter``.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.interpreter

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter lane: set TRITON_INTERPRET=1 before importing triton", allow_module_level=True)

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.ops import _registry as local  # noqa: E402
from splitsoftmax.core import reference as ref  # noqa: E402

NEG_INF = float("-inf")


def _run(fn, q, k, v, dout, kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    kw = dict(kw)
    if kw.get("sinks") is not None:
        kw["sinks"] = kw["sinks"].detach().clone().to(q.dtype).requires_grad_(True)
        leaves.append(kw["sinks"])
    out, lse = fn(*leaves[:3], **kw)
    grads = torch.autograd.grad((out.double() * dout).sum() + lse.double().sum(), leaves)
    return (out.detach(), lse.detach(), *grads)


def _check(kw, sq=17, sk=17, tol=2e-4):
    g = torch.Generator().manual_seed(sq + sk)
    q, k, v = (torch.randn(s, generator=g) for s in ((2, 4, sq, 16), (2, 2, sk, 16), (2, 2, sk, 16)))
    dout = torch.randn(2, 4, sq, 16, generator=g, dtype=torch.float64)
    got = _run(lambda *a, **w: ss.attention(*a, return_lse=True, **w), q, k, v, dout, kw)
    want = _run(ref.attention_variants, q.double(), k.double(), v.double(), dout, kw)
    for name, a, w in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, want):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a.double(), w, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_sinks_on_the_triton_path(causal):
    _check(dict(causal=causal, sinks=torch.tensor([0.5, NEG_INF, -1.0, 2.0])))


@pytest.mark.parametrize("kw", [
    dict(causal=True, window_size=(4, 0)),
    dict(cu_seqlens=[0, 0, 1, 6, 17], causal=True),
    dict(kv_range=torch.tensor([[2, 17], [0, 9]])),
    dict(causal=True, softcap=2.0, sinks=torch.tensor([0.5, NEG_INF, -1.0, 2.0])),
    dict(causal=True, q_offset=torch.tensor([3, 0], dtype=torch.int32)),
])
def test_masked_variants_on_the_triton_kernels(kw):
    """Every variant runs on the Triton forward and backward (they take the mask) and matches the
    float64 oracle, out, lse and every gradient."""
    q = torch.zeros(1, 1, 1, 16)
    assert local.takes_mask(local.op("attn_fwd", q)) and local.takes_mask(local.op("attn_bwd", q))
    _check(kw)


@pytest.mark.parametrize("seed", range(12))
def test_random_keyword_mixes_on_the_triton_kernels(seed):
    """The CPU lane's random mixes of every keyword (``test_variants._random_mix``) in float32 through
    the Triton kernels: out, lse and every gradient within 2e-4 of the rule written out in float64."""
    from test_variants import _random_mix, _rule_written_out
    (b, h, hkv, sq, sk, d, dv), kw = _random_mix(seed)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64)
               for shape in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv)))
    scale = kw.pop("scale") or d ** -0.5
    dout = torch.randn(b, h, sq, dv, generator=g, dtype=torch.float64)
    runs = {torch.float32: lambda q, k, v, **w: ss.attention(q, k, v, scale=scale, return_lse=True, **w),
            torch.float64: lambda q, k, v, **w: _rule_written_out(q, k, v, scale, **w)}
    got, want = (_run(fn, q.to(dt), k.to(dt), v.to(dt), dout, kw) for dt, fn in runs.items())
    seen = want[1] > NEG_INF
    assert torch.equal(got[1] == NEG_INF, ~seen)
    for name, a, w in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, want):
        assert not a.isnan().any(), name
        if name == "lse":
            a, w = a[seen], w[seen]
        torch.testing.assert_close(a.double(), w, atol=2e-4, rtol=2e-4, msg=name)
