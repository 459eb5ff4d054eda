"""What a kernel may ask of the environment: whether Triton imports here, and whether its kernels
run in the interpreter (``TRITON_INTERPRET=1``). Each answer is worked out once per process."""
from __future__ import annotations

import os

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
