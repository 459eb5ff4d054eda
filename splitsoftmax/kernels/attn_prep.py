"""The attention backward's row statistics in one pass: ``(lse, delta)`` from ``out``, ``dout``.

``delta = rowsum(dout * out) - dlse``; a row whose cotangents are all zero gets ``lse = -inf``
(the kernels' empty row, so it contributes nothing). Same math as ``cpu.attn_bwd_prep``; one read
of ``out`` and ``dout`` instead of several torch passes over float32 copies.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from . import configs
from .configs import ATTN_PREP_TILE_ELEMS


@triton.jit(do_not_specialize=["R"])
def _attn_bwd_prep_kernel(O, DO, LSE, DLSE, LSE_OUT, DELTA, R, DV: tl.constexpr, HAS_DLSE: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = tl.arange(0, BLOCK_DV)
    rmask = rows < R
    m = rmask[:, None] & (cols[None, :] < DV)
    offs = rows[:, None] * DV + cols[None, :]
    o = tl.load(O + offs, mask=m, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_DV]
    do = tl.load(DO + offs, mask=m, other=0.0).to(tl.float32)
    nz = do != 0.0
    delta = tl.sum(tl.where(nz, do * o, 0.0), 1)  # [BLOCK_R]; a zero cotangent ignores a NaN out
    active = tl.max(nz.to(tl.int32), 1) > 0
    if HAS_DLSE:
        dl = tl.load(DLSE + rows, mask=rmask, other=0.0)
        delta -= dl
        active = active | (dl != 0.0)
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    tl.store(LSE_OUT + rows, tl.where(active, lse, float("-inf")), mask=rmask)
    tl.store(DELTA + rows, delta, mask=rmask)


def attn_bwd_prep(out: Tensor, lse: Tensor, dout: Tensor, dlse: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(lse, delta)`` float32 ``(B, H, Sq)`` from ``out, dout (B, H, Sq, Dv)``, ``lse, dlse (B, H, Sq)``."""
    dv = out.shape[-1]
    o2, do2 = out.contiguous().view(-1, dv), dout.contiguous().view(-1, dv)
    lse1 = lse.float().contiguous().view(-1)
    lse_out, delta = torch.empty_like(lse1), torch.empty_like(lse1)
    rows = lse1.numel()
    if rows:
        block_dv = configs.next_pow2(max(dv, 1))
        block_r = max(1, min(configs.next_pow2(rows), ATTN_PREP_TILE_ELEMS // block_dv))
        dl = lse1 if dlse is None else dlse.float().contiguous().view(-1)
        _attn_bwd_prep_kernel[(configs.cdiv(rows, block_r),)](
            o2, do2, lse1, dl, lse_out, delta, rows, dv, dlse is not None, block_r, block_dv)
    return lse_out.view(lse.shape), delta.view(lse.shape)
