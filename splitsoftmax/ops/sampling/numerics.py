"""The element math of sampling in torch, bit for bit what the Triton kernels compute.

A draw must not depend on the device, the number of ranks, the shard widths or the tile sizes, so
every per-token quantity is a pure function of the token's logit and global id, computed with
operations that round the same everywhere: integer arithmetic, float32 ``+ - *`` (never fused:
the kernels are compiled without FMA contraction), comparisons, ``floor`` and conversions.
Logarithms and powers of two are polynomials built from those, not the device's ``log``/``exp2``.

- Noise: Philox 4x32-10 (Random123; ``tl.philox`` in Triton) keyed by the row's 64-bit key, counter
  ``(gid >> 2, offset low 32 bits, offset high 32 bits, STREAM)``; token ``gid`` takes word
  ``gid & 3``. ``v = clamp(float32(word) * 2^-32, 2^-33, 1 - 2^-24)``. A row's key is its own seed
  (a per-row seed tensor) or, under one int seed for the batch, :func:`row_seeds`: words 0 and 1 of
  Philox keyed by the seed at counter ``(row low 32 bits, row high 32 bits, 0, ROWS)``, so rows of
  one batch draw independently and two batch seeds share no row key (but by a 2^-64 chance).
- Gumbel-max in base 2: the token drawn is the argmax of ``key = zz - log2(-log2(1 - v))`` with
  ``zz = x * c``, ``c = float32(log2(e) / T)``: the base-2 form of ``x / T + Gumbel``.
- Probabilities: ``d = zz - zz_max <= 0`` is ``log2(p / p_max)``; a token's mass is the integer
  ``q = floor(2^d * 2^S)`` (``S = 62 - bitlen(V)``), so sums of masses are exact and the same in
  any order or split.
- Order keys: ``ord32(x)`` maps float32 to int32 monotonically (``-0`` as ``+0``, NaN above
  ``+inf``); ``pack(key, gid) = ord32(key) << 32 | (2^32 - 1 - gid)`` orders by key and then by
  lower id, so one integer max picks the winner with ties to the lower index.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


STREAM = 0x53414D50            # Philox counter word 3: this library's sampling stream
ROWS = 0x524F5753              # and of the row keys of a batch seed
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
U32 = 0xFFFFFFFF
NAN_ORD = 0x7FFFFFFF
NEG_INF = float("-inf")
PACKED_NONE = -(2 ** 63)       # the packed key of "no token" (below every real key)
# log2(1 + f) = f * poly(f) on [sqrt(1/2) - 1, sqrt(2) - 1] (relative error 1.4e-7 in float32)
LOG2_POLY = (1.4426950216293335, -0.7213473320007324, 0.48091059923171997, -0.36070483922958374,
             0.2879183292388916, -0.23892034590244293, 0.21566985547542572, -0.20742103457450867,
             0.12614846229553223)
# 2^f on [0, 1) (relative error 1.2e-7 in float32)
EXP2_POLY = (1.0, 0.6931469440460205, 0.2402305006980896, 0.05548042804002762, 0.009684580378234386,
             0.0012387821916490793, 0.00021877505059819669)
SQRT2 = 1.4142135381698608     # float32(sqrt(2))
ONE_MINUS_RSQRT2 = 0.29289323091506958  # float32(1 - sqrt(1/2))
V_MIN, V_MAX = 2.0 ** -33, 1.0 - 2.0 ** -24


def mass_shift(vocab: int) -> int:
    """``S``: masses are integers ``floor(p / p_max * 2^S)``; a row of ``vocab`` of them sums below 2^62."""
    return 62 - max(1, int(vocab)).bit_length()


def to_f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest even; from 2^128 - 2^103 on, where float32 rounds to
    infinity, +-inf)."""
    if abs(x) >= 3.4028235677973366e38:
        return math.copysign(math.inf, x)
    return float(np.float32(x))


def temperature_scale(temperature: float) -> float:
    """``c = float32(log2(e) / T)``, the factor turning a logit into its base-2 scaled logit ``zz``."""
    from .._triton.algebra import LOG2E  # its one home, imported where used: the package imports without triton
    return to_f32(LOG2E.value / temperature)


def f32(value: float, like: Tensor) -> Tensor:
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def _horner(coefs: tuple, f: Tensor) -> Tensor:
    """``sum coefs[i] f^i`` by Horner in float32, one rounding per ``*`` and ``+``."""
    p = torch.full_like(f, coefs[-1])
    for c in coefs[-2::-1]:
        p = p * f + f32(c, f)
    return p


def _split_log2(y: Tensor) -> tuple[Tensor, Tensor]:
    """``y > 0`` normal as ``2^e (1 + f)``, ``f`` in ``[sqrt(1/2) - 1, sqrt(2) - 1]``: ``(e float32, f)``."""
    bits = y.view(torch.int32)
    e = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    big = m > f32(SQRT2, m)
    m = torch.where(big, m * f32(0.5, m), m)
    e = torch.where(big, e + 1, e)
    return e.to(torch.float32), m - f32(1.0, m)


def log2_pos(y: Tensor) -> Tensor:
    """``log2(y)`` of positive normal float32 ``y``."""
    e, f = _split_log2(y)
    return e + f * _horner(LOG2_POLY, f)


def log2_1m(v: Tensor) -> Tensor:
    """``log2(1 - v)`` of float32 ``v`` in ``(0, 1)``, accurate near ``v = 0``."""
    small = v < f32(ONE_MINUS_RSQRT2, v)
    e, f = _split_log2(torch.where(small, f32(0.5, v), f32(1.0, v) - v))
    f = torch.where(small, -v, f)
    return torch.where(small, f32(0.0, v), e) + f * _horner(LOG2_POLY, f)


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(hi, lo)`` words of the 64-bit product of the 32-bit ``a`` and ``b`` (int64 holding uint32),
    from 48-bit partial products so that no int64 overflows."""
    t1 = b * (a & 0xFFFF)
    t2 = b * (a >> 16)
    u = t1 + ((t2 & 0xFFFF) << 16)
    return (u >> 32) + (t2 >> 16), u & U32


def philox(seed: Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor) -> tuple[Tensor, ...]:
    """Philox 4x32-10 of counters ``c0..c3`` (int64 holding uint32) under the 64-bit ``seed`` (int64):
    the four output words (int64 holding uint32). Same as ``tl.philox(seed, c0, c1, c2, c3)``."""
    k0, k1 = seed & U32, (seed >> 32) & U32
    for _ in range(10):
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & U32, (k1 + KEY_B) & U32
    return c0, c1, c2, c3


def words(seed: Tensor, offset: Tensor, g0: int, g1: int) -> Tensor:
    """The random word of every global token id in ``[g0, g1)``: ``(N, g1 - g0)`` int64 holding uint32.

    ``seed``, ``offset``: ``(N, 1)`` int64. One Philox call serves four consecutive ids."""
    ctr = torch.arange(g0 >> 2, ((g1 + 3) >> 2), device=seed.device, dtype=torch.int64).unsqueeze(0)
    ctr = ctr.expand(seed.shape[0], -1)
    out = philox(seed, ctr, offset & U32, (offset >> 32) & U32, torch.full_like(ctr, STREAM))
    flat = torch.stack(out, dim=-1).reshape(seed.shape[0], -1)  # [N, 4 * counters]: word of id 4 * ctr + lane
    start = g0 - 4 * (g0 >> 2)
    return flat[:, start:start + (g1 - g0)]


def words_at(seed: Tensor, offset: Tensor, gid: Tensor) -> Tensor:
    """The random word of each id in ``gid (N, K)`` (int64), for scattered tokens."""
    out = philox(seed, gid >> 2, offset & U32, (offset >> 32) & U32, torch.full_like(gid, STREAM))
    lane = gid & 3
    return torch.where(lane == 0, out[0], torch.where(lane == 1, out[1], torch.where(lane == 2, out[2], out[3])))


def row_seeds(seed: int, rows: Tensor) -> Tensor:
    """The Philox keys (int64) of rows ``rows`` (int64, any shape: their indices in the batch) drawn
    under the batch seed ``seed`` (an int64 int): ``w1 << 32 | w0`` of Philox keyed by ``seed`` at
    counter ``(row low 32 bits, row high 32 bits, 0, ROWS)``."""
    w0, w1, _, _ = philox(torch.full_like(rows, seed), rows & U32, (rows >> 32) & U32, torch.zeros_like(rows),
                          torch.full_like(rows, ROWS))
    return torch.where(w1 > 0x7FFFFFFF, w1 - 2 ** 32, w1) * 2 ** 32 + w0


def uniform(word: Tensor) -> Tensor:
    """float32 ``v`` in ``[2^-33, 1 - 2^-24]`` of the random words."""
    v = word.to(torch.float32) * f32(2.0 ** -32, word)
    return torch.clamp(v, V_MIN, V_MAX)


def gumbel_key(zz: Tensor, word: Tensor) -> Tensor:
    """The Gumbel-max key ``zz - log2(-log2(1 - v))`` (float32) of scaled logits ``zz``."""
    return zz - log2_pos(-log2_1m(uniform(word)))


def qmass(d: Tensor, shift: int) -> Tensor:
    """Integer masses ``floor(2^d * 2^shift)`` (int64) of ``d = zz - zz_max <= 0`` (float32); 0 below 2^-shift."""
    low = f32(-float(shift) - 2.0, d)
    d = torch.where(d > low, torch.clamp(d, max=0.0), low)   # also NaN, which no kept token has
    n = torch.floor(d)
    p = _horner(EXP2_POLY, d - n)
    sh = (n + f32(float(shift), n)).to(torch.int32)
    scale = ((torch.clamp(sh, min=0) + 127) << 23).view(torch.float32)
    return torch.where(sh >= 0, (p * scale).to(torch.int64), 0)


def ord32(x: Tensor) -> Tensor:
    """Monotone int32 order key (as int64) of float32 ``x``: ``-0`` counts as ``+0``, NaN tops ``+inf``."""
    bits = (x + f32(0.0, x)).view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return torch.where(torch.isnan(x), NAN_ORD, key).to(torch.int64)


def unord32(o: Tensor) -> Tensor:
    """The float32 value of order keys ``o`` (int64 in the int32 range): the inverse of :func:`ord32`."""
    o = o.to(torch.int32)
    return (o ^ ((o >> 31) & 0x7FFFFFFF)).view(torch.float32)


def pack(key: Tensor, gid: Tensor) -> Tensor:
    """int64 ``ord32(key) << 32 | (2^32 - 1 - gid)``: larger key first, then lower ``gid``."""
    return (ord32(key) << 32) | (U32 - gid)


def packed_gid(p: Tensor) -> Tensor:
    return U32 - (p & U32)


def packed_key(p: Tensor) -> Tensor:
    return unord32(p >> 32)
