"""Torch path of the softmax-family local ops, blockwise, with the same signatures as the Triton
launchers (``kernel.py``). Each takes a 2-D view ``x (R, N)`` and reduces a row one block of
``CPU_BLOCK_COLS`` columns at a time with the state algebra of ``splitsoftmax.core.state``: outputs
in float32 statistics (float64 for float64 inputs).
"""
from __future__ import annotations

from typing import Hashable, Optional

import torch
from torch import Tensor

from ...core.state import NEG_INF, State, empty_state, lse_of, merge, safe_max, stat_dtype, tile_state
from .._triton.configs import CPU_BLOCK_COLS


def _row_state(x: Tensor) -> State:
    """``(m, l)`` of each row of ``x (R, N)``, merged block by block."""
    dt = stat_dtype(x.dtype)
    s = empty_state((x.shape[0],), None, dtype=dt, device=x.device)
    for j in range(0, x.shape[1], CPU_BLOCK_COLS):
        s = merge(s, tile_state(x[:, j:j + CPU_BLOCK_COLS].to(dt)))
    return s


def lse_rows(x: Tensor) -> Tensor:
    """Natural-log logsumexp of each row of ``x (R, N)``: ``(R,)`` float32 (float64 for float64)."""
    return lse_of(_row_state(x))


def normalize(x: Tensor, lse: Tensor, log: bool) -> Tensor:
    """``exp(x - lse)`` (softmax) or ``x - lse`` (log-softmax) in ``x.dtype``; empty rows give 0 / -inf."""
    xf = x.to(lse.dtype) - safe_max(lse).unsqueeze(-1)
    empty = (lse == NEG_INF).unsqueeze(-1)
    y = torch.where(empty, NEG_INF, xf) if log else torch.where(empty, 0.0, torch.exp(xf))
    return y.to(x.dtype)


def softmax_fwd(x: Tensor, log: bool) -> tuple[Tensor, Tensor]:
    """Softmax or log-softmax of each row of ``x (R, N)``: ``(y (R, N) x.dtype, lse (R,))``.

    Normalises with the row's ``(m, l)`` rather than the rounded ``lse``: ``exp(x - m) / l``.
    """
    s = _row_state(x)
    lse = lse_of(s)
    if log:
        return normalize(x, lse, log), lse
    inv_l = torch.where(s.l != 0, 1.0 / torch.where(s.l != 0, s.l, 1.0), 0.0)
    y = torch.exp(x.to(s.m.dtype) - safe_max(s.m).unsqueeze(-1)) * inv_l.unsqueeze(-1)
    return y.to(x.dtype), lse


def softmax_out(x: Tensor, log: bool, along: Optional[Hashable] = None) -> Tensor:
    """:func:`softmax_fwd`'s ``y`` alone (``along``, the Triton launcher's key of a later call, unused)."""
    return softmax_fwd(x, log)[0]


def softmax_rowsum(y: Tensor, dy: Tensor, log: bool) -> Tensor:
    """The row sum the backward needs: ``sum(dy * y)`` (softmax) or ``sum(dy)`` (log): ``(R,)``."""
    dt = stat_dtype(y.dtype)
    return dy.to(dt).sum(-1) if log else (dy.to(dt) * y.to(dt)).sum(-1)


def softmax_bwd(y: Tensor, dy: Tensor, lse: Tensor, log: bool, rowsum: Optional[Tensor] = None) -> Tensor:
    """``dx`` of (log-)softmax from its output ``y``; ``rowsum`` (global, for shards) defaults to local.

    Rows with ``lse = -inf`` (no finite input) get ``dx = 0``.
    """
    dt = stat_dtype(y.dtype)
    s = softmax_rowsum(y, dy, log) if rowsum is None else rowsum.to(dt)
    yf, dyf = y.to(dt), dy.to(dt)
    dx = dyf - torch.exp(yf) * s.unsqueeze(-1) if log else yf * (dyf - s.unsqueeze(-1))
    return torch.where((lse == NEG_INF).unsqueeze(-1), 0.0, dx).to(y.dtype)


def logsumexp_bwd(x: Tensor, lse: Tensor, g: Tensor) -> Tensor:
    """``dx = g * exp(x - lse)`` for ``x (R, N)``, ``lse, g (R,)``; 0 in empty rows."""
    p = normalize(x.to(lse.dtype), lse, log=False)
    return (p * g.to(lse.dtype).unsqueeze(-1)).to(x.dtype)
