"""The merge custom op (``splitsoftmax::merge_fwd``): its implementation through the dispatcher, its
fake implementation and its autograd formula."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...core import state
from ...core.state import stat_dtype
from .._registry import custom_op, dense, op, register_formula

register_fake = torch.library.register_fake


@custom_op("merge_fwd")
def merge_fwd(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """N-way merge of ``outs (N, *rows, Dv)``, ``lses (N, *rows)``, N >= 1.

    Returns ``(out (*rows, Dv), lse (*rows))``, both in the accumulation dtype.
    """
    out, lse = op("merge_out_lse", outs)(outs, lses)
    dt = stat_dtype(outs.dtype)
    return dense(out, dt), dense(lse, dt)


@register_fake("splitsoftmax::merge_fwd")
def _merge_fwd_fake(outs, lses):
    dt = stat_dtype(outs.dtype)
    return outs.new_empty(outs.shape[1:], dtype=dt), outs.new_empty(lses.shape[1:], dtype=dt)


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


register_formula("merge_fwd", merge_backward, setup_merge)
