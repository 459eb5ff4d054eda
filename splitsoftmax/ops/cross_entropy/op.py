"""The cross-entropy custom ops (``splitsoftmax::ce_fwd / ce_bwd``): the kernels a tensor gets, the
implementations, fake implementations and the autograd formula of the forward."""
from __future__ import annotations

import importlib

from typing import Optional

import torch
from torch import Tensor

from ...core.state import stat_dtype
from .._registry import call, custom_op, dense, once_differentiable, register_formula, use_triton

register_fake = torch.library.register_fake


_CE_KERNELS: dict = {}  # use_triton -> the module


def ce_kernels(t: Tensor):
    """The cross-entropy kernels for tensors like ``t``: ``ops.cross_entropy.kernel`` (Triton) or
    ``ops.cross_entropy.torch`` (the torch path), alike in names and signatures."""
    triton = use_triton(t)
    k = _CE_KERNELS.get(triton)
    if k is None:
        k = _CE_KERNELS[triton] = importlib.import_module(f"splitsoftmax.ops.cross_entropy.{'kernel' if triton else 'torch'}")
    return k


@custom_op("ce_fwd")
def ce_fwd(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float,
           reduction: str) -> tuple[Tensor, Tensor, Tensor]:
    """Cross-entropy of ``logits (N, V)``: ``(loss, lse (N,), count)``. ``loss`` in ``logits.dtype``:
    ``(N,)`` for ``reduction="none"``, else the scalar sum or mean; ``count``: the rows not ignored,
    a scalar (``(0,)`` for ``"none"``); ``lse`` and ``count`` in the statistics dtype."""
    k = ce_kernels(logits)
    parts = k.ce_parts(logits, target, 0, label_smoothing > 0)
    return k.ce_loss(parts, target, ignore_index, label_smoothing, logits.shape[1], reduction, logits.dtype)


@register_fake("splitsoftmax::ce_fwd")
def _ce_fwd_fake(logits, target, ignore_index, label_smoothing, reduction):
    dt, rows, none = stat_dtype(logits.dtype), logits.shape[:1], reduction == "none"
    return (logits.new_empty(rows if none else ()), logits.new_empty(rows, dtype=dt),
            logits.new_empty((0,) if none else (), dtype=dt))


@custom_op("ce_bwd")
def ce_bwd(logits: Tensor, target: Tensor, lse: Tensor, g: Tensor, count: Tensor, ignore_index: int,
           smoothing: float, reduction: str) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype`` of ``ce_fwd`` for the loss gradient ``g`` (0 in ignored rows)."""
    dx = ce_kernels(logits).ce_grad(logits, target, lse, g, count, 0, ignore_index, smoothing, logits.shape[1],
                                    reduction)
    return dense(dx, logits.dtype)


@register_fake("splitsoftmax::ce_bwd")
def _ce_bwd_fake(logits, target, lse, g, count, ignore_index, smoothing, reduction):
    return logits.new_empty(logits.shape)


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
    return call("ce_bwd", logits, target, lse, g_loss, count, ignore_index, smoothing, reduction), None, None, None, None


register_formula("ce_fwd", cross_entropy_backward, setup_cross_entropy)
register_formula("ce_bwd", *once_differentiable("cross_entropy", "ce_bwd"))
