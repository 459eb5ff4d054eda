"""The rule the sinks gradient is held to in bf16, shared by the interpreter and GPU lanes: the
gradients of a float64 loss against the rule written out, in float64 (the truth) and in bf16 (the
same-precision peer), and FlashAttention's bound."""
from __future__ import annotations

import torch

from test_variants import _rule_written_out

NEG_INF = float("-inf")
BF16 = torch.bfloat16


def _loss(out, lse, dout, dlse):
    return (out.double() * dout.double()).sum() + (lse.double() * dlse.double()).masked_fill(lse == NEG_INF, 0).sum()


def _grads(fn, q, k, v, dout, dlse, sinks, dtype, sinks_dtype, kw):
    """``[dq, dk, dv, dsinks]`` of ``fn`` on the inputs in ``dtype`` (the sinks in ``sinks_dtype``),
    cotangents ``dout`` and ``dlse`` (on finite rows)."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [sinks.to(sinks_dtype).requires_grad_()]
    out, lse = fn(*leaves[:3], sinks=leaves[3], **kw)
    return list(torch.autograd.grad(_loss(out, lse, dout, dlse), leaves))


def _err(x, want):
    assert not x.isnan().any()
    return (x.double() - want).abs().max().item()


def _references(q, k, v, dout, dlse, sinks, scale, kw, sinks_dtype=torch.float32):
    """``(want, peer)``: the rule written out's gradients in float64, and in bf16 (sinks in ``sinks_dtype``)."""
    written = lambda q, k, v, **w: _rule_written_out(q, k, v, scale, **w)  # noqa: E731
    return (_grads(written, q, k, v, dout, dlse, sinks, torch.float64, torch.float64, kw),
            _grads(written, q, k, v, dout, dlse, sinks, BF16, sinks_dtype, kw))


def _within_rule(got, want, peer, what):
    """FlashAttention's rule: at most 2x the same-precision peer's error, plus twice the rounding of the
    exact result to ``got``'s dtype."""
    bound = 2 * _err(peer, want) + 2 * _err(want.to(got.dtype), want)
    assert _err(got, want) <= bound, (what, _err(got, want), _err(peer, want))
