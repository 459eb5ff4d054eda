"""The cross-entropy loss and gradient kernels compile for sm_90 (Hopper) as a bf16 launch would
specialise them, no GPU needed: the target check stays a device assertion, the mean divides with
IEEE rounding (as torch does), the loss leaves the kernel in bf16, and no register spills."""
from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU target: not under the interpreter", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from splitsoftmax.kernels import cross_entropy as K  # noqa: E402

FLOATS = {"one_minus", "smooth_v"}


def compile_sm90(fn, pointers: dict, consts: dict, warps: int, stages: int = 1):
    """``fn`` compiled for sm_90 with its ``debug`` setting (pointers 16-byte aligned, ints ``i32``)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name], attrs[(i,)] = pointers[name], [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, "debug": bool(fn.debug)})


def no_spills(ptx: str) -> bool:
    """Whether ptxas (sm_90a) allocates ``ptx`` without spilling registers."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                         text=True)
    os.unlink(f.name)
    assert out.returncode == 0, out.stderr
    return "0 bytes spill stores, 0 bytes spill loads" in out.stderr


ROWS = dict(STATS="*fp32", T="*i64", LSE="*fp32")


@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("parts", [1, 3])
def test_total_kernel(final, parts):
    block, warps = K.CE_TOTAL_TILE
    p2 = triton.next_power_of_2(parts)
    ptx = compile_sm90(K._ce_total_kernel, dict(ROWS, OUT="*bf16", COUNT="*fp32", PART="*fp32"),
                       dict(P=parts, BLOCK_R=block // p2, BLOCK_P=p2, CHECK=True, MEAN=True, FINAL=final),
                       warps).asm["ptx"]
    assert "__assertfail" in ptx
    assert ("div.rn.f32" in ptx) == final and ("cvt.rn.bf16.f32" in ptx) == final
    assert no_spills(ptx)


def test_finish_and_rows_kernels():
    ptx = compile_sm90(K._ce_finish_kernel, dict(PART="*fp32", OUT="*bf16", COUNT="*fp32"),
                       dict(MEAN=True, BLOCK_G=1024), 4).asm["ptx"]
    assert "div.rn.f32" in ptx and "cvt.rn.bf16.f32" in ptx
    ptx = compile_sm90(K._ce_rows_kernel, dict(ROWS, LOSS="*bf16"), dict(P=2, BLOCK_R=512, BLOCK_P=2, CHECK=True),
                       4).asm["ptx"]
    assert "__assertfail" in ptx and "cvt.rn.bf16.f32" in ptx


@pytest.mark.parametrize("mean", [True, False])
def test_grad_kernel(mean):
    block_v, warps, stages = K.CE_BWD_TILE
    ptx = compile_sm90(K._ce_bwd_kernel, dict(X="*bf16", T="*i64", LSE="*fp32", G="*bf16", COUNT="*fp32",
                                              DX="*bf16"),
                       dict(BLOCK_V=block_v, MEAN=mean, IGNORE=True), warps, stages).asm["ptx"]
    assert ("div.rn.f32" in ptx) == mean and no_spills(ptx)
