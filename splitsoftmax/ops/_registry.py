"""Dispatch of the local ops: Triton kernels for CUDA tensors (and for CPU tensors under
``TRITON_INTERPRET=1``), the blockwise torch path otherwise. Both sides share one signature per op.
"""
from __future__ import annotations

import importlib
import inspect
import os
from functools import partial

import torch
from torch import Tensor

from .attention import torch as cpu
from ..core.mask import Mask

# op name -> module of splitsoftmax.ops holding its Triton launcher
_TRITON_MODULE = {
    "lse_rows": "softmax.kernel",
    "normalize": "softmax.kernel",
    "softmax_fwd": "softmax.kernel",
    "softmax_rowsum": "softmax.kernel",
    "softmax_bwd": "softmax.kernel",
    "logsumexp_bwd": "softmax.kernel",
    "attn_fwd": "attention.fwd",
    "attn_fwd_acc": "attention.fwd",
    "attn_bwd": "attention.bwd",
    "attn_bwd_prep": "attention.prep",
    "merge_out_lse": "merge.kernel",
    "ce_stats": "cross_entropy.kernel",
    "ce_rows": "cross_entropy.kernel",
    "ce_bwd": "cross_entropy.kernel",
}


_ONCE: dict = {}  # what the dispatch computes once per process, by name


def _once(key, compute):
    """``compute()`` on the first call with ``key``, kept: a plain dict read where torch.compile
    traces the dispatch (it warns of an ``lru_cache`` wrapper in a traced path)."""
    if key not in _ONCE:
        _ONCE[key] = compute()
    return _ONCE[key]


def _imports_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available() -> bool:
    """Whether Triton imports here (it is a Linux-only dependency)."""
    return _once("triton", _imports_triton)


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``). Read once, as Triton
    reads it once: its kernels are compiled or interpreted from when they are defined."""
    return _once("interpret", lambda: os.environ.get("TRITON_INTERPRET", "0") == "1")


def use_triton(t: Tensor) -> bool:
    """Triton runs CUDA tensors, and CPU tensors when interpreting. float64 inputs take the torch
    path on any device: the kernels keep float32 statistics, float64 callers want float64 math
    (``gradcheck``, references)."""
    return triton_available() and (t.is_cuda or interpreting()) and t.dtype != torch.float64


def _triton_module(name: str):
    """The module of splitsoftmax.ops holding op ``name``'s Triton launcher (imported on first use)."""
    module = f"splitsoftmax.ops.{_TRITON_MODULE[name]}"
    return _once(module, lambda: importlib.import_module(module))


def op(name: str, t: Tensor):
    """The implementation of local op ``name`` for tensors like ``t``."""
    if use_triton(t):
        return getattr(_triton_module(name), name)
    return getattr(cpu, name)


def takes_mask(fn) -> bool:
    """Whether the local op ``fn`` has the ``mask`` keyword (the variants' visibility)."""
    return _once(("takes_mask", fn.__module__, fn.__qualname__), lambda: "mask" in inspect.signature(fn).parameters)


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
