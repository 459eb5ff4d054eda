"""Top-p alone on one device, by candidates: the row's best Gumbel keys, then which of them top-p keeps.

A draw takes the kept token with the largest exact key, and top-p keeps an upper set in ``d``: token
``j`` is kept iff the integer mass of the tokens with ``d > d_j`` is below ``top_p * Z``
(``sampling_rows``: ``tau`` is the ``d`` of the first token, descending, whose running mass reaches
it). So the token drawn is the first of the row's tokens in descending key order that passes that
test, and two passes settle a row whose ``M`` best keys hold a kept token:

- ``_nucleus_keys_kernel``: each span's ``M`` best exact keys and its largest logit. Per position the
  three best bounded keys (``_approx_noise``) and the columns of the first two; the exact keys of
  those within the bound's margin of the span's ``M``-th bounded key (a third within it at one
  position, rare, rescans the span with exact keys). The row's last program merges them: the row's
  ``M`` best keys (``NUC``), ``zmax`` and the candidates' ``d`` (the plan's pivot fields); an invalid
  row (NaN, ``+inf`` or all ``-inf``) draws -1, a best candidate at ``d = 0`` is drawn at once.
- ``_nucleus_mass_kernel``: each span's ``Z`` and, per candidate, the mass of ``d > d_i``, in float32
  (``2^d``: a column costs about a read); the last program draws the first candidate top-p keeps
  where the approximate masses decide it beyond their error bound, else it computes the exact
  integer masses over the row alone (rare: a candidate's mass above lies within that bound of
  ``top_p * Z``). Each candidate lies outside the kept set with probability at most ``1 - top_p``
  given those before it, so a row finds none with probability at most ``(1 - top_p)^M`` (the host
  picks ``M``); it takes the exact rounds over the whole row by that program
  (``sampling_fused._exact_row``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .decide import _range_pivots
from .finish import _token
from .fused import INTS, _exact_row, _last
from .jit import (DONE, EXACT, F_DTHR, F_PIV, F_RHI, F_RLO, F_XTHR, F_ZMAX, NEG_INF, NONE, PIVOTS, PLAN_W, POS_INF, U32,
                  _ord32, _seed_of, _unord32)
from .span import _approx_noise, _draw_tile, _exact_at, _exact_key, _pivot_span, _row_seed

NUCLEUS = tl.constexpr(5)          # the row mode between the two passes (after sampling_jit's modes)
NAN_FLAG = tl.constexpr(1 << 40)   # a span's NaN mark in its partial's logit word (above any int32 bits)


@triton.jit
def _insert3(ap, col, a1, i1, a2, i2, a3):
    """Bounded keys ``ap`` at columns ``col`` into each position's best three (columns of the first two)."""
    g1 = ap > a1
    g2 = ap > a2
    a3 = tl.where(g2, a2, tl.where(ap > a3, ap, a3))
    a2n = tl.where(g1, a1, tl.where(g2, ap, a2))
    i2 = tl.where(g1, i1, tl.where(g2, col, i2))
    return tl.where(g1, ap, a1), tl.where(g1, col, i1), a2n, i2, a3


@triton.jit
def _mth(a, M: tl.constexpr):
    """The ``M``-th largest entry of ``a`` counted with repeats (-inf if fewer are finite)."""
    t = tl.sum(tl.zeros([1], tl.float32), axis=0) + NEG_INF
    k = tl.sum(tl.zeros([1], tl.int32), axis=0)
    for _ in range(M):
        if k < M:
            t = tl.max(tl.max(a, axis=1), axis=0)
            k += tl.sum(tl.sum((a == t).to(tl.int32), axis=1), axis=0)
            a = tl.where(a == t, NEG_INF, a)
    return tl.where(k >= M, t, NEG_INF)


@triton.jit
def _best_m(e1, e2, M: tl.constexpr):
    """The ``M`` largest packed keys of ``e1`` and ``e2`` (distinct but for NONE), descending ``[M]``."""
    ki = tl.arange(0, M)
    rec = tl.full([M], NONE, tl.int64)
    for j in range(M):
        m = tl.maximum(tl.max(tl.max(e1, axis=1), axis=0), tl.max(tl.max(e2, axis=1), axis=0))
        rec = tl.where(ki == j, m, rec)
        e1 = tl.where(e1 == m, NONE, e1)
        e2 = tl.where(e2 == m, NONE, e2)
    return rec


@triton.jit
def _rescan_m(X, lo, hi, V, c, seed, off, floor, M: tl.constexpr, TILE: tl.constexpr):
    """The span's ``M`` best exact keys among the columns whose bounded key reaches ``floor``, one
    pass each (the rare path: three such keys at one position)."""
    ki = tl.arange(0, M)
    rec = tl.full([M], NONE, tl.int64)
    prev = tl.sum(tl.zeros([1], tl.int64), axis=0) + 0x7FFFFFFFFFFFFFFF
    for j in range(M):
        best = tl.full([TILE // 4, 4], NONE, tl.int64)
        for u0 in range(lo, hi, TILE):
            cols, valid, x, zz, d, keep, word = _draw_tile(X, u0, 0, V, 0, c, 0.0, NEG_INF, seed, off, TILE)
            near = keep & (zz + _approx_noise(word) >= floor)
            k = tl.where(near, _exact_key(zz, word, cols), NONE)
            best = tl.maximum(best, tl.where(k < prev, k, NONE))
        prev = tl.max(tl.max(best, axis=1), axis=0)
        rec = tl.where(ki == j, prev, rec)
    return rec


@triton.jit
def _keys_span(X, lo, hi, V, c, seed, off, M: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr):
    """``(the span's M best exact keys [M] descending, its largest non-NaN logit, whether it holds NaN)``."""
    Q4: tl.constexpr = TILE // 4
    a1 = tl.full([Q4, 4], NEG_INF, tl.float32)
    a2 = a1
    a3 = a1
    xm = a1
    i1 = tl.zeros([Q4, 4], tl.int32)
    i2 = i1
    nan = i1
    for u0 in tl.range(lo, hi, TILE, num_stages=STAGES):
        cols, valid, x, zz, d, keep, word = _draw_tile(X, u0, 0, V, 0, c, 0.0, NEG_INF, seed, off, TILE)
        ap = tl.where(keep, zz + _approx_noise(word), NEG_INF)          # keep: valid and not NaN
        a1, i1, a2, i2, a3 = _insert3(ap, cols, a1, i1, a2, i2, a3)
        xm = tl.maximum(xm, tl.where(keep, x, NEG_INF))
        nan = tl.maximum(nan, (valid & (x != x)).to(tl.int32))
    t = _mth(a1, M)
    floor = t - (4e-3 + tl.abs(t) * 2e-6)
    third = tl.max(tl.max(((a3 >= floor) & (a3 > NEG_INF)).to(tl.int32), axis=1), axis=0)
    if third > 0:
        rec = _rescan_m(X, lo, hi, V, c, seed, off, floor, M, TILE)
    else:
        e1 = _exact_at(X, (a1 >= floor) & (a1 > NEG_INF), i1, 0, c, seed, off)
        e2 = _exact_at(X, (a2 >= floor) & (a2 > NEG_INF), i2, 0, c, seed, off)
        rec = _best_m(e1, e2, M)
    return rec, tl.max(tl.max(xm, axis=1), axis=0), tl.max(tl.max(nan, axis=1), axis=0)


@triton.jit(do_not_specialize=INTS + ["c"])
def _nucleus_keys_kernel(X, PART, CNT, MODE, PLANF, NUC, OUT, SEED, seed_ptr, seed_lo, seed_hi, OFFSET, off_ptr,
                         off_lo, off_hi, V, tiles, s_xn, Q, c, M: tl.constexpr, TILE: tl.constexpr,
                         QP: tl.constexpr, STAGES: tl.constexpr):
    """Grid ``(N, Q)``: the span's ``M`` best exact keys and its logit word (``PART [N, Q, M + 1]``:
    the largest logit's float32 bits, ``NAN_FLAG`` if the span holds NaN); last, the row's candidates
    (``NUC [N, M]``, their ``d`` at the plan's pivots, ``zmax``), mode NUCLEUS, or the token."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    seed = _row_seed(SEED, row, seed_ptr, seed_lo, seed_hi)
    off = _seed_of(OFFSET, row, off_ptr, off_lo, off_hi)
    xrow = X + row * s_xn
    lo = split * tiles * TILE
    hi = tl.minimum(lo + tiles * TILE, V)
    rec, xmax, nan = _keys_span(xrow, lo, hi, V, c, seed, off, M, TILE, STAGES)
    part = PART + (row * Q + split) * (M + 1)
    ki = tl.arange(0, M)
    tl.store(part + ki, rec)
    tl.store(part + M, (xmax.to(tl.int32, bitcast=True).to(tl.int64) & U32) | tl.where(nan > 0, NAN_FLAG, 0))
    if _last(CNT, row, Q):
        qi = tl.arange(0, QP)
        ok = qi < Q
        keys = tl.load(PART + (row * Q + qi[:, None]) * (M + 1) + ki[None, :], mask=ok[:, None], other=NONE,
                       cache_modifier=".cg")
        word = tl.load(PART + (row * Q + qi) * (M + 1) + M, mask=ok, other=0xFF800000, cache_modifier=".cg")
        xs = (word & U32).to(tl.int32).to(tl.float32, bitcast=True)
        bad_nan = tl.max((word >= NAN_FLAG).to(tl.int32), axis=0) > 0
        zmax = tl.max(xs, axis=0) * c
        cand = _best_m(keys, tl.full([QP, M], NONE, tl.int64), M)
        gid = U32 - (cand & U32)
        valid = cand != NONE
        zz = tl.load(xrow + gid, mask=valid, other=0.0).to(tl.float32) * c
        d = tl.where(valid, zz - zmax, POS_INF)
        bad = bad_nan | ~(tl.abs(zmax) < float("inf"))
        at_top = tl.sum(tl.where(ki == 0, d, 0.0), axis=0) == 0.0      # the best key's token has p = p_max
        p = PLANF + row * PLAN_W
        tl.store(p + F_ZMAX, tl.where(bad, 0.0, zmax))
        tl.store(p + F_PIV + ki, d)
        tl.store(NUC + row * M + ki, cand)
        tl.store(OUT + row, tl.where(bad, -1, tl.where(at_top, _token(tl.max(cand, axis=0)), -1)))
        tl.store(MODE + row, tl.where(bad | at_top, DONE, NUCLEUS).to(tl.int64))
        tl.store(CNT + row, 0)


@triton.jit
def _mass_sums(PART, row, Q, M: tl.constexpr):
    """The row's approximate ``(Z, A [M])`` from its ``Q`` partials, 64 at a time (few registers at any ``Q``)."""
    z = tl.sum(tl.zeros([1], tl.float32), axis=0)
    a = tl.zeros([M], tl.float32)
    ki = tl.arange(0, M)
    for q0 in range(0, Q, 64):
        qi = q0 + tl.arange(0, 64)
        rows = PART + (row * Q + qi) * (M + 1)
        z += tl.sum(tl.load(rows, mask=qi < Q, other=0.0, cache_modifier=".cg"), axis=0)
        a += tl.sum(tl.load(rows[:, None] + 1 + ki[None, :], mask=(qi < Q)[:, None], other=0.0, cache_modifier=".cg"),
                    axis=0)
    return z, a


@triton.jit
def _first_kept(z, a, cand, top_p, ki, M: tl.constexpr):
    """Index of the first candidate top-p keeps (exact masses ``Z``, ``A [M]``; ``M``: none)."""
    kept = (cand != NONE) & (a.to(tl.float64) < top_p * z.to(tl.float64))
    return tl.min(tl.where(kept, ki, M), axis=0)


@triton.jit(do_not_specialize=INTS + ["c", "slack"])
def _nucleus_mass_kernel(X, PART, CNT, MODE, PLANF, NUC, OUT, CAND, CCOUNT, SEED, seed_ptr, seed_lo, seed_hi, OFFSET,
                         off_ptr, off_lo, off_hi, V, tiles, s_xn, Q, c, shift, top_p_bits, cap, slack,
                         M: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr, ROUNDS: tl.constexpr,
                         DTILE: tl.constexpr, XTILE: tl.constexpr, ETILE: tl.constexpr, CP: tl.constexpr):
    """Grid ``(N, Q)``, NUCLEUS rows: the span's approximate ``(Z, A [M])`` (``PART [N, Q, M + 1]``
    float32); last, the row's token: the first candidate the approximate masses keep, when those
    before it are out by more than their relative error ``slack``; else the exact masses over the
    row by this program decide; a row none of whose candidates is kept takes the exact rounds by
    this program (``ETILE``: the exact masses' tile; ``DTILE``, ``XTILE``: the exact rounds' draw and
    pivot tiles)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if tl.load(MODE + row) == NUCLEUS:
        p = PLANF + row * PLAN_W
        xrow = X + row * s_xn
        ki = tl.arange(0, M)
        above = _unord32(_ord32(tl.load(p + F_PIV + ki)) + 1)     # d > t_i as d >= the next float up
        zmax = tl.load(p + F_ZMAX)
        lo = split * tiles * TILE
        hi = tl.minimum(lo + tiles * TILE, V)
        z, a, unused = _pivot_span(xrow, lo, hi, c, zmax, NEG_INF, above, shift, TILE, M, STAGES, False)
        part = PART + (row * Q + split) * (M + 1)
        tl.store(part, z)
        tl.store(part + 1 + ki, a)
        if _last(CNT, row, Q):
            tl.store(CNT + row, 0)
            top_p = top_p_bits.to(tl.float64, bitcast=True)
            zs, az = _mass_sums(PART, row, Q, M)
            need = top_p.to(tl.float32) * zs
            cand = tl.load(NUC + row * M + ki)
            out = (cand == NONE) | (az >= need * (1.0 + slack))
            first = tl.min(tl.where(out, M, ki), axis=0)
            sure = tl.sum(tl.where((ki == first) & (az < need * (1.0 - slack)), 1, 0), axis=0) > 0
            if (first < M) & ~sure:                    # the approximate masses cannot tell: exact ones
                ze, ae, unused = _pivot_span(xrow, 0, V, c, zmax, NEG_INF, above, shift, ETILE, M, STAGES, True)
                first = _first_kept(ze, ae, cand, top_p, ki, M)
            if first < M:
                tl.store(OUT + row, _token(tl.max(tl.where(ki == first, cand, NONE), axis=0)))
                tl.store(MODE + row, DONE)
            else:
                floor = -shift.to(tl.float32)
                tl.store(p + F_XTHR, NEG_INF)
                tl.store(p + F_DTHR, NEG_INF)
                tl.store(p + F_RLO, NEG_INF)
                tl.store(p + F_RHI, POS_INF)
                tl.store(p + F_PIV + tl.arange(0, PIVOTS), _range_pivots(NEG_INF, POS_INF, floor))
                tl.store(MODE + row, EXACT)
                tl.debug_barrier()
                seed = _row_seed(SEED, row, seed_ptr, seed_lo, seed_hi)
                off = _seed_of(OFFSET, row, off_ptr, off_lo, off_hi)
                _exact_row(xrow, row, V, c, seed, off, shift, top_p_bits, cap, CAND, CCOUNT, MODE, PLANF, OUT,
                           ROUNDS, DTILE, XTILE, CP, STAGES)
