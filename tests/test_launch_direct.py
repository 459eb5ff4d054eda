"""CPU lane: bound launches (``ops._triton.launch.Launcher.bind``) around stand-in compiled kernels.

What reaches the C launcher in each of Triton's calling forms (integer pointers, constexprs in place,
descriptors expanded from their cached encodings), which calls fall back to the launcher's own
path, and the descriptor cache keyed by base pointer. The GPU lane runs the real launchers with
``configs.LAUNCH_VERIFY``.
"""
from __future__ import annotations

import gc
import weakref

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from triton import knobs  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from splitsoftmax.ops._triton import configs, launch  # noqa: E402


def _kernel(X, D, n, s, BLOCK: int, FLAG: bool = False):  # the stand-in's signature (two constexprs)
    pass


class _Entry:
    """A C launcher entry: records every call's arguments."""

    def __init__(self, log):
        self.log = log

    def __call__(self, *args):
        self.log.append(("c", args))


class _SpreadLauncher:
    """Triton 3.6's compiled launcher."""

    launch_cooperative_grid, launch_pdl, global_scratch_size, profile_scratch_size = False, True, 0, 0

    def __init__(self, log):
        self.log, self.launch = log, _Entry(log)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.log.append(("run", (gridX, gridY, gridZ, stream, function, *args)))


class _SequenceLauncher:
    """Triton 3.7 to 3.9's compiled launcher."""

    launch_cooperative_grid, launch_pdl, global_scratch_size, profile_scratch_size = True, False, 0, 0
    arg_annotations, kernel_signature = "annotations", b"signature"

    def __init__(self, log):
        self.log, self.launch = log, _Entry(log)

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
                 launch_exit_hook, *args):
        self.log.append(("run", (gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                                 launch_enter_hook, launch_exit_hook, *args)))


class _Metadata:
    tensordesc_meta = [{"block_size": [4, 8]}]


class _Compiled:
    function, packed_metadata, metadata = "function", (4, 1, 0), _Metadata

    def __init__(self, run):
        self.run = run


class _Jit:
    """A ``JITFunction``: ``[grid](...)`` compiles and launches through the compiled launcher;
    ``warmup`` compiles (once per constexprs) and returns the kernel."""

    fn = staticmethod(_kernel)

    def __init__(self, make_run):
        self.log, self.compiled, self.make_run, self.warmups = [], {}, make_run, 0

    def _lookup(self, kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in self.compiled:
            self.compiled[key] = _Compiled(self.make_run(self.log))
        return self.compiled[key]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return self._lookup(kwargs)
        return launch

    def warmup(self, *args, grid, **kwargs):
        self.warmups += 1
        return self._lookup(kwargs)


class _Driver:
    class active:
        get_current_device = staticmethod(lambda: 3)
        get_current_stream = staticmethod(lambda device: 1000 + device)


def _encode(log):
    def encode(desc, meta):
        log.append(("encode", desc.base.data_ptr()))
        return [f"map@{desc.base.data_ptr()}", *desc.shape, *desc.strides]
    return encode


@pytest.fixture
def env(monkeypatch):
    """CPU tensors taken for CUDA ones, device 3 current, a recording descriptor encoder."""
    device = {"index": 3}
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "driver", _Driver)
    monkeypatch.setattr(launch, "_on_cuda", lambda t: True)
    monkeypatch.setattr(launch, "_cuda_current", lambda: (lambda: device["index"], lambda d: 1000 + d))
    encodes = []
    monkeypatch.setattr(launch, "_descriptor_encoder", lambda: _encode(encodes))
    monkeypatch.setattr(configs, "LAUNCH_DIRECT", True)
    monkeypatch.setattr(configs, "LAUNCH_VERIFY", False)
    return device, encodes


def _operands():
    x = torch.zeros(16, 8)
    return x, TensorDescriptor.from_tensor(torch.zeros(32, 8), [4, 8])


def _calls(log, kind):
    return [e[1] for e in log if e[0] == kind]


def test_installed_triton_launcher_form():
    """3.6 spreads the kernel's arguments, 3.7 to 3.9 pass them as one sequence."""
    want = {(3, 6): "spread", (3, 7): "sequence", (3, 8): "sequence", (3, 9): "sequence"}
    if configs.TRITON_VERSION not in want:
        pytest.skip(f"triton {configs.TRITON_VERSION} is not one of the known launcher forms")
    assert launch.launcher_form() == want[configs.TRITON_VERSION]


def test_instance_forms_and_refusals():
    log = []
    assert launch.launcher_form(_SpreadLauncher(log)) == "spread"
    assert launch.launcher_form(_SequenceLauncher(log)) == "sequence"

    class Other:
        launch, global_scratch_size, profile_scratch_size = _Entry(log), 0, 0

        def __call__(self, grid, stream, *args):
            pass
    assert launch.launcher_form(Other()) is None
    scratch = _SequenceLauncher(log)
    scratch.global_scratch_size = 128  # Triton's own call allocates it
    assert launch.launcher_form(scratch) is None
    sanitized = _SpreadLauncher(log)
    sanitized.gsan_enabled = True
    assert launch.launcher_form(sanitized) is None
    class Bare(_SequenceLauncher):
        arg_annotations = None
    del Bare.arg_annotations, _SequenceLauncher.arg_annotations
    try:
        assert launch.launcher_form(Bare(log)) is None  # a sequence launcher without its annotations
    finally:
        _SequenceLauncher.arg_annotations = "annotations"


def test_c_entry_unwraps_the_descriptor_wrapper():
    entry = _Entry([])

    def wrap(launcher):
        def inner(*args):
            return launcher(*args)
        return inner
    assert launch._c_entry(entry) is entry
    assert launch._c_entry(wrap(entry)) is entry
    assert launch._c_entry(wrap(wrap(entry))) is entry
    assert launch._c_entry(lambda *args: None) is None  # no C entry found: Triton's own call


@pytest.mark.parametrize("form", ["sequence", "spread"])
def test_bound_call_hands_integer_pointers_and_encoded_descriptors(env, form):
    """Every parameter in order: the tensor as its pointer, the descriptor as its tensor map, shape
    and strides, the scalars, then the constexprs by name or default; nothing launched at bind."""
    _, encodes = env
    jit = _Jit(_SequenceLauncher if form == "sequence" else _SpreadLauncher)
    x, d = _operands()
    bound = launch.Launcher(jit).bind((5, 2), "geometry", (x, d, 7, 0.5), {"BLOCK": 64, "num_warps": 4})
    assert jit.log == [] and jit.warmups == 1
    y, z = torch.zeros(16, 8), torch.zeros(32, 8)
    bound(y, z)
    (call,) = _calls(jit.log, "c")
    kernel_args = [y.data_ptr(), f"map@{z.data_ptr()}", 32, 8, 8, 1, 7, 0.5, 64, False]
    if form == "sequence":
        assert call == (5, 2, 1, 1003, "function", True, False, (4, 1, 0), None, None, None, None, None,
                        "annotations", b"signature", kernel_args)
    else:
        assert call == (5, 2, 1, 1003, "function", False, True, None, None, (4, 1, 0), None, None, None,
                        *kernel_args)
    assert encodes == [("encode", d.base.data_ptr()), ("encode", z.data_ptr())]


def test_live_scalars_follow_the_tensors_in_parameter_order(env):
    jit = _Jit(_SequenceLauncher)
    x, d = _operands()
    bound = launch.Launcher(jit).bind((1,), "g", (x, d, 7, 0.5), {"BLOCK": 16}, live=(3,))
    bound(x, d.base, 0.25)
    bound(x, d.base, 2.0)
    assert [c[-1][7] for c in _calls(jit.log, "c")] == [0.25, 2.0]
    assert [c[-1][6] for c in _calls(jit.log, "c")] == [7, 7]


def test_descriptor_cache_encodes_each_base_pointer_once(env):
    _, encodes = env
    jit = _Jit(_SequenceLauncher)
    x, d = _operands()
    bound = launch.Launcher(jit).bind((1,), "g", (x, d, 7, 0.5), {"BLOCK": 16})
    others = [torch.zeros(32, 8) for _ in range(3)]
    for t in (d.base, d.base, *others, others[0], d.base):
        bound(x, t)
    assert [p for _, p in encodes] == [d.base.data_ptr(), *(t.data_ptr() for t in others)]
    assert [c[-1][1] for c in _calls(jit.log, "c")] == [
        f"map@{t.data_ptr()}" for t in (d.base, d.base, *others, others[0], d.base)]


def test_descriptor_cache_is_bounded():
    encodes = []
    desc = TensorDescriptor.from_tensor(torch.zeros(32, 8), [4, 8])
    cache = launch.DescriptorCache(desc, {}, _encode(encodes), max_keys=2)
    ts = [torch.zeros(32, 8) for _ in range(3)]
    for t in (ts[0], ts[1], ts[2], ts[0]):
        cache(t)
    assert len(cache.maps) == 2
    assert [p for _, p in encodes] == [t.data_ptr() for t in (ts[0], ts[1], ts[2], ts[0])]


@pytest.mark.parametrize("direct", [True, False])
def test_bound_launch_keeps_no_sample_tensor(env, monkeypatch, direct):
    """Neither the sample's tensors nor its descriptors' bases outlive the sample: the bound launch
    lives as long as its geometry, and a kept buffer (a dS buffer of B x H x S x S) is memory lost."""
    monkeypatch.setattr(configs, "LAUNCH_DIRECT", direct)
    jit = _Jit(_SequenceLauncher)
    x, d = _operands()
    alive = [weakref.ref(x), weakref.ref(d.base)]
    bound = launch.Launcher(jit).bind((1,), "g", (x, d, 7, 0.5), {"BLOCK": 16})
    del x, d
    gc.collect()
    assert [r() for r in alive] == [None, None]
    assert (bound.direct is not None) == direct


@pytest.mark.parametrize("direct", [True, False])
def test_a_bound_call_takes_exactly_its_live_arguments(env, monkeypatch, direct):
    """One live argument too many or too few is a TypeError on the direct path and on the launcher's,
    and nothing is launched."""
    jit = _Jit(_SequenceLauncher)
    x, d = _operands()
    bound = launch.Launcher(jit).bind((1,), "g", (x, d, 7, 0.5), {"BLOCK": 16})
    monkeypatch.setattr(configs, "LAUNCH_DIRECT", direct)
    for values in ((x,), (x, d.base, x)):
        with pytest.raises(TypeError):
            bound(*values)
    assert _calls(jit.log, "c") == [] and _fallback_runs(jit) == []
    bound(x, d.base)
    assert len(_calls(jit.log, "c")) == direct and len(_fallback_runs(jit)) == (not direct)


def _fallback_runs(jit):
    return [e for e in jit.log if e[0] in ("jit", "run")]


def test_launch_direct_off_takes_the_launchers_path(env, monkeypatch):
    jit = _Jit(_SequenceLauncher)
    x, d = _operands()
    bound = launch.Launcher(jit).bind((2,), "g", (x, d, 7, 0.5), {"BLOCK": 16})
    monkeypatch.setattr(configs, "LAUNCH_DIRECT", False)
    bound(x, d.base)
    bound(x, d.base)
    assert _calls(jit.log, "c") == []
    first, second = _fallback_runs(jit)
    assert first[0] == "jit" and first[2][0] is x and first[2][1].base is d.base
    assert first[2][1].block_shape == [4, 8] and first[2][2:] == (7, 0.5)
    assert second[0] == "run" and second[1][9] is x  # the launcher's cached kernel, given tensors


def test_bound_with_launch_direct_off_never_binds(env, monkeypatch):
    monkeypatch.setattr(configs, "LAUNCH_DIRECT", False)
    jit = _Jit(_SequenceLauncher)
    x, d = _operands()
    bound = launch.Launcher(jit).bind((2,), "g", (x, d, 7, 0.5), {"BLOCK": 16})
    assert bound.direct is None and jit.warmups == 0
    monkeypatch.setattr(configs, "LAUNCH_DIRECT", True)
    bound(x, d.base)
    assert _calls(jit.log, "c") == [] and _fallback_runs(jit)[0][0] == "jit"


def test_interpreter_or_host_tensors_never_bind(env, monkeypatch):
    x, d = _operands()
    monkeypatch.setattr(launch, "interpreting", lambda: True)
    assert launch.Launcher(_Jit(_SequenceLauncher)).bind((1,), "g", (x, d, 7, 0.5), {"BLOCK": 16}).direct is None
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "_on_cuda", lambda t: False)
    assert launch.Launcher(_Jit(_SequenceLauncher)).bind((1,), "g", (x, d, 7, 0.5), {"BLOCK": 16}).direct is None


def test_unknown_launcher_form_never_binds(env):
    class Unknown(_SequenceLauncher):
        def __call__(self, grid, stream, *args):
            pass
    x, d = _operands()
    bound = launch.Launcher(_Jit(Unknown)).bind((1,), "g", (x, d, 7, 0.5), {"BLOCK": 16})
    assert bound.direct is None


def test_decomposed_descriptors_never_bind(env, monkeypatch):
    """A kernel compiled without descriptor metadata takes its descriptors decomposed: Triton's call."""
    monkeypatch.setattr(_Metadata, "tensordesc_meta", None)
    x, d = _operands()
    assert launch.Launcher(_Jit(_SequenceLauncher)).bind((1,), "g", (x, d, 7, 0.5), {"BLOCK": 16}).direct is None


def test_a_launch_hook_or_another_device_takes_the_launchers_path(env, monkeypatch):
    device, _ = env
    jit = _Jit(_SequenceLauncher)
    x, d = _operands()
    bound = launch.Launcher(jit).bind((1,), "g", (x, d, 7, 0.5), {"BLOCK": 16})
    device["index"] = 0
    bound(x, d.base)
    device["index"] = 3
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    bound(x, d.base)
    assert _calls(jit.log, "c") == [] and [e[0] for e in jit.log] == ["jit", "jit"]
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    bound(x, d.base)
    assert len(_calls(jit.log, "c")) == 1


def test_verify_checks_the_bound_kernel_against_tritons_lookup(env, monkeypatch):
    jit = _Jit(_SequenceLauncher)
    x, d = _operands()
    bound = launch.Launcher(jit).bind((1,), "too coarse", (x, d, 7, 0.5), {"BLOCK": 16})
    monkeypatch.setattr(configs, "LAUNCH_VERIFY", True)
    bound(x, d.base)
    assert jit.warmups == 2
    monkeypatch.setattr(jit, "warmup", lambda *args, grid, **kwargs: _Compiled(None))
    with pytest.raises(AssertionError, match="too coarse"):
        bound(x, d.base)


def test_tritons_descriptor_encoding_is_reached_with_its_own_parameters():
    """The installed Triton's encoder takes two or three parameters; without descriptor metadata it
    decomposes the descriptor (base first), which needs no device."""
    desc = TensorDescriptor.from_tensor(torch.zeros(32, 8), [4, 8])
    out = launch._descriptor_encoder()(desc, None)
    assert out[0] is desc.base and list(out[1:5]) == [32, 8, 8, 1]


def test_bench_host_rows_are_median_rounds(monkeypatch):
    """``bench host`` times splitsoftmax (bound and unbound) and the peer in interleaved rounds and
    gives each its median round: one slow round moves no row."""
    from splitsoftmax.ops._triton import configs
    from splitsoftmax.tools.bench import host
    order, times = [], {"mine": iter([(30.0, 31.0), (90.0, 91.0), (28.0, 29.0)]),
                        "peer": iter([(20.0, 21.0), (21.0, 22.0), (60.0, 61.0)])}

    def mine():
        pass

    def peer():
        pass
    unbound = iter([(50.0, 51.0), (52.0, 53.0), (49.0, 50.0)])

    def per_call_us(fn):
        name = fn.__name__
        if name == "mine" and not configs.LAUNCH_DIRECT:
            order.append("unbound")
            return next(unbound)
        order.append(name)
        return next(times[name])
    monkeypatch.setattr(host, "per_call_us", per_call_us)
    monkeypatch.setattr(host, "CASES", [("c", "p", lambda: (mine, peer), ("x", 2.0))])
    (row,) = host.run_rows(False, rounds=3)
    assert order == ["mine", "unbound", "peer"] * 3
    assert (row["host_us"], row["wall_us"], row["unbound_host_us"], row["peer_host_us"]) == (30.0, 31.0, 50.0, 21.0)
    assert row["rounds"]["ss"][1] == (90.0, 91.0) and row["met"] is True


def test_bench_host_targets_and_table():
    """``bench host``: a ratio target against the peer's host time, an absolute one in microseconds,
    and the table shows the unbound column and the verdict."""
    from splitsoftmax.tools.bench import host
    row = {"case": "c", "peer": "p", "host_us": 30.0, "wall_us": 40.0, "unbound_host_us": 50.0,
           "peer_host_us": 20.0, "peer_wall_us": 25.0}
    assert host.target_met(row, ("x", 2.0)) is True
    assert host.target_met(row, ("x", 1.4)) is False
    assert host.target_met(row, ("us", 25.0)) is False
    assert host.target_met({"host_us": 30.0}, ("x", 2.0)) is None and host.target_met(row, None) is None
    row.update(target="<=2x", met=True)
    line = host.table([row]).splitlines()[1].split()
    assert line[1:8] == ["30.0", "40.0", "50.0", "20.0", "25.0", "<=2x", "yes"]
