"""Dispatch of the local ops: Triton kernels for CUDA tensors (and for CPU tensors under
``TRITON_INTERPRET=1``), the blockwise torch path otherwise. Both sides share one signature per op.

And the ``torch.library`` plumbing of the families' custom ops (namespace ``splitsoftmax``, each
family's ``op.py``): :func:`custom_op` registers an implementation, :func:`register_formula` its
autograd formula, and the public functions reach the ops through :func:`call`, which runs the
implementation directly when no autograd, transform, mode or tracing needs the dispatcher (the same
result, tens of microseconds less host time per call). Every output is a fresh dense tensor
(:func:`dense`); Python scalars (``log``, ``scale``, ``causal``, ``diag``) are op arguments.
"""
from __future__ import annotations

import importlib
import inspect
from functools import partial

import torch
from torch import Tensor

from ..core.mask import Mask
from ..core.runtime import once, interpreting, triton_available

# op name -> (the module of splitsoftmax holding its torch twin, the one holding its Triton launcher)
_MODULES = {
    "lse_rows": ("ops.softmax.torch", "ops.softmax.kernel"),
    "normalize": ("ops.softmax.torch", "ops.softmax.kernel"),
    "softmax_fwd": ("ops.softmax.torch", "ops.softmax.kernel"),
    "softmax_out": ("ops.softmax.torch", "ops.softmax.kernel"),
    "softmax_rowsum": ("ops.softmax.torch", "ops.softmax.kernel"),
    "softmax_bwd": ("ops.softmax.torch", "ops.softmax.kernel"),
    "logsumexp_bwd": ("ops.softmax.torch", "ops.softmax.kernel"),
    "attn_fwd": ("ops.attention.torch", "ops.attention.fwd"),
    "attn_fwd_acc": ("ops.attention.torch", "ops.attention.fwd"),
    "attn_runner": ("ops.attention.torch", "ops.attention.fwd"),
    "attn_bwd": ("ops.attention.torch", "ops.attention.bwd"),
    "attn_bwd_runner": ("ops.attention.torch", "ops.attention.bwd"),
    "attn_bwd_prep": ("ops.attention.torch", "ops.attention.prep"),
    "merge_out_lse": ("core.state", "ops.merge.kernel"),
    "merge_runner": ("core.state", "ops.merge.kernel"),
    "ce_stats": ("ops.cross_entropy.torch", "ops.cross_entropy.kernel"),
    "ce_rows": ("ops.cross_entropy.torch", "ops.cross_entropy.kernel"),
    "ce_bwd": ("ops.cross_entropy.torch", "ops.cross_entropy.kernel"),
}


def use_triton(t: Tensor) -> bool:
    """Triton runs CUDA tensors, and CPU tensors when interpreting. float64 inputs take the torch
    path on any device: the kernels keep float32 statistics, float64 callers want float64 math
    (``gradcheck``, references)."""
    return triton_available() and (t.is_cuda or interpreting()) and t.dtype != torch.float64


def _module(name: str, triton: bool):
    """The module holding op ``name``'s Triton launcher or torch twin (imported on first use)."""
    module = f"splitsoftmax.{_MODULES[name][triton]}"
    return once(module, lambda: importlib.import_module(module))


def op(name: str, t: Tensor):
    """The implementation of local op ``name`` for tensors like ``t``."""
    return getattr(_module(name, use_triton(t)), name)


def takes_mask(fn) -> bool:
    """Whether the local op ``fn`` has the ``mask`` keyword (the variants' visibility)."""
    return once(("takes_mask", fn.__module__, fn.__qualname__), lambda: "mask" in inspect.signature(fn).parameters)


def masked_op(name: str, t: Tensor, mask: Mask):
    """:func:`op` with ``mask`` bound; the plain mask calls the op as it always was. A launcher
    without the ``mask`` keyword cannot run a variant: ``NotImplementedError``."""
    fn = op(name, t)
    if mask.plain():
        return fn
    if not takes_mask(fn):
        fields = [f for f, d in zip(Mask._fields, Mask()) if getattr(mask, f) is not d and getattr(mask, f) != d]
        raise NotImplementedError(f"the Triton {name} kernel does not take attention variants yet (mask fields "
                                  f"{', '.join(fields)}); CPU tensors outside TRITON_INTERPRET=1 do")
    return partial(fn, mask=mask)


# op name -> its implementation, the function the op's CPU/CUDA kernel runs
IMPLS: dict = {}


# forward op name -> (backward, setup_context) of its autograd formula
AUTOGRAD: dict = {}


def custom_op(name: str):
    """Register the decorated function as ``torch.ops.splitsoftmax.<name>`` (no mutated arguments)
    and keep it, undecorated, in ``IMPLS`` for :func:`call`."""
    def register(fn):
        torch.library.custom_op(f"splitsoftmax::{name}", fn, mutates_args=())
        IMPLS[name] = fn
        return fn
    return register


_forward_ad = torch.autograd.forward_ad
_functorch_active = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._len_torch_function_stack
_grad_enabled = torch.is_grad_enabled


def _modes_off() -> bool:
    """No forward-mode level, functorch transform, torch function or dispatch mode is active."""
    return (_forward_ad._current_level < 0 and not _functorch_active() and _dispatch_modes() == 0
            and _function_modes() == 0)


def plain_eager(*tensors: Tensor) -> bool:
    """Whether running an op's implementation directly does exactly what the op would: no autograd
    to record (reverse or forward mode), no functorch transform, no tracing or compiling, no torch
    function or dispatch mode, and plain ``torch.Tensor`` inputs off the meta device (meta tensors,
    as deferred initialisation makes them, take the op's fake implementation: shapes only): the
    route :func:`call` takes to the implementation itself."""
    return _route(tensors) == _IMPL


def eager_grad(*tensors: Tensor):
    """None where an op on ``tensors`` goes through the dispatcher (see :func:`plain_eager`); else
    whether a gradient is recorded (:func:`call` runs the op's autograd formula in a plain
    ``autograd.Function``) or not (the implementation itself)."""
    how = _route(tensors)
    return None if how == _DISPATCH else how == _FORMULA


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


_DISPATCH, _IMPL, _FORMULA = 0, 1, 2


def _route(args: tuple) -> int:
    """How :func:`call` runs an op on ``args``: through the dispatcher (compiling, a tensor subclass or
    meta tensor, a mode or transform), the implementation itself (plain eager, no gradient recorded),
    or the autograd formula in a plain ``autograd.Function`` (plain eager, a gradient recorded)."""
    if torch.compiler.is_compiling():  # (first: Dynamo folds it and traces the op)
        return _DISPATCH
    grad = False
    for a in args:  # (one pass, no generator: this runs on every call)
        if isinstance(a, Tensor):
            if type(a) is not Tensor or a.is_meta:
                return _DISPATCH
            grad = grad or a.requires_grad
    if not _modes_off():
        return _DISPATCH
    return _FORMULA if grad and _grad_enabled() else _IMPL


def call(name: str, *args):
    """``torch.ops.splitsoftmax.<name>(*args)``, skipping the dispatcher's per-call cost (tens of
    microseconds of host time) in plain eager mode: the implementation itself when no gradient is
    recorded, else the same autograd formula in a plain ``autograd.Function``."""
    how = _route(args)
    if how == _IMPL:
        return IMPLS[name](*args)
    if how == _FORMULA and name in AUTOGRAD:
        return _Eager.apply(name, *args)
    return getattr(torch.ops.splitsoftmax, name)(*args)


_compiling = torch.compiler.is_compiling


def direct_one(t: Tensor) -> bool:
    """:func:`plain_eager` of the one tensor ``t`` (the same answer in a third of its host time): a
    caller may then take a local op that makes less (no ``lse`` where no gradient is recorded)."""
    return (not _compiling() and type(t) is Tensor and not t.is_meta and not (t.requires_grad and _grad_enabled())
            and _modes_off())


def dense(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as a contiguous tensor of ``dtype`` (no copy when it already is one; nor a call of
    ``Tensor.to``, whose argument parsing alone costs a microsecond or more per output)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def register_formula(name: str, backward, setup_context) -> None:
    """Register the autograd formula of op ``name``, for the custom op and for :func:`call`."""
    torch.library.register_autograd(f"splitsoftmax::{name}", backward, setup_context=setup_context)
    AUTOGRAD[name] = backward, setup_context


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
