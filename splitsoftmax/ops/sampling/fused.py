"""The Triton passes of a draw on one device, each with its per-row decision fused in.

Every pass runs on a grid ``(N, Q)``: a row's columns are cut into ``Q`` spans of whole tiles. A
program writes its span's partial result, and the last of a row's programs to finish (a counter
per row, reset by that program) merges the row's partials and decides (``sampling_decide``), so
a draw is a few launches (one to four) and nothing is read back to the host (a CUDA graph can hold
it):

- ``_records_kernel``: records (and the moments of ``d``) and the plan;
- ``_pivot_kernel``: an approximate pivot round of the PIVOT rows (and the next ones of a row by its
  last program, while its bracket is not listable);
- ``_draw_kernel``: the Gumbel-max draw of the THRESH and COLLECT rows, and their tokens; for
  top-p, one program of a row finishes it alone where the approximate rounds left it (its bracket
  not listable) or the exact masses refute its bracket: exact rounds over the whole row, then
  the draw (``_exact_row``; rare).

The partials the last program reads were stored by other programs: it reads them through L2
(``.cg``), after the counter's acquire.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .decide import _decide_draw, _decide_exact, _decide_pivots, _decide_records
from .jit import (COLLECT, EXACT, F_DTHR, F_HI, F_LO, F_PIV, F_XTHR, F_ZMAX, INTERPRETING, NONE, PIVOT, PIVOTS, PLAN_W,
                  POS_INF, THRESH, _seed_of)
from .span import _count_value, _draw_span, _pivot_span, _records_span, _row_seed

# integers that do not specialise a kernel (the row stride and V do: they decide vector loads)
INTS = ["col0", "tiles", "Q", "k_tie", "top_k", "cap", "seed_ptr", "seed_lo", "seed_hi", "off_ptr", "off_lo", "off_hi",
        "shift", "top_p_bits"]


@triton.jit
def _fence(row):
    """``fence.acq_rel.gpu`` in every thread (``__threadfence``): this program's stores are visible
    before it counts itself done; the last program's reads see the others' (none in the interpreter)."""
    if not INTERPRETING:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, $1;", "=r,r", [row.to(tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _last(CNT, row, Q):
    """Whether this program is the last of its row's ``Q`` to get here (its stores are done first)."""
    _fence(row)
    tl.debug_barrier()
    last = tl.atomic_add(CNT + row, 1) == Q - 1
    _fence(row)
    return last


@triton.jit(do_not_specialize=INTS + ["c", "cmin", "probit", "slack", "spread", "growth"])
def _records_kernel(X, PART, TIES, MOM, CNT, V, col0, tiles, s_xn, Q, k_tie, SEED, seed_ptr, seed_lo, seed_hi,
                    OFFSET, off_ptr, off_lo, off_hi, XK, MODE, PLANF, OUT, c, shift, top_p_bits, cmin, top_k,
                    probit, slack, spread, growth, KR: tl.constexpr, QP: tl.constexpr, TILE: tl.constexpr,
                    STAGES: tl.constexpr, MOMENTS: tl.constexpr, FUSED: tl.constexpr, LARGE_K: tl.constexpr,
                    GREEDY: tl.constexpr, TOP_P: tl.constexpr):
    """Grid ``(N, Q)``: the span's top ``KR`` packed keys ``PART [N, QP, KR]``, with ``k_tie`` the count
    of its columns equal to the last (``TIES [N, QP]``, -1 where no top-k needs it), with ``MOMENTS``
    ``(ref, sum e, sum e t, sum e t^2)`` (``MOM [N, QP, 4]``); ``FUSED``: the row's plan."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lo = split * tiles * TILE
    hi = tl.minimum(lo + tiles * TILE, V)
    xrow = X + row * s_xn
    rec, ref, l0, l1, l2 = _records_span(xrow, lo, hi, col0, c, KR, TILE, STAGES, MOMENTS)
    ki = tl.arange(0, KR)
    tl.store(PART + (row * QP + split) * KR + ki, rec)
    last = tl.min(rec, axis=0)
    ties = tl.sum(tl.zeros([1], tl.int64), axis=0) - 1
    if k_tie > 0:
        kth = tl.sum(tl.where(ki == k_tie - 1, rec, 0), axis=0)
        if ((kth >> 32) == (last >> 32)) & (last != NONE):
            ties = _count_value(xrow, lo, hi, (last >> 32).to(tl.int32), TILE)
    tl.store(TIES + row * QP + split, ties)
    if MOMENTS:
        m = MOM + (row * QP + split) * 4
        tl.store(m, ref)
        tl.store(m + 1, l0)
        tl.store(m + 2, l1)
        tl.store(m + 3, l2)
    if FUSED:
        if _last(CNT, row, Q):
            qi = tl.arange(0, QP)
            keys = tl.load(PART + (row * QP + qi[:, None]) * KR + ki[None, :], mask=(qi < Q)[:, None], other=NONE,
                           cache_modifier=".cg")
            tie = tl.load(TIES + row * QP + qi, mask=qi < Q, other=0, cache_modifier=".cg")
            seed = _row_seed(SEED, row, seed_ptr, seed_lo, seed_hi)
            off = _seed_of(OFFSET, row, off_ptr, off_lo, off_hi)
            _decide_records(row, keys, tie, Q, MOM, QP * 4, seed, off, XK, MODE, PLANF, OUT, c, shift, top_p_bits,
                            cmin, top_k, probit, slack, spread, growth, KR, QP, LARGE_K, GREEDY, TOP_P, MOMENTS)
            tl.store(CNT + row, 0)


@triton.jit(do_not_specialize=INTS + ["c", "top_p", "slack"])
def _pivot_kernel(X, PART, CNT, MODE, PLANF, V, tiles, s_xn, Q, c, shift, top_p, slack, cap, TILE: tl.constexpr,
                  QP: tl.constexpr, STAGES: tl.constexpr, MORE: tl.constexpr):
    """Grid ``(N, Q)``, PIVOT rows: the span's approximate masses ``(Z~, F~ [PIVOTS])`` (``PART [N, Q,
    PIVOTS + 1]``; ``QP >= Q``) and, last, the row's bracket or next pivots; a row still without a listable
    bracket then takes up to ``MORE`` rounds over the whole row by that program alone."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if tl.load(MODE + row) == PIVOT:
        p = PLANF + row * PLAN_W
        xrow = X + row * s_xn
        zmax = tl.load(p + F_ZMAX)
        xthr = tl.load(p + F_XTHR)
        lo = split * tiles * TILE
        hi = tl.minimum(lo + tiles * TILE, V)
        piv = tl.load(p + F_PIV + tl.arange(0, PIVOTS))
        z, f, unused = _pivot_span(xrow, lo, hi, c, zmax, xthr, piv, shift, TILE, PIVOTS, STAGES, False)
        out = PART + (row * Q + split) * (PIVOTS + 1)
        tl.store(out, z)
        tl.store(out + 1 + tl.arange(0, PIVOTS), f)
        if _last(CNT, row, Q):
            qi = tl.arange(0, QP)
            rows = PART + (row * Q + qi) * (PIVOTS + 1)
            zs = tl.sum(tl.load(rows, mask=qi < Q, other=0.0, cache_modifier=".cg"), axis=0)
            fs = tl.load(rows[:, None] + 1 + tl.arange(0, PIVOTS)[None, :], mask=(qi < Q)[:, None], other=0.0,
                         cache_modifier=".cg")
            _decide_pivots(row, zs, tl.sum(fs, axis=0), MODE, PLANF, shift, top_p, slack, cap)
            tl.store(CNT + row, 0)
            for rnd in range(MORE):
                tl.debug_barrier()
                if tl.load(MODE + row) == PIVOT:
                    piv = tl.load(p + F_PIV + tl.arange(0, PIVOTS))
                    zr, fr, unused = _pivot_span(xrow, 0, V, c, zmax, xthr, piv, shift, TILE, PIVOTS, STAGES, False)
                    _decide_pivots(row, zr, fr, MODE, PLANF, shift, top_p, slack, cap)


@triton.jit
def _row_draw(X, row, lo, hi, SHIFT4, V, col0, c, seed, off, shift, CAND, CCOUNT, MODE, PLANF, cap,
              TILE: tl.constexpr, STAGES: tl.constexpr):
    """The draw span of a THRESH or COLLECT row (``X``: the row) under its plan: ``(best, Z, A)``."""
    p = PLANF + row * PLAN_W
    collect = tl.load(MODE + row) == COLLECT
    b_hi = tl.load(p + F_HI)
    dthr = tl.load(p + F_DTHR)
    thr = tl.where(collect, tl.maximum(dthr, b_hi), dthr)
    return _draw_span(X, lo, hi, SHIFT4, V, col0, c, tl.load(p + F_ZMAX), tl.load(p + F_XTHR), thr,
                      tl.load(p + F_LO), b_hi, seed, off, shift, collect, CAND, CCOUNT, row, cap, TILE, STAGES)


@triton.jit
def _exact_row(X, row, V, c, seed, off, shift, top_p_bits, cap, CAND, CCOUNT, MODE, PLANF, OUT, ROUNDS: tl.constexpr,
               TILE: tl.constexpr, XTILE: tl.constexpr, CP: tl.constexpr, STAGES: tl.constexpr):
    """A PIVOT or EXACT row (``X``: the row) by one program: exact rounds over the whole row until its
    bracket is listable or one value, then the draw and the token."""
    p = PLANF + row * PLAN_W
    if tl.load(MODE + row) == PIVOT:            # the approximate pivots stay, between the widest ends
        tl.store(p + F_PIV, POS_INF)
        tl.store(p + F_PIV + PIVOTS - 1, -shift.to(tl.float32))
        tl.store(MODE + row, EXACT)
    tl.debug_barrier()
    for _ in range(ROUNDS):
        if tl.load(MODE + row) == EXACT:
            piv = tl.load(p + F_PIV + tl.arange(0, PIVOTS))
            z, f, cnt = _pivot_span(X, 0, V, c, tl.load(p + F_ZMAX), tl.load(p + F_XTHR), piv, shift, XTILE, PIVOTS,
                                    STAGES, True)
            tl.debug_barrier()
            _decide_exact(row, z, f, cnt, MODE, PLANF, shift, top_p_bits, cap)
            tl.debug_barrier()
    mode = tl.load(MODE + row)
    if (mode == THRESH) | (mode == COLLECT):
        best, z, above = _row_draw(X, row, 0, V, 0, V, 0, c, seed, off, shift, CAND, CCOUNT, MODE, PLANF, cap, TILE,
                                   STAGES)
        tl.debug_barrier()
        n = tl.atomic_xchg(CCOUNT + row, 0)
        _decide_draw(row, best, z, above, n, CAND, MODE, PLANF, OUT, seed, off, shift, top_p_bits, cap, CP)


@triton.jit(do_not_specialize=INTS + ["c"])
def _draw_kernel(X, PART, CAND, CCOUNT, CNT, MODE, PLANF, OUT, SEED, seed_ptr, seed_lo, seed_hi, OFFSET,
                 off_ptr, off_lo, off_hi, V, col0, tiles, s_xn, Q, c, shift, top_p_bits, cap, SHIFT4: tl.constexpr,
                 TILE: tl.constexpr, QP: tl.constexpr, CP: tl.constexpr, STAGES: tl.constexpr, EXACT_ROWS: tl.constexpr,
                 ROUNDS: tl.constexpr, XTILE: tl.constexpr):
    """Grid ``(N, Q)``, THRESH and COLLECT rows: the span's ``(best, Z, A)`` (``PART [N, Q, 4]``, ``QP >= Q``), the
    bracket's columns listed in ``CAND [N, cap]``, and, last, the row's token. With ``EXACT_ROWS``
    (top-p), the rows the approximate rounds left and those whose bracket the exact masses refute
    are finished by one program each (``_exact_row``)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    mode = tl.load(MODE + row)
    seed = _row_seed(SEED, row, seed_ptr, seed_lo, seed_hi)
    off = _seed_of(OFFSET, row, off_ptr, off_lo, off_hi)
    xrow = X + row * s_xn
    drawn = (mode == THRESH) | (mode == COLLECT)
    if drawn:
        lo = split * tiles * TILE
        hi = tl.minimum(lo + tiles * TILE, V + SHIFT4)
        best, z, above = _row_draw(xrow, row, lo, hi, SHIFT4, V, col0, c, seed, off, shift, CAND, CCOUNT, MODE, PLANF,
                                   cap, TILE, STAGES)
        out = PART + (row * Q + split) * 4
        tl.store(out, best)
        tl.store(out + 1, z)
        tl.store(out + 2, above)
    left = (mode == PIVOT) | (mode == EXACT)
    if drawn | (left & EXACT_ROWS):       # every program of the row has read its mode before the last changes it
        if _last(CNT, row, Q):
            if drawn:
                qi = tl.arange(0, QP)
                rows = PART + (row * Q + qi) * 4
                ok = qi < Q
                best = tl.max(tl.load(rows, mask=ok, other=NONE, cache_modifier=".cg"), axis=0)
                z = tl.sum(tl.load(rows + 1, mask=ok, other=0, cache_modifier=".cg"), axis=0)
                above = tl.sum(tl.load(rows + 2, mask=ok, other=0, cache_modifier=".cg"), axis=0)
                n = tl.atomic_xchg(CCOUNT + row, 0)
                _decide_draw(row, best, z, above, n, CAND, MODE, PLANF, OUT, seed, off, shift, top_p_bits, cap, CP)
            tl.store(CNT + row, 0)
            if EXACT_ROWS:
                tl.debug_barrier()
                if (tl.load(MODE + row) == EXACT) | (tl.load(MODE + row) == PIVOT):
                    _exact_row(xrow, row, V, c, seed, off, shift, top_p_bits, cap, CAND, CCOUNT, MODE, PLANF, OUT,
                               ROUNDS, TILE, XTILE, CP, STAGES)
