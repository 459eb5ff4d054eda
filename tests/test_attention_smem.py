"""Shared memory of the attention forward as compiled for sm_90 (Hopper), no GPU needed.

The short-causal tile (64x64, 4 warps, 3 stages) runs two programs per SM only while each needs
at most half of the SM's 228 KB, less the 1 KB the driver reserves per program; the long tile
(128x128, 8 warps, 3 stages) uses nearly all of it for one. A form of the forward 16 bytes over
that line lost a third of its speed at S=1k causal (docs/benchmarks/attention-forward.md, earlier history).
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU target: not under the interpreter", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from splitsoftmax.ops.attention import fwd as A  # noqa: E402
from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.ops.attention import decode  # noqa: E402

SM90_SMEM = 228 * 1024      # shared memory per SM
RESERVED = 1024             # per program, reserved by the driver
UNIT_STRIDES = ("s_qd", "s_kd", "s_vd", "s_od", "s_ls")
INTS = ("NH", "G", "Sq", "Sk", "diag", "chunk", "lo_off", "kstart", "GH")
MASK_PTRS = ("KVR", "QOFF", "ROWS")


def compile_forward(tile: tuple, causal: bool, **variant):
    """The TMA forward kernel (bf16, D = 128, row-view descriptors, output through a descriptor)
    compiled for sm_90 as a launch would specialise it (unit strides constant, the others and the
    pointers 16-byte aligned); ``variant``: the mask's constexprs (WINDOW, SOFTCAP, ...)."""
    bm, bn, warps, stages = tile
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(A._attn_fwd_kernel.arg_names):
        if name in ("Q", "O", "K", "V"):
            sig[name] = f"tensordesc<bf16[{bm if name in ('Q', 'O') else bn},128]>"
        elif name in UNIT_STRIDES:
            sig[name], consts[name] = "constexpr", 1
        elif name == "L" or name in MASK_PTRS or name.startswith("s_"):
            sig[name] = "*fp32" if name == "L" else "*i32" if name in MASK_PTRS else "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in INTS:
            sig[name] = "i32"
        elif name in ("qk_scale", "cap_in", "cap_out"):
            sig[name] = "fp32"
        else:
            sig[name] = "constexpr"
    consts.update(D=128, DV=128, BLOCK_D=128, BLOCK_DV=128, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, PACK=False,
                  ACC=False, POS_SCALE=True, PREC=decode.dot_precision(torch.bfloat16), TMA=True, O_TMA=True,
                  ROW2D=True, **variant)
    src = ASTSource(fn=A._attn_fwd_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


VARIANTS = [{}, dict(WINDOW=True), dict(SOFTCAP=True, SOFTCAP_APPROX=True),
            dict(WINDOW=True, KV_RANGE=True, Q_OFFSET=True, ROW_BOUNDS=True, SOFTCAP=True, SOFTCAP_APPROX=True)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(v) or "plain")
@pytest.mark.parametrize("kind,causal,programs", [("fwd_causal_short", True, 2), ("fwd", True, 1), ("fwd", False, 1)])
def test_programs_fit_an_sm(kind, causal, programs, variant):
    """The short-causal tile keeps two programs per SM; the long tile (128x128, 8 warps) fits one;
    so do the mask's variants (per-row key intervals, softcap)."""
    tile = configs.ATTN_TILES[(kind, 2, 128)]
    shared = compile_forward(tile, causal, **variant).metadata.shared
    assert programs * (shared + RESERVED) <= SM90_SMEM, f"{tile}: {shared} bytes of shared memory per program"
