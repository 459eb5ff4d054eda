"""Per-row decisions of sampling between the passes over the logits (torch, any device).

After each pass every rank holds the same merged records (they are exact: maxima of packed keys,
integer sums, sorted candidate lists), so these functions give the same plan on every rank and for
every split of the vocabulary. A row moves through the modes

- ``MASS``: top-p needs the total mass ``Z`` of the tokens kept by top-k (first round: ``Z`` and a
  histogram of ``d = log2(p / p_max)`` over ``bins`` bins of ``[-span, 0]``);
- ``REFINE``: the crossing of ``top_p * Z`` lies in a bracket holding more than ``cap`` tokens:
  the exact mass above it and the count and exact mass of each of its sub-bins (linear in the
  order keys of ``d``): the crossing sub-bin is the next bracket;
- ``COLLECT``: the sampling pass lists the bracket's tokens; the exact threshold follows from them;
- ``THRESH``: thresholds known, the sampling pass draws among the kept tokens;
- ``DONE``: the token is known (greedy, an invalid row, or every kept token among the records).

Top-p keeps the tokens with ``d >= tau``, ``tau`` the largest token value ``d`` such that the mass of
``{d >= tau}`` reaches ``top_p * Z`` (ties in ``d`` kept together); min-p keeps ``d >= log2(min_p)``;
top-k keeps ``x >= x_k``, the ``k``-th largest logit with ties.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from . import numerics as sm

DONE, THRESH, COLLECT, REFINE, MASS = 0, 1, 2, 3, 4
SENT_ID = 2 ** 63 - 1          # the id of a missing record (value -inf, after every real -inf)
INT32_LO, INT32_END = -(2 ** 31), 2 ** 31
SLACK_D = 2e-6                 # first-round bins: |error| of a token's bin edge in d
SLACK_Q = 4e-7                 # relative error of an integer mass against 2^d * 2^S (first round)


@dataclass
class Spec:
    """One sampling configuration: filters, constants and sizes (identical on every rank)."""
    greedy: bool
    top_k: int                 # 0: off
    top_p: float               # 1.0: off
    cmin: float                # float32 log2(min_p); -inf: off
    c: float                   # float32 log2(e) / T
    shift: int                 # S of the integer masses
    kr: int                    # records per row
    bins: int
    span: float
    cap: int


@dataclass
class RowPlan:
    """Per-row state between passes; ``(N,)`` tensors unless noted."""
    mode: Tensor               # int64
    token: Tensor              # int64, -1 until known
    xthr: Tensor               # float64: top-k keeps x >= xthr
    zmax: Tensor               # float32: zz of the largest logit
    dthr: Tensor               # float32: kept tokens have d >= dthr
    need: Tensor               # float64: top_p * Z
    b1: Tensor                 # (N, 2) int64: first-round bins of the bracket, inclusive
    orng: Tensor               # (N, 2) int64: order keys of d in the bracket, [lo, hi)
    count: Tensor              # int64: tokens in the bracket


def plain_plan(n: int, device) -> RowPlan:
    """Every row THRESH with no filter (plain sampling at a temperature)."""
    i64 = dict(dtype=torch.int64, device=device)
    return RowPlan(torch.full((n,), THRESH, **i64), torch.full((n,), -1, **i64),
                   torch.full((n,), sm.NEG_INF, dtype=torch.float64, device=device),
                   torch.zeros(n, dtype=torch.float32, device=device),
                   torch.full((n,), sm.NEG_INF, dtype=torch.float32, device=device),
                   torch.zeros(n, dtype=torch.float64, device=device),
                   torch.zeros((n, 2), **i64),
                   torch.stack((torch.full((n,), INT32_LO, **i64), torch.full((n,), INT32_END, **i64)), dim=1),
                   torch.zeros(n, **i64))


def merge_records(vals: Tensor, ids: Tensor, kr: int) -> tuple[Tensor, Tensor]:
    """The first ``kr`` of ``(vals, ids) (N, M)`` in the order (value descending, NaN first; id
    ascending), padded with missing records."""
    n, m = vals.shape
    if m < kr:
        vals = torch.cat((vals, vals.new_full((n, kr - m), sm.NEG_INF)), dim=1)
        ids = torch.cat((ids, ids.new_full((n, kr - m), SENT_ID)), dim=1)
    o = torch.argsort(ids, dim=1, stable=True)
    vals, ids = vals.gather(1, o), ids.gather(1, o)
    o = torch.argsort(vals, dim=1, descending=True, stable=True)[:, :kr]
    return vals.gather(1, o), ids.gather(1, o)


def count_equal(vals: Tensor, ids: Tensor, ties: Tensor, target: Tensor) -> Tensor:
    """Entries equal to ``target (N,)`` in partial records ``(N, Q, R)`` whose last values have
    ``ties (N, Q)`` entries in their slices: ``(N,)``, -1 where a needed tie count is unknown."""
    t = target.view(-1, 1, 1)
    in_rec = ((vals == t) & (ids != SENT_ID)).sum(dim=2)
    at_end = (ids[:, :, -1] != SENT_ID) & (vals[:, :, -1] == t[:, :, 0])
    unknown = (at_end & (ties < 0)).any(dim=1)
    return torch.where(unknown, -1, torch.where(at_end, ties, in_rec).sum(dim=1))


def merge_partials(vals: Tensor, ids: Tensor, ties: Tensor, kr: int) -> tuple[Tensor, Tensor, Tensor]:
    """Partial records ``(N, Q, R)`` with tie counts ``(N, Q)`` merged: ``(N, kr)`` and ``(N,)``."""
    n = vals.shape[0]
    mv, mi = merge_records(vals.reshape(n, -1), ids.reshape(n, -1), kr)
    t = count_equal(vals, ids, ties, mv[:, -1])
    return mv, mi, torch.where(mi[:, -1] == SENT_ID, 0, t)


def _winner(zz: Tensor, ids: Tensor, kept: Tensor, seed: Tensor, offset: Tensor) -> Tensor:
    """Packed best Gumbel key among the records ``kept`` (a prefix of each row of ``zz``, ``ids`` ``(N, R)``)."""
    if not zz.is_cuda and zz.shape[0]:
        width = max(1, int(kept.sum(dim=1).max()))   # noise only for the columns some row keeps
        zz, ids, kept = zz[:, :width], ids[:, :width], kept[:, :width]
    safe = torch.where(ids == SENT_ID, 0, ids)
    key = sm.gumbel_key(zz, sm.words_at(seed.unsqueeze(1), offset.unsqueeze(1), safe))
    return torch.where(kept, sm.pack(key, safe), sm.PACKED_NONE).amax(dim=1)


def token_of(packed: Tensor) -> Tensor:
    """The token id of a packed winner; -1 where there is none or its key is not finite."""
    ok = (packed != sm.PACKED_NONE) & torch.isfinite(sm.packed_key(packed))
    return torch.where(ok, sm.packed_gid(packed), -1)


def _tau(d: Tensor, q: Tensor, kept: Tensor, need: Tensor, extra_d: Tensor, extra_q: Tensor) -> Tensor:
    """The top-p threshold among sorted records (``d`` non-increasing, ``kept`` a prefix): the ``d``
    of the first record whose running mass (with ``extra_q`` more at ``d <= extra_d``) reaches
    ``need``; -inf where none does. The first record reaching it lies in the threshold's tie group."""
    cum = torch.cumsum(torch.where(kept, q, 0), dim=1)
    cum = cum + torch.where(d <= extra_d.unsqueeze(1), extra_q.unsqueeze(1), 0)
    ok = kept & (cum.to(torch.float64) >= need.unsqueeze(1))
    return torch.where(ok, d, sm.NEG_INF).amax(dim=1)


def after_records(vals_q: Tensor, ids_q: Tensor, ties_q: Tensor, spec: Spec, xk_large, seed: Tensor,
                  offset: Tensor) -> tuple[RowPlan, Tensor, Tensor]:
    """The plan from every rank's records ``(N, Q, kr)``: ``(plan, merged values, merged ids)``.

    ``xk_large``: the top-k threshold ``(N,)`` found outside the records (a top-k larger than
    them), or None."""
    vals, ids, _ = merge_partials(vals_q, ids_q, ties_q, spec.kr)
    n, dev = vals.shape[0], vals.device
    plan = plain_plan(n, dev)
    top = vals[:, 0]
    if spec.greedy:
        ok = ~torch.isnan(top) & (top > sm.NEG_INF)
        return replace(plan, mode=torch.full_like(plan.mode, DONE), token=torch.where(ok, ids[:, 0], -1)), vals, ids
    zmax = top.to(torch.float32) * sm.f32(spec.c, vals)
    bad = torch.isnan(top) | ~torch.isfinite(zmax)
    valid = ids != SENT_ID
    zz = vals.to(torch.float32) * sm.f32(spec.c, vals)
    d = zz - zmax.unsqueeze(1)
    q = torch.where(valid & ~bad.unsqueeze(1), sm.qmass(d, spec.shift), 0)
    xk, extra = _top_k(vals_q, ids_q, ties_q, vals, ids, spec, xk_large)
    keptk = valid & (vals >= xk.unsqueeze(1))
    dk = xk.to(torch.float32) * sm.f32(spec.c, vals) - zmax
    complete = ids[:, -1] == SENT_ID
    known = (extra >= 0) | complete
    extra = torch.clamp(extra, min=0)
    extra_q = extra * sm.qmass(dk, spec.shift)
    cmin = torch.full((n,), spec.cmin, dtype=torch.float32, device=dev)
    z = (q * keptk).sum(dim=1) + extra_q
    need = torch.tensor(spec.top_p, dtype=torch.float64) * z.to(torch.float64)
    if spec.top_p < 1.0:
        tau = _tau(d, q, keptk, need, torch.where(extra > 0, dk, sm.NEG_INF), extra_q)
        dthr = torch.where(known, torch.maximum(tau, cmin), cmin)
    else:
        dthr = cmin
    outside = torch.where(known, torch.where(extra > 0, dk, sm.NEG_INF), d[:, -1])
    outside = torch.where(vals[:, -1] < xk, sm.NEG_INF, outside)
    decided = ~(outside > sm.NEG_INF) | (outside < dthr)
    needs_mass = (spec.top_p < 1.0) & ~known
    mode = torch.where(bad, DONE, torch.where(needs_mass, MASS, torch.where(decided, DONE, THRESH)))
    win = _winner(zz, ids, keptk & (d >= dthr.unsqueeze(1)), seed, offset)
    token = torch.where(bad | (mode != DONE), -1, token_of(win))
    plan = replace(plan, mode=mode, token=token, xthr=xk, zmax=torch.where(bad, 0.0, zmax), dthr=dthr, need=need)
    return plan, vals, ids


def _top_k(vals_q, ids_q, ties_q, vals, ids, spec: Spec, xk_large) -> tuple[Tensor, Tensor]:
    """``(x_k (N,) float64, extra (N,))``: the top-k threshold (-inf: off) and the tokens equal to it
    beyond the merged records (-1: unknown, or the threshold came from outside the records)."""
    n = vals.shape[0]
    if xk_large is not None:
        return xk_large, torch.full((n,), -1, dtype=torch.int64, device=vals.device)
    if not spec.top_k:
        return vals.new_full((n,), sm.NEG_INF), torch.full((n,), -1, dtype=torch.int64, device=vals.device)
    xk = vals[:, spec.top_k - 1]
    total = count_equal(vals_q, ids_q, ties_q, xk)
    inside = ((vals == xk.unsqueeze(1)) & (ids != SENT_ID)).sum(dim=1)
    return xk, torch.where(total < 0, -1, total - inside)


def _first(ok: Tensor, default: int) -> Tensor:
    """Index of the first True along dim 1 of ``ok (N, B)``; ``default`` where there is none."""
    idx = torch.arange(ok.shape[1], device=ok.device).expand_as(ok)
    return torch.where(ok.any(dim=1), torch.where(ok, idx, ok.shape[1]).amin(dim=1), default)


def _bin1_bounds(spec: Spec, device) -> tuple[Tensor, Tensor]:
    """``(low, high)`` integer mass bounds ``(bins,)`` float64 of a token in each first-round bin."""
    w = spec.span / (spec.bins - 1)
    b = torch.arange(spec.bins, dtype=torch.float64, device=device)
    unit = 2.0 ** spec.shift
    lo = torch.floor(torch.exp2(-(b + 1) * w - SLACK_D) * unit * (1 - SLACK_Q)) - 1
    hi = torch.ceil(torch.exp2(-b * w + SLACK_D) * unit * (1 + SLACK_Q)) + 1
    lo[-1] = 0.0
    return lo.clamp_min(0), hi.clamp_max(unit * (1 + SLACK_Q) + 1)


def _to_bracket(plan: RowPlan, rows: Tensor, count: Tensor, spec: Spec, b1: Tensor, orng: Tensor) -> RowPlan:
    """Rows ``rows`` with a new bracket: COLLECT when it holds at most ``cap`` tokens, else REFINE."""
    mode = torch.where(rows, torch.where(count <= spec.cap, COLLECT, REFINE), plan.mode)
    return replace(plan, mode=mode, b1=torch.where(rows.unsqueeze(1), b1, plan.b1),
                   orng=torch.where(rows.unsqueeze(1), orng, plan.orng), count=torch.where(rows, count, plan.count))


def after_mass(plan: RowPlan, z: Tensor, hist: Tensor, vals: Tensor, ids: Tensor, spec: Spec, seed: Tensor,
               offset: Tensor) -> RowPlan:
    """MASS rows given ``Z (N,)`` and the first-round histogram ``(N, bins)``: the threshold from the
    records when the crossing lies among them, else the bracket of first-round bins."""
    rows = plan.mode == MASS
    need = torch.where(rows, torch.tensor(spec.top_p, dtype=torch.float64) * z.to(torch.float64), plan.need)
    valid = ids != SENT_ID
    zz = vals.to(torch.float32) * sm.f32(spec.c, vals)
    d = zz - plan.zmax.unsqueeze(1)
    keptk = valid & (vals >= plan.xthr.unsqueeze(1))
    q = torch.where(keptk, sm.qmass(d, spec.shift), 0)
    none = torch.full_like(plan.dthr, sm.NEG_INF)
    tau = _tau(d, q, keptk, need, none, torch.zeros_like(z))
    by_records = rows & (tau > d[:, -1])
    dthr = torch.where(by_records, torch.maximum(tau, plan.dthr), plan.dthr)
    win = _winner(zz, ids, keptk & (d >= dthr.unsqueeze(1)), seed, offset)
    plan = replace(plan, need=need, dthr=dthr, mode=torch.where(by_records, DONE, plan.mode),
                   token=torch.where(by_records, token_of(win), plan.token))
    lo, hi = _bin1_bounds(spec, z.device)
    low = torch.cumsum(hist.to(torch.float64) * lo, dim=1)
    high = torch.cumsum(hist.to(torch.float64) * hi, dim=1)
    first = _first(high >= need.unsqueeze(1), spec.bins - 1)
    last = torch.maximum(_first(low >= need.unsqueeze(1), spec.bins - 1), first)
    b = torch.arange(spec.bins, device=z.device)
    count = torch.where((b >= first.unsqueeze(1)) & (b <= last.unsqueeze(1)), hist, 0).sum(dim=1)
    w = spec.span / (spec.bins - 1)
    # the threshold is a token with a positive mass: d > -(shift + 1)
    d_lo = torch.where(last == spec.bins - 1, -(spec.shift + 1.0), -(last + 1).double() * w * (1 + 1e-5) - SLACK_D)
    d_hi = -first.double() * w * (1 - 1e-5) + SLACK_D
    orng = torch.stack((sm.ord32(d_lo.to(torch.float32)), sm.ord32(d_hi.to(torch.float32)) + 1), dim=1)
    wide = count > spec.cap
    orng = torch.where(wide.unsqueeze(1), orng, torch.tensor([INT32_LO, INT32_END], device=z.device))
    return _to_bracket(plan, rows & ~by_records, count, spec, torch.stack((first, last), dim=1), orng)


def _sub_edges(orng: Tensor, bins: int) -> Tensor:
    """``(N, bins + 1)`` int64 edges: sub-bin ``j`` holds order keys ``[e_j, e_{j+1})``."""
    lo, width = orng[:, :1], (orng[:, 1:] - orng[:, :1]).clamp_min(1)
    j = torch.arange(bins + 1, device=orng.device).unsqueeze(0)
    return lo + (j * width + bins - 1) // bins


def after_refine(plan: RowPlan, above: Tensor, hist: Tensor, hmass: Tensor, spec: Spec) -> RowPlan:
    """REFINE rows given the exact mass above the bracket ``(N,)``, the count and the exact mass of
    each of its sub-bins ``(N, bins)``: the new bracket is the sub-bin where the mass crosses."""
    rows = plan.mode == REFINE
    edges = _sub_edges(plan.orng, spec.bins)
    reach = above.unsqueeze(1) + torch.flip(torch.cumsum(torch.flip(hmass, [1]), dim=1), [1])  # sub-bins >= j
    ok = reach.to(torch.float64) >= plan.need.unsqueeze(1)
    j = (spec.bins - 1 - _first(torch.flip(ok, [1]), spec.bins - 1)).unsqueeze(1)
    count = hist.gather(1, j)[:, 0]
    orng = torch.cat((edges.gather(1, j), edges.gather(1, j + 1)), dim=1)
    single = rows & (count > spec.cap) & (orng[:, 1] - orng[:, 0] == 1)
    tau = sm.unord32(orng[:, 0].clamp(INT32_LO, INT32_END - 1))
    plan = replace(plan, mode=torch.where(single, THRESH, plan.mode),
                   dthr=torch.where(single, torch.maximum(tau, plan.dthr), plan.dthr))
    return _to_bracket(plan, rows & ~single, count, spec, plan.b1, orng)


def after_sample(plan: RowPlan, best: Tensor, above: Tensor, cand_d: Tensor, cand_k: Tensor, spec: Spec) -> Tensor:
    """Tokens ``(N,)``: DONE rows keep theirs; THRESH rows take the best key; COLLECT rows find
    the exact top-p threshold among the candidates ``(N, C)`` and take the best kept key."""
    if cand_k.shape[1] == 0:
        return torch.where(plan.mode == DONE, plan.token, token_of(best))
    valid = cand_k != sm.PACKED_NONE
    d_s, order = torch.sort(torch.where(valid, cand_d, sm.NEG_INF), dim=1, descending=True)
    v_s = valid.gather(1, order)
    q = torch.where(v_s, sm.qmass(d_s, spec.shift), 0)
    reach = (above.unsqueeze(1) + torch.cumsum(q, dim=1)).to(torch.float64) >= plan.need.unsqueeze(1)
    tau = torch.where(v_s & reach, d_s, sm.NEG_INF).amax(dim=1)
    thr = torch.maximum(tau, plan.dthr)
    inside = torch.where(valid & (cand_d >= thr.unsqueeze(1)), cand_k, sm.PACKED_NONE).amax(dim=1)
    win = torch.where(plan.mode == COLLECT, torch.maximum(best, inside), best)
    return torch.where(plan.mode == DONE, plan.token, token_of(win))
