"""Cross-entropy over (a slice of) the vocabulary in two Triton passes, never a float32 copy of the logits.

Forward (``ce_parts`` / ``ce_stats``): one read of each row chunk gives the chunk's softmax state
``(m, l)`` (the softmax family's online statistics pass), the logit of the target class if the
chunk holds it, and with label smoothing the chunk's sum. A row is split into several chunks
(programs) only when there are too few rows to fill the GPU.

Loss (``ce_loss``): one small launch merges the statistics of every chunk and slice (ranks, for the
sharded loss) with the state algebra, turns them into each row's ``lse`` and loss, checks the
targets on the device and, for ``reduction="sum"`` / ``"mean"``, sums the losses in float32 in a
fixed order (deterministic) and counts the rows not ignored: the loss leaves the kernel as the
scalar in the logits' dtype (beyond 16384 rows, per-program partial sums and a second launch).

Backward (``ce_grad``): one read and one write per element,
``dx = coef * (exp(x - lse) - eps/V - (1-eps) [j == target])`` in the logits' dtype, the row
coefficient (the loss gradient, over the count for ``"mean"``, 0 for ignored rows) computed in it.

``ce_stats`` / ``ce_rows`` / ``ce_bwd``: the signatures and math of ``torch.py``; ``ce_parts`` /
``ce_loss`` / ``ce_grad``: those of ``ops.cross_entropy.torch``.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...core.runtime import interpreting
from .torch import merge_ce_stats
from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .._triton import configs
from .._triton.algebra import LOG2E
from .._triton.configs import CE_BWD_TILE, CE_FWD_TILE, CE_INTERPRET_SMS, CE_PROGRAMS_PER_SM, CE_TILE_INTERPRET
from .._triton.device import sm_count
from .._triton.launch import Launcher
from ..softmax.kernel import _lse, _merge_states, _stats


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


@triton.jit
def _row_losses(STATS, T, rows, rmask, N, ignore_index, vocab, one_minus, smooth_v, P: tl.constexpr,
                BLOCK_P: tl.constexpr, CHECK: tl.constexpr):
    """``(loss, lse, kept)`` of ``rows [BLOCK_R]``: the ``P`` slices' ``(m, l, x_t, sum)`` of each row
    (``STATS (P, N, 4)``) merged into its ``lse`` and loss ``lse - (1-eps) x_t - eps/V sum``; ``kept``:
    rows in range and not ignored (the others' loss is 0). ``CHECK``: a target outside ``[0, vocab)``
    that is not ``ignore_index`` fails a device assertion."""
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
    kept = rmask & (t != ignore_index)
    return tl.where(kept, lse - one_minus * xt - smooth_v * total, 0.0), lse, kept


@triton.jit(do_not_specialize=["N", "ignore_index"], debug=True)
def _ce_rows_kernel(STATS, T, LOSS, LSE, N, ignore_index, vocab, one_minus, smooth_v, P: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, CHECK: tl.constexpr):
    """Grid ``cdiv(N, BLOCK_R)``: each row's loss (in ``LOSS``'s dtype) and ``lse`` (see ``_row_losses``)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rmask = rows < N
    loss, lse, _ = _row_losses(STATS, T, rows, rmask, N, ignore_index, vocab, one_minus, smooth_v, P, BLOCK_P,
                               CHECK)
    tl.store(LOSS + rows, loss.to(LOSS.dtype.element_ty, fp_downcast_rounding="rtne"), mask=rmask)
    tl.store(LSE + rows, lse, mask=rmask)


@triton.jit
def _finish(OUT, COUNT, total, kept, MEAN: tl.constexpr):
    """Store the count of kept rows (float32) and the sum of their losses, or with ``MEAN`` the
    mean (0 / 0 = NaN when every row is ignored, as torch), in ``OUT``'s dtype."""
    count = kept.to(tl.float32)
    if MEAN:
        total = tl.math.div_rn(total, count)
    tl.store(COUNT, count)
    tl.store(OUT, total.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"))


@triton.jit(do_not_specialize=["N", "ignore_index", "span"], debug=True)
def _ce_total_kernel(STATS, T, LSE, OUT, COUNT, PART, N, ignore_index, vocab, one_minus, smooth_v, span,
                     P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, CHECK: tl.constexpr,
                     MEAN: tl.constexpr, FINAL: tl.constexpr):
    """Grid ``cdiv(N, span)``: each row's ``lse`` and the float32 sum of the losses of rows
    ``[pid * span, +span)`` (a multiple of ``BLOCK_R``), in a fixed order; with ``FINAL`` (one
    program) the loss itself (``_finish``), else ``PART[pid] = (sum, kept rows)`` for ``_ce_finish_kernel``."""
    lo = tl.program_id(0) * span
    acc = tl.zeros([BLOCK_R], tl.float32)
    kept = tl.zeros([BLOCK_R], tl.int32)
    for start in range(lo, tl.minimum(lo + span, N), BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        rmask = rows < N
        loss, lse, keep = _row_losses(STATS, T, rows, rmask, N, ignore_index, vocab, one_minus, smooth_v, P,
                                      BLOCK_P, CHECK)
        tl.store(LSE + rows, lse, mask=rmask)
        acc += loss
        kept += keep.to(tl.int32)
    total = tl.sum(acc, axis=0)
    n_kept = tl.sum(kept, axis=0)
    if FINAL:
        _finish(OUT, COUNT, total, n_kept, MEAN)
    else:
        tl.store(PART + 2 * tl.program_id(0), total)
        tl.store(PART + 2 * tl.program_id(0) + 1, n_kept.to(tl.float32))


@triton.jit
def _ce_finish_kernel(PART, OUT, COUNT, G, MEAN: tl.constexpr, BLOCK_G: tl.constexpr):
    """One program: the ``G`` partial ``(sum, kept rows)`` of ``PART (G, 2)`` summed in a fixed order."""
    g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    total = tl.sum(tl.load(PART + 2 * g, mask=g < G, other=0.0), axis=0)
    kept = tl.sum(tl.load(PART + 2 * g + 1, mask=g < G, other=0.0).to(tl.int32), axis=0)
    _finish(OUT, COUNT, total, kept, MEAN)


@triton.jit
def _ce_grad(x, cols, t, lse, coef, smooth_v, one_minus):
    """``coef * (exp(x - lse) - eps/V - (1-eps) [col == t])`` of a tile ``x [BLOCK_V]``; 0 where coef is 0."""
    g = tl.math.exp2((x - lse) * LOG2E) - smooth_v - tl.where(cols == t, one_minus, 0.0)
    return tl.where(coef != 0, coef * g, 0.0)


@triton.jit(do_not_specialize=["col0", "ignore_index", "smooth_v", "one_minus"])
def _ce_bwd_kernel(X, T, LSE, G, COUNT, DX, V, col0, span, s_xn, s_dn, s_g, ignore_index, smooth_v, one_minus,
                   BLOCK_V: tl.constexpr, MEAN: tl.constexpr, IGNORE: tl.constexpr):
    """Grid ``(N, splits)``: the gradient of columns ``[split * span, +span)`` of a row, for the row
    loss gradient ``G[row * s_g]`` (``s_g = 0``: one for every row), divided by ``COUNT`` with
    ``MEAN``; with ``IGNORE`` 0 for rows whose target is ``ignore_index``."""
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * span
    hi = tl.minimum(lo + span, V)
    coef = tl.load(G + row * s_g).to(tl.float32)
    if MEAN:
        coef = tl.math.div_rn(coef, tl.load(COUNT))
    t = tl.load(T + row)
    if IGNORE:
        coef = tl.where(t == ignore_index, 0.0, coef)
    t = t - col0
    lse = tl.load(LSE + row).to(tl.float32)
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
_CE_TOTAL, _CE_FINISH = Launcher(_ce_total_kernel), Launcher(_ce_finish_kernel)

# the reduced loss (``_ce_total_kernel``): (rows per tile of one slice, num_warps), tiles per program and
# the most programs; one program up to 16384 rows, then one partial sum per program and a second launch.
# Small tiles under the interpreter, so that tests reach the row loop and the two-level sum.
CE_TOTAL_TILE = (4096, 8)
CE_TOTAL_INTERPRET = (4, 1)
CE_TOTAL_TILES_PER_PROGRAM = 4
CE_TOTAL_INTERPRET_TILES = 2
CE_TOTAL_MAX_PROGRAMS = 1024


def _splits(n: int, v: int, block_v: int, like: Tensor) -> tuple[int, int]:
    """``(splits, span)``: programs per row and the columns each covers (a multiple of ``block_v``)."""
    return _split_plan(n, v, block_v, CE_INTERPRET_SMS if interpreting() else sm_count(like))


@lru_cache(maxsize=1024)
def _split_plan(n: int, v: int, block_v: int, sms: int) -> tuple[int, int]:
    want = configs.cdiv(CE_PROGRAMS_PER_SM * sms, max(n, 1))
    splits = max(1, min(want, configs.cdiv(max(v, 1), block_v)))
    span = configs.cdiv(configs.cdiv(max(v, 1), splits), block_v) * block_v
    return configs.cdiv(max(v, 1), span), span


def ce_parts(logits: Tensor, target: Tensor, col0: int = 0, with_sum: bool = True) -> Tensor:
    """``(P, N, 4)`` float32: the :func:`ce_stats` of ``P`` column slices of each row of ``logits
    (N, V)`` (``P > 1`` when there are too few rows to fill the GPU), unmerged: :func:`ce_loss`
    merges them. The row sum (label smoothing) costs a per-lane accumulator: only ``with_sum``."""
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
    return parts


def ce_stats(logits: Tensor, target: Tensor, col0: int = 0, with_sum: bool = True) -> Tensor:
    """``(N, 4)`` float32 ``(m, l, x_t, sum_j x_j or 0)`` of ``logits (N, V)`` (see ``torch.ce_stats``)."""
    parts = ce_parts(logits, target, col0, with_sum)
    return parts[0] if parts.shape[0] == 1 else merge_ce_stats(parts)


def _rows(stats: Tensor, target: Tensor, loss: Tensor, lse: Tensor, ignore_index: int, smoothing: float,
          vocab: int) -> None:
    """Fill ``loss (N,)`` (its dtype) and ``lse (N,)`` from ``stats (P, N, 4)`` (``_ce_rows_kernel``)."""
    p, n, _ = stats.shape
    if n:
        block_r = min(configs.next_pow2(n), max(1, 1024 // configs.next_pow2(p)))
        _CE_ROWS.auto((configs.cdiv(n, block_r),),
                      (stats, target.contiguous(), loss, lse, n, ignore_index, vocab, 1.0 - smoothing,
                       smoothing / vocab),
                      P=p, BLOCK_R=block_r, BLOCK_P=configs.next_pow2(p), CHECK=True)


def ce_rows(stats: Tensor, target: Tensor, ignore_index: int, smoothing: float, vocab: int) -> tuple[Tensor, Tensor]:
    """``(loss (N,), lse (N,))`` float32 from the statistics ``stats (P, N, 4)`` of ``P`` slices of
    the vocabulary (see ``torch.ce_rows``); targets are checked on the device."""
    loss = torch.empty(stats.shape[1], dtype=torch.float32, device=stats.device)
    lse = torch.empty_like(loss)
    _rows(stats.float().contiguous(), target, loss, lse, ignore_index, smoothing, vocab)
    return loss, lse


def _total_plan(n: int, p: int) -> tuple[int, int, int, int]:
    """``(BLOCK_R, num_warps, span, programs)`` of ``_ce_total_kernel`` over ``n`` rows of ``p`` slices."""
    (block, warps), per = ((CE_TOTAL_INTERPRET, CE_TOTAL_INTERPRET_TILES) if interpreting()
                           else (CE_TOTAL_TILE, CE_TOTAL_TILES_PER_PROGRAM))
    block_r = min(configs.next_pow2(max(n, 1)), max(1, block // configs.next_pow2(p)))
    tiles = configs.cdiv(n, block_r)
    span = max(per, configs.cdiv(tiles, CE_TOTAL_MAX_PROGRAMS)) * block_r
    return block_r, warps, span, max(1, configs.cdiv(n, span))


def ce_loss(stats: Tensor, target: Tensor, ignore_index: int, smoothing: float, vocab: int, reduction: str,
            dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, lse (N,), count)`` from the statistics ``stats (P, N, 4)`` of ``P`` slices of the
    vocabulary (see ``ops.cross_entropy.torch.ce_loss``), the targets checked on the device.

    ``reduction="none"``: ``loss (N,)`` in ``dtype``, ``count (0,)``. ``"sum"`` / ``"mean"``: ``loss``
    a scalar in ``dtype`` (the float32 sum of the row losses, in a fixed order, or that sum over
    ``count``), ``count`` the float32 number of rows not ignored. One launch up to 16384 rows, then two.
    """
    if stats.dtype != torch.float32 or not stats.is_contiguous():
        stats = stats.float().contiguous()
    p, n, _ = stats.shape
    lse = torch.empty(n, dtype=torch.float32, device=stats.device)
    if reduction == "none":
        loss = torch.empty(n, dtype=dtype, device=stats.device)
        _rows(stats, target, loss, lse, ignore_index, smoothing, vocab)
        return loss, lse, lse.new_empty(0)
    out = torch.empty((), dtype=dtype, device=stats.device)
    count = torch.empty((), dtype=torch.float32, device=stats.device)
    block_r, warps, span, programs = _total_plan(n, p)
    part = torch.empty((programs, 2), dtype=torch.float32, device=stats.device) if programs > 1 else count
    mean = reduction == "mean"
    _CE_TOTAL.auto((programs,), (stats, target.contiguous(), lse, out, count, part, n, ignore_index, vocab,
                                 1.0 - smoothing, smoothing / vocab, span),
                   P=p, BLOCK_R=block_r, BLOCK_P=configs.next_pow2(p), CHECK=True, MEAN=mean,
                   FINAL=programs == 1, num_warps=warps)
    if programs > 1:
        _CE_FINISH.auto((1,), (part, out, count, programs), MEAN=mean, BLOCK_G=configs.next_pow2(programs))
    return out, lse, count


def _grad(logits: Tensor, target: Tensor, lse: Tensor, g: Tensor, s_g: int, count: Tensor, col0: int,
          ignore_index: int, smoothing: float, vocab: int, mean: bool, ignore: bool) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype`` through ``_ce_bwd_kernel`` (its docstring has the arguments)."""
    n, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_v, warps, stages = CE_TILE_INTERPRET if interpreting() else CE_BWD_TILE
    splits, span = _splits(n, v, block_v, logits)
    dx = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    if n and v:
        _CE_BWD.auto((n, splits), (logits, target.contiguous(), lse, g, count, dx, v, col0, span, logits.stride(0),
                                   dx.stride(0), s_g, ignore_index, smoothing / vocab, 1.0 - smoothing),
                     BLOCK_V=block_v, MEAN=mean, IGNORE=ignore, num_warps=warps, num_stages=stages)
    return dx


def ce_grad(logits: Tensor, target: Tensor, lse: Tensor, g: Tensor, count: Tensor, col0: int, ignore_index: int,
            smoothing: float, vocab: int, reduction: str) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype`` of the :func:`ce_loss` of this slice of the classes
    (see ``ops.cross_entropy.torch.ce_grad``): one launch, the per-row coefficient computed in it."""
    mean = reduction == "mean"
    return _grad(logits, target, lse, g, g.stride(0) if g.dim() else 0, count if mean else lse, col0,
                 ignore_index, smoothing, vocab, mean, True)


def ce_bwd(logits: Tensor, target: Tensor, lse: Tensor, coef: Tensor, col0: int, smoothing: float,
           vocab: int) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype`` (see ``torch.ce_bwd``)."""
    return _grad(logits, target, lse.float().contiguous(), coef, coef.stride(0), lse, col0, 0, smoothing, vocab,
                 False, False)
