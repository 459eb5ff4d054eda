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
from splitsoftmax import local  # noqa: E402
from splitsoftmax import reference as ref  # noqa: E402

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
