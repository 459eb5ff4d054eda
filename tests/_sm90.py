"""Kernels compiled for sm_90 (Hopper) without a GPU, as a launch there would specialise them, and
ptxas's report on them: for the tests that check registers, spills, shared memory and instructions."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource


def compile_sm90(fn, pointers: dict, consts: dict, warps: int, stages: int = 1, floats=(), aligned=(),
                 options=None):
    """``fn`` compiled for sm_90: ``pointers`` (name -> type) 16-byte aligned, ``consts`` its
    constexprs, the other arguments ``fp32`` when in ``floats`` else ``i32`` (divisible by 16 when
    in ``aligned``); ``options`` beside the warps and stages."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name], attrs[(i,)] = pointers[name], [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in floats else "i32"
            if name in aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, **(options or {})})


def ptxas_report(ptx: str) -> str:
    """ptxas's ``-v`` report (sm_90a) on ``ptx``; it must assemble."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                         text=True)
    os.unlink(f.name)
    assert out.returncode == 0, out.stderr
    return out.stderr


def no_spills(ptx: str) -> bool:
    """Whether ptxas allocates ``ptx`` without spilling registers."""
    return "0 bytes spill stores, 0 bytes spill loads" in ptxas_report(ptx)


def spill_stores(report: str) -> int:
    """The bytes of spill stores in ptxas's ``report``."""
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))
