"""The attention custom ops (``splitsoftmax::attn_fwd / attn_bwd / attn_bwd_prep``): implementations
through the dispatcher, fake implementations and the autograd formula of the forward (the backward
ops have none: a second derivative raises)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...core import state
from ...core.mask import Mask
from ...core.runtime import Memo, geometry, heads_inner
from ...core.state import stat_dtype
from .._registry import (call, custom_op, dense, masked_op, once_differentiable, op, plain_eager, register_formula,
                         use_triton)

register_fake = torch.library.register_fake


@custom_op("attn_fwd")
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, diag: int, lo: Optional[int] = None,
             softcap: float = 0.0, kv_range: Optional[Tensor] = None, q_offset: Optional[Tensor] = None,
             rows: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention of ``q (B,H,Sq,D)`` over ``k (B,Hkv,Sk,D)``, ``v (B,Hkv,Sk,Dv)``.

    Returns ``(out (B,H,Sq,Dv) q.dtype, lse (B,H,Sq))``; causal: query ``i`` sees key ``j <= i + diag``.
    ``lo, softcap, kv_range, q_offset, rows`` are the fields of :class:`splitsoftmax.core.mask.Mask`;
    ``sinks (H,)``: one more partial ``(0, sinks[h])`` merged into every row after the keys.
    """
    fn = masked_op("attn_fwd", q, Mask(lo, softcap, kv_range, q_offset, rows))
    if sinks is None:
        out, lse = fn(q, k, v, scale, causal, diag, out_dtype=q.dtype)
    elif use_triton(q):
        out, lse = state.add_sinks(*fn(q, k, v, scale, causal, diag), sinks)
    else:  # the torch path merges the sinks before rounding its float64 result
        out, lse = fn(q, k, v, scale, causal, diag, out_dtype=q.dtype, sinks=sinks)
    return _out_like_q(out, q), dense(lse, stat_dtype(q.dtype))


def _out_like_q(out: Tensor, q: Tensor) -> Tensor:
    """The attention output in ``q.dtype``: a ``(B, H, S, Dv)`` view of a ``(B, S, H, Dv)`` tensor when
    ``q`` is one (so that the caller's ``out.transpose(1, 2).contiguous()`` copies nothing), else
    contiguous; no copy when the kernel wrote it so (the Triton forward does)."""
    if heads_inner(q):
        t = out.transpose(1, 2)
        return out if out.dtype == q.dtype and t.is_contiguous() else t.to(q.dtype).contiguous().transpose(1, 2)
    return dense(out, q.dtype)


@register_fake("splitsoftmax::attn_fwd")
def _attn_fwd_fake(q, k, v, scale, causal, diag, lo=None, softcap=0.0, kv_range=None, q_offset=None, rows=None,
                   sinks=None):
    b, h, sq, _ = q.shape
    lse = q.new_empty((b, h, sq), dtype=stat_dtype(q.dtype))
    if heads_inner(q):
        return q.new_empty((b, sq, h, v.shape[-1])).transpose(1, 2), lse
    return q.new_empty((b, h, sq, v.shape[-1])), lse


def _grad(g: Tensor, like: Tensor) -> Tensor:
    """``g`` in ``like``'s dtype and ``torch.empty_like(like)``'s strides (a ``(B, H, S, D)`` view of
    ``(B, S, H, D)`` gets its gradient as one), with no copy when it already is that."""
    if g.dtype == like.dtype and g.stride() == like.stride():
        return g
    return torch.empty_like(like).copy_(g)


@custom_op("attn_bwd")
def attn_bwd(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, scale: float, causal: bool,
             diag: int, lo: Optional[int] = None, softcap: float = 0.0, kv_range: Optional[Tensor] = None,
             q_offset: Optional[Tensor] = None, rows: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
             dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)``: the first three like ``q, k, v`` (dtype, and strides where dense); ``lse``,
    ``delta = rowsum(dout*out) - dlse``: ``(B,H,Sq)``; the mask fields as in ``attn_fwd``.

    ``dsinks (H,)`` in ``sinks.dtype`` (``(0,)`` without sinks) is ``-sum_rows p_sink * delta``, with
    ``rowsum(dout * out)`` taken from each path's own ``P`` and ``dout . v_j`` rather than from the
    rounded ``out``: per row in float64 on the torch path (and ``dlse``), summed with ``p_sink`` per
    key in float32 by the Triton dK/dV kernels (``core.state.sink_grad``'s ``weighted``).
    """
    mask = Mask(lo, softcap, kv_range, q_offset, rows)
    fn = masked_op("attn_bwd", q, mask)
    if sinks is None:
        return (*_bwd_outs(fn(q, k, v, dout, lse, delta, scale, causal, diag, out_dtype=q.dtype), q, k, v),
                _no_sinks_grad(q))
    if use_triton(q):
        dq, dk, dv, weighted = fn(q, k, v, dout, lse, delta, scale, causal, diag, out_dtype=q.dtype, sinks=sinks)
        return (*_bwd_outs((dq, dk, dv), q, k, v), state.sink_grad(lse, _minus(dlse), sinks, weighted))
    sums = torch.zeros((2, *lse.shape), dtype=torch.float64, device=q.device)
    dq, dk, dv = fn(q, k, v, dout, lse, delta, scale, causal, diag, rowsum=sums)
    lse, delta = _exact_row_stats(lse, sums, sinks, dlse)
    return (*_bwd_outs((dq, dk, dv), q, k, v), state.sink_grad(lse, delta, sinks))


_NO_SINKS_GRADS: dict = {}


def _no_sinks_grad(q: Tensor) -> Tensor:
    """The ``dsinks`` of a backward without sinks: an empty ``(0,)`` tensor like ``q``, one per device
    and dtype (it holds no data: made once, not on every backward)."""
    key = (q.dtype, q.device)
    t = _NO_SINKS_GRADS.get(key)
    if t is None:
        t = _NO_SINKS_GRADS[key] = q.new_empty((0,))
    return t


def _minus(dlse: Optional[Tensor]) -> Optional[Tensor]:
    """``-dlse`` (None without it): the part of ``delta`` that the kernels' sums for the sinks leave out."""
    return None if dlse is None else -dlse


def bwd_call(fn, args: tuple, sink: Optional[list]) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one local backward ``fn(q, k, v, dout, lse, delta, scale, causal, diag)``
    (``args``) of a schedule, whose rows' ``lse`` are global (final, with the sinks). With ``sink =
    [sinks, total]`` the call also sums ``p_sink * sum_j P_ij (dout_i . v_j)`` over its rows and keys
    per head, added into ``total`` ((H,); None until a call adds to it): by the Triton kernels
    (``attn_bwd``, float32), or per row in float64 on the torch path (float64). The sum over every call of a
    rank's rows is ``core.state.sink_grad``'s ``weighted``."""
    if sink is None:
        return fn(*args)
    q, lse = args[0], args[4]
    if use_triton(q):
        dq, dk, dv, w = fn(*args, sinks=sink[0])
    else:
        sums = torch.zeros((2, *lse.shape), dtype=torch.float64, device=q.device)
        dq, dk, dv = fn(*args, rowsum=sums)
        w = (state.sink_weights(lse.to(torch.float64), sink[0]) * sums[0]).sum((0, 2))
    sink[1] = w if sink[1] is None else sink[1] + w
    return dq, dk, dv


def sink_total(sink: list, q: Tensor) -> Tensor:
    """The ``total`` of :func:`bwd_call`'s ``sink``; where no call added to it, zeros ``(H,)`` in the
    dtype the calls on ``q`` would have given (every rank's alike)."""
    if sink[1] is not None:
        return sink[1]
    return torch.zeros(sink[0].shape, dtype=torch.float32 if use_triton(q) else torch.float64, device=q.device)


def _exact_row_stats(lse: Tensor, sums: Tensor, sinks: Tensor, dlse: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """float64 ``(lse, delta)`` of rows that the torch path's backward saw whole: ``sums`` holds each
    row's ``sum_j P_ij dout . v_j`` and ``sum_j P_ij`` under the rounded ``lse``; the row's mass with its
    sink renormalises both (the rounding of ``lse`` and of ``out`` cancel out)."""
    lse64 = lse.to(torch.float64)
    exact = state.sink_lse(lse64, sums[1], sinks)
    rowsum = sums[0] * torch.exp(lse64 - state.safe_max(exact))
    return exact, rowsum if dlse is None else rowsum - dlse.to(torch.float64)


def _bwd_outs(grads, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = grads
    return _grad(dq, q), _grad(dk, k), _grad(dv, v)


@register_fake("splitsoftmax::attn_bwd")
def _attn_bwd_fake(q, k, v, dout, lse, delta, scale, causal, diag, lo=None, softcap=0.0, kv_range=None, q_offset=None,
                   rows=None, sinks=None, dlse=None):
    dsinks = q.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


@custom_op("attn_bwd_prep")
def attn_bwd_prep(out: Tensor, lse: Tensor, dout: Tensor, dlse: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(lse, delta)`` rows ``(B,H,Sq)`` for ``attn_bwd``: ``delta = rowsum(dout*out) - dlse``;
    rows with all-zero cotangents get ``lse = -inf`` (they contribute nothing)."""
    lse2, delta = op("attn_bwd_prep", out)(out, lse, dout, dlse)
    return dense(lse2, lse.dtype), dense(delta, lse.dtype)


@register_fake("splitsoftmax::attn_bwd_prep")
def _attn_bwd_prep_fake(out, lse, dout, dlse):
    return lse.new_empty(lse.shape), lse.new_empty(lse.shape)


def backward_stats(out: Tensor, lse: Tensor, dout: Tensor, dlse) -> tuple[Tensor, Tensor]:
    """``(lse, delta)`` rows ``(B, H, Sq)`` for the attention backward kernels (see
    ``ops.attention.torch.attn_bwd_prep``: rows with all-zero cotangents drop out with ``lse = -inf``)."""
    return call("attn_bwd_prep", out, lse, dout, dlse)


def attention_grads(q, k, v, out, lse, dout, dlse, scale: float, causal: bool, diag: int, *mask_args, sinks=None):
    """``(dq, dk, dv, dsinks)`` from the saved ``out (B,H,Sq,Dv)``, ``lse (B,H,Sq)``; ``dout`` or ``dlse``
    may be ``None`` (no gradient through that output); ``mask_args``: the op's mask fields; ``dsinks``
    is ``(0,)`` without ``sinks``."""
    if dout is None:
        dout = torch.zeros_like(out)
    lse, delta = backward_stats(out, lse, dout, dlse)
    return tuple(call("attn_bwd", q, k, v, dout, lse, delta, scale, causal, diag, *mask_args, sinks,
                                 dlse))


def setup_attention(ctx, inputs, output) -> None:
    """``attn_fwd(q, k, v, scale, causal, diag, lo, softcap, kv_range, q_offset, rows, sinks) -> (out, lse)``:
    saves tensors and scalars."""
    q, k, v, scale, causal, diag, lo, softcap, kv_range, q_offset, rows, sinks = _attn_inputs(inputs)
    out, lse = output
    extra = (kv_range, q_offset, rows, sinks)
    ctx.extra = None if all(t is None for t in extra) else tuple(t is not None for t in extra)  # (no None saved)
    ctx.save_for_backward(q, k, v, out, lse, *(t for t in extra if t is not None))
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros made and read
    ctx.args = (scale, causal, diag, lo, softcap)
    ctx.sinks_grad = sinks is not None and sinks.requires_grad  # (not needs_input_grad: call() shifts it)



def _attn_inputs(inputs) -> tuple:
    """The ``attn_fwd`` arguments with the trailing defaults filled in."""
    return (*inputs, None, 0.0, None, None, None, None)[:12]


def attention_backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
    """``(dq, dk, dv)``, no gradient for the scalars and the mask, and the sinks' gradient
    ``-sum_rows p_sink * delta`` (``attn_bwd``, :func:`splitsoftmax.core.state.sink_grad`)."""
    saved = ctx.saved_tensors
    q, k, v, out, lse = saved[:5]
    if ctx.extra is None:
        kv_range = q_offset = rows = sinks = None
    else:
        rest = iter(saved[5:])
        kv_range, q_offset, rows, sinks = (next(rest) if present else None for present in ctx.extra)
    scale, causal, diag, lo, softcap = ctx.args
    if ctx.extra is None and lo is None and softcap == 0.0 and dlse is None and dout is not None:
        return (*_plain_grads(q, k, v, out, lse, dout, scale, causal, diag), *(None,) * 9)
    sinks = sinks if ctx.sinks_grad else None
    dq, dk, dv, dsinks = attention_grads(q, k, v, out, lse, dout, dlse, scale, causal, diag, lo, softcap, kv_range,
                                         q_offset, rows, sinks=sinks)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None if sinks is None else dsinks


# plain backwards by their operands' geometry and scalars: the runner (``op("attn_bwd_runner")``)
# their first call left
_BWD_RUNNERS = Memo()


def _plain_grads(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, scale: float,
                 causal: bool, diag: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`attention_grads` for the plain mask and no ``dlse``. Where the
    backward runs the implementations themselves (:func:`plain_eager`: no double backward recorded,
    no mode, transform or tracing), a geometry whose backward ran before is one lookup of the runner
    its first call left (no route, mask or plan; the runner answers to a changed setting)."""
    key = None
    if plain_eager(q, k, v, out, lse, dout):
        key = (geometry(q, k, v, out, lse, dout), scale, causal, diag)
        run = _BWD_RUNNERS.get(key)
        if run is not None and run.fresh(q, v):
            return run(q, k, v, out, lse, dout)
    grads = attention_grads(q, k, v, out, lse, dout, None, scale, causal, diag, None, 0.0, None, None, None)[:3]
    if key is not None:
        run = op("attn_bwd_runner", q)(q, k, v, out, lse, dout, scale, causal, diag)
        if run is not None:
            _BWD_RUNNERS.put(key, run)
    return grads


class LeanAttention(torch.autograd.Function):
    """The plain attention of ``q, k, v`` recording a gradient in plain eager mode, through ``run``,
    the forward's runner of their geometry (``fwd.LeanForward``, fresh): ``attn_fwd``'s formula
    (:func:`setup_attention`, :func:`attention_backward`) without the op's checks, route and plan.
    ``LeanAttention.apply(run, q, k, v) -> (out (B, H, Sq, Dv), lse (B, H, Sq))``."""

    @staticmethod
    def forward(ctx, run, q: Tensor, k: Tensor, v: Tensor):
        out, lse = run(q, k, v)
        setup_attention(ctx, (q, k, v, run.scale, run.causal, 0), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
        return (None, *attention_backward(ctx, dout, dlse)[:3])


register_formula("attn_fwd", attention_backward, setup_attention)
for _name in ("attn_bwd", "attn_bwd_prep"):
    register_formula(_name, *once_differentiable("attention", _name))
