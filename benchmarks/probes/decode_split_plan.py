"""Probe: the split-KV decode plan and launch on one GPU (GQA 32/8, D=128, bf16), beside SDPA cuDNN.

    PYTHONPATH=. python3 benchmarks/probes/decode_split_plan.py OUTDIR [SECTIONS]

Backs these choices (numbers: docs/benchmarks/decode-merge.md):
``configs.ATTN_TILES[("decode", 2, 128)]`` and ``ATTN_SPLIT_PROGRAMS_PER_SM`` (the split plan),
``ATTN_SHORT_SPLIT_TILES`` / ``ATTN_SHORT_SPLIT_STAGES`` (short splits pipeline 3 stages),
``ATTN_SPLIT_TRIGGER`` and ``MERGE_PDL`` (the merge launched early), the launch cache
(``ops/_triton/launch.py``), and the few-row merge that loads every partial at once
(``MERGE_PARTS_*``).

SECTIONS (comma-separated, default all):
- host: host time per 128k-key decode call of each layer: the public call and the launcher with
  the launch cache (``ops._triton.launch``) and through Triton's own launch path, SDPA cuDNN, a
  cProfile of the public call; and of each step of Triton's launch of the split kernel and the
  merge kernel: the whole ``kernel[grid](...)``, its argument binder, its cache key, the compiled
  kernel's own ``run`` with the bound arguments, a key built over the arguments in Python;
- tiles: batch 1 at 128k and 1M keys, batch 4 at 128k, replayed from a CUDA graph (no host time)
  under the ``variants`` of ``sec_tiles`` (decode tile, split programs per SM, the early trigger,
  short splits' stages), in two rounds; the public call eager;
- eager: 128k keys, B=1, the public call timed eager with the launch cache, the early trigger and
  the merge's PDL each on or off, and the host time per iteration of a do_bench-like loop;
- profile: GPU time of each kernel of a decode call at 128k and 1M keys (the split kernel, the
  merge), beside cuDNN's kernels.
Writes OUTDIR/probe.json.
"""
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from helpers import ROWS, bench, guard, rec, rec_profile, run_sections  # beside this file


def decode_inputs(keys, batch=1):
    q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, 8, keys, 128, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def host_us(fn, n=200):
    """Median host time of one call, each started with the GPU idle (so no launch waits on a full
    queue)."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[n // 2] * 1e6


def rec_host(name, fn):
    us = host_us(fn)
    print(f"host {name:44s} {us:8.1f} us per call", flush=True)
    ROWS.append({"group": "host", "name": name, "us": us})


def _capture(jit_fn, call):
    """``(grid, args, kwargs)`` of the next launch of ``jit_fn`` made by ``call()``."""
    seen = {}
    orig = jit_fn.run

    def spy(*args, grid, warmup, **kwargs):
        seen.setdefault("launch", (grid, args, kwargs))
        return orig(*args, grid=grid, warmup=warmup, **kwargs)
    jit_fn.run = spy
    try:
        call()
    finally:
        del jit_fn.run
    return seen["launch"]


def _spec_key(args, kwargs):
    """A cache key over the arguments in Python: tensors by dtype and 16-byte alignment, the rest
    by value (what Triton specialises a launch on, and more)."""
    return (tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args),
            tuple(kwargs.items()))


def _launch_steps(label, jit_fn, grid, args, kwargs):
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key
    dev = driver.active.get_current_device()
    kernel_cache, key_cache, _, _, binder = jit_fn.device_caches[dev]
    compiled = jit_fn[grid](*args, **kwargs)
    bound, spec, options = binder(*args, **kwargs)
    values = tuple(bound.values())
    g = tuple(grid) + (1,) * (3 - len(grid))
    stream = driver.active.get_current_stream(dev)
    rec_host(f"{label}: kernel[grid](...)", lambda: jit_fn[grid](*args, **kwargs))
    rec_host(f"{label}: binder", lambda: binder(*args, **kwargs))
    rec_host(f"{label}: cache key", lambda: compute_cache_key(key_cache, spec, options))
    rec_host(f"{label}: current stream", lambda: driver.active.get_current_stream(dev))
    rec_host(f"{label}: compiled.run", lambda: compiled.run(*g, stream, compiled.function, compiled.packed_metadata,
                                                            None, None, None, *values))
    cache = {}

    def keyed():
        key = _spec_key(args, kwargs)
        c = cache.get(key)
        if c is None:
            cache[key] = c = compiled
        c.run(*g, driver.active.get_current_stream(dev), c.function, c.packed_metadata, None, None, None, *values)
    rec_host(f"{label}: python key + compiled.run", keyed)
    rec_host(f"{label}: python key alone", lambda: _spec_key(args, kwargs))


def sec_host():
    import splitsoftmax as ss
    from splitsoftmax.core import checks as _checks
    from splitsoftmax.ops.attention import fwd as A, decode as P
    from splitsoftmax.ops._triton import launch as L
    from splitsoftmax.ops.merge import kernel as M
    from splitsoftmax.ops._registry import interpreting
    from splitsoftmax.ops._registry import IMPLS
    q, k, v = decode_inputs(131072)
    scale = 128 ** -0.5
    with torch.no_grad():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            rec_host("sdpa cudnn", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        for cached in (True, False):
            L.interpreting = (lambda: False) if cached else (lambda: True)  # False: Triton's own launch path
            rec_host(f"ss.attention (launch cache {cached})", lambda: ss.attention(q, k, v))
            rec_host(f"ops.attention.fwd.attn_fwd (launch cache {cached})",
                     lambda: A.attn_fwd(q, k, v, scale, False, out_dtype=torch.bfloat16))
        L.interpreting = interpreting
        p = P.plan(q, k, v, False, 0)
        r = 32
        outs, lses = torch.empty(p.nsplit, r, 128, device="cuda"), torch.empty(p.nsplit, r, device="cuda")
        out, lse = torch.empty(r, 128, device="cuda", dtype=torch.bfloat16), torch.empty(r, device="cuda")
        rec_host("ops IMPLS attn_fwd", lambda: IMPLS["attn_fwd"](q, k, v, scale, False, 0))
        rec_host("_split_fwd", lambda: A._split_fwd(q, k, v, out.view(1, 32, 1, 128), lse.view(1, 32, 1), scale, False,
                                                    0, p, acc=False))
        rec_host("launch_fwd (split)", lambda: A.launch_fwd(q, k, v, outs, lses, scale, False, 0, p, split_dim=True))
        rec_host("merge_into", lambda: M.merge_into(outs, lses, out, lse))
        rec_host("2x torch.empty", lambda: (torch.empty(33, 1, 32, 1, 128, device="cuda"),
                                            torch.empty(33, 1, 32, 1, device="cuda")))
        rec_host("outs.view", lambda: outs.view(-1, r, 128))
        rec_host("3x stride()", lambda: (q.stride(), k.stride(), v.stride()))
        rec_host("5x data_ptr", lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()))
        rec_profile("host", "cprofile ss.attention", lambda: ss.attention(q, k, v), rows=25)
        rec_host("plan", lambda: P.plan(q, k, v, False, 0))
        rec_host("checks", lambda: _checks.attention_args(q, k, v, None, False))
        rec_host("4x torch.empty", lambda: (torch.empty(33, 1, 32, 1, 128, device="cuda"),
                                            torch.empty(33, 1, 32, 1, device="cuda"),
                                            torch.empty(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16),
                                            torch.empty(1, 32, 1, device="cuda")))
        call = lambda: A.attn_fwd(q, k, v, scale, False, out_dtype=torch.bfloat16)  # noqa: E731
        L.interpreting = lambda: True  # every launch through kernel[grid], where _capture sees it
        grid_kw = {"split kernel": _capture(A._attn_fwd_kernel, call),
                   "merge kernel": _capture(M._merge_parts_kernel, call)}
        L.interpreting = interpreting
        for label, (grid, args, kwargs) in grid_kw.items():
            jit_fn = A._attn_fwd_kernel if label == "split kernel" else M._merge_parts_kernel
            guard("host", label, lambda: _launch_steps(label, jit_fn, grid, args, kwargs))


def sec_tiles():
    import splitsoftmax as ss
    from splitsoftmax.tools.bench import graph_ms
    from splitsoftmax.ops._triton import configs
    names = ("ATTN_SPLIT_PROGRAMS_PER_SM", "ATTN_SPLIT_TRIGGER", "ATTN_SHORT_SPLIT_STAGES")
    key = ("decode", 2, 128)
    saved = configs.ATTN_TILES[key], [getattr(configs, n) for n in names]
    # (decode tile, split programs per SM, early trigger, most stages of short splits)
    variants = [((16, 64, 4, 4), 2, True, 3), ((16, 64, 4, 4), 2, True, 4), ((16, 64, 4, 4), 2, False, 3),
                ((16, 64, 4, 4), 1, True, 3), ((16, 64, 4, 4), 4, True, 3)]
    for batch, keys in ((1, 131072), (1, 1048576), (4, 131072)):
        q, k, v = decode_inputs(keys, batch)
        nb = 2 * k.numel() * 2
        grp = f"decode B={batch} {keys}"
        with torch.no_grad():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                peer = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                want = peer().double()
                rec(grp, "cudnn eager", bench(peer), nb)
                rec(grp, "cudnn graph", graph_ms(peer), nb)
            for rnd in (1, 2):
                for tile, *values in variants:
                    configs.ATTN_TILES[key] = tile
                    for n, val in zip(names, values):
                        setattr(configs, n, val)
                    name = f"tile {tile} pps/trigger/short stages {values}"

                    def one(name=name):
                        fn = lambda: ss.attention(q, k, v)  # noqa: E731
                        err = (fn().double() - want).abs().max().item()
                        rec(grp, f"{name} graph r{rnd}", graph_ms(fn), nb, err_vs_cudnn=f"{err:.1e}")
                    guard(grp, name, one)
            configs.ATTN_TILES[key] = saved[0]
            for n, val in zip(names, saved[1]):
                setattr(configs, n, val)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                rec(grp, "cudnn graph again", graph_ms(peer), nb)
                rec(grp, "cudnn eager again", bench(peer), nb)
            rec(grp, "ss eager", bench(lambda: ss.attention(q, k, v)), nb)
        del q, k, v
        torch.cuda.empty_cache()


def sec_eager():
    """128k keys, B=1: the public call timed eager (``do_bench``, the L2 cleared before each call)
    with the launch cache on or off, the split forward's early trigger on or off and the merge under
    PDL or not; and the host time per iteration of a do_bench-like loop, GPU busy."""
    import triton
    import splitsoftmax as ss
    from splitsoftmax.ops._triton import configs, launch as L
    from splitsoftmax.ops._registry import interpreting
    q, k, v = decode_inputs(131072)
    nb = 2 * k.numel() * 2
    saved = configs.ATTN_SPLIT_TRIGGER, configs.MERGE_PDL
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    with torch.no_grad():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            peer = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            rec("eager", "cudnn", bench(peer), nb)
        for cached in (True, False):
            L.interpreting = (lambda: False) if cached else (lambda: True)
            for trigger, pdl in ((True, True), (False, True), (False, False)):
                configs.ATTN_SPLIT_TRIGGER, configs.MERGE_PDL = trigger, pdl
                name = f"ss cache {cached} trigger {trigger} pdl {pdl}"
                fn = lambda: ss.attention(q, k, v)  # noqa: E731
                rec("eager", name, bench(fn), nb)
                fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(100):
                    cache.zero_()
                    fn()
                us = (time.perf_counter() - t0) * 1e4
                torch.cuda.synchronize()
                print(f"host per do_bench-like iteration, {name}: {us:.1f} us", flush=True)
                ROWS.append({"group": "eager", "name": name + " loop host us", "us": us})
        L.interpreting = interpreting
        configs.ATTN_SPLIT_TRIGGER, configs.MERGE_PDL = saved


def sec_profile():
    """GPU time of each kernel of a decode call (torch.profiler, 20 calls) beside SDPA cuDNN's."""
    import splitsoftmax as ss
    from torch.profiler import ProfilerActivity, profile
    for keys in (131072, 1048576):
        q, k, v = decode_inputs(keys)
        with torch.no_grad():
            for name, fn in (("cudnn", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
                             ("ss", lambda: ss.attention(q, k, v))):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(20):
                            fn()
                        torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=50)
                print(f"==== decode {keys} {name}: 20 calls ====\n{table}", flush=True)
                ROWS.append({"group": f"profile {keys}", "name": name, "text": table})
        del q, k, v
        torch.cuda.empty_cache()


SECTIONS = {"host": sec_host, "tiles": sec_tiles, "eager": sec_eager, "profile": sec_profile}

if __name__ == "__main__":
    run_sections(SECTIONS, sys.argv)
