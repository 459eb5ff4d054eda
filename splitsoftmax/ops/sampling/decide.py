"""Per-row decisions of the one-device Triton draw, between its passes (``ops.sampling.fused``).

The decisions that pick the token are exact and the torch path's (``sampling_rows``): the merged
records, the top-k threshold and its ties, top-p among the records when they hold every kept
token, and at the end the top-p threshold ``tau`` (the largest ``d`` whose kept mass reaches
``top_p * Z``, integer masses) from the exact masses at and above a bracket and the bracket's
listed tokens. Only where the bracket lies is decided from float32 masses (``_decide_pivots``):
a wrong bracket is caught by the exact masses (``_decide_draw``) and the row takes the exact
rounds (``_decide_exact``: integer masses and counts at every pivot), which narrow an exact range
``[RLO, RHI)`` until its tokens can be listed or share one value.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .finish import _and, _decode, _not, _or, _pick, _records_cut, _token, _winner
from .jit import (COLLECT, DONE, EXACT, F_DTHR, F_HI, F_LO, F_PIV, F_RHI, F_RLO, F_XTHR, F_ZMAX, NEG_INF, NONE, PIVOT,
                  PIVOTS, PLAN_W, POS_INF, THRESH, _ord32, _qmass, _top, _unord32)
from .span import _exact_key, _words_at


@triton.jit
def _store_pivots(PLANF, row, piv):
    tl.store(PLANF + row * PLAN_W + F_PIV + tl.arange(0, PIVOTS), piv)


@triton.jit
def _range_pivots(lo, hi, floor):
    """``PIVOTS`` pivots, descending, from ``hi`` down to ``max(lo, floor)``, the others between (from
    0 down when ``hi`` lies above every ``d``): evenly in value while the range spans many float32
    values, else evenly in order keys."""
    k = tl.arange(0, PIVOTS)
    top = tl.minimum(hi, 0.0)
    low = tl.maximum(lo, floor)
    open_top = hi > 0.0
    j = tl.where(open_top, tl.maximum(k - 1, 0), k).to(tl.float32)
    parts = tl.where(open_top, PIVOTS - 2, PIVOTS - 1).to(tl.float32)
    o_hi = _ord32(top).to(tl.int64)
    o_lo = _ord32(low).to(tl.int64)
    by_value = top - (top - low) * (j / parts)
    step = (j / parts * (o_hi - o_lo).to(tl.float32)).to(tl.int64)
    by_key = _unord32(tl.minimum(tl.maximum(o_hi - step, o_lo), o_hi))
    piv = tl.where(o_hi - o_lo > (1 << 20), by_value, by_key)
    piv = tl.where(k == 0, hi, piv)
    return tl.where(k == PIVOTS - 1, low, piv)


@triton.jit
def _single(a, b):
    """Whether ``[a, b)`` holds one float32 value of ``d`` (every ``d`` is at most 0)."""
    o_b = tl.where(b > 0.0, 1, _ord32(b).to(tl.int64))
    return o_b - _ord32(a).to(tl.int64) <= 1


@triton.jit
def _moment_pivots(MOM, row, s_mn, Q, zmax, d_last, probit, floor, spread, growth, QP: tl.constexpr):
    """``(Z~, pivots)``: the approximate mass of the row from the passes' moments, and the first
    round's pivots around the threshold of a Gaussian of the same mean and deviation in ``d``, at
    ``spread * 2^(growth j)`` deviations above and below it (``j < PIVOTS / 2``)."""
    qi = tl.arange(0, QP)
    m = MOM + row * s_mn + qi * 4
    ok = qi < Q
    ref = tl.load(m, mask=ok, other=0.0, cache_modifier=".cg")
    l0 = tl.load(m + 1, mask=ok, other=0.0, cache_modifier=".cg")
    l1 = tl.load(m + 2, mask=ok, other=0.0, cache_modifier=".cg")
    l2 = tl.load(m + 3, mask=ok, other=0.0, cache_modifier=".cg")
    delta = tl.minimum(ref - zmax, 60.0)
    s = tl.where(ok, tl.exp2(delta), 0.0)
    z0 = tl.sum(s * l0, axis=0)
    z1 = tl.sum(s * (l1 + l0 * delta), axis=0)
    z2 = tl.sum(s * (l2 + 2.0 * delta * l1 + delta * delta * l0), axis=0)
    mean = z1 / tl.maximum(z0, 1e-30)
    dev = tl.sqrt(tl.maximum(z2 / tl.maximum(z0, 1e-30) - mean * mean, 0.0))
    dev = tl.minimum(tl.maximum(dev, 0.05), 16.0)
    guess = mean - dev * probit
    k = tl.arange(0, PIVOTS)
    half = PIVOTS // 2
    j = tl.where(k < half, half - 1 - k, k - half).to(tl.float32)
    piv = guess + dev * tl.where(k < half, 1.0, -1.0) * spread * tl.exp2(growth * j)
    piv = tl.minimum(tl.maximum(piv, floor), tl.maximum(d_last, floor))
    return z0, piv


@triton.jit
def _decide_records(row, keys, ties, Q, MOM, s_mn, seed, off, XK, MODE, PLANF, OUT, c, shift,
                    top_p_bits, cmin, top_k, probit, slack, spread, growth, KR: tl.constexpr, QP: tl.constexpr,
                    LARGE_K: tl.constexpr, GREEDY: tl.constexpr, TOP_P: tl.constexpr, MOMENTS: tl.constexpr):
    """``sampling_rows.after_records`` on the partial records ``keys [QP, KR]`` (ties ``[QP]``) of
    one row; a top-p the records cannot settle gets a bracket from the records (when their mass
    surely reaches the threshold) or the first round's pivots (around the threshold the
    ``MOMENTS`` suggest, else evenly below the records)."""
    rec = _top(tl.reshape(keys, [QP * KR]), KR)                   # [KR] merged, descending
    x, gid, valid = _decode(rec)
    top = _pick(x, 0, KR)
    zero_f = tl.sum(tl.zeros([1], tl.float32), axis=0)
    if GREEDY:
        tl.store(MODE + row, DONE)
        tl.store(OUT + row, tl.where(_and(top == top, top > NEG_INF), _pick(gid, 0, KR), -1))
    else:
        bad, zmax, zz, d, q, xk, keptk, known, need, dthr, d_last, decided = _records_cut(
            x, valid, rec, keys, ties, XK, row, c, shift, top_p_bits, cmin, top_k, KR, LARGE_K, TOP_P)
        if TOP_P:
            to_pivot = _and(_not(known), _not(bad))
        else:
            to_pivot = _and(known, _not(known))
        mode = tl.where(bad, DONE, tl.where(to_pivot, PIVOT, tl.where(decided, DONE, THRESH)))
        win = _winner(zz, gid, keptk & (d >= dthr), seed, off, KR)
        p = PLANF + row * PLAN_W
        tl.store(p + F_XTHR, xk)
        tl.store(p + F_ZMAX, tl.where(bad, 0.0, zmax))
        tl.store(p + F_DTHR, dthr)
        tl.store(p + F_RLO, zero_f + NEG_INF)
        tl.store(p + F_RHI, zero_f + POS_INF)
        if TOP_P:
            if to_pivot:
                floor = -shift.to(tl.float32)
                if not MOMENTS:     # none taken (a large top-k's would count what it drops): pivots evenly below
                    piv = _range_pivots(floor, tl.maximum(d_last, floor), floor)
                    a = zero_f + NEG_INF
                else:
                    z_mom, piv = _moment_pivots(MOM, row, s_mn, Q, zmax, d_last, probit, floor, spread, growth, QP)
                    reach = top_p_bits.to(tl.float64, bitcast=True).to(tl.float32) * z_mom * (1.0 + slack)
                    cum = tl.cumsum(tl.where(keptk, q, 0), axis=0).to(tl.float32) / tl.exp2(shift.to(tl.float32))
                    a = tl.max(tl.where(keptk & (cum >= reach), d, NEG_INF), axis=0)
                piv = tl.where(piv == piv, piv, floor)
                mode = tl.where(a > NEG_INF, COLLECT, PIVOT)
                tl.store(p + F_LO, a)
                tl.store(p + F_HI, zero_f + POS_INF)
                _store_pivots(PLANF, row, piv)
        tl.store(MODE + row, mode.to(tl.int64))
        tl.store(OUT + row, tl.where(_or(bad, mode != DONE), -1, _token(win)))


@triton.jit
def _bracket(piv, f, lo_t, hi_t):
    """``(ib, ia)`` over pivots descending with masses ``f`` non-decreasing: the last index with
    ``f < lo_t`` (-1: none) and the first with ``f >= hi_t`` (PIVOTS: none)."""
    k = tl.arange(0, PIVOTS)
    return tl.max(tl.where(f < lo_t, k, -1), axis=0), tl.min(tl.where(f >= hi_t, k, PIVOTS), axis=0)


@triton.jit
def _decide_pivots(row, z, f, MODE, PLANF, shift, top_p, slack, cap):
    """An approximate round's masses ``Z~`` and ``F~ [PIVOTS]`` of a PIVOT row: a listable bracket
    ``[a, b)`` (COLLECT), or the next round's pivots."""
    p = PLANF + row * PLAN_W
    piv = tl.load(p + F_PIV + tl.arange(0, PIVOTS))
    need = top_p * z
    ib, ia = _bracket(piv, f, need * (1.0 - slack), need * (1.0 + slack))
    b = tl.where(ib >= 0, _pick(piv, ib, PIVOTS), POS_INF)
    fb = tl.where(ib >= 0, _pick(f, ib, PIVOTS), 0.0)
    a = tl.where(ia < PIVOTS, _pick(piv, ia, PIVOTS), NEG_INF)
    fa = tl.where(ia < PIVOTS, _pick(f, ia, PIVOTS), z)
    floor = -shift.to(tl.float32)
    count = (fa - fb + 2.0 * slack * z) / tl.exp2(tl.maximum(a, floor)) + 1.0
    single = _single(a, b)
    listed = _and(a >= floor, _or(count <= cap, single))      # below floor a token's mass bounds nothing
    # the next pivots: the threshold interpolated in log mass between the bracket's ends, and
    # pivots spread around it; a bracket open at one end extends past the outermost pivot
    lo = tl.where(a > NEG_INF, a, floor)
    hi = tl.where(b < POS_INF, b, 0.0)
    frac = tl.log2(tl.maximum(need, 1e-30) / tl.maximum(fb, 1e-30)) / tl.log2(tl.maximum(fa, 1e-30) /
                                                                             tl.maximum(fb, 1e-30))
    frac = tl.where(_and(fb > 0, fa > fb), frac, 0.5)
    guess = hi - (hi - lo) * tl.minimum(tl.maximum(frac, 0.0), 1.0)
    k = tl.arange(0, PIVOTS)
    side = tl.where(k < PIVOTS // 2, 1.0, -1.0)
    j = tl.where(k < PIVOTS // 2, PIVOTS // 2 - 1 - k, k - PIVOTS // 2).to(tl.float32)
    spread = guess + side * (hi - lo) * 0.002 * tl.exp2(1.25 * j)
    nxt = tl.minimum(tl.maximum(spread, lo), hi)
    nxt = tl.where(k == 0, hi, tl.where(k == PIVOTS - 1, lo, nxt))
    wide = _or(a == NEG_INF, b == POS_INF)
    nxt = tl.where(wide, _range_pivots(lo, hi, floor), nxt)
    tl.store(p + F_LO, a)
    tl.store(p + F_HI, b)
    _store_pivots(PLANF, row, nxt)
    tl.store(MODE + row, tl.where(listed, COLLECT, PIVOT).to(tl.int64))


@triton.jit
def _decide_exact(row, z, f, cnt, MODE, PLANF, shift, top_p_bits, cap):
    """An exact round's integer masses ``Z``, ``F [PIVOTS]`` and counts ``C [PIVOTS]`` of an EXACT row
    (the pivots hold the range's ends): the exact bracket, listed (COLLECT), a single value
    (THRESH at it), or the next round's pivots inside it."""
    p = PLANF + row * PLAN_W
    piv = tl.load(p + F_PIV + tl.arange(0, PIVOTS))
    need = top_p_bits.to(tl.float64, bitcast=True) * z.to(tl.float64)
    reach = f.to(tl.float64) >= need
    k = tl.arange(0, PIVOTS)
    ib = tl.max(tl.where(reach, -1, k), axis=0)
    ia = tl.min(tl.where(reach, k, PIVOTS), axis=0)
    b = tl.where(ib >= 0, _pick(piv, ib, PIVOTS), POS_INF)
    a = tl.where(ia < PIVOTS, _pick(piv, ia, PIVOTS), NEG_INF)
    count = tl.where(ia < PIVOTS, _pick(cnt, ia, PIVOTS), 1 << 62) - tl.where(ib >= 0, _pick(cnt, ib, PIVOTS), 0)
    single = _single(a, b)
    dthr = tl.load(p + F_DTHR)
    tl.store(p + F_LO, a)
    tl.store(p + F_HI, b)
    tl.store(p + F_RLO, a)
    tl.store(p + F_RHI, b)
    tl.store(p + F_DTHR, tl.where(single, tl.maximum(a, dthr), dthr))
    _store_pivots(PLANF, row, _range_pivots(a, b, -shift.to(tl.float32)))
    tl.store(MODE + row, tl.where(single, THRESH, tl.where(count <= cap, COLLECT, EXACT)).to(tl.int64))


@triton.jit
def _refute(row, lower, upper, MODE, PLANF, shift):
    """A bracket ``[LO, HI)`` the exact masses refute (``lower``: the threshold is below ``HI``;
    ``upper``: at or above ``LO``; both: too many tokens to list): narrow the exact range and leave
    the row to the exact rounds."""
    p = PLANF + row * PLAN_W
    a = tl.load(p + F_LO)
    b = tl.load(p + F_HI)
    rlo = tl.where(_not(lower), b, tl.where(_not(upper), tl.load(p + F_RLO), a))
    rhi = tl.where(_not(lower), tl.load(p + F_RHI), tl.where(_not(upper), a, b))
    tl.store(p + F_RLO, rlo)
    tl.store(p + F_RHI, rhi)
    _store_pivots(PLANF, row, _range_pivots(rlo, rhi, -shift.to(tl.float32)))
    tl.store(MODE + row, EXACT)


@triton.jit
def _decide_draw(row, best, z, above, n, CAND, MODE, PLANF, OUT, seed, off, shift, top_p_bits, cap,
                 CP: tl.constexpr):
    """The token of a row after the draw: THRESH takes the best key; COLLECT checks with the exact
    masses ``Z`` and ``A`` (at and above the bracket) and the ``n`` listed tokens of the bracket that
    the threshold lies in it, finds it among them and takes the best kept key; a bracket the
    masses refute, or one too full to list, goes to the exact rounds."""
    mode = tl.load(MODE + row)
    if mode == THRESH:
        tl.store(OUT + row, _token(best))
    if mode == COLLECT:
        p = PLANF + row * PLAN_W
        need = top_p_bits.to(tl.float64, bitcast=True) * z.to(tl.float64)
        lower = above.to(tl.float64) < need
        if n <= cap:
            ci = tl.arange(0, CP)
            valid = ci < n
            cand = tl.load(CAND + row * cap + ci, mask=valid, other=0, cache_modifier=".cg")
            zz = (cand >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            gid = cand & 0xFFFFFFFF
            d = tl.where(valid, zz - tl.load(p + F_ZMAX), NEG_INF)
            ds = tl.sort(d, descending=True)
            cum = tl.cumsum(tl.where(ds > NEG_INF, _qmass(ds, shift), 0), axis=0)
            upper = (above + tl.max(cum, axis=0)).to(tl.float64) >= need
            if _and(lower, upper):
                reach = _and(ds > NEG_INF, (above + cum).to(tl.float64) >= need)
                thr = tl.maximum(tl.max(tl.where(reach, ds, NEG_INF), axis=0), tl.load(p + F_DTHR))
                packed = _exact_key(zz, _words_at(seed, off, gid), gid)
                win = tl.maximum(best, tl.max(tl.where(valid & (d >= thr), packed, NONE), axis=0))
                tl.store(OUT + row, _token(win))
                tl.store(MODE + row, DONE)
            else:
                _refute(row, lower, upper, MODE, PLANF, shift)
        else:
            _refute(row, lower, lower, MODE, PLANF, shift)
