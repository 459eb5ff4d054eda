"""The torch path of the cross-entropy loss: the reference of ``ops.cross_entropy.kernel``'s
``ce_parts`` / ``ce_loss`` / ``ce_grad`` (same signatures), built on ``ops.attention.torch``'s per-row
statistics. float64 logits keep float64 statistics, sums and counts; other dtypes float32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..attention import torch as cpu


def ce_parts(logits: Tensor, target: Tensor, col0: int = 0, with_sum: bool = True) -> Tensor:
    """``(1, N, 4)``: the :func:`ops.attention.torch.ce_stats` of ``logits (N, V)`` as one slice."""
    return cpu.ce_stats(logits, target, col0, with_sum)[None]


def ce_loss(stats: Tensor, target: Tensor, ignore_index: int, smoothing: float, vocab: int, reduction: str,
            dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, lse (N,), count)`` from the statistics ``stats (P, N, 4)`` of ``P`` slices of the
    vocabulary (``vocab`` classes in all, label smoothing ``smoothing``).

    ``reduction="none"``: ``loss (N,)`` in ``dtype``, 0 where ``target == ignore_index``; ``count``
    is ``(0,)``. ``"sum"``: the sum of the row losses; ``"mean"``: that sum over ``count``, the number
    of rows not ignored (0 / 0 = NaN when every row is, like torch); both scalars in ``dtype``, summed
    in the statistics dtype; ``count`` a scalar of the statistics dtype.
    """
    loss, lse = cpu.ce_rows(stats, target, ignore_index, smoothing, vocab)
    if reduction == "none":
        return loss.to(dtype), lse, lse.new_empty(0)
    count = (target != ignore_index).sum().to(lse.dtype)
    total = loss.sum()
    return (total / count if reduction == "mean" else total).to(dtype), lse, count


def ce_grad(logits: Tensor, target: Tensor, lse: Tensor, g: Tensor, count: Tensor, col0: int, ignore_index: int,
            smoothing: float, vocab: int, reduction: str) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype`` of :func:`ce_loss` for this slice of the classes (its
    first global class ``col0``), from the gradient ``g`` of the loss (``(N,)`` for ``"none"``, else a
    scalar) and the saved ``lse (N,)`` and ``count``; exactly 0 in ignored rows."""
    coef = g.to(lse.dtype)
    if reduction == "mean":
        coef = coef / count
    coef = torch.where(target == ignore_index, 0.0, coef.expand(target.shape))
    return cpu.ce_bwd(logits, target, lse, coef, col0, smoothing, vocab)
