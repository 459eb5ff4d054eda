"""Probe (no GPU needed): registers and spills of the softmax coop kernel on sm_90, per dtype, chunk
and warps. Compiles with Triton for a GPUTarget and runs the bundled ptxas with ``-v``.

    PYTHONPATH=. python3 benchmarks/probes/softmax_coop_registers.py

Backs ``configs.SoftmaxConfig.coop_chunk_elems`` / ``coop_elems_per_warp`` (16384-element chunks,
8 warps: the largest chunk that holds three chunks per thread without spilling much); numbers in
docs/benchmarks/softmax.md history.
"""
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from splitsoftmax.ops.softmax import kernel as K

PTXAS = get_ptxas(90).path  # the ptxas Triton itself runs for sm_90 (its bundled CUDA 12 or 13 one)
ALIGNED = (0, 1, 3, 5, 7, 8)  # pointers and ints divisible by 16, as a launch would specialise them


def ptxas_report(dt: str, block_n: int, warps: int, log: bool = False) -> str:
    sig = {"x_ptr": f"*{dt}", "y_ptr": f"*{dt}", "lse_ptr": "*fp32", "st_ptr": "*i64", "R": "i32", "N": "i32",
           "C": "i32", "stride_x": "i32", "stride_y": "i32", "spin": "i32", "LOG": "constexpr",
           "BLOCK_N": "constexpr", "BLOCK_C": "constexpr", "LOOP_N": "constexpr"}
    # LOOP_N: the fallback's loop tile, 16 KB (configs.SOFTMAX.loop_tile_bytes)
    consts = {"LOG": log, "BLOCK_N": block_n, "BLOCK_C": 16, "LOOP_N": 16384 // (2 if dt == "bf16" else 4)}
    attrs = {(i,): [["tt.divisibility", 16]] for i in ALIGNED}
    src = ASTSource(fn=K._softmax_coop_kernel, signature=sig, constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return f"regs {regs.group(1) if regs else '?'}, spill stores {spill.group(1) if spill else '?'} B"


if __name__ == "__main__":
    for dt, block_n, warps in (("fp32", 16384, 8), ("bf16", 16384, 8), ("bf16", 8192, 8), ("bf16", 16384, 16),
                               ("bf16", 32768, 16)):
        for log in (False, True):
            print(f"{dt} chunk {block_n} warps {warps} log={log}: {ptxas_report(dt, block_n, warps, log)}",
                  flush=True)
