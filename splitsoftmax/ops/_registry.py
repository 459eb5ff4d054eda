"""Dispatch of the local ops: Triton kernels for CUDA tensors (and for CPU tensors under
``TRITON_INTERPRET=1``), the blockwise torch path otherwise. Both sides share one signature per op.
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
    "softmax_rowsum": ("ops.softmax.torch", "ops.softmax.kernel"),
    "softmax_bwd": ("ops.softmax.torch", "ops.softmax.kernel"),
    "logsumexp_bwd": ("ops.softmax.torch", "ops.softmax.kernel"),
    "attn_fwd": ("ops.attention.torch", "ops.attention.fwd"),
    "attn_fwd_acc": ("ops.attention.torch", "ops.attention.fwd"),
    "attn_bwd": ("ops.attention.torch", "ops.attention.bwd"),
    "attn_bwd_prep": ("ops.attention.torch", "ops.attention.prep"),
    "merge_out_lse": ("core.state", "ops.merge.kernel"),
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
