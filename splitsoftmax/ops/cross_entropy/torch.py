"""The torch path of the cross-entropy loss: the reference of ``kernel.py``'s ``ce_stats`` /
``ce_rows`` / ``ce_bwd`` and ``ce_parts`` / ``ce_loss`` / ``ce_grad`` (same signatures), blockwise over
``CPU_BLOCK_COLS`` columns. float64 logits keep float64 statistics, sums and counts; other dtypes float32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...core.state import State, empty_state, lse_of, merge, stat_dtype, tile_state
from .._triton.configs import CPU_BLOCK_COLS


def ce_parts(logits: Tensor, target: Tensor, col0: int = 0, with_sum: bool = True) -> Tensor:
    """``(1, N, 4)``: the :func:`ce_stats` of ``logits (N, V)`` as one slice."""
    return ce_stats(logits, target, col0, with_sum)[None]


def ce_loss(stats: Tensor, target: Tensor, ignore_index: int, smoothing: float, vocab: int, reduction: str,
            dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, lse (N,), count)`` from the statistics ``stats (P, N, 4)`` of ``P`` slices of the
    vocabulary (``vocab`` classes in all, label smoothing ``smoothing``).

    ``reduction="none"``: ``loss (N,)`` in ``dtype``, 0 where ``target == ignore_index``; ``count``
    is ``(0,)``. ``"sum"``: the sum of the row losses; ``"mean"``: that sum over ``count``, the number
    of rows not ignored (0 / 0 = NaN when every row is, like torch); both scalars in ``dtype``, summed
    in the statistics dtype; ``count`` a scalar of the statistics dtype.
    """
    loss, lse = ce_rows(stats, target, ignore_index, smoothing, vocab)
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
    return ce_bwd(logits, target, lse, coef, col0, smoothing, vocab)


def ce_stats(logits: Tensor, target: Tensor, col0: int = 0, with_sum: bool = True) -> Tensor:
    """Cross-entropy row statistics of ``logits (N, V)``: ``(N, 4)`` = ``(m, l, x_t, sum_j x_j)``.

    ``(m, l)`` is the row's softmax state (merged block by block over V), ``x_t`` the logit of the
    global class ``target (N,)`` when it falls in this slice ``[col0, col0 + V)`` (else 0), and the
    last column the sum of the row (label smoothing needs it; 0 unless ``with_sum``). float32
    (float64 for float64 logits).
    """
    n, v = logits.shape
    dt = stat_dtype(logits.dtype)
    s = empty_state((n,), None, dtype=dt, device=logits.device)
    total = torch.zeros(n, dtype=dt, device=logits.device)
    for j in range(0, v, CPU_BLOCK_COLS):
        xb = logits[:, j:j + CPU_BLOCK_COLS].to(dt)  # [N, block]
        s = merge(s, tile_state(xb))
        if with_sum:
            total = total + xb.sum(-1)
    local = target - col0
    own = (local >= 0) & (local < v)
    xt = torch.zeros(n, dtype=dt, device=logits.device)
    if v:
        picked = logits.gather(1, torch.where(own, local, 0).unsqueeze(1)).squeeze(1).to(dt)
        xt = torch.where(own, picked, xt)
    return torch.stack((s.m, s.l, xt, total), dim=-1)


def merge_ce_stats(parts: Tensor) -> Tensor:
    """Merge cross-entropy statistics of column slices ``parts (P, N, 4)`` (rank/split order) -> ``(N, 4)``.

    ``(m, l)`` merge with the state algebra; ``x_t`` (non-zero on one slice only) and the row sums add.
    """
    from ...core.state import merge_stack
    s = merge_stack(State(parts[..., 0], parts[..., 1]))
    return torch.stack((s.m, s.l, parts[..., 2].sum(0), parts[..., 3].sum(0)), dim=-1)


def ce_rows(stats: Tensor, target: Tensor, ignore_index: int, smoothing: float, vocab: int) -> tuple[Tensor, Tensor]:
    """Per-row ``(loss (N,), lse (N,))`` from the statistics ``stats (P, N, 4)`` of ``P`` slices of the
    vocabulary (merged by :func:`merge_ce_stats`): ``loss = lse - (1 - eps) x_t - eps/V sum_j x_j``
    (torch's label smoothing over the global ``V = vocab``), 0 where ``target == ignore_index``."""
    merged = merge_ce_stats(stats)
    lse = lse_of(State(merged[:, 0], merged[:, 1]))
    loss = lse - (1.0 - smoothing) * merged[:, 2]
    if smoothing:
        loss = loss - (smoothing / vocab) * merged[:, 3]
    return torch.where(target == ignore_index, 0.0, loss), lse


def ce_bwd(logits: Tensor, target: Tensor, lse: Tensor, coef: Tensor, col0: int, smoothing: float,
           vocab: int) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype``: ``coef * (softmax - (1-eps) onehot(target) - eps/vocab)``.

    ``lse, coef (N,)``: the global logsumexp and the upstream gradient of each row's loss (0 for
    ignored rows, which get exactly 0); ``col0`` the global id of this slice's first class,
    ``vocab`` the global vocabulary size. Written block by block over V.
    """
    n, v = logits.shape
    dt = stat_dtype(logits.dtype)
    dx = torch.empty_like(logits)
    local = (target - col0).unsqueeze(1)
    c = coef.to(dt).unsqueeze(1)
    skip = c == 0
    for j in range(0, v, CPU_BLOCK_COLS):
        xb = logits[:, j:j + CPU_BLOCK_COLS].to(dt)  # [N, block]
        hit = local == torch.arange(j, j + xb.shape[1], device=logits.device)
        g = torch.exp(xb - lse.to(dt).unsqueeze(1)) - smoothing / vocab - (1.0 - smoothing) * hit.to(dt)
        dx[:, j:j + CPU_BLOCK_COLS] = torch.where(skip, 0.0, c * g).to(logits.dtype)
    return dx
