"""Cross-entropy over (a slice of) the vocabulary in two Triton passes, never a float32 copy of the logits.

Forward (``ce_stats``): one read of each row chunk gives the chunk's softmax state ``(m, l)`` (the
softmax family's online statistics pass), the logit of the target class if the chunk holds it,
and with label smoothing the chunk's sum. A row is split into several chunks (programs) only when
there are too few rows to fill the GPU; the chunks' states are then merged by
``kernels.cpu.merge_ce_stats`` (the state algebra).

Rows (``ce_rows``): one small launch merges the statistics of every slice (ranks, for the sharded
loss), turns them into each row's loss and ``lse``, and checks the targets on the device.

Backward (``ce_bwd``): one read and one write per element,
``dx = coef * (exp(x - lse) - eps/V - (1-eps) [j == target])`` in the logits' dtype.

Same signatures and math as ``kernels.cpu.ce_stats`` / ``ce_rows`` / ``ce_bwd``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..local import interpreting
from .cpu import merge_ce_stats
from . import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from . import configs
from .configs import CE_BWD_TILE, CE_FWD_TILE, CE_INTERPRET_SMS, CE_PROGRAMS_PER_SM, CE_TILE_INTERPRET
from .decode import sm_count
from .launch import Launcher
from .softmax import _lse, _merge_states, _stats

LOG2E = tl.constexpr(1.4426950408889634)

@triton.jit(do_not_specialize=["col0", "s_sp", "s_sn"])
def _ce_fwd_kernel(X, T, STATS, V, col0, span, s_xn, s_sp, s_sn, BLOCK_V: tl.constexpr, STAGES: tl.constexpr,
                   SUM: tl.constexpr):
    """Grid ``(N, splits)``: ``(m, l, x_t, sum or 0)`` of columns ``[split * span, +span)`` of a row."""
    rows = tl.program_id(0) + tl.arange(0, 1)  # [1]
    split = tl.program_id(1)
    lo = split * span
    hi = tl.minimum(lo + span, V)
    xrow = X + rows.to(tl.int64) * s_xn  # [1]
    m, l, total = _stats(xrow[:, None], rows >= 0, lo, hi, BLOCK_V, STAGES, SUM)
    t = tl.load(T + rows) - col0
    own = (t >= lo) & (t < hi)
    xt = tl.load(xrow + tl.where(own, t, 0), mask=own, other=0.0).to(tl.float32)
    out = STATS + split * s_sp + rows * s_sn
    tl.store(out, m)
    tl.store(out + 1, l)
    tl.store(out + 2, xt)
    tl.store(out + 3, total)


@triton.jit(do_not_specialize=["N", "ignore_index"], debug=True)
def _ce_rows_kernel(STATS, T, LOSS, LSE, N, ignore_index, vocab, one_minus, smooth_v, P: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, CHECK: tl.constexpr):
    """Grid ``cdiv(N, BLOCK_R)``: merge the ``P`` slices' ``(m, l, x_t, sum)`` of each row (``STATS
    (P, N, 4)``) into its ``lse`` and loss ``lse - (1-eps) x_t - eps/V sum`` (0 for ignored rows).
    ``CHECK``: a target outside ``[0, vocab)`` that is not ``ignore_index`` fails a device assertion."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rmask = rows < N
    parts = tl.arange(0, BLOCK_P)  # [BLOCK_P]
    pmask = rmask[:, None] & (parts < P)[None, :]
    at = STATS + parts[None, :].to(tl.int64) * N * 4 + rows[:, None].to(tl.int64) * 4  # [BLOCK_R, BLOCK_P]
    m, l = _merge_states(tl.load(at, mask=pmask, other=float("-inf")), tl.load(at + 1, mask=pmask, other=0.0))
    xt = tl.sum(tl.load(at + 2, mask=pmask, other=0.0), axis=1)  # [BLOCK_R]
    total = tl.sum(tl.load(at + 3, mask=pmask, other=0.0), axis=1)
    lse = _lse(m, l)
    t = tl.load(T + rows, mask=rmask, other=ignore_index)
    if CHECK:
        tl.device_assert((t == ignore_index) | ((t >= 0) & (t < vocab)),
                         "target holds a class outside [0, V) that is not ignore_index")
    loss = lse - one_minus * xt - smooth_v * total
    tl.store(LOSS + rows, tl.where(t == ignore_index, 0.0, loss), mask=rmask)
    tl.store(LSE + rows, lse, mask=rmask)


@triton.jit
def _ce_grad(x, cols, t, lse, coef, smooth_v, one_minus):
    """``coef * (exp(x - lse) - eps/V - (1-eps) [col == t])`` of a tile ``x [BLOCK_V]``; 0 where coef is 0."""
    g = tl.math.exp2((x - lse) * LOG2E) - smooth_v - tl.where(cols == t, one_minus, 0.0)
    return tl.where(coef != 0, coef * g, 0.0)


@triton.jit(do_not_specialize=["col0", "smooth_v", "one_minus"])
def _ce_bwd_kernel(X, T, LSE, COEF, DX, V, col0, span, s_xn, s_dn, smooth_v, one_minus,
                   BLOCK_V: tl.constexpr):
    """Grid ``(N, splits)``: the gradient of columns ``[split * span, +span)`` of a row."""
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * span
    hi = tl.minimum(lo + span, V)
    coef = tl.load(COEF + row).to(tl.float32)
    lse = tl.load(LSE + row).to(tl.float32)
    t = tl.load(T + row) - col0
    xrow = X + row * s_xn
    drow = DX + row * s_dn
    lanes = tl.arange(0, BLOCK_V)  # [BLOCK_V]
    n_full = (hi - lo) // BLOCK_V
    for i in range(n_full):  # whole tiles: unmasked vector loads and stores
        cols = tl.multiple_of(lo + i * BLOCK_V, BLOCK_V) + lanes
        x = tl.load(xrow + cols).to(tl.float32)  # [BLOCK_V]
        g = _ce_grad(x, cols, t, lse, coef, smooth_v, one_minus)
        tl.store(drow + cols, g.to(DX.dtype.element_ty, fp_downcast_rounding="rtne"))
    cols = lo + n_full * BLOCK_V + lanes
    mask = cols < hi
    x = tl.load(xrow + cols, mask=mask, other=0.0).to(tl.float32)
    g = _ce_grad(x, cols, t, lse, coef, smooth_v, one_minus)
    tl.store(drow + cols, g.to(DX.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


_CE_FWD, _CE_ROWS, _CE_BWD = Launcher(_ce_fwd_kernel), Launcher(_ce_rows_kernel), Launcher(_ce_bwd_kernel)


def _splits(n: int, v: int, block_v: int, like: Tensor) -> tuple[int, int]:
    """``(splits, span)``: programs per row and the columns each covers (a multiple of ``block_v``)."""
    sms = CE_INTERPRET_SMS if interpreting() else sm_count(like)
    want = configs.cdiv(CE_PROGRAMS_PER_SM * sms, max(n, 1))
    splits = max(1, min(want, configs.cdiv(max(v, 1), block_v)))
    span = configs.cdiv(configs.cdiv(max(v, 1), splits), block_v) * block_v
    return configs.cdiv(max(v, 1), span), span


def ce_stats(logits: Tensor, target: Tensor, col0: int = 0, with_sum: bool = True) -> Tensor:
    """``(N, 4)`` float32 ``(m, l, x_t, sum_j x_j or 0)`` of ``logits (N, V)`` (unit stride along V).

    The row sum (label smoothing) costs a per-lane accumulator: only ``with_sum`` computes it.
    """
    n, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_v, warps, stages = CE_TILE_INTERPRET if interpreting() else CE_FWD_TILE
    splits, span = _splits(n, v, block_v, logits)
    parts = torch.empty((splits, n, 4), dtype=torch.float32, device=logits.device)
    if n:
        _CE_FWD.auto((n, splits), (logits, target.contiguous(), parts, v, col0, span, logits.stride(0),
                                   parts.stride(0), parts.stride(1)),
                     BLOCK_V=block_v, STAGES=stages, SUM=with_sum, num_warps=warps)
    return parts[0] if splits == 1 else merge_ce_stats(parts)


def ce_rows(stats: Tensor, target: Tensor, ignore_index: int, smoothing: float, vocab: int) -> tuple[Tensor, Tensor]:
    """``(loss (N,), lse (N,))`` float32 from the statistics ``stats (P, N, 4)`` of ``P`` slices of
    the vocabulary (see ``kernels.cpu.ce_rows``); targets are checked on the device."""
    p, n, _ = stats.shape
    loss = torch.empty(n, dtype=torch.float32, device=stats.device)
    lse = torch.empty_like(loss)
    if n:
        block_r = min(configs.next_pow2(n), max(1, 1024 // configs.next_pow2(p)))
        _CE_ROWS.auto((configs.cdiv(n, block_r),),
                      (stats.float().contiguous(), target.contiguous(), loss, lse, n, ignore_index, vocab,
                       1.0 - smoothing, smoothing / vocab),
                      P=p, BLOCK_R=block_r, BLOCK_P=configs.next_pow2(p), CHECK=True)
    return loss, lse


def ce_bwd(logits: Tensor, target: Tensor, lse: Tensor, coef: Tensor, col0: int, smoothing: float,
           vocab: int) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype`` (see ``kernels.cpu.ce_bwd``)."""
    n, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_v, warps, stages = CE_TILE_INTERPRET if interpreting() else CE_BWD_TILE
    splits, span = _splits(n, v, block_v, logits)
    dx = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    if n and v:
        _CE_BWD.auto((n, splits), (logits, target.contiguous(), lse.float().contiguous(), coef.float().contiguous(),
                                   dx, v, col0, span, logits.stride(0), dx.stride(0), smoothing / vocab,
                                   1.0 - smoothing),
                     BLOCK_V=block_v, num_warps=warps, num_stages=stages)
    return dx
