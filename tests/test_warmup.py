"""CPU lane: ``splitsoftmax.tools.warmup`` compiles every kernel variant that attention at a new length of a
warmed bucket launches. The Triton path runs on CPU tensors with every launch recorded instead of
run, as on a Hopper GPU of 132 SMs: each launch's constexprs and launch options, and the
specialisation Triton would compile it for (argument types, 16-byte alignment, integers divisible by
16 or equal to 1), from Triton's own argument binder for an sm_90 target."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("records compiled launches: not under the interpreter", allow_module_level=True)

from triton.runtime.jit import JITFunction  # noqa: E402

from splitsoftmax.ops import _registry as local  # noqa: E402
from splitsoftmax.ops.attention import op as attention_op  # noqa: E402
from splitsoftmax.ops.cross_entropy import op as ce_op  # noqa: E402
from splitsoftmax.tools import warmup  # noqa: E402
from splitsoftmax.ops.attention import fwd as attention, bwd as attention_bwd, decode  # noqa: E402
from splitsoftmax.ops._triton import device, launch  # noqa: E402
from splitsoftmax.ops.merge import kernel as merge  # noqa: E402

SMS = 132


class _Variants:
    """The compiled variants launches would need: ``(kernel, constexprs and options)`` and, where
    Triton's binder can be built for sm_90 here, ``(kernel, specialisation, options)``."""

    def __init__(self):
        self.binders, self.sets = {}, {"constexprs": set(), "specialised": set()}

    def record(self, fn, args, kwargs):
        name = f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.fn.__name__}"
        self.sets["constexprs"].add((name, tuple(sorted(kwargs.items()))))
        binder = self._binder(fn)
        if binder is not None:
            _, spec, options = binder(*args, **kwargs)
            self.sets["specialised"].add((name, tuple(spec), tuple(sorted(options.items()))))

    def _binder(self, fn):
        if fn not in self.binders:
            try:
                from triton.backends.compiler import GPUTarget
                from triton.backends.nvidia.compiler import CUDABackend
                from triton.runtime.jit import create_function_from_signature
                backend = CUDABackend(GPUTarget("cuda", 90, 32))
                self.binders[fn] = create_function_from_signature(fn.signature, fn.params, backend)
            except (ImportError, AttributeError, TypeError):  # another Triton: constexprs only
                self.binders[fn] = None
        return self.binders[fn]

    def take(self) -> dict:
        sets = self.sets
        self.sets = {"constexprs": set(), "specialised": set()}
        return sets


@pytest.fixture
def variants(monkeypatch):
    """Launches of CPU tensors take the Triton path and are recorded, as on a Hopper GPU of 132 SMs."""
    rec = _Variants()
    use = lambda t: t.dtype != torch.float64  # noqa: E731
    monkeypatch.setattr(local, "use_triton", use)
    monkeypatch.setattr(attention_op, "use_triton", use)
    monkeypatch.setattr(ce_op, "use_triton", use)
    monkeypatch.setattr(launch.Launcher, "__call__",
                        lambda self, grid, key, args, kwargs: rec.record(self.fn, args, kwargs))
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs: rec.record(self, args, kwargs))
    monkeypatch.setattr(decode, "sm_count", lambda t: SMS)
    for mod in (device, attention, attention_bwd, merge):
        if hasattr(mod, "sm_count"):
            monkeypatch.setattr(mod, "sm_count", lambda t: SMS)
        monkeypatch.setattr(mod, "hopper", lambda t: True)
    monkeypatch.setattr(merge, "_PLANS", {})  # plans worked out with this device's numbers only
    empty = torch.empty
    monkeypatch.setattr(torch, "randn", lambda *shape, **kw: empty(*shape, **kw))  # no kernel reads the inputs
    return rec


def _warm(rec, head_dim, heads, kv_heads, batch=1, layout="bhsd", max_len=warmup.MAX_LEN) -> dict:
    cases = warmup.buckets(head_dim, torch.bfloat16, (True, False), heads, kv_heads, batch, max_len, device="cpu")
    assert len(cases) < 64, cases  # a small set
    for sq, sk, causal in cases:
        warmup.run(sq, sk, causal, head_dim, torch.bfloat16, heads, kv_heads, batch, layout, device="cpu")
    return rec.take()


def _new(rec, warmed: dict, runs, head_dim, heads, kv_heads, batch=1, layout="bhsd") -> dict:
    """The variants ``runs`` (``(Sq, Sk, causal)``) launch that warmup did not."""
    for sq, sk, causal in runs:
        warmup.run(sq, sk, causal, head_dim, torch.bfloat16, heads, kv_heads, batch, layout, device="cpu")
    seen = rec.take()
    assert seen["constexprs"]
    return {kind: sorted(seen[kind] - warmed[kind], key=str) for kind in seen if seen[kind] - warmed[kind]}


def test_the_gpu_tests_lengths_need_no_new_variant(variants):
    """What tests/test_gpu_host.py runs after warming (4 heads over 2 kv heads, head dim 64): new
    lengths of short, long, whole and partial buckets, causal and not, and a decode step."""
    warmed = _warm(variants, 64, 4, 2)
    runs = ([(s, s, c) for s in (1001, 1040, 1500, 2048, 3000, 4097, 8192, 9000) for c in (True, False)]
            + [(1, 7777, False), (1, 12345, False)])
    assert not _new(variants, warmed, runs, 64, 4, 2)


@pytest.mark.parametrize("head_dim,heads,kv_heads,batch,layout", [(64, 4, 2, 1, "bhsd"), (128, 8, 8, 2, "bhsd"),
                                                                   (128, 8, 2, 1, "bshd")])
def test_lengths_of_every_residue_need_no_new_variant(variants, head_dim, heads, kv_heads, batch, layout):
    """Lengths of every divisibility by 16, both sides of each tile, split and planning threshold;
    inputs contiguous or, as Hugging Face passes them, views of ``(B, S, H, D)``."""
    warmed = _warm(variants, head_dim, heads, kv_heads, batch, layout, max_len=6000)
    lengths = (100, 127, 129, 1001, 1002, 1004, 1040, 2047, 2048, 2049, 2100, 4095, 4097, 5999)
    runs = [(s, s, c) for s in lengths for c in (True, False)] + [(1, s, False) for s in (3, 600, 2500, 4100, 5997)]
    assert not _new(variants, warmed, runs, head_dim, heads, kv_heads, batch, layout)


def test_merge_parts_tile_rounds_the_part_count_up():
    """The all-parts merge holds ``next_pow2(N)`` parts, at least ``MERGE_PARTS_MIN_BLOCK``: any few
    splits share one compiled merge."""
    from splitsoftmax.ops._triton import configs
    blocks = {n: merge.merge_plan(n, 32, 128, SMS, True) for n in (1, 2, 3, 9, 16, 17, 33)}
    assert {n: (kind, kw["BLOCK_P"]) for n, (kind, _, kw) in blocks.items()} == {
        1: ("parts", 16), 2: ("parts", 16), 3: ("parts", 16), 9: ("parts", 16), 16: ("parts", 16),
        17: ("parts", 32), 33: ("parts", 64)}
    assert configs.MERGE_PARTS_MIN_BLOCK == 16
    assert merge.merge_plan(4, 1 << 16, 128, SMS, True)[0] == "rows"  # many rows: the row-tiled kernel
