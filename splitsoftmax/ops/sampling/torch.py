"""Torch path of the sampling passes over a slice of the vocabulary, blockwise, the Triton kernels' twin.

Each pass reads ``logits (N, V_r)`` (this rank's columns ``[col0, col0 + V_r)`` of the global
vocabulary) one block of ``CPU_BLOCK_COLS`` columns at a time and returns per-row records that
merge exactly across blocks, tiles and ranks (maxima of packed keys, integer sums, the multiset of
candidates), so the result does not depend on how the columns were split:

- ``records``: the top-``kr`` ``(value, global id)`` in the order (value descending, id
  ascending), and the count of entries equal to the last one;
- ``mass``: the total integer mass ``Z`` and the bracket histogram of the first top-p round;
- ``refine``: the mass above a bracket and the histogram of its sub-bins;
- ``sample``: the best packed Gumbel key among the tokens surely kept, the mass above a bracket
  and the bracket's candidates.

The row plan (modes, thresholds, brackets) and how records merge are in ``splitsoftmax.ops.sampling.rows``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._triton import configs
from . import numerics as sm
from . import rows
from .rows import COLLECT, MASS, REFINE, THRESH, RowPlan, SENT_ID, merge_records, plain_plan  # noqa: F401


def _blocks(v: int):
    step = max(1, configs.CPU_BLOCK_COLS)
    return range(0, v, step) if v else range(0)


def records(x: Tensor, col0: int, kr: int, k_tie: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Partial records ``(values (N, 1, kr) float64, ids (N, 1, kr) int64, ties (N, 1) int64)`` of
    ``x (N, V_r)``: the top ``kr`` of the slice.

    Missing entries (fewer than ``kr`` columns) have value ``-inf`` and id ``SENT_ID``; ``ties`` counts
    the columns equal to the last value (0 when it is missing). ``k_tie`` is ignored (the Triton
    pass counts ties only when a top-k needs them; here they are always counted)."""
    n, v = x.shape
    vals = torch.full((n, 0), sm.NEG_INF, dtype=torch.float64, device=x.device)
    ids = torch.full((n, 0), SENT_ID, dtype=torch.int64, device=x.device)
    for lo in _blocks(v):
        blk = x[:, lo:lo + configs.CPU_BLOCK_COLS].to(torch.float64)
        bv, bi = torch.sort(blk, dim=1, descending=True, stable=True)
        vals = torch.cat((vals, bv[:, :kr]), dim=1)
        ids = torch.cat((ids, bi[:, :kr] + (col0 + lo)), dim=1)
        vals, ids = merge_records(vals, ids, kr)
    vals, ids = merge_records(vals, ids, kr)
    last = vals[:, -1:]
    ties = torch.zeros(n, dtype=torch.int64, device=x.device)
    for lo in _blocks(v):
        ties += (x[:, lo:lo + configs.CPU_BLOCK_COLS].to(torch.float64) == last).sum(dim=1)
    return vals.unsqueeze(1), ids.unsqueeze(1), torch.where(ids[:, -1] == SENT_ID, 0, ties).unsqueeze(1)


def local_merge(parts: tuple) -> tuple:
    """This rank's records are already one partial per row."""
    return parts


def merge_top(parts: tuple, k: int) -> tuple[Tensor, Tensor]:
    """The top ``k`` ``(values float64, ids)`` ``(N, k)`` of partial records ``(N, Q, kr)``."""
    vals, ids, _ = parts
    return merge_records(vals.flatten(1), ids.flatten(1), k)


def after_records(parts: tuple, spec, xk_large, seed: Tensor, offset: Tensor):
    """``(plan, merged records)`` from every rank's partial records (``sampling_rows.after_records``)."""
    plan, vals, ids = rows.after_records(*parts, spec, xk_large, seed, offset)
    return plan, (vals, ids)


def after_mass(plan: RowPlan, parts: tuple, recs: tuple, spec, seed: Tensor, offset: Tensor) -> RowPlan:
    z, hist = parts
    return rows.after_mass(plan, z.sum(dim=1), hist.sum(dim=1), *recs, spec, seed, offset)


def after_refine(plan: RowPlan, parts: tuple, spec) -> RowPlan:
    above, hist, hmass = parts
    return rows.after_refine(plan, above.sum(dim=1), hist.sum(dim=1), hmass.sum(dim=1), spec)


def after_sample(plan: RowPlan, parts: tuple, spec) -> Tensor:
    best, above, cand_d, cand_k = parts
    return rows.after_sample(plan, best.amax(dim=1), above.sum(dim=1), cand_d.flatten(1), cand_k.flatten(1), spec)


def _scaled(blk: Tensor, plan: RowPlan, rows: Tensor, c: float):
    """``(zz, d, kept_x)`` of a block's rows: scaled logits, ``zz - zz_max`` and the top-k test."""
    zz = blk.to(torch.float32) * sm.f32(c, blk)
    d = zz - plan.zmax[rows].unsqueeze(1)
    keep = blk.to(torch.float64) >= plan.xthr[rows].unsqueeze(1)
    return zz, d, keep


def bin1(d: Tensor, bins: int, span: float) -> Tensor:
    """First-round bin of ``d`` (int64): ``floor(-d * (bins - 1) / span)``, the last bin holding ``d <= -span``."""
    b = torch.floor(-d * sm.f32((bins - 1) / span, d))
    return torch.clamp(torch.nan_to_num(b, nan=bins - 1.0, posinf=bins - 1.0), 0, bins - 1).to(torch.int64)


def _bracket(d: Tensor, plan: RowPlan, rows: Tensor, bins: int, span: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(inside, above, order key)`` of a block against each row's bracket: first-round bins
    ``b1[0] <= bin <= b1[1]`` and order keys ``orng[0] <= ord32(d) < orng[1]``."""
    b = bin1(d, bins, span)
    o = sm.ord32(d)
    b1, orng = plan.b1[rows], plan.orng[rows]
    in_b1 = (b >= b1[:, :1]) & (b <= b1[:, 1:])
    inside = in_b1 & (o >= orng[:, :1]) & (o < orng[:, 1:])
    above = (b < b1[:, :1]) | (in_b1 & (o >= orng[:, 1:]))
    return inside, above, o


def _active(plan: RowPlan, *modes: int) -> Tensor:
    return torch.isin(plan.mode, torch.tensor(modes, device=plan.mode.device)).nonzero().flatten()


def mass(x: Tensor, col0: int, plan: RowPlan, c: float, shift: int, bins: int, span: float):
    """``(Z (N, 1) int64, hist (N, 1, bins) int64)`` for the rows in mode MASS: the integer mass of
    the columns that pass the top-k test and their first-round histogram (others: zeros)."""
    n, v = x.shape
    z = torch.zeros(n, dtype=torch.int64, device=x.device)
    hist = torch.zeros((n, bins), dtype=torch.int64, device=x.device)
    rows = _active(plan, MASS)
    for lo in _blocks(v):
        zz, d, keep = _scaled(x[rows, lo:lo + configs.CPU_BLOCK_COLS], plan, rows, c)
        z[rows] += torch.where(keep, sm.qmass(d, shift), 0).sum(dim=1)
        hist[rows] += torch.zeros_like(hist[rows]).scatter_add_(1, bin1(d, bins, span), keep.to(torch.int64))
    return z.unsqueeze(1), hist.unsqueeze(1)


def sub_bin(o: Tensor, orng: Tensor, bins: int) -> Tensor:
    """Refinement bin of order keys ``o`` in ``[orng[0], orng[1])``: ``(o - lo) * bins // (hi - lo)``."""
    lo, hi = orng[:, :1], orng[:, 1:]
    return torch.clamp((o - lo) * bins // torch.clamp(hi - lo, min=1), 0, bins - 1)


def refine(x: Tensor, col0: int, plan: RowPlan, c: float, shift: int, bins: int, span: float):
    """``(mass above (N, 1), hist (N, 1, bins), hist mass (N, 1, bins))`` int64 for the rows in mode REFINE:
    the integer mass above each row's bracket, the count and the integer mass of the bracket's
    columns in each sub-bin (others: zeros)."""
    n, v = x.shape
    above_mass = torch.zeros(n, dtype=torch.int64, device=x.device)
    hist = torch.zeros((n, bins), dtype=torch.int64, device=x.device)
    hmass = torch.zeros((n, bins), dtype=torch.int64, device=x.device)
    rows = _active(plan, REFINE)
    for lo in _blocks(v):
        zz, d, keep = _scaled(x[rows, lo:lo + configs.CPU_BLOCK_COLS], plan, rows, c)
        inside, above, o = _bracket(d, plan, rows, bins, span)
        q = sm.qmass(d, shift)
        above_mass[rows] += torch.where(keep & above, q, 0).sum(dim=1)
        sub = sub_bin(o, plan.orng[rows], bins)
        take = keep & inside
        hist[rows] += torch.zeros_like(hist[rows]).scatter_add_(1, sub, take.to(torch.int64))
        hmass[rows] += torch.zeros_like(hmass[rows]).scatter_add_(1, sub, torch.where(take, q, 0))
    return above_mass.unsqueeze(1), hist.unsqueeze(1), hmass.unsqueeze(1)


def sample(x: Tensor, col0: int, plan: RowPlan, seed: Tensor, offset: Tensor, c: float, shift: int, bins: int,
           span: float, cap: int):
    """The sampling pass over the rows in mode THRESH or COLLECT.

    Returns partials ``(best (N, 1) packed int64, mass above (N, 1) int64, cand_d (N, 1, cap) float32,
    cand_key (N, 1, cap) packed int64)``: THRESH rows take the best key among the
    columns kept by ``x >= xthr`` and ``d >= dthr`` (and any NaN, which makes the row's winner NaN);
    COLLECT rows take it among the columns above the bracket that pass both tests, sum their mass,
    and list the bracket's columns as candidates ``(d, packed key)``. ``seed``, ``offset``: ``(N,)`` int64.
    """
    n, v = x.shape
    dev = x.device
    best = torch.full((n,), sm.PACKED_NONE, dtype=torch.int64, device=dev)
    above_mass = torch.zeros(n, dtype=torch.int64, device=dev)
    cand_d = torch.full((n, cap), sm.NEG_INF, dtype=torch.float32, device=dev)
    cand_k = torch.full((n, cap), sm.PACKED_NONE, dtype=torch.int64, device=dev)
    count = torch.zeros(n, dtype=torch.int64, device=dev)
    rows = _active(plan, THRESH, COLLECT)
    collect = (plan.mode[rows] == COLLECT).unsqueeze(1)
    sd, off = seed[rows].unsqueeze(1), offset[rows].unsqueeze(1)
    for lo in _blocks(v):
        blk = x[rows, lo:lo + configs.CPU_BLOCK_COLS]
        zz, d, keep = _scaled(blk, plan, rows, c)
        g0 = col0 + lo
        gid = torch.arange(g0, g0 + blk.shape[1], device=dev).unsqueeze(0).expand_as(blk)
        packed = sm.pack(sm.gumbel_key(zz, sm.words(sd, off, g0, g0 + blk.shape[1])), gid)
        inside, above, _ = _bracket(d, plan, rows, bins, span)
        kept = keep & (d >= plan.dthr[rows].unsqueeze(1))
        win = torch.where(collect, kept & above, kept | torch.isnan(blk))
        best[rows] = torch.maximum(best[rows], torch.where(win, packed, sm.PACKED_NONE).amax(dim=1))
        above_mass[rows] += torch.where(collect & keep & above, sm.qmass(d, shift), 0).sum(dim=1)
        _collect(cand_d, cand_k, count, rows, collect & keep & inside, d, packed)
    return best.unsqueeze(1), above_mass.unsqueeze(1), cand_d.unsqueeze(1), cand_k.unsqueeze(1)


def _collect(cand_d: Tensor, cand_k: Tensor, count: Tensor, rows: Tensor, take: Tensor, d: Tensor,
             packed: Tensor) -> None:
    """Append the block's columns ``take`` (per row) after each row's ``count`` candidates."""
    pos = count[rows].unsqueeze(1) + torch.cumsum(take.to(torch.int64), dim=1) - 1
    r, j = take.nonzero(as_tuple=True)
    cand_d[rows[r], pos[r, j]] = d[r, j]
    cand_k[rows[r], pos[r, j]] = packed[r, j]
    count[rows] += take.sum(dim=1)
