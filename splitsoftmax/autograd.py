"""autograd Functions of the single-device ops, over the local ops of ``splitsoftmax.local``."""
from __future__ import annotations

import torch
from torch import Tensor

from . import state
from .local import op


class SoftmaxFn(torch.autograd.Function):
    """(log-)softmax of each row of ``x (R, N)``."""

    @staticmethod
    def forward(ctx, x: Tensor, log: bool) -> Tensor:
        y, lse = op("softmax_fwd", x)(x, log)
        ctx.save_for_backward(y, lse)
        ctx.log = log
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        y, lse = ctx.saved_tensors
        return op("softmax_bwd", y)(y, dy.contiguous(), lse, ctx.log), None


class LogSumExpFn(torch.autograd.Function):
    """logsumexp of each row of ``x (R, N)``: ``(R,)`` float32."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        lse = op("lse_rows", x)(x)
        ctx.save_for_backward(x, lse)
        return lse.float()

    @staticmethod
    def backward(ctx, g: Tensor):
        x, lse = ctx.saved_tensors
        return op("logsumexp_bwd", x)(x, lse, g.contiguous())


def attention_grads(q, k, v, out, lse, dout, dlse, scale: float, causal: bool, diag: int):
    """``(dq, dk, dv)`` in the inputs' dtypes, from the saved ``out (B,H,Sq,Dv)``, ``lse (B,H,Sq)``.

    A gradient through ``lse`` enters as ``delta - dlse`` (``d lse / d s = p``).
    """
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(lse.dtype)
    dq, dk, dv = op("attn_bwd", q)(q, k, v, dout.contiguous(), lse, delta, scale, causal, diag)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class AttentionFn(torch.autograd.Function):
    """Attention of ``q (B,H,Sq,D)`` over ``k, v (B,Hkv,Sk,*)``: ``(out (B,H,Sq,Dv), lse (B,H,Sq))``."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, causal: bool, diag: int):
        out, lse = op("attn_fwd", q)(q, k, v, scale, causal, diag, out_dtype=q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, diag)
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*attention_grads(q, k, v, out, lse, dout, dlse, *ctx.args), None, None, None)


class MergeStatesFn(torch.autograd.Function):
    """N-way merge of ``outs (N, *rows, Dv)``, ``lses (N, *rows)`` with an explicit backward.

    With ``w_i = exp(lse_i - lse)`` (0 for empty partials): ``d outs_i = w_i g_out`` and
    ``d lses_i = w_i (<g_out, out_i - out> + g_lse)``.
    """

    @staticmethod
    def forward(ctx, outs: Tensor, lses: Tensor):
        out, lse = op("merge_out_lse", outs)(outs, lses)
        ctx.save_for_backward(outs, lses, out, lse)
        return out.to(outs.dtype), lse.float()

    @staticmethod
    def backward(ctx, g_out, g_lse):
        outs, lses, out, lse = ctx.saved_tensors
        parts = state.from_out_lse(outs, lses)  # NaN in empty partials zeroed
        w = torch.exp(parts.m - state.safe_max(lse.to(parts.m.dtype)))
        w = torch.where(parts.l > 0, w, 0.0)
        g_out = torch.zeros_like(out) if g_out is None else g_out.to(out.dtype)
        inner = ((parts.o - out.to(parts.o.dtype)) * g_out).sum(-1)
        if g_lse is not None:
            inner = inner + g_lse.to(inner.dtype)
        return (w.unsqueeze(-1) * g_out).to(outs.dtype), (w * inner).to(lses.dtype)
