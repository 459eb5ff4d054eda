"""The local ops as ``torch.library`` custom ops (namespace ``splitsoftmax``).

Each op has a real implementation that dispatches through :func:`splitsoftmax.ops._registry.op`
(Triton for CUDA tensors and under ``TRITON_INTERPRET=1``, the blockwise torch path otherwise),
a fake implementation giving shapes and dtypes (``torch.compile`` traces with it), and, for the
forward ops, an autograd formula from :mod:`splitsoftmax.ops._autograd`. So a function calling
``ss.softmax``, ``ss.attention`` or ``ss.merge_states`` compiles with ``fullgraph=True``.

The public functions reach the ops through :func:`call`, which runs the implementation directly
when no autograd, transform, mode or tracing needs the dispatcher (the same result, tens of
microseconds less host time per call).

Every output is a fresh dense tensor: contiguous, except that attention outputs and gradients
follow the ``(B, S, H, D)`` layout of inputs given as ``(B, H, S, D)`` views of it; statistics are
float32 (float64 for float64 inputs).
Python scalars (``log``, ``scale``, ``causal``, ``diag``) are op arguments.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch import Tensor


from . import _autograd as ag
from ..core import state
from ._registry import masked_op, op, use_triton
from ..core.mask import Mask
from ..core.state import stat_dtype

register_fake, register_autograd = torch.library.register_fake, torch.library.register_autograd

# op name -> its implementation, the function the op's CPU/CUDA kernel runs
IMPLS: dict = {}
# forward op name -> (backward, setup_context) of its autograd formula
AUTOGRAD: dict = {}


def _op(name: str):
    """Register the decorated function as ``torch.ops.splitsoftmax.<name>`` (no mutated arguments)
    and keep it, undecorated, in ``IMPLS`` for :func:`call`."""
    def register(fn):
        torch.library.custom_op(f"splitsoftmax::{name}", fn, mutates_args=())
        IMPLS[name] = fn
        return fn
    return register


def plain_tensors(tensors) -> bool:
    """Whether nothing but plain eager autograd can see ops on ``tensors``: plain ``torch.Tensor``
    inputs, no forward-mode level, functorch transform, torch function or dispatch mode."""
    return (all(type(t) is Tensor and not t.is_meta for t in tensors) and torch.autograd.forward_ad._current_level < 0
            and not torch._C._are_functorch_transforms_active() and torch._C._len_torch_dispatch_stack() == 0
            and torch._C._len_torch_function_stack() == 0)


def plain_eager(*tensors: Tensor) -> bool:
    """Whether running an op's implementation directly does exactly what the op would: no autograd
    to record (reverse or forward mode), no functorch transform, no tracing or compiling, no torch
    function or dispatch mode, and plain ``torch.Tensor`` inputs off the meta device (meta tensors,
    as deferred initialisation makes them, take the op's fake implementation: shapes only)."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return False  # (compiling first: Dynamo folds it, and traces none of the checks below)
    return plain_tensors(tensors)


class _Eager(torch.autograd.Function):
    """An op with autograd in plain eager mode: its implementation and the same autograd formula
    (``setup_context`` and ``backward`` of :data:`AUTOGRAD`), without the custom-op dispatch, which
    costs about a hundred microseconds of host time per forward and backward."""

    @staticmethod
    def forward(ctx, name, *args):
        output = IMPLS[name](*args)
        ctx.name = name
        AUTOGRAD[name][1](ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        g = AUTOGRAD[ctx.name][0](ctx, *grads)
        return (None, *(g if isinstance(g, tuple) else (g,)))


def call(name: str, *args):
    """``torch.ops.splitsoftmax.<name>(*args)``, skipping the dispatcher's per-call cost (tens of
    microseconds of host time) in plain eager mode: the implementation itself when no gradient is
    recorded, else the same autograd formula in a plain ``autograd.Function``."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    if not torch.compiler.is_compiling() and plain_tensors(tensors):
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return IMPLS[name](*args)
        if name in AUTOGRAD:
            return _Eager.apply(name, *args)
    return getattr(torch.ops.splitsoftmax, name)(*args)


def _out(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as a contiguous tensor of ``dtype`` (no copy when it already is one; nor a call of
    ``Tensor.to``, whose argument parsing alone costs a microsecond or more per output)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


@_op("softmax_fwd")
def softmax_fwd(x: Tensor, log: bool) -> tuple[Tensor, Tensor]:
    """(Log-)softmax of each row of ``x (R, N)``: ``(y (R, N) x.dtype, lse (R,))``."""
    y, lse = op("softmax_fwd", x)(x, log)
    return _out(y, x.dtype), _out(lse, stat_dtype(x.dtype))


@register_fake("splitsoftmax::softmax_fwd")
def _softmax_fwd_fake(x, log):
    return x.new_empty(x.shape), x.new_empty(x.shape[:1], dtype=stat_dtype(x.dtype))


@_op("softmax_bwd")
def softmax_bwd(y: Tensor, dy: Tensor, lse: Tensor, log: bool) -> Tensor:
    """``dx (R, N)`` in ``y.dtype`` from the output ``y``, its gradient ``dy`` and ``lse (R,)``."""
    return _out(op("softmax_bwd", y)(y, dy, lse, log), y.dtype)


@register_fake("splitsoftmax::softmax_bwd")
def _softmax_bwd_fake(y, dy, lse, log):
    return y.new_empty(y.shape)


@_op("logsumexp_fwd")
def logsumexp_fwd(x: Tensor) -> Tensor:
    """Logsumexp of each row of ``x (R, N)``: ``(R,)``, natural log."""
    return _out(op("lse_rows", x)(x), stat_dtype(x.dtype))


@register_fake("splitsoftmax::logsumexp_fwd")
def _logsumexp_fwd_fake(x):
    return x.new_empty(x.shape[:1], dtype=stat_dtype(x.dtype))


@_op("logsumexp_bwd")
def logsumexp_bwd(x: Tensor, lse: Tensor, g: Tensor) -> Tensor:
    """``dx = g * exp(x - lse)``, ``(R, N)`` in ``x.dtype``; 0 in empty rows."""
    return _out(op("logsumexp_bwd", x)(x, lse, g), x.dtype)


@register_fake("splitsoftmax::logsumexp_bwd")
def _logsumexp_bwd_fake(x, lse, g):
    return x.new_empty(x.shape)


@_op("attn_fwd")
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
    return _out_like_q(out, q), _out(lse, stat_dtype(q.dtype))


def _heads_inner(q: Tensor) -> bool:
    """Whether ``q (B, H, S, D)`` is a view of a ``(B, S, H, D)`` tensor (Hugging Face's layout)."""
    return q.shape[1] > 1 and q.shape[2] > 1 and q.stride(1) < q.stride(2)


def _out_like_q(out: Tensor, q: Tensor) -> Tensor:
    """The attention output in ``q.dtype``: a ``(B, H, S, Dv)`` view of a ``(B, S, H, Dv)`` tensor when
    ``q`` is one (so that the caller's ``out.transpose(1, 2).contiguous()`` copies nothing), else
    contiguous; no copy when the kernel wrote it so (the Triton forward does)."""
    if _heads_inner(q):
        t = out.transpose(1, 2)
        return out if out.dtype == q.dtype and t.is_contiguous() else t.to(q.dtype).contiguous().transpose(1, 2)
    return _out(out, q.dtype)


@register_fake("splitsoftmax::attn_fwd")
def _attn_fwd_fake(q, k, v, scale, causal, diag, lo=None, softcap=0.0, kv_range=None, q_offset=None, rows=None,
                   sinks=None):
    b, h, sq, _ = q.shape
    lse = q.new_empty((b, h, sq), dtype=stat_dtype(q.dtype))
    if _heads_inner(q):
        return q.new_empty((b, sq, h, v.shape[-1])).transpose(1, 2), lse
    return q.new_empty((b, h, sq, v.shape[-1])), lse


def _grad(g: Tensor, like: Tensor) -> Tensor:
    """``g`` in ``like``'s dtype and ``torch.empty_like(like)``'s strides (a ``(B, H, S, D)`` view of
    ``(B, S, H, D)`` gets its gradient as one), with no copy when it already is that."""
    if g.dtype == like.dtype and g.stride() == like.stride():
        return g
    return torch.empty_like(like).copy_(g)


@_op("attn_bwd")
def attn_bwd(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, scale: float, causal: bool,
             diag: int, lo: Optional[int] = None, softcap: float = 0.0, kv_range: Optional[Tensor] = None,
             q_offset: Optional[Tensor] = None, rows: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
             dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)``: the first three like ``q, k, v`` (dtype, and strides where dense); ``lse``,
    ``delta = rowsum(dout*out) - dlse``: ``(B,H,Sq)``; the mask fields as in ``attn_fwd``.

    ``dsinks (H,)`` in ``sinks.dtype`` (``(0,)`` without sinks) is ``-sum_rows p_sink * delta``; the
    torch path forms ``delta`` from its own ``P`` and ``dout . v_j`` (and ``dlse``) rather than from
    the rounded ``out``.
    """
    mask = Mask(lo, softcap, kv_range, q_offset, rows)
    fn = masked_op("attn_bwd", q, mask)
    if sinks is None:
        return (*_bwd_outs(fn(q, k, v, dout, lse, delta, scale, causal, diag, out_dtype=q.dtype), q, k, v),
                q.new_empty((0,)))
    if use_triton(q):
        dq, dk, dv = fn(q, k, v, dout, lse, delta, scale, causal, diag, out_dtype=q.dtype)
    else:
        sums = torch.zeros((2, *lse.shape), dtype=torch.float64, device=q.device)
        dq, dk, dv = fn(q, k, v, dout, lse, delta, scale, causal, diag, rowsum=sums)
        lse, delta = _exact_row_stats(lse, sums, sinks, dlse)
    return (*_bwd_outs((dq, dk, dv), q, k, v), state.sink_grad(lse, delta, sinks))


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


@_op("attn_bwd_prep")
def attn_bwd_prep(out: Tensor, lse: Tensor, dout: Tensor, dlse: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(lse, delta)`` rows ``(B,H,Sq)`` for ``attn_bwd``: ``delta = rowsum(dout*out) - dlse``;
    rows with all-zero cotangents get ``lse = -inf`` (they contribute nothing)."""
    lse2, delta = op("attn_bwd_prep", out)(out, lse, dout, dlse)
    return _out(lse2, lse.dtype), _out(delta, lse.dtype)


@register_fake("splitsoftmax::attn_bwd_prep")
def _attn_bwd_prep_fake(out, lse, dout, dlse):
    return lse.new_empty(lse.shape), lse.new_empty(lse.shape)


@_op("merge_fwd")
def merge_fwd(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """N-way merge of ``outs (N, *rows, Dv)``, ``lses (N, *rows)``, N >= 1.

    Returns ``(out (*rows, Dv), lse (*rows))``, both in the accumulation dtype.
    """
    out, lse = op("merge_out_lse", outs)(outs, lses)
    dt = stat_dtype(outs.dtype)
    return _out(out, dt), _out(lse, dt)


@register_fake("splitsoftmax::merge_fwd")
def _merge_fwd_fake(outs, lses):
    dt = stat_dtype(outs.dtype)
    return outs.new_empty(outs.shape[1:], dtype=dt), outs.new_empty(lses.shape[1:], dtype=dt)


_CE_KERNELS: dict = {}  # use_triton -> the module


def ce_kernels(t: Tensor):
    """The cross-entropy kernels for tensors like ``t``: ``ops.cross_entropy.kernel`` (Triton) or
    ``ops.cross_entropy.torch`` (the torch path), alike in names and signatures."""
    triton = use_triton(t)
    k = _CE_KERNELS.get(triton)
    if k is None:
        k = _CE_KERNELS[triton] = importlib.import_module(f"splitsoftmax.ops.cross_entropy.{'kernel' if triton else 'torch'}")
    return k


@_op("ce_fwd")
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


@_op("ce_bwd")
def ce_bwd(logits: Tensor, target: Tensor, lse: Tensor, g: Tensor, count: Tensor, ignore_index: int,
           smoothing: float, reduction: str) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype`` of ``ce_fwd`` for the loss gradient ``g`` (0 in ignored rows)."""
    dx = ce_kernels(logits).ce_grad(logits, target, lse, g, count, 0, ignore_index, smoothing, logits.shape[1],
                                    reduction)
    return _out(dx, logits.dtype)


@register_fake("splitsoftmax::ce_bwd")
def _ce_bwd_fake(logits, target, lse, g, count, ignore_index, smoothing, reduction):
    return logits.new_empty(logits.shape)


def _autograd(name: str, backward, setup_context) -> None:
    """Register the autograd formula of op ``name``, for the custom op and for :func:`call`."""
    register_autograd(f"splitsoftmax::{name}", backward, setup_context=setup_context)
    AUTOGRAD[name] = backward, setup_context


_autograd("softmax_fwd", ag.softmax_backward, ag.setup_softmax)
_autograd("logsumexp_fwd", ag.logsumexp_backward, ag.setup_logsumexp)
_autograd("softmax_bwd", ag.softmax_bwd_backward, ag.setup_softmax_bwd)  # (second derivatives)
_autograd("logsumexp_bwd", ag.logsumexp_bwd_backward, ag.setup_logsumexp_bwd)
_autograd("attn_fwd", ag.attention_backward, ag.setup_attention)
_autograd("merge_fwd", ag.merge_backward, ag.setup_merge)
_autograd("ce_fwd", ag.cross_entropy_backward, ag.setup_cross_entropy)
for _name, _what in (("attn_bwd", "attention"), ("attn_bwd_prep", "attention"), ("ce_bwd", "cross_entropy")):
    _autograd(_name, *ag.once_differentiable(_what, _name))
