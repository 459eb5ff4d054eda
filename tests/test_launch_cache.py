"""CPU lane: the launch cache's bookkeeping (``ops._triton.launch.Launcher``) around a stand-in kernel.

The GPU lane checks each cached launch of the real kernels against Triton's own lookup
(``configs.LAUNCH_VERIFY``); here, which path each call takes and what reaches the launcher.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from triton import knobs  # noqa: E402

from splitsoftmax.ops._triton import configs, launch  # noqa: E402


def _kernel(X, n, s, BLOCK: int, FLAG: bool = False):  # the stand-in's signature (two constexprs)
    pass


class _Compiled:
    """A compiled kernel: records what its launcher receives."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("run", args))


class _Jit:
    """A ``JITFunction``: ``[grid](...)`` compiles (once per constexprs) and launches; ``warmup``
    returns what Triton's lookup picks."""

    fn = staticmethod(_kernel)

    def __init__(self):
        self.log, self.compiled = [], {}

    def _lookup(self, kwargs):
        return self.compiled.setdefault(tuple(sorted(kwargs.items())), _Compiled(self.log))

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return self._lookup(kwargs)
        return launch

    def warmup(self, *args, grid, **kwargs):
        return self._lookup(kwargs)


class _Driver:
    class active:
        get_current_device = staticmethod(lambda: 3)
        get_current_stream = staticmethod(lambda device: 1000 + device)


@pytest.fixture
def jit(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "driver", _Driver)
    return _Jit()


def test_first_launch_compiles_then_the_cached_kernel_runs(jit):
    run = launch.Launcher(jit)
    run((2,), "geometry", ("x", 5, 0.5), {"BLOCK": 64, "num_warps": 4})
    run((7, 2), "geometry", ("y", 5, 0.25), {"BLOCK": 64, "num_warps": 4})
    assert [e[0] for e in jit.log] == ["jit", "run"]
    # grid padded to three dims, the current stream, no metadata or hooks, then every parameter
    # in signature order: the positional ones, then constexprs by name or default
    assert jit.log[1][1] == (7, 2, 1, 1003, "function", "metadata", None, None, None, "y", 5, 0.25, 64, False)


def test_a_new_key_or_new_constexprs_compile_again(jit):
    run = launch.Launcher(jit)
    run((1,), "a", ("x", 1, 0.0), {"BLOCK": 64})
    run((1,), "b", ("x", 1, 0.0), {"BLOCK": 64})
    run((1,), "b", ("x", 1, 0.0), {"BLOCK": 32})
    run((1,), "b", ("x", 1, 0.0), {"BLOCK": 32, "FLAG": True})
    run((1,), "b", ("x", 1, 0.0), {"BLOCK": 32, "FLAG": True})
    assert [e[0] for e in jit.log] == ["jit", "jit", "jit", "jit", "run"]
    assert jit.log[-1][1][-2:] == (32, True)


def test_the_cache_is_bounded(jit):
    run = launch.Launcher(jit, max_keys=2)
    for key in ("a", "b", "c", "a"):
        run((1,), key, ("x", 1, 0.0), {"BLOCK": 64})
    assert [e[0] for e in jit.log] == ["jit"] * 4


def test_a_launch_hook_takes_tritons_path(jit, monkeypatch):
    run = launch.Launcher(jit)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    for _ in range(2):
        run((1,), "a", ("x", 1, 0.0), {"BLOCK": 64})
    assert [e[0] for e in jit.log] == ["jit", "jit"]


def test_verify_catches_a_key_that_misses_a_specialisation(jit, monkeypatch):
    """A key that maps to a kernel other than the one Triton picks fails loudly under
    ``LAUNCH_VERIFY`` (and goes unchecked without it)."""
    run = launch.Launcher(jit)
    run((1,), "too coarse", ("x", 1, 0.0), {"BLOCK": 64})
    monkeypatch.setattr(jit, "warmup", lambda *args, grid, **kwargs: _Compiled(jit.log))
    run((1,), "too coarse", ("x", 1, 0.0), {"BLOCK": 64})
    monkeypatch.setattr(configs, "LAUNCH_VERIFY", True)
    with pytest.raises(AssertionError, match="too coarse"):
        run((1,), "too coarse", ("x", 1, 0.0), {"BLOCK": 64})


def test_fits_int32():
    assert launch.fits_int32(0, -2 ** 31, 2 ** 31 - 1)
    assert not launch.fits_int32(5, 2 ** 31)
    assert not launch.fits_int32(-2 ** 31 - 1)


def test_auto_key_fixes_every_specialisation():
    """``auto_key``: integers by value, tensors by dtype and 16-byte alignment, floats by type; so
    two calls share a compiled kernel only where Triton would specialise them alike."""
    import torch
    buf = torch.zeros(64)
    base = launch.auto_key((buf, 16, 0.5, None))
    assert launch.auto_key((torch.ones(64), 16, 2.5, None)) == base  # another aligned tensor, another float
    assert launch.auto_key((buf[1:], 16, 0.5, None)) != base  # 4 bytes off a 16-byte boundary
    assert launch.auto_key((buf.double(), 16, 0.5, None)) != base
    assert launch.auto_key((buf, 17, 0.5, None)) != base
    assert launch.auto_key((buf, 16, 1, None)) != base  # an int where a float was


def test_auto_launch_caches_by_auto_key(jit):
    """``Launcher.auto`` launches through the cache under ``auto_key(args)``."""
    import torch
    cached = launch.Launcher(jit)
    x = torch.zeros(8)
    cached.auto((2,), (x, 3, 4), BLOCK=16)
    cached.auto((2,), (x, 3, 4), BLOCK=16)
    cached.auto((2,), (x, 5, 4), BLOCK=16)
    assert [e[0] for e in jit.log] == ["jit", "run", "jit"]
