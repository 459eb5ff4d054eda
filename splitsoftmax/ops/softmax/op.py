"""The softmax family's custom ops (``splitsoftmax::softmax_fwd / softmax_bwd / logsumexp_fwd /
logsumexp_bwd``): implementations through the dispatcher, fake implementations (shapes and dtypes,
for ``torch.compile``) and autograd formulas (a ``setup_*`` saving what the backward needs, a
``*_backward`` written with torch ops and the backward ops only, so ``torch.compile`` traces it)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...core.state import stat_dtype
from .._registry import call, custom_op, dense, op, register_formula

register_fake = torch.library.register_fake


@custom_op("softmax_fwd")
def softmax_fwd(x: Tensor, log: bool) -> tuple[Tensor, Tensor]:
    """(Log-)softmax of each row of ``x (R, N)``: ``(y (R, N) x.dtype, lse (R,))``."""
    y, lse = op("softmax_fwd", x)(x, log)
    return dense(y, x.dtype), dense(lse, stat_dtype(x.dtype))


@register_fake("splitsoftmax::softmax_fwd")
def _softmax_fwd_fake(x, log):
    return x.new_empty(x.shape), x.new_empty(x.shape[:1], dtype=stat_dtype(x.dtype))


@custom_op("softmax_bwd")
def softmax_bwd(y: Tensor, dy: Tensor, lse: Tensor, log: bool) -> Tensor:
    """``dx (R, N)`` in ``y.dtype`` from the output ``y``, its gradient ``dy`` and ``lse (R,)``."""
    return dense(op("softmax_bwd", y)(y, dy, lse, log), y.dtype)


@register_fake("splitsoftmax::softmax_bwd")
def _softmax_bwd_fake(y, dy, lse, log):
    return y.new_empty(y.shape)


@custom_op("logsumexp_fwd")
def logsumexp_fwd(x: Tensor) -> Tensor:
    """Logsumexp of each row of ``x (R, N)``: ``(R,)``, natural log."""
    return dense(op("lse_rows", x)(x), stat_dtype(x.dtype))


@register_fake("splitsoftmax::logsumexp_fwd")
def _logsumexp_fwd_fake(x):
    return x.new_empty(x.shape[:1], dtype=stat_dtype(x.dtype))


@custom_op("logsumexp_bwd")
def logsumexp_bwd(x: Tensor, lse: Tensor, g: Tensor) -> Tensor:
    """``dx = g * exp(x - lse)``, ``(R, N)`` in ``x.dtype``; 0 in empty rows."""
    return dense(op("logsumexp_bwd", x)(x, lse, g), x.dtype)


@register_fake("splitsoftmax::logsumexp_bwd")
def _logsumexp_bwd_fake(x, lse, g):
    return x.new_empty(x.shape)


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
    return call("softmax_bwd", y, dy.contiguous(), lse, ctx.log), None


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
    return call("logsumexp_bwd", x, lse, g.contiguous())


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


register_formula("softmax_fwd", softmax_backward, setup_softmax)
register_formula("logsumexp_fwd", logsumexp_backward, setup_logsumexp)
register_formula("softmax_bwd", softmax_bwd_backward, setup_softmax_bwd)  # (second derivatives)
register_formula("logsumexp_bwd", logsumexp_bwd_backward, setup_logsumexp_bwd)
