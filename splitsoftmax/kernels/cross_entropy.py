"""Cross-entropy over (a slice of) the vocabulary in two Triton passes, never a float32 copy of the logits.

Forward (``ce_stats``): one read of each row chunk gives the chunk's softmax state ``(m, l)``, the
logit of the target class if the chunk holds it, and the chunk's sum (for label smoothing). Each
lane keeps its own online ``(m, l)`` and the lanes are merged once at the end of the chunk. A row
is split into several chunks (programs) only when there are too few rows to fill the GPU; the
chunks' states are then merged by ``kernels.cpu.merge_ce_stats`` (the state algebra).

Backward (``ce_bwd``): one read and one write per element,
``dx = coef * (exp(x - lse) - eps/V - (1-eps) [j == target])`` in the logits' dtype.

Same signatures and math as ``kernels.cpu.ce_stats`` / ``ce_bwd``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..local import interpreting
from .cpu import merge_ce_stats
from . import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .configs import CE_BWD_TILE, CE_FWD_TILE, CE_INTERPRET_SMS, CE_PROGRAMS_PER_SM, CE_TILE_INTERPRET

LOG2E = tl.constexpr(1.4426950408889634)

@triton.jit(do_not_specialize=["V", "col0", "span", "s_xn", "s_sp", "s_sn"])
def _ce_fwd_kernel(X, T, STATS, V, col0, span, s_xn, s_sp, s_sn, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lo = split * span
    hi = tl.minimum(lo + span, V)
    xrow = X + row * s_xn
    lanes = tl.arange(0, BLOCK_V)  # [BLOCK_V]
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_V], tl.float32)
    total = tl.zeros([BLOCK_V], tl.float32)
    for j in range(0, span, BLOCK_V):
        cols = lo + j + lanes
        mask = cols < hi
        x = tl.load(xrow + cols, mask=mask, other=float("-inf")).to(tl.float32)  # [BLOCK_V]
        m_new = tl.maximum(m, x)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.math.exp2((m - m_use) * LOG2E) + tl.math.exp2((x - m_use) * LOG2E)
        m = m_new
        total += tl.where(mask, x, 0.0)
    # merge the lanes: the chunk's state
    m_row = tl.max(m, axis=0)
    m_row_use = tl.where(m_row == float("-inf"), 0.0, m_row)
    l_row = tl.sum(l * tl.math.exp2((m - m_row_use) * LOG2E), axis=0)
    t = tl.load(T + row) - col0
    own = (t >= lo) & (t < hi)
    xt = tl.load(xrow + tl.where(own, t, 0), mask=own, other=0.0).to(tl.float32)
    out = STATS + split * s_sp + row * s_sn
    tl.store(out, m_row)
    tl.store(out + 1, l_row)
    tl.store(out + 2, xt)
    tl.store(out + 3, tl.sum(total, axis=0))


@triton.jit(do_not_specialize=["V", "col0", "span", "s_xn", "s_dn", "smooth_v", "one_minus"])
def _ce_bwd_kernel(X, T, LSE, COEF, DX, V, col0, span, s_xn, s_dn, smooth_v, one_minus,
                   BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * span
    hi = tl.minimum(lo + span, V)
    coef = tl.load(COEF + row).to(tl.float32)
    lse = tl.load(LSE + row).to(tl.float32)
    t = tl.load(T + row) - col0
    lanes = tl.arange(0, BLOCK_V)  # [BLOCK_V]
    for j in range(0, span, BLOCK_V):
        cols = lo + j + lanes
        mask = cols < hi
        x = tl.load(X + row * s_xn + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_V]
        g = tl.math.exp2((x - lse) * LOG2E) - smooth_v - tl.where(cols == t, one_minus, 0.0)
        g = tl.where(coef != 0, coef * g, 0.0)
        tl.store(DX + row * s_dn + cols, g.to(DX.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _splits(n: int, v: int, block_v: int, device: torch.device) -> tuple[int, int]:
    """``(splits, span)``: programs per row and the columns each covers (a multiple of ``block_v``)."""
    sms = CE_INTERPRET_SMS if interpreting() else torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(CE_PROGRAMS_PER_SM * sms, max(n, 1))
    splits = max(1, min(want, triton.cdiv(max(v, 1), block_v)))
    span = triton.cdiv(triton.cdiv(max(v, 1), splits), block_v) * block_v
    return triton.cdiv(max(v, 1), span), span


def ce_stats(logits: Tensor, target: Tensor, col0: int = 0) -> Tensor:
    """``(N, 4)`` float32 ``(m, l, x_t, sum_j x_j)`` of ``logits (N, V)`` (unit stride along V)."""
    n, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_v, warps = CE_TILE_INTERPRET if interpreting() else CE_FWD_TILE
    splits, span = _splits(n, v, block_v, logits.device)
    parts = torch.empty((splits, n, 4), dtype=torch.float32, device=logits.device)
    if n:
        _ce_fwd_kernel[(n, splits)](logits, target.contiguous(), parts, v, col0, span, logits.stride(0),
                                    parts.stride(0), parts.stride(1), BLOCK_V=block_v, num_warps=warps)
    return parts[0] if splits == 1 else merge_ce_stats(parts)


def ce_bwd(logits: Tensor, target: Tensor, lse: Tensor, coef: Tensor, col0: int, smoothing: float,
           vocab: int) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype`` (see ``kernels.cpu.ce_bwd``)."""
    n, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_v, warps = CE_TILE_INTERPRET if interpreting() else CE_BWD_TILE
    splits, span = _splits(n, v, block_v, logits.device)
    dx = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    if n and v:
        _ce_bwd_kernel[(n, splits)](logits, target.contiguous(), lse.float().contiguous(),
                                    coef.float().contiguous(), dx, v, col0, span, logits.stride(0), dx.stride(0),
                                    smoothing / vocab, 1.0 - smoothing, BLOCK_V=block_v, num_warps=warps)
    return dx
