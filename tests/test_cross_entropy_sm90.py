"""The cross-entropy loss and gradient kernels compile for sm_90 (Hopper) as a bf16 launch would
specialise them, no GPU needed: the target check stays a device assertion, the mean divides with
IEEE rounding (as torch does), the loss leaves the kernel in bf16, and no register spills."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU target: not under the interpreter", allow_module_level=True)

import triton  # noqa: E402
from _sm90 import compile_sm90 as _compile, no_spills  # noqa: E402

from splitsoftmax.ops.cross_entropy import kernel as K  # noqa: E402

FLOATS = {"one_minus", "smooth_v"}


def compile_sm90(fn, pointers: dict, consts: dict, warps: int, stages: int = 1):
    """``fn`` compiled for sm_90 with its ``debug`` setting (pointers 16-byte aligned, ints ``i32``)."""
    return _compile(fn, pointers, consts, warps, stages, floats=FLOATS, options={"debug": bool(fn.debug)})


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
