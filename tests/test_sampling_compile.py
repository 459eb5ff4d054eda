"""The sampling passes as compiled for sm_90 (Hopper), no GPU needed: no fused multiply-add in the
exact float math (the draw would differ from the torch path's by one rounding; the device ``log2``
of the draw's pruning bound may use one, it decides nothing) and no register spills."""
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

import triton.language as tl  # noqa: E402

from splitsoftmax.kernels import configs  # noqa: E402
from splitsoftmax.kernels import sampling as ks  # noqa: E402
from splitsoftmax.kernels.sampling_jit import _gumbel, _qmass  # noqa: E402

PLAN = dict(MODE="*i64", XTHR="*fp64", ZMAX="*fp32", DTHR="*fp32", B1="*i64", ORNG="*i64", SEED="*i64",
            OFFSET="*i64", NEED="*fp64", COUNT="*i64", c="fp32", inv_w="fp32")


def _compile(kernel, types: dict, consts: dict, warps: int, options=None):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
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


def _ptxas_report(ptx: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                         text=True)
    os.unlink(f.name)
    assert out.returncode == 0, out.stderr
    return out.stderr


CASES = {
    "records": (ks._records_kernel, dict(X="*bf16", OUT="*i64", TIES="*i64"), dict(KR=64, G=configs.SAMPLE_GROUP), 4),
    "records 256": (ks._records_kernel, dict(X="*fp32", OUT="*i64", TIES="*i64"), dict(KR=256, G=configs.SAMPLE_GROUP),
                    8),
    "mass": (ks._mass_kernel, dict(PLAN, X="*bf16", Z="*i64", H="*i32"),
             dict(BINS=configs.SAMPLE_BINS, TILE=configs.SAMPLE_TILE), ks._warps(configs.SAMPLE_TILE)),
    "draw": (ks._sample_kernel, dict(PLAN, X="*fp32", BEST="*i64", A="*i64", CD="*fp32", CZ="*fp32", CW="*i64",
                                     CG="*i64", COUNT="*i32"),
             dict(SHIFT4=1, BINS=configs.SAMPLE_BINS, TILE=configs.SAMPLE_DRAW_TILE),
             ks._warps(configs.SAMPLE_DRAW_TILE)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_no_spills(name):
    kernel, types, consts, warps = CASES[name]
    report = _ptxas_report(_compile(kernel, types, consts, warps).asm["ptx"])
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
