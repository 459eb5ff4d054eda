"""Attention under ``torch.autocast`` behaves like ``scaled_dot_product_attention``.

SDPA is on autocast's lower-precision list (CUDA and CPU): inside an autocast region its
floating inputs of an eligible dtype (float16, bfloat16, float32) are cast to the region's dtype
and the output comes back in that dtype. :func:`like_sdpa` gives an attention function the same
behaviour, and runs it with autocast off, so that the blockwise math inside (matmuls on the CPU
path) keeps the precision it chose instead of being cast a second time.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def target_dtype(t) -> Optional[torch.dtype]:
    """The dtype autocast casts ``t`` to, or None (no autocast region for its device, not eligible)."""
    if not torch._C._is_any_autocast_enabled():  # (the common case: one call, no device object)
        return None
    if not isinstance(t, Tensor) or t.dtype not in _ELIGIBLE:
        return None
    dev = t.device.type
    if dev not in ("cpu", "cuda", "xpu", "mps") or not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


def cast(t, dtype: torch.dtype):
    """``t`` in ``dtype`` when autocast would cast it (an eligible floating tensor), else ``t``."""
    return t.to(dtype) if isinstance(t, Tensor) and t.dtype in _ELIGIBLE else t


def like_sdpa(fn):
    """Decorate ``fn(q, k, v, ...)``: under autocast, ``q, k, v`` are cast to the region's dtype
    and ``fn`` runs with autocast disabled (its result is then in that dtype, as SDPA's is)."""
    @functools.wraps(fn)
    def wrapper(q, k, v, *args, **kwargs):
        dtype = target_dtype(q)
        if dtype is None:
            return fn(q, k, v, *args, **kwargs)
        with torch.autocast(q.device.type, enabled=False):
            return fn(cast(q, dtype), cast(k, dtype), cast(v, dtype), *args, **kwargs)
    return wrapper
