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

:meth:`Launcher.bind` goes further for a caller that keeps what it bound per geometry: everything
of a launch but its tensors' pointers and per-call scalars is worked out once, and each call hands
integer pointers (``data_ptr()``) straight to the compiled kernel's C launcher, TMA descriptors
encoded once per base pointer (:class:`DescriptorCache`). Triton's compiled launchers differ by
version (:func:`launcher_form`): Triton 3.6 takes the kernel's arguments spread, 3.7 to 3.9 a
sequence beside the arguments' annotations. Where the form is unknown, under the interpreter, off
CUDA, with a launch hook, another current device or ``configs.LAUNCH_DIRECT = False``, a bound call
takes :meth:`Launcher.__call__`'s path.
"""
from __future__ import annotations

import copy
import inspect
from typing import Callable, Hashable, Optional

from torch import Tensor
from triton import knobs
from triton.runtime.driver import driver

from ...core.runtime import Memo, geometry, interpreting  # noqa: F401  (re-exported: the launchers take them from here)
from . import configs


def _unhooked() -> bool:
    """Neither of Triton's launch hooks is set (a hook is a function, or a ``HookChain`` holding one)."""
    rt = knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and (leave is None or not getattr(leave, "calls", True))


def fits_int32(*values: int) -> bool:
    """Whether every value is typed ``i32`` by Triton (the rest are ``i64``/``u64``)."""
    return all(-2 ** 31 <= x < 2 ** 31 for x in values)


def auto_key(args: tuple) -> tuple:
    """A key for :class:`Launcher` that fixes every specialisation of ``args``, for kernels called
    with few distinct integer values (sizes of a model's layers): integers by value, tensors by
    dtype and 16-byte alignment, anything else (floats, ``None``) by type."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, Tensor)
                 else a if isinstance(a, int) else type(a) for a in args)


def launch_bound(memo: Memo, geo: Hashable, make: Callable, args: tuple, live: tuple) -> None:
    """Launch the bound launch that ``memo`` keeps under ``geo`` (``make(*args)`` on its first use,
    a :class:`BoundLaunch`) with the live arguments ``live``: one dict hit per call."""
    bound = memo.get(geo)
    if bound is None:
        bound = memo.put(geo, make(*args))
    bound(*live)


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
        if interpreting() or not _unhooked():
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

    def bind(self, grid: tuple, key: Hashable, args: tuple, kwargs: dict, live: tuple = ()) -> "BoundLaunch":
        """This launch with everything but its live arguments fixed, for a caller that keeps it under
        the geometry that fixes them (``key`` as for :meth:`__call__`; ``args`` a sample call's).

        Every tensor and tensor descriptor of ``args`` is live, and so are the per-call scalars
        at the indices ``live``; the bound launch is called with the live arguments in parameter
        order: tensors, each descriptor's base tensor (its shape, strides and block are the
        sample's), scalars. Nothing is launched here (the kernel is compiled where it is new)."""
        return BoundLaunch(self, tuple(grid), key, args, kwargs, live)


# ---- bound launches -------------------------------------------------------------------------

def _cuda_current() -> tuple:
    """``(current device index (), raw current stream (device))`` of torch's CUDA runtime: what
    Triton's own launch asks, without its Python wrappers."""
    import torch
    return torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream


_CLASS_FORMS: dict = {}
_HEAD = ["self", "gridX", "gridY", "gridZ", "stream", "function"]
_SEQUENCE_TAIL = ["kernel_metadata", "launch_metadata", "launch_enter_hook", "launch_exit_hook"]


def _class_form(cls) -> Optional[str]:
    if cls not in _CLASS_FORMS:
        form = None
        try:
            params = list(inspect.signature(cls.__call__).parameters.values())
        except (TypeError, ValueError):
            params = []
        names = [p.name for p in params]
        if names[:6] == _HEAD and params and params[-1].kind is inspect.Parameter.VAR_POSITIONAL:
            if names[6:-1] == _SEQUENCE_TAIL:
                form = "sequence"
            elif len(names) == 7:
                form = "spread"
        _CLASS_FORMS[cls] = form
    return _CLASS_FORMS[cls]


def _triton_launcher_class():
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except Exception:  # no NVIDIA backend in this build
        return None
    return CudaLauncher


def launcher_form(run=None) -> Optional[str]:
    """How the installed Triton's compiled launcher hands a kernel's arguments to its C entry (or,
    given ``run``, a compiled kernel's launcher ``kernel.run``): ``"spread"`` (Triton 3.6: ``launch(
    gridX, gridY, gridZ, stream, function, coop, pdl, global_scratch, profile_scratch, metadata,
    launch_metadata, enter_hook, exit_hook, *args)``), ``"sequence"`` (3.7 to 3.9: ``launch(gridX,
    gridY, gridZ, stream, function, coop, pdl, metadata, launch_metadata, enter_hook, exit_hook,
    global_scratch, profile_scratch, annotations, signature, args)``), or None where neither is
    known, or where ``run`` needs what only its own call does (scratch memory, a sanitizer)."""
    if run is None:
        cls = _triton_launcher_class()
        return None if cls is None else _class_form(cls)
    form = _class_form(type(run))
    if form is None or not hasattr(run, "launch") or getattr(run, "gsan_enabled", False):
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    if form == "sequence" and not (hasattr(run, "arg_annotations") and hasattr(run, "kernel_signature")):
        return None
    return form


def _c_entry(launch) -> Optional[Callable]:
    """The C function under a launcher's ``launch`` (unwrapping Triton's tensor-descriptor wrapper,
    whose encoding the bound launch does itself), or None where it is not found."""
    code = getattr(launch, "__code__", None)
    if code is None:
        return launch
    if "launcher" in code.co_freevars and launch.__closure__:
        return _c_entry(launch.__closure__[code.co_freevars.index("launcher")].cell_contents)
    return None


def _descriptor_encoder() -> Callable:
    """``encode(desc, meta) -> [tensor map, *shape, *strides]``: Triton's own encoding of a host TMA
    descriptor for a compiled kernel's descriptor metadata (two or three parameters by version)."""
    from triton.backends.nvidia.driver import make_tensordesc_arg
    if len(inspect.signature(make_tensordesc_arg).parameters) == 2:
        return make_tensordesc_arg
    return lambda desc, meta: make_tensordesc_arg(desc, meta, None)


def _on_cuda(t: Tensor) -> bool:
    return t.is_cuda


def _is_descriptor(a) -> bool:
    return hasattr(a, "block_shape") and hasattr(a, "base") and hasattr(a, "strides")


class _Base:
    """A descriptor's base as Triton's encoding reads it: its pointer (and dtype)."""
    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


class DescriptorCache:
    """One bound TMA descriptor argument: its geometry (shape, strides, block, padding, dtype and
    the compiled kernel's descriptor metadata, fixed by the bound launch) and its encodings by base
    pointer, so that a launch re-encodes only where the base pointer is new (a buffer freed and
    made again at the same address encodes the same descriptor). At most ``max_keys`` pointers are
    kept (the oldest dropped first)."""

    __slots__ = ("desc", "meta", "encode", "maps", "max_keys")

    def __init__(self, desc, meta, encode: Callable, max_keys: int = 16):
        self.desc = copy.copy(desc)
        self.meta, self.encode, self.max_keys = meta, encode, max_keys
        self.maps: dict = {}

    def expand(self, ptr: int) -> list:
        """The launcher's arguments for the descriptor at ``ptr``: ``[tensor map, *shape, *strides]``
        (the tensor map kept)."""
        self.desc.base = _Base(ptr, getattr(self.desc.base, "dtype", None))
        expanded = list(self.encode(self.desc, self.meta))
        if len(self.maps) >= self.max_keys:
            del self.maps[next(iter(self.maps))]
        self.maps[ptr] = expanded[0]
        return expanded

    def __call__(self, t: Tensor):
        """The tensor map of the descriptor whose base is ``t``."""
        ptr = t.data_ptr()
        m = self.maps.get(ptr)
        return self.expand(ptr)[0] if m is None else m


def _direct_call(c: Callable, form: str, head: tuple, tail: tuple, template: list, live: tuple, device: int,
                 stream: Callable) -> Callable:
    """``call(*values)``: one launch through the C launcher ``c`` with the live ``values`` in the
    positions ``live`` names (``(position, conversion)`` each; ``Tensor.data_ptr`` or None the usual
    ones) of the argument ``template``. The call is generated once per bound launch, as Python
    source with the fixed arguments as names (Triton's own launchers are generated the same way), so
    a launch copies no list and runs no loop: ``c(*head, stream(device), *tail, *arguments)``
    (``form`` ``"spread"``) or ``c(*head, stream(device), *tail, [arguments])`` (``"sequence"``)."""
    env = {"_c": c, "_stream": stream, "_device": device}
    names = []
    for i, a in enumerate((*head, *tail, *template)):
        env[f"_k{i}"] = a
        names.append(f"_k{i}")
    fixed, given = names[len(head) + len(tail):], [f"v{j}" for j in range(len(live))]
    for j, (pos, conv) in enumerate(live):
        if conv is None:
            fixed[pos] = given[j]
        elif conv is Tensor.data_ptr:
            fixed[pos] = f"{given[j]}.data_ptr()"
        else:
            env[f"_f{j}"] = conv
            fixed[pos] = f"_f{j}({given[j]})"
    arguments = ", ".join(fixed)
    call = ", ".join([*names[:len(head)], "_stream(_device)", *names[len(head):len(head) + len(tail)],
                      arguments if form == "spread" else f"[{arguments}]"])
    exec(f"def call({', '.join(given)}):\n    _c({call})\n", env)
    return env["call"]


class BoundLaunch:
    """A launch of :meth:`Launcher.bind`: ``bound(*live)`` launches it with these live arguments.

    ``direct`` is the call into the compiled kernel's C launcher (None where the bound launch always
    takes the launcher's path); a call takes it while ``configs.LAUNCH_DIRECT`` holds, no launch
    hook is set and the current device is the one bound."""

    __slots__ = ("launcher", "grid", "key", "args", "kwargs", "slots", "descs", "kernel", "device", "direct",
                 "device_fn")

    def __init__(self, launcher: Launcher, grid: tuple, key: Hashable, args: tuple, kwargs: dict, live: tuple):
        self.launcher, self.grid, self.key, self.args, self.kwargs = launcher, grid, key, tuple(args), kwargs
        self.descs = {i: a for i, a in enumerate(args) if _is_descriptor(a)}
        self.slots = tuple(sorted({i for i, a in enumerate(args) if isinstance(a, Tensor)} | set(self.descs)
                                  | set(live)))
        self.kernel = self.device = self.direct = self.device_fn = None
        if configs.LAUNCH_DIRECT and not interpreting() and not getattr(launcher.fn, "pre_run_hooks", None) \
                and all(_on_cuda(t) for t in (*(a for a in args if isinstance(a, Tensor)),
                                              *(d.base for d in self.descs.values()))):
            self._bind_direct()
        # the sample's tensors are not kept, nor its descriptors (whose bases are tensors): every one is
        # live (a kept one would hold the sample's buffers, a dS buffer of B x H x S x S among them, for
        # as long as the geometry's bound launches live)
        self.args = tuple(None if isinstance(a, Tensor) or i in self.descs else a for i, a in enumerate(self.args))
        for i, d in self.descs.items():
            self.descs[i] = copy.copy(d)
            self.descs[i].base = _Base(0, d.base.dtype)

    def _bind_direct(self) -> None:
        device_fn, stream_fn = _cuda_current()
        kernel = self.launcher.fn.warmup(*self.args, grid=self.grid, **self.kwargs)
        if kernel is None:  # (compiling in the background: the launcher's path until a later bind)
            return
        run = kernel.run
        form = launcher_form(run)
        c = None if form is None else _c_entry(run.launch)
        if c is None:
            return
        rest = tuple(self.kwargs[n] if n in self.kwargs else self.launcher.defaults[n]
                     for n in self.launcher.names[len(self.args):])
        metas = list(getattr(kernel.metadata, "tensordesc_meta", None) or ())
        if len(metas) != len(self.descs):
            return  # descriptors decomposed (no metadata): Triton's own launcher handles them
        template, live, encode, d = [], {}, None, 0
        for i, a in enumerate((*self.args, *rest)):
            conv = None
            if i in self.descs:
                encode = encode or _descriptor_encoder()
                conv = DescriptorCache(a, metas[d], encode, configs.LAUNCH_DESCRIPTORS)
                d += 1
                expanded = conv.expand(a.base.data_ptr())
            elif isinstance(a, Tensor):
                conv, expanded = Tensor.data_ptr, [a.data_ptr()]
            else:
                expanded = [a]
            if i in self.slots:
                live[i] = len(template), conv
            template.extend(expanded)
        live = tuple(live[i] for i in self.slots)
        self.kernel, self.device_fn, self.device = kernel, device_fn, device_fn()
        grid = (*self.grid, 1, 1)[:3]
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
        if form == "spread":  # global and profile scratch, metadata, launch metadata, the two hooks
            tail = (kernel.function, coop, pdl, None, None, kernel.packed_metadata, None, None, None)
        else:  # metadata, launch metadata, the two hooks, the two scratches, the arguments' annotations, signature
            tail = (kernel.function, coop, pdl, kernel.packed_metadata, None, None, None, None, None,
                    run.arg_annotations, run.kernel_signature)
        self.direct = _direct_call(c, form, grid, tail, template, live, self.device, stream_fn)

    def rebuild(self, values: tuple) -> tuple:
        """The launch's arguments with these live values (descriptors made on their base tensors)."""
        if len(values) != len(self.slots):  # (the direct call takes exactly as many)
            raise TypeError(f"{self.launcher.fn.fn.__name__}: a bound launch takes {len(self.slots)} live "
                            f"arguments, got {len(values)}")
        a = list(self.args)
        for i, v in zip(self.slots, values):
            if i in self.descs:
                d = copy.copy(self.descs[i])
                d.base = v
                v = d
            a[i] = v
        return tuple(a)

    def __call__(self, *values) -> None:
        direct = self.direct
        if direct is not None and configs.LAUNCH_DIRECT and self.device_fn() == self.device and _unhooked():
            if configs.LAUNCH_VERIFY:
                self.verify(values)
            direct(*values)
            return
        self.launcher(self.grid, self.key, self.rebuild(values), self.kwargs)

    def verify(self, values: tuple) -> None:
        """Raise where Triton's own lookup picks another kernel for these live values than the bound one."""
        if self.launcher.fn.warmup(*self.rebuild(values), grid=self.grid, **self.kwargs) is not self.kernel:
            raise AssertionError(f"{self.launcher.fn.fn.__name__}: bound key {self.key!r} maps to another kernel "
                                 f"than Triton's lookup")
