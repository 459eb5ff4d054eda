"""Triton passes of a sharded draw over a slice of the vocabulary: the same signatures and results as
``ops.sampling.torch`` (the element math is ``ops.sampling.numerics``'s, bit for bit), so that the
partial records of every rank are exchanged and merged by ``sampling_rows`` (on one device the
draw is ``ops.sampling.device``'s fused passes).

Every kernel runs on a grid ``(N, splits)``: a row's columns are cut into ``splits`` spans of whole
tiles, so that a batch of one row still spreads over the GPU; the spans' records merge exactly
(maxima of packed keys, integer sums). Kernels are compiled without FMA contraction
(``enable_fp_fusion=False``): a fused multiply-add rounds once where the torch path rounds twice.

- records: ``sampling_fused._records_kernel`` unfused (each span's top ``KR`` packed keys, and the
  ties to the last where a top-k needs them); ``ss.topk`` merges them with one ``torch.topk``;
- ``_mass_kernel``: integer masses and the first-round histogram (``tl.histogram``) of top-p;
- ``_refine_kernel``: the mass above a bracket and its sub-bins' counts and masses (atomics; rare);
- ``_sample_kernel``: the Gumbel-max draw; tiles start at global ids divisible by 4, so one Philox
  call gives the noise of four consecutive tokens. The device's ``log2`` bounds every key within
  1e-4; only the lanes within 4e-3 of a tile's best bound (almost always one) get the exact key.
  Bracket candidates are appended with one atomic per tile, as ``(d, zz, word, id)``: their exact
  keys are computed by the finisher.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .rows import SENT_ID, RowPlan, merge_partials
from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .._triton import configs
from . import config as sc
from . import numerics as sm
from .._triton.launch import Launcher
from .device import _sms, _tile, records_splits
from .device import _splits as span_splits
from .finish import _key
from .finish import after_mass, after_records, after_refine, after_sample, plain_plan  # noqa: F401
from .fused import _records_kernel
from .jit import COLLECT, LAUNCH, MASS, NEG_INF, NONE, REFINE, THRESH, U32, _bin1, _gumbel, _ord32, _qmass
from .span import INF_KEY, NAN_KEY, _approx_noise


@triton.jit
def _row_inputs(X, XTHR, ZMAX, row, cols, valid, s_xn, c):
    """``(x, zz, d, kept by top-k)`` of a tile of a row."""
    x = tl.load(X + row * s_xn + cols, mask=valid, other=0.0).to(tl.float32)
    zz = x * c
    d = zz - tl.load(ZMAX + row)
    return x, zz, d, valid & (x >= tl.load(XTHR + row))


@triton.jit(do_not_specialize=["span", "c", "inv_w", "shift"])
def _mass_kernel(X, MODE, XTHR, ZMAX, Z, H, V, span, s_xn, c, inv_w, shift, s_zn, s_hn, s_hs,
                 BINS: tl.constexpr, TILE: tl.constexpr):
    """Grid ``(N, splits)``, rows in mode MASS: the span's integer mass of the columns kept by
    top-k and their first-round histogram."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lo = split * span
    hi = tl.minimum(lo + span, V)
    hi = tl.where(tl.load(MODE + row) == MASS, hi, lo)
    lanes = tl.arange(0, TILE)
    z = tl.zeros([TILE], tl.int64)
    hist = tl.zeros([BINS], tl.int32)
    for t0 in range(lo, hi, TILE):
        cols = t0 + lanes
        x, zz, d, keep = _row_inputs(X, XTHR, ZMAX, row, cols, cols < hi, s_xn, c)
        z += tl.where(keep, _qmass(d, shift), 0)
        hist += tl.histogram(_bin1(d, inv_w, BINS), BINS, mask=keep)
    tl.store(Z + row * s_zn + split, tl.sum(z, axis=0))
    tl.store(H + row * s_hn + split * s_hs + tl.arange(0, BINS), hist)


@triton.jit
def _bracket(d, B1, ORNG, row, inv_w, BINS: tl.constexpr):
    """``(inside, above, order key)`` of a tile against the row's bracket (``sampling_cpu._bracket``)."""
    b = _bin1(d, inv_w, BINS)
    o = _ord32(d).to(tl.int64)
    b_lo, b_hi = tl.load(B1 + 2 * row), tl.load(B1 + 2 * row + 1)
    o_lo, o_hi = tl.load(ORNG + 2 * row), tl.load(ORNG + 2 * row + 1)
    in_b1 = (b >= b_lo) & (b <= b_hi)
    inside = in_b1 & (o >= o_lo) & (o < o_hi)
    above = (b < b_lo) | (in_b1 & (o >= o_hi))
    return inside, above, o


@triton.jit
def _refine_span(X, XTHR, ZMAX, B1, ORNG, HM, row, lo, hi, s_xn, c, inv_w, shift, BINS: tl.constexpr,
                 TILE: tl.constexpr):
    """Columns ``[lo, hi)`` of a REFINE row: ``(mass above the bracket, count per sub-bin [BINS])``;
    the mass per sub-bin is added to ``HM + row * BINS`` (atomics)."""
    o_lo = tl.load(ORNG + 2 * row)
    width = tl.maximum(tl.load(ORNG + 2 * row + 1) - o_lo, 1)
    lanes = tl.arange(0, TILE)
    above_mass = tl.zeros([TILE], tl.int64)
    hist = tl.zeros([BINS], tl.int32)
    for t0 in range(lo, hi, TILE):
        cols = t0 + lanes
        x, zz, d, keep = _row_inputs(X, XTHR, ZMAX, row, cols, cols < hi, s_xn, c)
        inside, above, o = _bracket(d, B1, ORNG, row, inv_w, BINS)
        q = _qmass(d, shift)
        above_mass += tl.where(keep & above, q, 0)
        sub = tl.minimum(tl.maximum((o - o_lo) * BINS // width, 0), BINS - 1).to(tl.int32)
        take = keep & inside
        hist += tl.histogram(sub, BINS, mask=take)
        tl.atomic_add(HM + row * BINS + sub, q, mask=take)
    return tl.sum(above_mass, axis=0), hist


@triton.jit(do_not_specialize=["span", "c", "inv_w", "shift"])
def _refine_kernel(X, MODE, XTHR, ZMAX, B1, ORNG, A, H, HM, V, span, s_xn, c, inv_w, shift, s_an, s_hn, s_hs,
                   BINS: tl.constexpr, TILE: tl.constexpr):
    """Grid ``(N, splits)``, rows in mode REFINE: the span's mass above the bracket, the count of
    its columns per sub-bin (``H``, per split) and their mass (``HM (N, BINS)``, atomics)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lo = split * span
    hi = tl.minimum(lo + span, V)
    hi = tl.where(tl.load(MODE + row) == REFINE, hi, lo)
    above, hist = _refine_span(X, XTHR, ZMAX, B1, ORNG, HM, row, lo, hi, s_xn, c, inv_w, shift, BINS, TILE)
    tl.store(A + row * s_an + split, above)
    tl.store(H + row * s_hn + split * s_hs + tl.arange(0, BINS), hist)


@triton.jit
def _tile_best(zz, word, gid, win):
    """The best packed Gumbel key among the lanes ``win`` of a tile: the keys are bounded by the
    approximate noise, and the exact key (``_gumbel``) computed only for the lanes that can win --
    almost always one, whose scalar key is computed alone."""
    approx = tl.where(win, zz + _approx_noise(word), NEG_INF)
    top = tl.max(approx, axis=0)
    best = tl.sum(tl.zeros([1], tl.int64), axis=0) + NONE
    if top == float("inf"):                     # an infinite scaled logit: the row draws nothing (-1)
        best = best - NONE + INF_KEY
    elif top > NEG_INF:
        near = win & (approx >= top - (4e-3 + tl.abs(top) * 2e-6))
        if tl.sum(near.to(tl.int32), axis=0) == 1:
            one_word = tl.sum(tl.where(near, word.to(tl.int64), 0), axis=0).to(tl.uint32)
            key = _gumbel(tl.sum(tl.where(near, zz, 0.0), axis=0), one_word)
            best = (_ord32(key).to(tl.int64) << 32) | (U32 - tl.sum(tl.where(near, gid, 0), axis=0))
        else:
            packed = (_ord32(_gumbel(zz, word)).to(tl.int64) << 32) | (U32 - gid)
            best = tl.max(tl.where(near, packed, NONE), axis=0)
    return best


@triton.jit(do_not_specialize=["col0", "span", "c", "inv_w", "shift", "cap"])
def _sample_kernel(X, MODE, XTHR, ZMAX, DTHR, B1, ORNG, SEED, OFFSET, BEST, A, CD, CZ, CW, CG, COUNT, V, col0, span,
                   s_xn, s_bn, c, inv_w, shift, cap, SHIFT4: tl.constexpr, BINS: tl.constexpr, TILE: tl.constexpr):
    """Grid ``(N, splits)``, rows THRESH or COLLECT: the best packed Gumbel key of the kept columns
    of the span (COLLECT: those above the bracket; a NaN makes a THRESH row's best key NaN), the
    mass above the bracket, and the bracket's columns appended to the row's candidates as
    ``(d, zz, word, id)``. Spans cut ``u = column + SHIFT4`` (``SHIFT4 = col0 % 4``), so every tile
    starts at a global id divisible by 4."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    mode = tl.load(MODE + row)
    lo = split * span
    hi = tl.minimum(lo + span, V + SHIFT4)
    hi = tl.where((mode == COLLECT) | (mode == THRESH), hi, lo)
    seed = tl.load(SEED + row)
    off = tl.load(OFFSET + row)
    q4: tl.constexpr = TILE // 4
    c1 = tl.full([q4], 0, tl.int64) + (off & U32)
    c2 = tl.full([q4], 0, tl.int64) + ((off >> 32) & U32)
    c3 = tl.full([q4], 0x53414D50, tl.int64)
    dthr = tl.load(DTHR + row)
    lanes = tl.arange(0, TILE)
    best = tl.sum(tl.zeros([1], tl.int64), axis=0) + NONE
    above_mass = tl.zeros([TILE], tl.int64)
    for u0 in range(lo, hi, TILE):
        cols = u0 - SHIFT4 + lanes
        valid = (cols >= 0) & (cols < V)
        x, zz, d, keep = _row_inputs(X, XTHR, ZMAX, row, cols, valid, s_xn, c)
        ctr = ((col0 - SHIFT4 + u0) >> 2) + tl.arange(0, q4).to(tl.int64)
        r0, r1, r2, r3 = tl.philox(seed, ctr.to(tl.uint32), c1.to(tl.uint32), c2.to(tl.uint32), c3.to(tl.uint32))
        word = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [TILE])  # word of id 4 * ctr + lane
        gid = (cols + col0).to(tl.int64)
        kept = keep & (d >= dthr)
        if mode == COLLECT:
            inside, above, o = _bracket(d, B1, ORNG, row, inv_w, BINS)
            win = kept & above
            above_mass += tl.where(keep & above, _qmass(d, shift), 0)
            take = keep & inside
            one = tl.where(take, 1, 0)
            n_take = tl.sum(one, axis=0)
            if n_take > 0:
                base = tl.atomic_add(COUNT + row, n_take)
                pos = base + tl.cumsum(one, axis=0) - 1
                at = row * cap + pos
                ok = take & (pos < cap)
                tl.store(CD + at, d, mask=ok)
                tl.store(CZ + at, zz, mask=ok)
                tl.store(CW + at, word.to(tl.int64), mask=ok)
                tl.store(CG + at, gid, mask=ok)
        else:
            win = kept
            nan = valid & (x != x)
            if tl.sum(nan.to(tl.int32), axis=0) > 0:      # the row has no distribution: its winner is NaN
                best = tl.maximum(best, tl.max(tl.where(nan, (U32 - gid) | NAN_KEY, NONE), axis=0))
        best = tl.maximum(best, _tile_best(zz, word, gid, win))
    tl.store(BEST + row * s_bn + split, best)
    tl.store(A + row * s_bn + split, tl.sum(above_mass, axis=0))


def _splits(n: int, width: int, tile: int, device: torch.device, most: int = 1 << 30) -> tuple[int, int]:
    """``(splits, span)``: programs per row (at most ``most``) and the columns each covers (whole tiles)."""
    want = min(most, configs.cdiv(configs.SAMPLE_PROGRAMS_PER_SM * _sms(device), max(n, 1)))
    splits = max(1, min(want, configs.cdiv(max(width, 1), tile)))
    span = configs.cdiv(configs.cdiv(max(width, 1), splits), tile) * tile
    return configs.cdiv(max(width, 1), span), span


def _rows(x: Tensor) -> Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def _pass_tile(draw: bool = False) -> int:
    if _tile() == sc.TILE_INTERPRET:
        return configs.SAMPLE_TILE_INTERPRET
    return configs.SAMPLE_DRAW_TILE if draw else configs.SAMPLE_TILE


def _warps(tile: int) -> int:
    return max(1, min(8, tile // 128))


_RECORDS, _MASS, _SAMPLE = Launcher(_records_kernel), Launcher(_mass_kernel), Launcher(_sample_kernel)


def records(x: Tensor, col0: int, kr: int, k_tie: int = 0) -> tuple[Tensor, Tensor]:
    """Partial records of ``x (N, V_r)``: ``(packed keys (N, splits, kr) int64, ties (N, splits) int64)``,
    each split's top ``kr`` descending and the count of its columns equal to its last record (-1
    where no top-k of ``k_tie`` needs it)."""
    x = _rows(x)
    n, v = x.shape
    tile = max(_tile(), kr // 4)
    qp = records_splits(kr, x.device, n)
    splits, tiles = span_splits(n, v, tile, qp, x.device)
    part = torch.empty((n, qp, kr), dtype=torch.int64, device=x.device)
    ties = torch.empty((n, qp), dtype=torch.int64, device=x.device)
    if n:
        k_tie = k_tie if k_tie < kr else 0
        args = (x, part, ties, ties, ties, v, col0, tiles, x.stride(0), splits, k_tie, part, 0, 0, 0, part, 0, 0,
                0, part, part, part, part, 1.0, 0, 0, 0.0, 0, 0.0, 0.0, 0.0, 0.0)
        consts = dict(KR=kr, QP=qp, TILE=tile, STAGES=sc.STAGES, MOMENTS=False, FUSED=False, LARGE_K=False,
                      GREEDY=kr == 1, TOP_P=False, num_warps=sc.WARPS, **LAUNCH)
        _RECORDS((n, splits), _key(args), args, consts)
    return part[:, :splits], ties[:, :splits]


def decode(part: Tensor) -> tuple[Tensor, Tensor]:
    """Packed record keys to ``(values float64, ids)``; missing ones to ``(-inf, SENT_ID)``."""
    none = part == sm.PACKED_NONE
    vals = torch.where(none, sm.NEG_INF, sm.unord32(part >> 32).to(torch.float64))
    return vals, torch.where(none, SENT_ID, sm.packed_gid(part))


def local_merge(parts: tuple) -> tuple[Tensor, Tensor]:
    """This rank's partial records ``(N, splits, kr)`` merged into one per row ``(N, 1, kr)`` (with the
    tie count of the merged last record), so that an exchange carries ``kr`` records per rank."""
    keys, ties = parts
    vals, ids = decode(keys)
    vals, ids, t = merge_partials(vals, ids, ties, keys.shape[2])
    packed = torch.where(ids == SENT_ID, sm.PACKED_NONE, sm.pack(vals.to(torch.float32), torch.where(ids == SENT_ID,
                                                                                                     0, ids)))
    return packed.unsqueeze(1), t.unsqueeze(1)


def merge_top(parts: tuple, k: int) -> tuple[Tensor, Tensor]:
    """The top ``k`` ``(values float64, ids)`` of partial records: packed keys are distinct, so
    ``torch.topk`` of them is exact."""
    keys = parts[0].flatten(1)
    return decode(torch.topk(keys, k, dim=1).values)


def _plan_args(plan: RowPlan):
    return plan.mode, plan.xthr, plan.zmax


def mass(x: Tensor, col0: int, plan: RowPlan, c: float, shift: int, bins: int, span: float):
    """Partials ``(Z (N, splits) int64, hist (N, splits, bins) int32)`` (see ``sampling_cpu.mass``)."""
    x = _rows(x)
    n, v = x.shape
    tile = _pass_tile()
    splits, cols = _splits(n, v, tile, x.device)
    z = torch.empty((n, splits), dtype=torch.int64, device=x.device)
    h = torch.empty((n, splits, bins), dtype=torch.int32, device=x.device)
    if n:
        args = (x, *_plan_args(plan), z, h, v, cols, x.stride(0), c, (bins - 1) / span, shift, z.stride(0),
                h.stride(0), h.stride(1))
        _MASS((n, splits), _key(args), args, dict(BINS=bins, TILE=tile, num_warps=_warps(tile), **LAUNCH))
    return z, h


def refine(x: Tensor, col0: int, plan: RowPlan, c: float, shift: int, bins: int, span: float):
    """Partials ``(mass above (N, splits) int64, hist (N, splits, bins) int32, hist mass (N, 1, bins)
    int64)`` (see ``sampling_cpu.refine``)."""
    x = _rows(x)
    n, v = x.shape
    tile = _pass_tile()
    splits, cols = _splits(n, v, tile, x.device)
    above = torch.empty((n, splits), dtype=torch.int64, device=x.device)
    h = torch.empty((n, splits, bins), dtype=torch.int32, device=x.device)
    hm = torch.zeros((n, 1, bins), dtype=torch.int64, device=x.device)
    if n:
        _refine_kernel[(n, splits)](x, *_plan_args(plan), plan.b1, plan.orng, above, h, hm, v, cols, x.stride(0), c,
                                    (bins - 1) / span, shift, above.stride(0), h.stride(0), h.stride(1), BINS=bins,
                                    TILE=tile, num_warps=_warps(tile), **LAUNCH)
    return above, h, hm


def sample(x: Tensor, col0: int, plan: RowPlan, seed: Tensor, offset: Tensor, c: float, shift: int, bins: int,
           span: float, cap: int):
    """Partials ``(best (N, splits), mass above (N, splits), and the candidates (N, 1, cap): d
    float32, zz float32, word int64, id int64 (-1: none))`` (see ``sampling_cpu.sample``, whose
    candidates are ``(d, packed key)``: here the finisher computes their keys)."""
    x = _rows(x)
    n, v = x.shape
    tile = _pass_tile(draw=True)
    shift4 = col0 % 4
    splits, cols = _splits(n, v + shift4, tile, x.device)
    best = torch.empty((n, splits), dtype=torch.int64, device=x.device)
    above = torch.empty((n, splits), dtype=torch.int64, device=x.device)
    cand_d, cand_z, cand_w, cand_g, count = _candidates(n, cap, x.device)
    if n:
        args = (x, *_plan_args(plan), plan.dthr, plan.b1, plan.orng, seed, offset, best, above, cand_d, cand_z, cand_w,
                cand_g, count, v, col0, cols, x.stride(0), best.stride(0), c, (bins - 1) / span, shift, cap)
        _SAMPLE((n, splits), _key(args), args,
                dict(SHIFT4=shift4, BINS=bins, TILE=tile, num_warps=_warps(tile), **LAUNCH))
    return best, above, cand_d, cand_z, cand_w, cand_g


_NO_CANDIDATES: dict = {}


def _candidates(n: int, cap: int, device: torch.device) -> tuple:
    """Candidate lists ``(N, 1, cap)`` (d, zz, word, id) and their counts; with ``cap = 0`` nothing is
    written (no bracket can occur), so empty lists and a count buffer are kept per device."""
    if cap:
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        return (torch.full((n, 1, cap), sm.NEG_INF, **f32), torch.empty((n, 1, cap), **f32),
                torch.empty((n, 1, cap), **i64), torch.full((n, 1, cap), -1, **i64),
                torch.zeros(n, dtype=torch.int32, device=device))
    key = (n, str(device))
    if key not in _NO_CANDIDATES:
        if len(_NO_CANDIDATES) >= 16:
            _NO_CANDIDATES.clear()
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        _NO_CANDIDATES[key] = (torch.empty((n, 1, 0), **f32), torch.empty((n, 1, 0), **f32),
                               torch.empty((n, 1, 0), **i64), torch.empty((n, 1, 0), **i64),
                               torch.zeros(n, dtype=torch.int32, device=device))
    return _NO_CANDIDATES[key]