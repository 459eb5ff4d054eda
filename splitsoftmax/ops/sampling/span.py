"""The streaming loops of the Triton sampling passes over the columns ``[lo, hi)`` of one row.

Each loop keeps its state per tile position (registers; no reduction across the program inside
the loop) and reduces it once at the end:

- ``_records_span``: the top ``KR`` packed keys ``(ord32(x), global id)``. Each position keeps its
  own top four (integer order keys and columns, inserted in column order, so an equal key keeps
  the lower id first) and the largest order key it dropped; the top ``KR`` of the ``4 * TILE``
  kept keys are the span's unless some position dropped a key at or above the ``KR``-th's value
  (five of the span's top ``KR`` at one position: on random logits about one span in 500 at
  ``KR = 64`` and 256 positions). Then one more pass assigns the columns to the positions another
  way, and should that saturate too, the records are found one pass per record. With
  ``MOMENTS``: the mass, and its first two moments in ``zz``, of every column, relative to the
  first tile's largest ``zz`` (float32, approximate: they only place pivots).
- ``_pivot_span``: the mass of the columns kept by top-k and at each of ``P`` pivots the mass of
  those with ``d >= pivot``: approximate (float32, ``exp2``) or ``EXACT`` (the integer masses,
  and counts).
- ``_draw_span``: the Gumbel-max draw. Keys are bounded with the device's ``log2`` (within 1e-4);
  each position keeps its best bounded key (and column) and its second best, so at the end only
  the positions whose best lies within the bound's margin of the span's best need the exact key;
  a second key within the margin at one position (near ties, rare) rescans the span with exact
  keys. In a bracket (``collect``): the exact integer masses of all kept columns, of those at or
  above the bracket, and the bracket's columns appended to the row's list.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...core.runtime import interpreting
from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .._triton.algebra import LOG2E
from .jit import INT32_MIN, NEG_INF, NONE, U32, _gumbel, _ord32, _qmass, _seed_of, _top

NAN_KEY = tl.constexpr(0x7FFFFFFF << 32)      # the packed high word of a NaN key
INF_KEY = tl.constexpr(0x7F800000 << 32)      # and of a +inf key
STREAM = tl.constexpr(0x53414D50)              # Philox counter word 3 (``sampling_math.STREAM``)
ROWS = tl.constexpr(0x524F5753)                # and of a batch seed's row keys (``sampling_math.ROWS``)
# ``tl.log2`` compiles to libdevice's exact log2 (about 25 instructions); the bound of the draw
# takes the special function unit's ``lg2.approx`` (one), except in the interpreter
FAST_LOG2 = tl.constexpr(not interpreting())


@triton.jit
def _log2_approx(x):
    if FAST_LOG2:
        y = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        y = tl.log2(x)
    return y


@triton.jit
def _pack(v, col, col0):
    """Packed record keys ``v << 32 | (2^32 - 1 - global id)`` of int32 order keys ``v`` at local
    columns ``col``; NONE for an empty slot (``v = INT32_MIN``)."""
    key = (v.to(tl.int64) << 32) | (U32 - (col.to(tl.int64) + col0))
    return tl.where(v == INT32_MIN, NONE, key)


@triton.jit
def _insert4(k, col, v1, i1, v2, i2, v3, i3, v4, i4, v5):
    """Keys ``k`` at columns ``col`` inserted into each position's descending top four ``(v, i)``;
    ``v5``: the largest key each position dropped (the old fourth, or ``k`` itself)."""
    g1 = k > v1
    g2 = k > v2
    g3 = k > v3
    g4 = k > v4
    v5n = tl.maximum(v5, tl.where(g4, v4, k))
    v4n = tl.where(g3, v3, tl.where(g4, k, v4))
    i4n = tl.where(g3, i3, tl.where(g4, col, i4))
    v3n = tl.where(g2, v2, tl.where(g3, k, v3))
    i3n = tl.where(g2, i2, tl.where(g3, col, i3))
    v2n = tl.where(g1, v1, tl.where(g2, k, v2))
    i2n = tl.where(g1, i1, tl.where(g2, col, i2))
    return tl.where(g1, k, v1), tl.where(g1, col, i1), v2n, i2n, v3n, i3n, v4n, i4n, v5n


@triton.jit
def _top4_span(X, lo, hi, c, ref, TILE: tl.constexpr, STAGES: tl.constexpr, MOMENTS: tl.constexpr,
               ROTATE: tl.constexpr = False):
    """Each position's top four order keys of columns ``[lo, hi)`` of the row at ``X`` and the
    largest it dropped (``INT32_MIN``: none), and with ``MOMENTS`` the position's ``(sum e, sum e t,
    sum e t^2)``, ``t = zz - ref``, ``e = 2^min(t, 60)``.
    ``ROTATE``: position ``p`` of the ``j``-th tile takes its column ``(p + 97 j) % TILE`` (another
    assignment of columns to positions, for logits periodic in the tile)."""
    lanes = tl.arange(0, TILE)
    v1 = tl.full([TILE], INT32_MIN, tl.int32)
    i1 = tl.zeros([TILE], tl.int32)
    v2, v3, v4, v5, i2, i3, i4 = v1, v1, v1, v1, i1, i1, i1
    l0 = tl.zeros([TILE], tl.float32)
    l1, l2 = l0, l0
    for t0 in tl.range(lo, hi, TILE, num_stages=STAGES):
        if ROTATE:
            cols = t0 + (lanes + 97 * ((t0 - lo) // TILE)) % TILE
        else:
            cols = t0 + lanes
        valid = cols < hi
        x = tl.load(X + cols, mask=valid, other=0.0).to(tl.float32)
        k = tl.where(valid, _ord32(x), INT32_MIN)
        if MOMENTS:
            zz = x * c
            fin = valid & (zz > NEG_INF)
            t = tl.where(fin, zz - ref, 0.0)
            e = tl.where(fin, tl.exp2(tl.minimum(t, 60.0)), 0.0)
            l0 += e
            l1 = tl.fma(e, t, l1)                     # approximate: fused where it saves an instruction
            l2 = tl.fma(e * t, t, l2)
        v1, i1, v2, i2, v3, i3, v4, i4, v5 = _insert4(k, cols, v1, i1, v2, i2, v3, i3, v4, i4, v5)
    return v1, i1, v2, i2, v3, i3, v4, i4, v5, l0, l1, l2


@triton.jit
def _slots(v1, i1, v2, i2, v3, i3, v4, i4, col0, TILE: tl.constexpr):
    """The four slots of every position as one ``[4 * TILE]`` tensor of packed keys."""
    a = tl.join(_pack(v1, i1, col0), _pack(v2, i2, col0))
    b = tl.join(_pack(v3, i3, col0), _pack(v4, i4, col0))
    return tl.reshape(tl.join(a, b), [4 * TILE])


@triton.jit
def _first_ref(X, lo, hi, c, TILE: tl.constexpr):
    """The largest finite ``zz`` of the span's first tile (0 if none): the moments' reference."""
    cols = lo + tl.arange(0, TILE)
    x = tl.load(X + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
    ref = tl.max(tl.where(x == x, x * c, NEG_INF), axis=0)
    return tl.where(tl.abs(ref) < float("inf"), ref, 0.0)


@triton.jit
def _top_by_max(X, lo, hi, col0, KR: tl.constexpr, TILE: tl.constexpr):
    """The span's top ``KR`` packed keys one at a time, each the largest below the one before (a
    pass over the span per record: the slow exact path of ``_records_span``)."""
    lanes = tl.arange(0, TILE)
    ki = tl.arange(0, KR)
    rec = tl.full([KR], NONE, tl.int64)
    prev = tl.sum(tl.zeros([1], tl.int64), axis=0) + 0x7FFFFFFFFFFFFFFF
    for j in range(KR):
        best = tl.full([TILE], NONE, tl.int64)
        for t0 in range(lo, hi, TILE):
            cols = t0 + lanes
            x = tl.load(X + cols, mask=cols < hi, other=0.0).to(tl.float32)
            p = _pack(tl.where(cols < hi, _ord32(x), INT32_MIN), cols, col0)
            best = tl.maximum(best, tl.where(p < prev, p, NONE))
        prev = tl.max(best, axis=0)
        rec = tl.where(ki == j, prev, rec)
    return rec


@triton.jit
def _dropped_a_top_key(dropped, rec):
    """Whether the largest key the positions dropped, ``dropped`` (``INT32_MIN``: none), may belong
    in the records ``rec`` (descending): at or above the last record's value (an equal value may have
    the lower id)."""
    last = (tl.min(rec, axis=0) >> 32).to(tl.int32)
    return (dropped > INT32_MIN) & (dropped >= last)


@triton.jit
def _records_span(X, lo, hi, col0, c, KR: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr,
                  MOMENTS: tl.constexpr):
    """``(top KR packed keys descending [KR], ref, sum e, sum e t, sum e t^2)`` of the span."""
    ref = 0.0
    if MOMENTS:
        ref = _first_ref(X, lo, hi, c, TILE)
    v1, i1, v2, i2, v3, i3, v4, i4, v5, l0, l1, l2 = _top4_span(X, lo, hi, c, ref, TILE, STAGES, MOMENTS)
    if KR == 1:
        rec = _top(_pack(v1, i1, col0), 1)
    else:
        dropped = tl.max(v5, axis=0)                         # (one register through the selection)
        rec = _top(_slots(v1, i1, v2, i2, v3, i3, v4, i4, col0, TILE), KR)
        if _dropped_a_top_key(dropped, rec):                 # rare
            v1, i1, v2, i2, v3, i3, v4, i4, v5, l0, l1, l2 = _top4_span(X, lo, hi, c, ref, TILE, 1, False, True)
            dropped = tl.max(v5, axis=0)
            rec = _top(_slots(v1, i1, v2, i2, v3, i3, v4, i4, col0, TILE), KR)
            if _dropped_a_top_key(dropped, rec):             # under both assignments: rarer still
                rec = _top_by_max(X, lo, hi, col0, KR, TILE)
    return rec, ref, tl.sum(l0, axis=0), tl.sum(l1, axis=0), tl.sum(l2, axis=0)


@triton.jit
def _count_value(X, lo, hi, v_last, TILE: tl.constexpr):
    """How many columns of ``[lo, hi)`` have the order key ``v_last``."""
    lanes = tl.arange(0, TILE)
    count = tl.zeros([TILE], tl.int64)
    for t0 in range(lo, hi, TILE):
        cols = t0 + lanes
        x = tl.load(X + cols, mask=cols < hi, other=0.0).to(tl.float32)
        count += ((_ord32(x) == v_last) & (cols < hi)).to(tl.int64)
    return tl.sum(count, axis=0)


@triton.jit
def _pivot_span(X, lo, hi, c, zmax, xthr, piv, shift, TILE: tl.constexpr, P: tl.constexpr,
                STAGES: tl.constexpr, EXACT: tl.constexpr):
    """``(Z, F [P], C [P])`` of the span's columns kept by top-k (``x >= xthr``): their total mass, and
    for each pivot ``piv [P]`` the mass (and, ``EXACT``, the count) of those with ``d >= pivot``.
    Approximate: float32 ``2^d`` (C zeros); ``EXACT``: the integer masses ``qmass(d)``."""
    lanes = tl.arange(0, TILE)[:, None]                       # [TILE, 1]
    pv = piv[None, :]                                         # [1, P]
    if EXACT:
        z = tl.zeros([TILE, 1], tl.int64)
        f = tl.zeros([TILE, P], tl.int64)
    else:
        z = tl.zeros([TILE, 1], tl.float32)
        f = tl.zeros([TILE, P], tl.float32)
    cnt = tl.zeros([TILE, P], tl.int32)
    for t0 in tl.range(lo, hi, TILE, num_stages=STAGES):
        cols = t0 + lanes
        valid = cols < hi
        x = tl.load(X + cols, mask=valid, other=0.0).to(tl.float32)
        keep = valid & (x >= xthr)
        zz = x * c
        d = zz - zmax
        ge = d >= pv                                          # [TILE, P]
        if EXACT:
            q = tl.where(keep, _qmass(d, shift), 0)
            z += q
            f += tl.where(ge, q, 0)
            cnt += (ge & keep).to(tl.int32)
        else:
            m = tl.where(keep, tl.exp2(d), 0.0)
            z += m
            f += m * ge.to(tl.float32)
    return tl.sum(tl.sum(z, axis=1), axis=0), tl.sum(f, axis=0), tl.sum(cnt.to(tl.int64), axis=0)


@triton.jit
def _approx_noise(word):
    """The base-2 Gumbel noise ``-log2(-log2(1 - v))`` to within 1e-4 from the device's ``log2``:
    a bound for pruning, never the draw itself."""
    v = word.to(tl.float32) * 2.3283064365386963e-10
    v = tl.minimum(tl.maximum(v, 1.1641532182693481e-10), 0.9999999403953552)
    e = tl.where(v < 0.0078125, v * (LOG2E + 0.5 * LOG2E * v), -_log2_approx(1.0 - v))
    return -_log2_approx(e)


@triton.jit
def _philox(seed, c0, c1, c2, c3):
    """Philox 4x32-10 (``tl.philox``'s, ``sampling_math.philox``) of uint32 counters under the 64-bit
    ``seed``, each round's products as one 32 x 32 -> 64-bit multiply."""
    k0 = (seed & U32).to(tl.uint32)
    k1 = ((seed >> 32) & U32).to(tl.uint32)
    for _ in tl.static_range(10):
        pb = c2.to(tl.uint64) * 0xCD9E8D57
        pa = c0.to(tl.uint64) * 0xD2511F53
        c0 = (pb >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (pa >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = pb.to(tl.uint32)
        c3 = pa.to(tl.uint32)
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _row_seed(SEED, row, seed_ptr, seed_lo, seed_hi):
    """A row's Philox key (int64): its own seed ``SEED[row]`` when ``seed_ptr``, else the batch seed
    ``seed_hi << 32 | seed_lo`` keyed with the row index ``row`` (``sampling_math.row_seeds``)."""
    own = _seed_of(SEED, row, seed_ptr, seed_lo, seed_hi)
    r = row.to(tl.int64)
    zero = (r * 0).to(tl.uint32)
    w0, w1, _, _ = _philox(own, (r & U32).to(tl.uint32), ((r >> 32) & U32).to(tl.uint32), zero, zero + ROWS)
    batch = (w1.to(tl.int64) << 32) | w0.to(tl.int64)
    return tl.where(seed_ptr != 0, own, batch)


@triton.jit
def _words_at(seed, off, gid):
    """The random words (uint32) of global ids ``gid`` (any shape): Philox of ``(gid >> 2, offset,
    STREAM)``, word ``gid & 3``."""
    c1 = (gid * 0 + (off & U32)).to(tl.uint32)
    c2 = (gid * 0 + ((off >> 32) & U32)).to(tl.uint32)
    c3 = (gid * 0 + STREAM).to(tl.uint32)
    r0, r1, r2, r3 = _philox(seed, (gid >> 2).to(tl.uint32), c1, c2, c3)
    lane = gid & 3
    return tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))


@triton.jit
def _exact_key(zz, word, gid):
    """Packed exact Gumbel keys ``ord32(zz - log2(-log2(1 - v))) << 32 | (2^32 - 1 - gid)``."""
    return (_ord32(_gumbel(zz, word)).to(tl.int64) << 32) | (U32 - gid.to(tl.int64))


@triton.jit
def _exact_at(X, near, col, col0, c, seed, off):
    """Packed exact keys of the local columns ``col`` (global ids ``col + col0``) where ``near``, NONE
    elsewhere."""
    gid = (col + col0).to(tl.int64)
    zz = tl.load(X + col, mask=near, other=0.0).to(tl.float32) * c
    return tl.where(near, _exact_key(zz, _words_at(seed, off, gid), gid), NONE)


@triton.jit
def _tile_words(seed, off, g0, Q4: tl.constexpr):
    """The words of global ids ``g0 + [0, 4 Q4)`` (``g0`` divisible by 4) as ``[Q4, 4]``."""
    ctr = (g0 >> 2) + tl.arange(0, Q4).to(tl.int64)
    c1 = tl.full([Q4], 0, tl.int64) + (off & U32)
    c2 = tl.full([Q4], 0, tl.int64) + ((off >> 32) & U32)
    c3 = tl.full([Q4], STREAM, tl.int64)
    r0, r1, r2, r3 = _philox(seed, ctr.to(tl.uint32), c1.to(tl.uint32), c2.to(tl.uint32), c3.to(tl.uint32))
    j = tl.arange(0, 4)[None, :]
    return tl.where(j == 0, r0[:, None], tl.where(j == 1, r1[:, None], tl.where(j == 2, r2[:, None], r3[:, None])))


@triton.jit
def _draw_tile(X, u0, SHIFT4, V, col0, c, zmax, xthr, seed, off, TILE: tl.constexpr):
    """``(cols, valid, x, zz, d, kept by top-k, random words)`` of the tile at ``u = u0`` ``[TILE/4, 4]``."""
    Q4: tl.constexpr = TILE // 4
    lane = tl.arange(0, Q4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    cols = u0 - SHIFT4 + lane
    if SHIFT4 == 0:
        valid = cols < V
    else:
        valid = (cols >= 0) & (cols < V)
    x = tl.load(X + cols, mask=valid, other=0.0).to(tl.float32)
    zz = x * c
    d = zz - zmax
    word = _tile_words(seed, off, col0 - SHIFT4 + u0, Q4)
    return cols, valid, x, zz, d, valid & (x >= xthr), word


@triton.jit
def _append(CAND, CCOUNT, row, cap, inside, zz, gid):
    """Append the tile's columns ``inside`` to the row's list as ``zz bits << 32 | gid`` (a slot per
    column from the row's counter: few columns are in a bracket)."""
    pos = tl.atomic_add(CCOUNT + row + gid * 0, 1, mask=inside, sem="relaxed")
    packed = (zz.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (gid.to(tl.int64) & U32)
    tl.store(CAND + row * cap + pos, packed, mask=inside & (pos < cap))


@triton.jit
def _near_rescan(X, lo, hi, SHIFT4, V, col0, c, zmax, xthr, thr, seed, off, floor, TILE: tl.constexpr):
    """The best exact packed key among the kept columns whose bounded key reaches ``floor``."""
    best = tl.full([TILE // 4, 4], NONE, tl.int64)
    for u0 in range(lo, hi, TILE):
        cols, valid, x, zz, d, keep, word = _draw_tile(X, u0, SHIFT4, V, col0, c, zmax, xthr, seed, off, TILE)
        near = keep & (d >= thr) & (zz + _approx_noise(word) >= floor)
        best = tl.maximum(best, tl.where(near, _exact_key(zz, word, cols + col0), NONE))
    return tl.max(tl.max(best, axis=1), axis=0)


@triton.jit
def _draw_span(X, lo, hi, SHIFT4, V, col0, c, zmax, xthr, thr, b_lo, b_hi, seed, off, shift, collect, CAND, CCOUNT,
               row, cap, TILE: tl.constexpr, STAGES: tl.constexpr):
    """``(best packed key, Z, A)`` of the span ``u in [lo, hi)`` (``u = column + SHIFT4``): the best
    exact key among the kept columns with ``d >= thr``; without ``collect`` NaN_KEY if a column is
    NaN; with ``collect`` (``thr`` is then at least the bracket's top ``b_hi``) ``Z`` and ``A`` are the
    integer masses of the columns kept by top-k and of those with ``d >= b_hi``, and the columns in
    ``[b_lo, b_hi)`` are appended to the row's list."""
    Q4: tl.constexpr = TILE // 4
    a1 = tl.full([Q4, 4], NEG_INF, tl.float32)
    a2 = a1
    i1 = tl.zeros([Q4, 4], tl.int32)
    nan = tl.zeros([Q4, 4], tl.int32)
    zq = tl.zeros([Q4, 4], tl.int64)
    aq = zq
    for u0 in tl.range(lo, hi, TILE, num_stages=STAGES):
        cols, valid, x, zz, d, keep, word = _draw_tile(X, u0, SHIFT4, V, col0, c, zmax, xthr, seed, off, TILE)
        ap = tl.where(keep & (d >= thr), zz + _approx_noise(word), NEG_INF)
        gt = ap > a1
        a2 = tl.maximum(a2, tl.minimum(ap, a1))
        a1 = tl.where(gt, ap, a1)
        i1 = tl.where(gt, cols, i1)
        if collect:
            q = tl.where(keep, _qmass(d, shift), 0)
            above = d >= b_hi
            zq += q
            aq += tl.where(above, q, 0)
            _append(CAND, CCOUNT, row, cap, keep & (d >= b_lo) & ~above, zz, cols + col0)
        else:
            nan = tl.maximum(nan, (valid & (x != x)).to(tl.int32))
    top = tl.max(tl.max(a1, axis=1), axis=0)
    best = tl.sum(tl.zeros([1], tl.int64), axis=0) + NONE
    if top == float("inf"):                     # an infinite scaled logit: the row draws nothing (-1)
        best = best - NONE + INF_KEY
    elif top > NEG_INF:
        floor = top - (4e-3 + tl.abs(top) * 2e-6)
        if tl.max(tl.max(a2, axis=1), axis=0) >= floor:        # two bounded keys near the best at one position
            best = _near_rescan(X, lo, hi, SHIFT4, V, col0, c, zmax, xthr, thr, seed, off, floor, TILE)
        else:
            best = tl.max(tl.max(_exact_at(X, a1 >= floor, i1, col0, c, seed, off), axis=1), axis=0)
    best = tl.where(tl.max(tl.max(nan, axis=1), axis=0) > 0, NAN_KEY, best)
    return best, tl.sum(tl.sum(zq, axis=1), axis=0), tl.sum(tl.sum(aq, axis=1), axis=0)
