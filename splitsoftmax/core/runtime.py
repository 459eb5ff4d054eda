"""What a kernel may ask of the environment: whether Triton imports here, and whether its kernels
run in the interpreter (``TRITON_INTERPRET=1``). Each answer is worked out once per process. Also
the keys of host work kept per launch geometry (:func:`geometry`, :class:`Memo`) and the layout
rule of attention outputs (:func:`heads_inner`), which callers without Triton read too."""
from __future__ import annotations

import os
from typing import Hashable

from torch import Tensor

_ONCE: dict = {}  # what the dispatch computes once per process, by name


def once(key, compute):
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
    return once("triton", _imports_triton)


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``). Read once, as Triton
    reads it once: its kernels are compiled or interpreted from when they are defined."""
    return once("interpret", lambda: os.environ.get("TRITON_INTERPRET", "0") == "1")


def heads_inner(q: Tensor) -> bool:
    """Whether ``q (B, H, S, D)`` is a view of a ``(B, S, H, D)`` tensor (Hugging Face's layout): the
    attention's outputs are then laid out the same way."""
    return q.shape[1] > 1 and q.shape[2] > 1 and q.stride(1) < q.stride(2)


def geometry(*tensors: Tensor) -> tuple:
    """What fixes a launch's plan and specialisation in ``tensors`` (all on one device): the device,
    and each tensor's shape, strides, dtype and 16-byte alignment (not its data pointer)."""
    return (tensors[0].get_device(), *((t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in tensors))


class Memo(dict):
    """Host work by :func:`geometry` (and the scalars beside it), so that a repeated call is a
    lookup; cleared when it holds ``max_keys`` (a run with ever new shapes stays bounded). A key must
    also hold every setting the work read (``configs`` flags that tests change)."""

    def __init__(self, max_keys: int = 1024):
        super().__init__()
        self.max_keys = max_keys

    def put(self, key: Hashable, value):
        """Keep ``value`` under ``key`` and return it."""
        if len(self) >= self.max_keys:
            self.clear()
        self[key] = value
        return value
