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

from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .._triton import configs
from .._triton.configs import ATTN_PREP_TILE_ELEMS
from .._triton.launch import Launcher, Memo, auto_key, geometry, launch_bound


@triton.jit(do_not_specialize=["S", "s_lb", "s_lh", "s_gb", "s_gh"])
def _attn_bwd_prep_kernel(O, DO, LSE, DLSE, LSE_OUT, DELTA, s_ob, s_oh, s_os, s_db, s_dh, s_ds, s_lb, s_lh, s_ls,
                          s_gb, s_gh, s_gs, H, S, DV: tl.constexpr, HAS_DLSE: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_DV: tl.constexpr):
    """Grid ``(row blocks, B * H)``; ``out``, ``dout``, ``lse``, ``dlse`` any strides (unit last
    stride for the first two), the results contiguous ``(B, H, S)``."""
    b = (tl.program_id(1) // H).to(tl.int64)
    h = (tl.program_id(1) % H).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = tl.arange(0, BLOCK_DV)
    rmask = rows < S
    m = rmask[:, None] & (cols[None, :] < DV)
    o = tl.load(O + b * s_ob + h * s_oh + rows[:, None] * s_os + cols[None, :], mask=m, other=0.0).to(tl.float32)
    do = tl.load(DO + b * s_db + h * s_dh + rows[:, None] * s_ds + cols[None, :], mask=m, other=0.0).to(tl.float32)
    nz = do != 0.0
    delta = tl.sum(tl.where(nz, do * o, 0.0), 1)  # [BLOCK_R]; a zero cotangent ignores a NaN out
    active = tl.max(nz.to(tl.int32), 1) > 0
    if HAS_DLSE:
        dl = tl.load(DLSE + b * s_gb + h * s_gh + rows * s_gs, mask=rmask, other=0.0)
        delta -= dl
        active = active | (dl != 0.0)
    lse = tl.load(LSE + b * s_lb + h * s_lh + rows * s_ls, mask=rmask, other=0.0)
    dst = (b * H + h) * S + rows
    tl.store(LSE_OUT + dst, tl.where(active, lse, float("-inf")), mask=rmask)
    tl.store(DELTA + dst, delta, mask=rmask)


_PREP = Launcher(_attn_bwd_prep_kernel)
# bound launches by geometry
_LAUNCHES = Memo()


def _bind(out: Tensor, dout: Tensor, lse: Tensor, dl: Tensor, lse_out: Tensor, delta: Tensor, has_dlse: bool):
    """The prep launch for these operands, bound (:meth:`Launcher.bind`)."""
    b, h, s, dv = out.shape
    block_dv = configs.next_pow2(max(dv, 1))
    block_r = max(1, min(configs.next_pow2(s), ATTN_PREP_TILE_ELEMS // block_dv))
    scalars = (*out.stride()[:3], *dout.stride()[:3], *lse.stride(), *dl.stride(), h, s)
    args = (out, dout, lse, dl, lse_out, delta, *scalars)
    return _PREP.bind((configs.cdiv(s, block_r), b * h), auto_key(args), args,
                      dict(DV=dv, HAS_DLSE=has_dlse, BLOCK_R=block_r, BLOCK_DV=block_dv))


def attn_bwd_prep(out: Tensor, lse: Tensor, dout: Tensor, dlse: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(lse, delta)`` float32 ``(B, H, Sq)`` from ``out, dout (B, H, Sq, Dv)``, ``lse, dlse (B, H, Sq)``,
    any strides (a ``(B, H, S, Dv)`` view of ``(B, S, H, Dv)`` is read in place)."""
    b, h, s, _ = out.shape
    if out.stride(-1) != 1:
        out = out.contiguous()
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    lse_out = torch.empty((b, h, s), dtype=torch.float32, device=out.device)
    delta = torch.empty_like(lse_out)
    if lse_out.numel():
        lse1 = lse if lse.dtype == torch.float32 else lse.float()
        dl = lse1 if dlse is None else dlse if dlse.dtype == torch.float32 else dlse.float()
        # (lse_out, delta: fresh, 16-byte aligned, contiguous)
        geo = (geometry(out, dout, lse1, dl), dlse is not None)
        live = (out, dout, lse1, dl, lse_out, delta)
        launch_bound(_LAUNCHES, geo, _bind, (*live, dlse is not None), live)
    return lse_out, delta


def bound(out: Tensor, dout: Tensor, lse: Tensor):
    """The prep launch that a call of :func:`attn_bwd_prep` with these operands (``lse`` float32, no
    ``dlse``, ``out`` and ``dout`` of unit last stride) bound: ``launch(out, dout, lse, lse, lse_out,
    delta)``, or None where none has run at this geometry."""
    return _LAUNCHES.get((geometry(out, dout, lse, lse), False))
