"""The sampling passes as compiled for sm_90 (Hopper), no GPU needed: no fused multiply-add in the
exact float math (the draw would differ from the torch path's by one rounding; the approximate
pivot rounds may use one, they decide nothing), the draw's bound from the special function unit,
and no register spills in the passes of a one-device draw and the sharded draw's records finisher."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU target: not under the interpreter", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import triton.language as tl  # noqa: E402
from _sm90 import ptxas_report, spill_stores  # noqa: E402

from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.ops.sampling import kernel as ks  # noqa: E402
from splitsoftmax.ops.sampling import config as sc  # noqa: E402
from splitsoftmax.ops.sampling import fused as kf  # noqa: E402
from splitsoftmax.ops.sampling import nucleus as kn  # noqa: E402
from splitsoftmax.ops.sampling.jit import _gumbel, _qmass  # noqa: E402


def _compile(kernel, types: dict, consts: dict, warps: int, options=None):
    """``kernel`` compiled for sm_90 as a launch specialises it: pointers, ``V`` and the row stride
    16-byte aligned."""
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if sig[n].startswith("*") or n in ("V", "s_xn")}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": 3, **(ks.LAUNCH if options is None else options)})


@triton.jit
def _exact_math(ZZ, W, D, KEY, Q, shift):
    """The element math of a draw: Gumbel keys and integer masses of 128 tokens."""
    i = tl.arange(0, 128)
    tl.store(KEY + i, _gumbel(tl.load(ZZ + i), tl.load(W + i)))
    tl.store(Q + i, _qmass(tl.load(D + i), shift))


def test_the_exact_math_has_no_fma():
    """Compiled as the kernels are launched, the keys and masses use no FMA; with contraction left
    on (Triton's default) they would."""
    types = dict(ZZ="*fp32", W="*u32", D="*fp32", KEY="*fp32", Q="*i64")
    ptx = _compile(_exact_math, types, {}, 4).asm["ptx"]
    assert "fma.rn" not in ptx
    assert "fma.rn" in _compile(_exact_math, types, {}, 4, options={"enable_fp_fusion": True}).asm["ptx"]



TYPES = dict(X="*fp32", PART="*i64", TIES="*i64", MOM="*fp32", CNT="*i32", SEED="*i64", OFFSET="*i64", XK="*fp32",
             MODE="*i64", PLANF="*fp32", OUT="*i64", CAND="*i64", CCOUNT="*i32", c="fp32", cmin="fp32",
             probit="fp32", slack="fp32", spread="fp32", growth="fp32", top_p="fp32", top_p_bits="i64")
RECORDS = dict(QP=32, TILE=sc.TILE, STAGES=sc.STAGES, FUSED=True, LARGE_K=False, GREEDY=False)
DRAW = dict(SHIFT4=0, TILE=sc.TILE, QP=512, CP=sc.SLOTS, STAGES=sc.STAGES, ROUNDS=sc.EXACT_ROUNDS, XTILE=sc.TILE_EXACT)
CASES = {
    "records, top-p": (kf._records_kernel, dict(TYPES, X="*bf16"), dict(RECORDS, KR=64, MOMENTS=True, TOP_P=True),
                       None),
    "records, top-k and top-p, few rows": (kf._records_kernel, TYPES, dict(RECORDS, TILE=sc.FEW_ROWS_TILE, KR=64,
                                                                         MOMENTS=False, TOP_P=True), None),
    "records, min-p alone": (kf._records_kernel, TYPES, dict(RECORDS, TILE=sc.FEW_ROWS_TILE, QP=512, KR=1,
                                                             MOMENTS=False, TOP_P=False), None),
    "records 256": (kf._records_kernel, TYPES, dict(RECORDS, QP=8, KR=256, MOMENTS=False, TOP_P=False), None),
    "pivots": (kf._pivot_kernel, dict(TYPES, PART="*fp32"), dict(TILE=sc.TILE, QP=512, STAGES=sc.STAGES, MORE=1),
               {"enable_fp_fusion": True}),
    "draw, top-p": (kf._draw_kernel, TYPES, dict(DRAW, EXACT_ROWS=True), None),
    "nucleus keys": (kn._nucleus_keys_kernel, dict(TYPES, NUC="*i64"),
                     dict(M=16, TILE=sc.TILE, QP=512, STAGES=sc.STAGES), None),
    "nucleus masses": (kn._nucleus_mass_kernel, dict(TYPES, NUC="*i64", PART="*fp32", slack="fp32"),
                       dict(M=16, TILE=sc.NUCLEUS_TILE, STAGES=sc.NUCLEUS_STAGES, ROUNDS=sc.EXACT_ROUNDS, DTILE=sc.TILE,
                            XTILE=sc.TILE_EXACT, ETILE=sc.NUCLEUS_TILE // 4, CP=sc.SLOTS), None),
}


# Spill stores (bytes) where a Triton version allocates a case's kernel beyond none: ptxas on
# Triton 3.8.0's PTX of the 256-candidate records kernel uses 128 registers a thread and reports
# "8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads" (one 64-bit value; 3.6.0, 3.7.1
# and 3.9.0 spill none of the same source).
SPILLS = {((3, 8), "records 256"): 8}


@pytest.mark.parametrize("name", list(CASES))
def test_no_spills(name):
    kernel, types, consts, options = CASES[name]
    report = ptxas_report(_compile(kernel, types, consts, sc.WARPS, options).asm["ptx"])
    assert spill_stores(report) <= SPILLS.get((configs.TRITON_VERSION, name), 0), report


@pytest.mark.parametrize("top_k", [False, True])
def test_sharded_records_finisher_compiles_without_spills(top_k):
    """The sharded draw's records finisher (four warps, as launched), with top-p and with a top-k
    beyond the records, shares its cut-offs with the one-device finisher: compiled for sm_90 it
    keeps everything in registers."""
    from splitsoftmax.ops.sampling import finish as kfin
    types = dict(PART="*i64", TIES="*i64", SEED="*i64", OFFSET="*i64", XK="*fp32", MODE="*i64", TOKEN="*i64",
                 XTHR="*fp64", ZMAX="*fp32", DTHR="*fp32", NEED="*fp64", B1="*i64", ORNG="*i64", COUNT="*i64",
                 MERGED="*i64", c="fp32", cmin="fp32", top_p_bits="i64")
    consts = dict(KR=64, QP=8, LARGE_K=top_k, GREEDY=False, TOP_P=True)
    report = ptxas_report(_compile(kfin._finish_records_kernel, types, consts, 4).asm["ptx"])
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report


def test_the_draw_bounds_keys_with_the_special_function_unit():
    """The draw's bound on the keys takes ``lg2.approx`` (one instruction), not libdevice's exact
    log2 (``tl.log2``: some 25), and no FMA (the exact keys and masses are the torch path's)."""
    kernel, types, consts, options = CASES["draw, top-p"]
    ptx = _compile(kernel, types, consts, sc.WARPS, options).asm["ptx"]
    assert "lg2.approx.ftz.f32" in ptx and "fma.rn" not in ptx
