"""The vocabulary-statistics kernels compile for sm_90 (Hopper) at their configured tiles, no GPU
needed, and leave room for at least four programs per SM (the forward streams the logits: its
bandwidth needs several programs' loads in flight on every SM)."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU target: not under the interpreter", allow_module_level=True)

from _sm90 import compile_sm90 as _compile  # noqa: E402

from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.ops.vocab import kernel as V  # noqa: E402

SM90_SMEM = 228 * 1024  # shared memory per SM
RESERVED = 1024         # per program, reserved by the driver
FLOATS = {"c", "inv_t"}


def compile_sm90(fn, pointers: dict, consts: dict, warps: int, stages: int):
    """``fn`` compiled for sm_90 as a launch on bf16 logits would specialise it (pointers and the
    row strides 16-byte aligned)."""
    aligned = [n for n in fn.arg_names if n.startswith("s_") or n == "V"]
    return _compile(fn, pointers, consts, warps, stages, floats=FLOATS, aligned=aligned)


KERNELS = {
    "stats forward": (V._vocab_fwd_kernel, dict(X="*bf16", T="*i64", REC="*fp32"), configs.VOCAB_FWD_TILE,
                      dict(TARGET=True, ENTROPY=True), True),
    "KL forward": (V._kl_fwd_kernel, dict(P="*bf16", Q="*bf16", REC="*fp32"), configs.VOCAB_KL_FWD_TILE, {}, True),
    "stats backward": (V._vocab_bwd_kernel, dict(X="*bf16", T="*i64", ROWS="*fp32", GL="*fp32", GH="*fp32",
                                                 DX="*bf16"), configs.VOCAB_BWD_TILE,
                       dict(TARGET=True, ENTROPY=True), False),
    "KL backward": (V._kl_bwd_kernel, dict(P="*bf16", Q="*bf16", ROWS="*fp32", G="*fp32", DP="*bf16", DQ="*bf16"),
                    configs.VOCAB_KL_BWD_TILE, {}, False),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_compiles_and_fits(name):
    fn, pointers, (block_v, _, warps, stages), consts, in_loop = KERNELS[name]
    consts = dict(consts, BLOCK_R=1, BLOCK_V=block_v, **({"STAGES": stages} if in_loop else {}))
    shared = compile_sm90(fn, pointers, consts, warps, 1 if in_loop else stages).metadata.shared
    assert 4 * (shared + RESERVED) <= SM90_SMEM, f"{name}: {shared} bytes of shared memory per program"
