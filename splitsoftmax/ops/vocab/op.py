"""The vocabulary statistics' local ops: which implementation a tensor gets, and the single-device
``torch.library`` custom ops (``splitsoftmax::vocab_fwd / vocab_bwd / kl_fwd / kl_bwd``) with
their fake and autograd formulas, so functions calling ``ss.logprobs``, ``ss.entropy`` or
``ss.kl_div`` compile with ``fullgraph=True``.

Implementations: ``ops/vocab/kernel.py`` (Triton: CUDA tensors, and CPU tensors under
``TRITON_INTERPRET=1``) or ``ops/vocab/torch.py`` (the blockwise torch path; float64 always).
Outputs are in the statistics dtype (float32, float64 for float64 logits).
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch import Tensor

from . import torch as vocab_cpu
from .torch import kl_coef, stats_coefs
from .._registry import custom_op, once_differentiable, use_triton
from ...core.state import stat_dtype

register_fake, register_autograd = torch.library.register_fake, torch.library.register_autograd


def impl(name: str, *tensors: Tensor):
    """The implementation of ``name`` for ``tensors``: Triton where every one of them runs it."""
    if all(use_triton(t) for t in tensors):
        return getattr(importlib.import_module("splitsoftmax.ops.vocab.kernel"), name)
    return getattr(vocab_cpu, name)


def _stat(*tensors: Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return stat_dtype(dtype)


def _fresh(ts, dtype: torch.dtype) -> tuple:
    """The outputs in ``dtype`` (the implementations return fresh contiguous tensors)."""
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in ts)


@custom_op("vocab_fwd")
def vocab_fwd(logits: Tensor, target: Optional[Tensor], inv_t: float, ignore_index: int,
              entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(logp (N,), entropy (N,), rows (N, 3))`` of ``logits (N, V)`` at ``1/T = inv_t``
    (``ops.vocab.torch.vocab_finish``); without ``target`` ``logp`` is meaningless, without
    ``entropy`` so is the entropy."""
    rec = impl("vocab_records", logits)(logits, target, 0, inv_t, entropy)
    return _fresh(impl("vocab_finish", rec)(rec, target, ignore_index), _stat(logits))


@register_fake("splitsoftmax::vocab_fwd")
def _vocab_fwd_fake(logits, target, inv_t, ignore_index, entropy):
    n, dt = logits.shape[0], _stat(logits)
    return logits.new_empty((n,), dtype=dt), logits.new_empty((n,), dtype=dt), logits.new_empty((n, 3), dtype=dt)


@custom_op("vocab_bwd")
def vocab_bwd(logits: Tensor, target: Optional[Tensor], rows: Tensor, gl: Optional[Tensor], gh: Optional[Tensor],
              inv_t: float, col0: int) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype`` (``ops.vocab.torch.vocab_bwd``)."""
    return impl("vocab_bwd", logits)(logits, target, rows, gl, gh, inv_t, col0)


@register_fake("splitsoftmax::vocab_bwd")
def _vocab_bwd_fake(logits, target, rows, gl, gh, inv_t, col0):
    return logits.new_empty(logits.shape)


@custom_op("kl_fwd")
def kl_fwd(p: Tensor, q: Tensor, inv_t: float) -> tuple[Tensor, Tensor]:
    """``(kl (N,), rows (N, 5))`` of ``p, q (N, V)`` at ``1/T = inv_t`` (``ops.vocab.torch.kl_finish``)."""
    rec = impl("kl_records", p, q)(p, q, inv_t)
    return _fresh(impl("kl_finish", rec)(rec), _stat(p, q))


@register_fake("splitsoftmax::kl_fwd")
def _kl_fwd_fake(p, q, inv_t):
    n, dt = p.shape[0], _stat(p, q)
    return p.new_empty((n,), dtype=dt), p.new_empty((n, 5), dtype=dt)


@custom_op("kl_bwd")
def kl_bwd(p: Tensor, q: Tensor, rows: Tensor, g: Tensor, inv_t: float) -> tuple[Tensor, Tensor]:
    """``(dp, dq)`` in the dtypes of ``p, q`` (``ops.vocab.torch.kl_bwd``)."""
    return impl("kl_bwd", p, q)(p, q, rows, g, inv_t)


@register_fake("splitsoftmax::kl_bwd")
def _kl_bwd_fake(p, q, rows, g, inv_t):
    return p.new_empty(p.shape), q.new_empty(q.shape)


def _setup_vocab(ctx, inputs, output) -> None:
    logits, target, inv_t, ignore_index, entropy = inputs
    ctx.save_for_backward(logits, target, output[2])
    ctx.mark_non_differentiable(output[2])
    ctx.args = (inv_t, ignore_index, entropy)


def _vocab_backward(ctx, g_logp, g_ent, _g_rows):
    logits, target, rows = ctx.saved_tensors
    inv_t, ignore_index, entropy = ctx.args
    gl, gh = stats_coefs(rows, target, ignore_index, g_logp if target is not None else None,
                         g_ent if entropy else None)
    dx = torch.ops.splitsoftmax.vocab_bwd(logits, target, rows, gl, gh, inv_t, 0)
    return dx, None, None, None, None


def _setup_kl(ctx, inputs, output) -> None:
    p, q, inv_t = inputs
    ctx.save_for_backward(p, q, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.inv_t = inv_t


def _kl_backward(ctx, g, _g_rows):
    p, q, rows = ctx.saved_tensors
    dp, dq = torch.ops.splitsoftmax.kl_bwd(p, q, rows, kl_coef(rows, g), ctx.inv_t)
    return dp, dq, None


register_autograd("splitsoftmax::vocab_fwd", _vocab_backward, setup_context=_setup_vocab)
register_autograd("splitsoftmax::kl_fwd", _kl_backward, setup_context=_setup_kl)
for _name, _what in (("vocab_bwd", "the vocabulary statistics"), ("kl_bwd", "kl_div")):
    _backward, _setup = once_differentiable(_what, _name)
    register_autograd(f"splitsoftmax::{_name}", _backward, setup_context=_setup)
