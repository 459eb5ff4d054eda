"""The softmax state and its merge: the one copy of the math every host-side path calls.

A state summarises a set of scores ``x_j`` (and, for attention, values ``v_j``) per row:

    m = max_j x_j                       running maximum
    l = sum_j exp(x_j - m)              normaliser relative to m
    o = sum_j exp(x_j - m) v_j          unnormalised numerator (optional)

all float32 (float64 when the inputs are float64). The empty set is ``(m=-inf, l=0, o=0)``
and is the identity of the merge

    m' = max_i m_i,   c_i = exp(m_i - m'),   l' = sum_i c_i l_i,   o' = sum_i c_i o_i.

``m' = -inf`` (every part empty) is guarded explicitly: the subtraction uses ``m' = 0`` there,
so ``c_i = exp(-inf) = 0`` instead of ``exp(-inf - -inf) = NaN``, and gradients stay finite.

At the edges a state travels as ``(out = o / l, lse = m + log l)``; the empty state is
``(out=0, lse=-inf)``. A partial whose ``lse`` is ``-inf`` contributes nothing, whatever its
``out`` holds (NaN included): ``from_out_lse`` zeroes it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

NEG_INF = float("-inf")


class State(NamedTuple):
    """Per-row softmax state. ``m, l``: ``(*rows)``; ``o``: ``(*rows, Dv)`` or ``None``."""

    m: Tensor
    l: Tensor
    o: Optional[Tensor] = None


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of ``dtype``: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def safe_max(m: Tensor) -> Tensor:
    """``m`` with ``-inf`` replaced by 0, the reference to subtract from in an empty row."""
    return torch.where(m == NEG_INF, torch.zeros((), dtype=m.dtype, device=m.device), m)


def empty_state(rows: tuple, dv: Optional[int], *, dtype=torch.float32, device=None) -> State:
    """The identity of the merge for ``rows`` rows (``dv=None``: no numerator)."""
    m = torch.full(rows, NEG_INF, dtype=dtype, device=device)
    l = torch.zeros(rows, dtype=dtype, device=device)
    o = None if dv is None else torch.zeros((*rows, dv), dtype=dtype, device=device)
    return State(m, l, o)


def merge_stack(s: State) -> State:
    """Merge N states stacked along dim 0 (``m, l: (N, *rows)``, ``o: (N, *rows, Dv)``)."""
    m = s.m.amax(dim=0)
    c = torch.exp(s.m - safe_max(m))  # (N, *rows); 0 for empty parts and in empty rows
    l = (c * s.l).sum(dim=0)
    o = None if s.o is None else (c.unsqueeze(-1) * s.o).sum(dim=0)
    return State(m, l, o)


def merge(a: State, b: State) -> State:
    """Merge two states (associative and commutative up to rounding)."""
    o = None if a.o is None else torch.stack((a.o, b.o))
    return merge_stack(State(torch.stack((a.m, b.m)), torch.stack((a.l, b.l)), o))


def weighted_sum(p: Tensor, x: Tensor) -> Tensor:
    """``p @ x`` (``p (*, r, n)``, ``x (*, n, d)``) where a weight of exactly 0 ignores its row of
    ``x`` even if that row holds NaN/Inf (a masked key changes nothing); a non-zero weight on a
    non-finite row makes the output row NaN."""
    bad = ~torch.isfinite(x).all(-1)  # (*, n)
    if not bad.any():
        return p @ x
    hit = ((p != 0) & bad.unsqueeze(-2)).any(-1, keepdim=True)  # (*, r, 1)
    return (p @ x.masked_fill(bad.unsqueeze(-1), 0.0)).masked_fill(hit, float("nan"))


def tile_state(scores: Tensor, values: Optional[Tensor] = None) -> State:
    """State of one tile of scores ``(*rows, n)`` (``-inf`` = masked), values ``(*, n, Dv)``."""
    m = scores.amax(dim=-1) if scores.shape[-1] else scores.new_full(scores.shape[:-1], NEG_INF)
    p = torch.exp(scores - safe_max(m).unsqueeze(-1))
    o = None if values is None else weighted_sum(p, values)
    return State(m, p.sum(dim=-1), o)


def lse_of(s: State) -> Tensor:
    """``m + log l``; ``-inf`` where the state is empty (l == 0); NaN stays NaN."""
    nonempty = s.l != 0
    return torch.where(nonempty, s.m + torch.log(torch.where(nonempty, s.l, 1.0)), NEG_INF)


def to_out_lse(s: State) -> tuple[Tensor, Tensor]:
    """``(out = o / l, lse)``; an empty row gives ``(0, -inf)``; NaN stays NaN."""
    nonempty = s.l != 0
    inv = torch.where(nonempty, 1.0 / torch.where(nonempty, s.l, 1.0), 0.0)
    return s.o * inv.unsqueeze(-1), lse_of(s)


def from_out_lse(out: Tensor, lse: Tensor) -> State:
    """State ``(m=lse, l=1, o=out)`` in float32; rows with ``lse=-inf`` become exactly empty."""
    dt = stat_dtype(out.dtype)
    lse = lse.to(dt)
    empty = lse == NEG_INF
    o = torch.where(empty.unsqueeze(-1), torch.zeros((), dtype=dt, device=out.device), out.to(dt))
    return State(lse, (~empty).to(dt), o)


def merge_out_lse(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """N-way merge of partial results: ``outs (N, *rows, Dv)``, ``lses (N, *rows)``.

    Returns ``(out, lse)`` with ``out`` in the accumulation dtype and ``lse`` float32/64.
    """
    return to_out_lse(merge_stack(from_out_lse(outs, lses)))


def merge_runner(outs: Tensor, lses: Tensor) -> None:
    """The torch path keeps no runner of a merge (the Triton merge's ``merge_runner``)."""
    return None


def sink_lse(lse: Tensor, mass: Tensor, sinks: Tensor) -> Tensor:
    """The ``lse`` of a row with its sink: the keys' state ``(m = lse, l = mass)`` merged with the sink's
    ``(m = sinks[h], l = 1)``. ``lse, mass (B, H, Sq)``, ``sinks (H,)``; in ``lse.dtype``."""
    sink = sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse)
    return lse_of(merge_stack(State(torch.stack((lse, sink)), torch.stack((mass.to(lse.dtype), torch.ones_like(lse))))))


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Merge one sink per head into final results ``out (B, H, Sq, Dv)``, ``lse (B, H, Sq)``: the
    partial ``(out = 0, lse = sinks[h])`` (a virtual key of value 0), once per row, after every key
    partial. ``lse`` becomes ``logaddexp(lse, sinks[h])`` and ``out`` scales by the merge's weight
    ``exp(lse - lse')`` of the key part (0 in rows that saw no key). Returns ``(out, lse)`` in the
    dtypes of ``out`` and ``lse``."""
    lse2 = sink_lse(lse, (lse != NEG_INF).to(lse.dtype), sinks)
    w = torch.where(lse == NEG_INF, 0.0, torch.exp(lse - safe_max(lse2)))
    return (out * w.unsqueeze(-1).to(out.dtype)), lse2


def sink_weights(lse: Tensor, sinks: Tensor) -> Tensor:
    """``p_sink = exp(sinks[h] - lse)`` ``(B, H, Sq)`` in ``lse.dtype``: the weight the sink took in
    each row of final ``lse`` (0 where ``lse = -inf``)."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    return torch.where(lse == NEG_INF, 0.0, torch.exp(sink - safe_max(lse)))


def sink_grad(lse: Tensor, delta: Optional[Tensor], sinks: Tensor, weighted: Optional[Tensor] = None) -> Tensor:
    """Gradient of the sinks ``(H,)`` (in ``sinks.dtype``) from the final ``lse`` and
    ``delta = rowsum(dout * out) - dlse`` ``(B, H, Sq)``: ``-sum_rows p_sink * delta``
    (:func:`sink_weights`).

    ``weighted (H,)``: ``sum_rows p_sink * rowsum(dout * out)`` already summed (by the backward
    kernels from their own ``P`` and ``dP = dout . v_j``, ``out`` never rounded); ``delta`` then
    holds ``-dlse`` alone (None: no ``dlse``) and the gradient is ``-(weighted + sum_rows p_sink *
    delta)``."""
    if delta is None:
        return (-weighted).to(sinks.dtype)
    total = (sink_weights(lse, sinks) * delta.to(lse.dtype)).sum((0, 2))
    return -(total if weighted is None else total + weighted.to(lse.dtype)).to(sinks.dtype)
