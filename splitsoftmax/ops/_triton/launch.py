"""Repeated Triton launches with less host time: the compiled kernel found by the caller's key.

``kernel[grid](*args, **kwargs)`` works out on every call what the kernel is specialised for (each
integer's type, divisibility by 16 or being 1; each pointer's dtype and 16-byte alignment; the
constexprs), looks the compiled kernel up and launches it. On the H200 hosts that is 43 us of host
time for the split-KV forward's 49 arguments, of which the compiled kernel's own launcher takes 11
(``benchmarks/probes/decode_split_plan.py host``). A :class:`Launcher` keeps the compiled kernel under a key the
caller builds from what fixes every specialisation, and launches it directly next time, as torch
inductor's generated launchers do. A new key, the interpreter or a launch hook (a profiler) take
Triton's own path.

The caller's key must hold, for each non-constexpr argument: integers by value (or, for the
kernel's ``do_not_specialize`` ones, whether they fit int32); tensors by dtype and
``data_ptr() % 16 == 0``; tensor descriptors by dtype (their block shape is fixed by the
constexprs). Floats are not specialised. The launcher adds the keyword arguments (constexprs and
launch options) itself. With ``configs.LAUNCH_VERIFY`` (the GPU tests set it) every cached launch is
checked against the kernel Triton's own lookup picks.
"""
from __future__ import annotations

import inspect
from typing import Hashable

from torch import Tensor
from triton import knobs
from triton.runtime.driver import driver

from ...core.runtime import interpreting
from . import configs


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: a function, or a ``HookChain`` (Triton 3.6) holding one."""
    return hook is not None and bool(getattr(hook, "calls", True))


def fits_int32(*values: int) -> bool:
    """Whether every value is typed ``i32`` by Triton (the rest are ``i64``/``u64``)."""
    return all(-2 ** 31 <= x < 2 ** 31 for x in values)


def auto_key(args: tuple) -> tuple:
    """A key for :class:`Launcher` that fixes every specialisation of ``args``, for kernels called
    with few distinct integer values (sizes of a model's layers): integers by value, tensors by
    dtype and 16-byte alignment, anything else (floats, ``None``) by type."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, Tensor)
                 else a if isinstance(a, int) else type(a) for a in args)


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


class Launcher:
    """``fn[grid](*args, **kwargs)`` through a cache of compiled kernels keyed by the caller.

    ``args`` fill the kernel's leading parameters positionally; the remaining parameters come from
    ``kwargs`` by name (or their defaults), with the launch options (``num_warps``, ...) beside them.
    """

    def __init__(self, fn, max_keys: int = 256):
        self.fn = fn
        self.max_keys = max_keys
        self.kernels: dict = {}
        params = inspect.signature(fn.fn).parameters.values()
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.names = [p.name for p in params]

    def auto(self, grid: tuple, args: tuple, **kwargs) -> None:
        """Launch with :func:`auto_key` of ``args`` (``kwargs``: constexprs and launch options)."""
        self(grid, auto_key(args), args, kwargs)

    def __call__(self, grid: tuple, key: Hashable, args: tuple, kwargs: dict) -> None:
        if interpreting() or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            self.fn[grid](*args, **kwargs)
            return
        device = driver.active.get_current_device()
        full = (device, key, len(args), tuple(kwargs.items()))
        hit = self.kernels.get(full)
        if hit is None:
            kernel = self.fn[grid](*args, **kwargs)
            if len(self.kernels) >= self.max_keys:
                self.kernels.clear()
            # the parameters after ``args``: constexprs, fixed by the key
            rest = tuple(kwargs[n] if n in kwargs else self.defaults[n] for n in self.names[len(args):])
            self.kernels[full] = kernel, rest
            return
        kernel, rest = hit
        if configs.LAUNCH_VERIFY and self.fn.warmup(*args, grid=grid, **kwargs) is not kernel:
            raise AssertionError(f"{self.fn.fn.__name__}: key {key!r} maps to another kernel than Triton's lookup")
        g = (*grid, 1, 1)
        kernel.run(g[0], g[1], g[2], driver.active.get_current_stream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *args, *rest)
