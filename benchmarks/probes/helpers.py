"""Helpers shared by the probes beside this file (not a probe): timing, recording, sections.

Each probe runs ``SECTIONS`` named on its command line through :func:`run_sections`, prints one
line per timing and writes every row to ``OUTDIR/probe.json``, even when a section fails.
"""
import importlib
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench


def bench(fn):
    """ms of ``fn``: the better of two ``do_bench`` medians, after a first call."""
    fn()
    torch.cuda.synchronize()
    return min(do_bench(fn, warmup=25, rep=120, return_mode="median") for _ in range(2))


ROWS = []


def rec(group, name, ms, nbytes=None, flops=None, **extra):
    """Record and print one timing; ``extra`` (an error, a difference) goes along."""
    r = {"group": group, "name": name, "ms": ms, **extra}
    if nbytes:
        r["gbps"] = nbytes / ms / 1e6
    if flops:
        r["tflops"] = flops / ms / 1e9
    ROWS.append(r)
    rate = f"{r['gbps']:7.0f} GB/s" if nbytes else f"{r['tflops']:6.0f} TFLOP/s"
    print(f"{group:26s} {name:44s} {ms:8.4f} ms {rate} {extra or ''}", flush=True)


def guard(group, name, f):
    """Run ``f``; a failure is printed and recorded, and the probe goes on."""
    try:
        f()
    except Exception as e:  # noqa: BLE001  (a variant that fails is recorded, the rest go on)
        print(f"{group:26s} {name:44s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        ROWS.append({"group": group, "name": name, "error": f"{type(e).__name__}: {str(e)[:500]}"})


def rec_profile(group, name, fn, n=300, rows=30):
    """Record and print a cProfile (by own time) of ``n`` calls of ``fn``."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(rows)
    print(text.getvalue(), flush=True)
    ROWS.append({"group": group, "name": name, "text": text.getvalue()})


def kernel_times(step, steps=10) -> list:
    """``[(kernel, us)]`` of one call of ``step``, longest first: the torch profiler's device time per
    kernel averaged over ``steps`` calls after 3."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / steps) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def causal_case(S):
    """The bench's prefill inputs at sequence length ``S`` (B*S = 32k tokens, H=16, D=128, bf16) and
    the causal forward's FLOPs."""
    q, k, v = (torch.randn(32768 // S, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return q, k, v, 4 * q.shape[0] * 16 * S * S * 128 / 2


def rec_flash_causal(group, q, k, v, flops, name="sdpa flash"):
    """Record SDPA flash's causal forward on these inputs."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        rec(group, name, bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), flops=flops)


def run_sections(sections, argv):
    """``argv = [script, OUTDIR, [SECTIONS]]``: run the named sections (default all), each guarded,
    and write every recorded row to ``OUTDIR/probe.json`` even when one fails."""
    out = argv[1]
    os.makedirs(out, exist_ok=True)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    try:
        for s in (argv[2].split(",") if len(argv) > 2 else list(sections)):
            guard(s, "section", sections[s])
    finally:
        with open(os.path.join(out, "probe.json"), "w") as f:
            json.dump(ROWS, f, indent=1)


def copy_tags(package: str, module: str) -> list:
    """The tags of the earlier copies of kernel module ``package.module`` (``_probe_<tag>_<module>.py`` in
    the package's folder, ignored by git) beside it, sorted."""
    here, end = os.path.dirname(importlib.import_module(package).__file__), f"_{module}.py"
    return sorted(f[len("_probe_"):-len(end)] for f in os.listdir(here) if f.startswith("_probe_") and f.endswith(end))
