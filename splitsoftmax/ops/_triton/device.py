"""What the launchers ask of the device a tensor lives on: its multiprocessors and its generation.
Each answer is read once per device index."""
from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from .configs import ATTN_INTERPRET_SMS


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def hopper(t: Tensor) -> bool:
    """Whether ``t`` lives on a CUDA GPU of compute capability 9.0 or later (Hopper on: TMA,
    programmatic dependent launch)."""
    return t.is_cuda and _hopper(t.device.index or 0)


@lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] == 9


def sm90(t: Tensor) -> bool:
    """Whether ``t`` lives on a CUDA GPU of compute capability 9.x (Hopper: warpgroup products)."""
    return t.is_cuda and _sm90(t.device.index or 0)


def sm_count(t: Tensor) -> int:
    """Multiprocessors of ``t``'s device (a fixed small number under the interpreter)."""
    return _sm_count(t.device.index or 0) if t.is_cuda else ATTN_INTERPRET_SMS
