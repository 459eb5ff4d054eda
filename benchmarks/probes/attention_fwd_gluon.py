"""Probe: the Gluon forward (``configs.ATTN_FWD_GLUON``, sm_90) against the Triton one and SDPA cuDNN.

    PYTHONPATH=. python3 benchmarks/probes/attention_fwd_gluon.py OUTDIR [SECTIONS]

bf16, D=128, the forward through ``ops.attention.fwd.attn_fwd`` (bf16 out, float32 lse).
SECTIONS (comma-separated, default all): ``check`` (each Gluon tile's output and lse against the
Triton kernel's and float64, at odd lengths, GQA and (B, S, H, D) views), ``time`` (TFLOP/s of
the Triton kernel, each Gluon tile and SDPA cuDNN on the bench's MHA grid and the model's GQA
layers; tiles that fail to run are recorded and skipped), ``few`` (``time`` at 1k full, 8k causal
and full, 32k full and the model's two layers), ``short`` (causal at 1k, 2k, 4k and 32k and the
model's three layers). Writes OUTDIR/probe.json.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from helpers import ROWS, bench, guard, rec, run_sections  # beside this file
from splitsoftmax.core import reference as ref
from splitsoftmax.ops.attention import fwd as A
from splitsoftmax.ops._triton import configs

# each consumer's tile and whether the launch is persistent (1: one program per SM), as
# BLOCK_MxBLOCK_NxWARPSxSTAGESxPERSISTENT in $TILES (comma-separated)
TILES = [tuple(int(x) for x in t.split("x")) for t in os.environ.get("TILES", "64x128x4x2x1,64x128x4x2x0").split(",")]
configs.LAUNCH_VERIFY = True
configs.ATTN_FWD_GLUON_MIN_SQ = (0, 0)


def make(B, H, HKV, S, views, sk=None, seed=0):
    """bf16 ``q (B, H, S, 128)``, ``k, v (B, HKV, sk, 128)``; ``views``: of ``(B, S, H, D)`` tensors."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def t(h, s):
        x = torch.randn(B, s, h, 128, device="cuda", generator=g).to(torch.bfloat16)
        return x.transpose(1, 2) if views else x.transpose(1, 2).contiguous()
    return t(H, S), t(HKV, sk or S), t(HKV, sk or S)


def fwd(q, k, v, causal, diag=0, tile=None):
    """``attn_fwd`` with the Gluon kernel at ``tile`` (one of TILES), or the Triton kernel (``tile`` None)."""
    configs.ATTN_FWD_GLUON = tile is not None
    if tile is not None:
        configs.ATTN_TILES[("fwd_gluon", 2, 128)] = tile[:4]
        configs.ATTN_FWD_GLUON_PERSISTENT = bool(tile[4])
    return A.attn_fwd(q, k, v, q.shape[-1] ** -0.5, causal, diag, out_dtype=torch.bfloat16)


def sec_check():
    """Max |out - float64| and |lse - float64| of each tile and of the Triton kernel."""
    cases = [(2, 8, 2, 1000, False, None, True, 0), (2, 8, 2, 1000, False, None, False, 0),
             (1, 16, 4, 777, True, None, True, 0), (4, 16, 4, 300, True, 1000, True, 700),
             (2, 8, 2, 640, False, 512, True, -100), (2, 4, 4, 4096, True, None, True, 0)]
    for B, H, HKV, S, views, sk, causal, diag in cases:
        q, k, v = make(B, H, HKV, S, views, sk)
        o64, l64 = ref.attention(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5, diag=diag)
        name = f"{B}x{H}/{HKV} {S}x{sk or S} {'views' if views else 'contig'} {'causal' if causal else 'full'} {diag}"
        for tile in [None] + TILES:
            def one():
                o, lse = fwd(q, k, v, causal, diag, tile)
                if tile is not None:
                    plan = A.plan(q, k, v, causal, diag)
                    assert A._gluon_fwd_tile(q, k, v, o, 1.0, causal, plan, False, False) == tile[:4]
                eo = (o.double() - o64).abs().max().item()
                fin = l64 > float("-inf")
                el = (lse.double() - l64)[fin].abs().max().item()
                empty_ok = bool((lse[~fin] == float("-inf")).all() and (o[~fin] == 0).all())
                row = dict(group="check " + name, name=str(tile), out_err=eo, lse_err=el, empty_ok=empty_ok,
                           nan=bool(o.isnan().any()))
                ROWS.append(row)
                print(row, flush=True)
            guard("check " + name, str(tile), one)


GRID = [(32768 // S, 16, 16, S, False, c) for S in (1024, 2048, 4096, 8192, 16384, 32768) for c in (True, False)]
MODEL = [(1, 16, 4, 8192, True, True), (4, 16, 4, 2048, True, True), (1, 32, 8, 8192, True, True)]


def sec_time(shapes=GRID + MODEL):
    """TFLOP/s at the bench's grid (H=16, B*S = 32k) and the model's GQA layers (views)."""
    for B, H, HKV, S, views, causal in shapes:
        q, k, v = make(B, H, HKV, S, views)
        flops = 4 * B * H * S * S * 128 / (2 if causal else 1)
        name = f"{B}x{H}/{HKV}x{S} {'views' if views else 'contig'} {'causal' if causal else 'full'}"
        base = fwd(q, k, v, causal)[0]
        for tile in [None] + TILES:
            def one():
                diff = (fwd(q, k, v, causal, 0, tile)[0].float() - base.float()).abs().max().item()
                rec(name, "triton" if tile is None else f"gluon {tile}",
                    bench(lambda: fwd(q, k, v, causal, 0, tile)), flops=flops, diff=diff)
            guard(name, str(tile), one)
        kr, vr = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            guard(name, "cudnn", lambda: rec(name, "sdpa cudnn", bench(
                lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)), flops=flops))


if __name__ == "__main__":
    run_sections({"check": sec_check, "time": sec_time,
                  "few": lambda: sec_time([GRID[1], GRID[6], GRID[7], GRID[11], MODEL[0], MODEL[1]]),
                  "short": lambda: sec_time([GRID[0], GRID[2], GRID[4], GRID[10], *MODEL])}, sys.argv)
