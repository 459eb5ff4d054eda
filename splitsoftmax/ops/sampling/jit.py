"""The element math of ``ops.sampling.numerics`` as Triton functions, bit for bit (no FMA: the
kernels that call them are compiled with ``enable_fp_fusion=False``), and the layout of the row
plan the Triton passes share."""
from __future__ import annotations

import triton
import triton.language as tl

from ...core.runtime import interpreting

# launch options of every exact sampling kernel: no FMA contraction, the torch path rounds each + and *
LAUNCH = dict(enable_fp_fusion=False)
NONE = tl.constexpr(-(2 ** 63))
NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
U32 = tl.constexpr(0xFFFFFFFF)
INTERPRETING = tl.constexpr(interpreting())
INT32_MIN = tl.constexpr(-(2 ** 31))
# the row modes of the Triton passes: the token is known; draw above a threshold; draw above a
# bracket and list the bracket's tokens; find a bracket by approximate pivots; by exact pivots
DONE, THRESH, COLLECT, PIVOT, EXACT = (tl.constexpr(m) for m in range(5))
# the torch path's modes (``sampling_rows``) that the passes of a sharded draw share with it
REFINE, MASS = tl.constexpr(3), tl.constexpr(4)
# float32 fields of a row's plan ``(N, PLAN_F)``: top-k keeps x >= XTHR; d = x c - ZMAX; drawn
# tokens have d >= DTHR (and d >= HI in a bracket); the bracket [LO, HI) in d; the exact range
# [RLO, RHI) known to hold the top-p threshold; PIVOTS pivots, descending, for the next round
F_XTHR, F_ZMAX, F_DTHR, F_LO, F_HI, F_RLO, F_RHI = (tl.constexpr(i) for i in range(7))
F_PIV = tl.constexpr(8)
PIVOTS = tl.constexpr(16)
PLAN_F = 24
PLAN_W = tl.constexpr(PLAN_F)


@triton.jit
def _seed_of(SEED, row, seed_ptr, seed_lo, seed_hi):
    """A row's 64-bit seed (or offset): ``SEED[row]`` when ``seed_ptr``, else ``seed_hi << 32 | seed_lo``
    (two int32 halves, so that every value compiles to one kernel)."""
    own = tl.load(SEED + row, mask=seed_ptr != 0, other=0)
    scalar = (seed_hi.to(tl.int64) << 32) | (seed_lo.to(tl.int64) & 0xFFFFFFFF)
    return tl.where(seed_ptr != 0, own, scalar)


@triton.jit
def _ord32(x):
    """Monotone int32 order key of float32 ``x`` (``-0`` as ``+0``, NaN on top)."""
    x = x + 0.0
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _log2_core(f):
    """``f * poly(f) ~ log2(1 + f)`` (Horner, the coefficients of ``sampling_math.LOG2_POLY``)."""
    p = tl.zeros_like(f) + 0.12614846229553223
    p = p * f + -0.20742103457450867
    p = p * f + 0.21566985547542572
    p = p * f + -0.23892034590244293
    p = p * f + 0.2879183292388916
    p = p * f + -0.36070483922958374
    p = p * f + 0.48091059923171997
    p = p * f + -0.7213473320007324
    p = p * f + 1.4426950216293335
    return f * p


@triton.jit
def _split_log2(y):
    bits = y.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > 1.4142135381698608
    m = tl.where(big, m * 0.5, m)
    e = tl.where(big, e + 1, e)
    return e.to(tl.float32), m - 1.0


@triton.jit
def _gumbel(zz, word):
    """``zz - log2(-log2(1 - v))`` of the uniform ``v`` of the random words (``sampling_math.gumbel_key``)."""
    v = word.to(tl.float32) * 2.3283064365386963e-10
    v = tl.minimum(tl.maximum(v, 1.1641532182693481e-10), 0.9999999403953552)
    small = v < 0.29289323091506958
    e, f = _split_log2(tl.where(small, 0.5, 1.0 - v))
    f = tl.where(small, -v, f)
    e1 = -(tl.where(small, 0.0, e) + _log2_core(f))
    e2, f2 = _split_log2(e1)
    return zz - (e2 + _log2_core(f2))


@triton.jit
def _qmass(d, shift):
    """Integer masses ``floor(2^d * 2^shift)`` (``sampling_math.qmass``)."""
    d = tl.where(d > -shift - 2.0, tl.minimum(d, 0.0), -shift - 2.0)
    n = tl.floor(d)
    f = d - n
    p = tl.zeros_like(d) + 0.00021877505059819669
    p = p * f + 0.0012387821916490793
    p = p * f + 0.009684580378234386
    p = p * f + 0.05548042804002762
    p = p * f + 0.2402305006980896
    p = p * f + 0.6931469440460205
    p = p * f + 1.0
    sh = (n + shift).to(tl.int32)
    scale = ((tl.maximum(sh, 0) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(sh >= 0, (p * scale).to(tl.int64), 0)


@triton.jit
def _bin1(d, inv_w, BINS: tl.constexpr):
    b = tl.floor(-d * inv_w)
    return tl.minimum(tl.maximum(b, 0.0), BINS - 1.0).to(tl.int32)


@triton.jit
def _unord32(o):
    """float32 value of an order key (``sampling_math.unord32``)."""
    o = o.to(tl.int32)
    return (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _top(keys, K: tl.constexpr):
    """``tl.topk`` of a 1-D tensor of int64 keys (distinct, but for repeats of the smallest),
    descending: ``[K]``. ``K = 1`` is the maximum (Triton 3.6's ``tl.topk`` fails to compile for
    ``K = 1``). The interpreter takes the maxima one by one instead: its sorting network costs
    seconds a call."""
    if K == 1:
        top = tl.full([1], 0, keys.dtype) + tl.max(keys, axis=0)
    elif INTERPRETING:
        top = tl.full([K], 0, keys.dtype)
        ki = tl.arange(0, K)
        for j in tl.static_range(K):
            m = tl.max(keys, axis=0)
            top = tl.where(ki == j, m, top)
            keys = tl.where(keys == m, -(2 ** 63), keys)
    else:
        top = tl.topk(keys, K)
    return top
