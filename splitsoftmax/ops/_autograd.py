"""Autograd formulas of the single-device ops, registered on the custom ops of ``splitsoftmax.ops._library``.

Each op has a ``setup_*`` (what the forward saves) and a ``*_backward`` (the gradient), in the
form ``torch.library.register_autograd`` takes. Backwards are written with torch ops and the
``torch.ops.splitsoftmax`` backward ops only, so ``torch.compile`` traces them without a break.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..core import state


class _Ops:
    """``_ops().<name>(*args)``: the backward op ``torch.ops.splitsoftmax.<name>`` through
    ``splitsoftmax.ops._library.call`` (its implementation directly where nothing needs the dispatcher)."""

    def __getattr__(self, name: str):  # (first use of ``name`` only: the result stays an attribute)
        from ._library import call  # (ops imports this module)
        fn = functools.partial(call, name)
        setattr(self, name, fn)
        return fn


_OPS = _Ops()


def _ops() -> _Ops:
    return _OPS


def setup_softmax(ctx, inputs, output) -> None:
    """``softmax_fwd(x (R, N), log) -> (y, lse)``: saves ``y``, ``lse``; ``lse`` is a side output."""
    _, log = inputs
    y, lse = output
    ctx.save_for_backward(y, lse)
    ctx.mark_non_differentiable(lse)
    ctx.log = log


def softmax_backward(ctx, dy: Tensor, _dlse: Optional[Tensor]):
    """``dx (R, N)`` from the saved output; the non-differentiable ``lse`` takes no gradient."""
    y, lse = ctx.saved_tensors
    return _ops().softmax_bwd(y, dy.contiguous(), lse, ctx.log), None


def setup_softmax_bwd(ctx, inputs, output) -> None:
    """``softmax_bwd(y, dy, lse, log) -> dx``: saves ``y``, ``dy``, ``lse`` (for a second derivative)."""
    y, dy, lse, log = inputs
    ctx.save_for_backward(y, dy, lse)
    ctx.log = log


def softmax_bwd_backward(ctx, g: Tensor):
    """``(d y, d dy)`` of ``dx = y (dy - sum(dy y))`` (softmax) or ``dy - exp(y) sum(dy)`` (log-softmax)
    against the cotangent ``g`` of ``dx``, in torch ops (so differentiable again); 0 in empty rows."""
    y, dy, lse = ctx.saved_tensors
    f = torch.float64 if y.dtype == torch.float64 else torch.float32
    yf, dyf, gf = y.to(f), dy.to(f), g.to(f)
    live = (lse != float("-inf")).unsqueeze(-1)
    if ctx.log:
        p = torch.where(live, torch.exp(yf), 0.0)
        d_dy = gf - (gf * p).sum(-1, keepdim=True)
        d_y = -gf * p * dyf.sum(-1, keepdim=True)
    else:
        gy = (gf * yf).sum(-1, keepdim=True)
        d_dy = yf * (gf - gy)
        d_y = gf * (dyf - (dyf * yf).sum(-1, keepdim=True)) - dyf * gy
    zero = torch.zeros((), dtype=f, device=y.device)
    return torch.where(live, d_y, zero).to(y.dtype), torch.where(live, d_dy, zero).to(dy.dtype), None, None


def setup_logsumexp(ctx, inputs, output) -> None:
    """``logsumexp_fwd(x (R, N)) -> lse (R,)``: saves ``x`` and ``lse``."""
    (x,) = inputs
    ctx.save_for_backward(x, output)


def logsumexp_backward(ctx, g: Tensor):
    """``dx = g * exp(x - lse)``: ``(R, N)`` in ``x.dtype``."""
    x, lse = ctx.saved_tensors
    return _ops().logsumexp_bwd(x, lse, g.contiguous())


def setup_logsumexp_bwd(ctx, inputs, output) -> None:
    """``logsumexp_bwd(x, lse, g) -> dx``: saves all three (for a second derivative)."""
    ctx.save_for_backward(*inputs)


def logsumexp_bwd_backward(ctx, h: Tensor):
    """``(d x, d lse, d g)`` of ``dx = g exp(x - lse)`` against the cotangent ``h`` of ``dx``, in torch
    ops; 0 in empty rows (``lse = -inf``)."""
    x, lse, g = ctx.saved_tensors
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    live = (lse != float("-inf")).unsqueeze(-1)
    p = torch.where(live, torch.exp(x.to(f) - torch.where(live, lse.unsqueeze(-1).to(f), 0.0)), 0.0)
    hp = h.to(f) * p
    gf = g.to(f).unsqueeze(-1)
    return (hp * gf).to(x.dtype), -(hp * gf).sum(-1).to(lse.dtype), hp.sum(-1).to(g.dtype)


def backward_stats(out: Tensor, lse: Tensor, dout: Tensor, dlse) -> tuple[Tensor, Tensor]:
    """``(lse, delta)`` rows ``(B, H, Sq)`` for the attention backward kernels (see
    ``ops.attention.torch.attn_bwd_prep``: rows with all-zero cotangents drop out with ``lse = -inf``)."""
    return _ops().attn_bwd_prep(out, lse, dout, dlse)


def attention_grads(q, k, v, out, lse, dout, dlse, scale: float, causal: bool, diag: int, *mask_args, sinks=None):
    """``(dq, dk, dv, dsinks)`` from the saved ``out (B,H,Sq,Dv)``, ``lse (B,H,Sq)``; ``dout`` or ``dlse``
    may be ``None`` (no gradient through that output); ``mask_args``: the op's mask fields; ``dsinks``
    is ``(0,)`` without ``sinks``."""
    if dout is None:
        dout = torch.zeros_like(out)
    lse, delta = backward_stats(out, lse, dout, dlse)
    return tuple(_ops().attn_bwd(q, k, v, dout, lse, delta, scale, causal, diag, *mask_args, sinks,
                                 dlse))


def setup_attention(ctx, inputs, output) -> None:
    """``attn_fwd(q, k, v, scale, causal, diag, lo, softcap, kv_range, q_offset, rows, sinks) -> (out, lse)``:
    saves tensors and scalars."""
    q, k, v, scale, causal, diag, lo, softcap, kv_range, q_offset, rows, sinks = _attn_inputs(inputs)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_range, q_offset, rows, sinks)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros made and read
    ctx.args = (scale, causal, diag, lo, softcap)
    ctx.sinks_grad = sinks is not None and sinks.requires_grad  # (not needs_input_grad: call() shifts it)


def _attn_inputs(inputs) -> tuple:
    """The ``attn_fwd`` arguments with the trailing defaults filled in."""
    return (*inputs, None, 0.0, None, None, None, None)[:12]


def attention_backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
    """``(dq, dk, dv)``, no gradient for the scalars and the mask, and the sinks' gradient
    ``-sum_rows p_sink * delta`` (``attn_bwd``, :func:`splitsoftmax.core.state.sink_grad`)."""
    q, k, v, out, lse, kv_range, q_offset, rows, sinks = ctx.saved_tensors
    scale, causal, diag, lo, softcap = ctx.args
    sinks = sinks if ctx.sinks_grad else None
    dq, dk, dv, dsinks = attention_grads(q, k, v, out, lse, dout, dlse, scale, causal, diag, lo, softcap, kv_range,
                                         q_offset, rows, sinks=sinks)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None if sinks is None else dsinks


def setup_merge(ctx, inputs, output) -> None:
    """``merge_fwd(outs (N, *rows, Dv), lses (N, *rows)) -> (out, lse)``, accumulation dtype."""
    outs, lses = inputs
    ctx.save_for_backward(outs, lses, *output)


def merge_backward(ctx, g_out: Optional[Tensor], g_lse: Optional[Tensor]):
    """N-way merge backward.

    With ``w_i = exp(lse_i - lse)`` (0 for empty partials): ``d outs_i = w_i g_out`` and
    ``d lses_i = w_i (<g_out, out_i - out> + g_lse)``.
    """
    outs, lses, out, lse = ctx.saved_tensors
    parts = state.from_out_lse(outs, lses)  # NaN in empty partials zeroed
    w = torch.exp(parts.m - state.safe_max(lse.to(parts.m.dtype)))
    w = torch.where(parts.l > 0, w, 0.0)
    g_out = torch.zeros_like(out) if g_out is None else g_out.to(out.dtype)
    inner = ((parts.o - out.to(parts.o.dtype)) * g_out).sum(-1)
    if g_lse is not None:
        inner = inner + g_lse.to(inner.dtype)
    return (w.unsqueeze(-1) * g_out).to(outs.dtype), (w * inner).to(lses.dtype)


def setup_cross_entropy(ctx, inputs, output) -> None:
    """``ce_fwd(logits (N, V), target, ignore_index, label_smoothing, reduction) -> (loss, lse, count)``:
    saves the inputs, ``lse`` and ``count`` (side outputs, no gradient: none is materialised for them)."""
    logits, target, ignore_index, smoothing, reduction = inputs
    _, lse, count = output
    ctx.save_for_backward(logits, target, lse, count)
    ctx.mark_non_differentiable(lse, count)
    ctx.set_materialize_grads(False)
    ctx.args = (ignore_index, smoothing, reduction)


def cross_entropy_backward(ctx, g_loss: Optional[Tensor], _g_lse: Optional[Tensor], _g_count: Optional[Tensor]):
    """``dlogits = g * (softmax - (1-eps) onehot - eps/V)`` per row (``g`` over the count of rows not
    ignored for ``"mean"``), 0 for ignored rows: one ``ce_bwd``."""
    if g_loss is None:
        return None, None, None, None, None
    logits, target, lse, count = ctx.saved_tensors
    ignore_index, smoothing, reduction = ctx.args
    return _ops().ce_bwd(logits, target, lse, g_loss, count, ignore_index, smoothing, reduction), None, None, None, None


def once_differentiable(what: str, op: str) -> tuple:
    """``(backward, setup_context)`` for a backward op ``op`` without a second derivative: a
    backward through it (a double backward of ``what``) raises a NotImplementedError naming both."""
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"double backward through splitsoftmax {what} is not supported: its gradient (splitsoftmax::{op}) "
            f"is not differentiable; take one derivative (create_graph=True works only where the result is "
            f"not differentiated again through {what})")

    def setup_context(ctx, inputs, output) -> None:
        pass
    return backward, setup_context

