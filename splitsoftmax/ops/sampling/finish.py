"""Triton twins of ``sampling_rows``: the per-row decisions between the passes, one program per row.

Each kernel reads the partial records of a pass (every split of every rank, ``(N, Q, ...)``) and
writes the row's plan, with the same operations as the torch functions, so that the plan, and the
token, are the same bit for bit; on a GPU a draw is then a handful of launches and no host work.

- ``_finish_records_kernel``: merge the records (the top keys of the packed records), the top-k
  threshold and the ties beyond the records, the top-p threshold among them, min-p, the Gumbel
  keys of the records and the winner where every kept token is a record;
- ``_finish_mass_kernel``: ``Z``, the threshold from the records where it lies among them, else
  the first-round bracket from the histogram's mass bounds;
- ``_finish_refine`` (a function, shared by the refinement kernel): the sub-bin where the exact
  mass crosses;
- ``_finish_sample_kernel``: the best key, and for a bracket the exact threshold from its sorted
  candidates.
"""
from __future__ import annotations

import struct
from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import rows
from .rows import RowPlan, Spec
from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .._triton.launch import Launcher
from .jit import (COLLECT, DONE, LAUNCH, MASS, NEG_INF, NONE, REFINE, THRESH, U32, _gumbel, _ord32, _qmass, _top,
                  _unord32)

INT32_LO = tl.constexpr(-(2 ** 31))
INT32_END = tl.constexpr(2 ** 31)


@triton.jit
def _or(a, b):
    """Logical or, also of int1 scalars (the interpreter's ``|`` of scalars gives int32, and ``~`` of that is wrong)."""
    return (a.to(tl.int32) | b.to(tl.int32)) != 0


@triton.jit
def _and(a, b):
    return (a.to(tl.int32) & b.to(tl.int32)) != 0


@triton.jit
def _not(a):
    return a.to(tl.int32) == 0


@triton.jit
def _decode(rec):
    """``(value float32, id int64, valid)`` of packed record keys."""
    return _unord32(rec >> 32), U32 - (rec & U32), rec != NONE


@triton.jit
def _pick(t, i, KR: tl.constexpr):
    """Element ``i`` of a ``[KR]`` tensor (a scalar)."""
    return tl.sum(tl.where(tl.arange(0, KR) == i, t, 0), axis=0)


@triton.jit
def _token(win):
    """``sampling_rows.token_of``: the id of a packed winner, -1 if none or its key is not finite."""
    key = _unord32(win >> 32)
    ok = _and(_and(win != NONE, key == key), tl.abs(key) < float("inf"))
    return tl.where(ok, U32 - (win & U32), -1)


@triton.jit
def _winner(zz, gid, kept, seed, offset, KR: tl.constexpr):
    """Packed best Gumbel key among the records ``kept`` (``sampling_rows._winner``)."""
    c1 = tl.full([KR], 0, tl.int64) + (offset & U32)
    c2 = tl.full([KR], 0, tl.int64) + ((offset >> 32) & U32)
    c3 = tl.full([KR], 0x53414D50, tl.int64)
    safe = tl.where(kept, gid, 0)
    r0, r1, r2, r3 = tl.philox(seed, (safe >> 2).to(tl.uint32), c1.to(tl.uint32), c2.to(tl.uint32), c3.to(tl.uint32))
    lane = safe & 3
    word = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    packed = (_ord32(_gumbel(zz, word)).to(tl.int64) << 32) | (U32 - safe)
    return tl.max(tl.where(kept, packed, NONE), axis=0)


@triton.jit
def _tau(d, q, kept, need, extra_d, extra_q):
    """``sampling_rows._tau``: the ``d`` of the first kept record whose running mass reaches ``need``."""
    cum = tl.cumsum(tl.where(kept, q, 0), axis=0) + tl.where(d <= extra_d, extra_q, 0)
    ok = kept & (cum.to(tl.float64) >= need)
    return tl.max(tl.where(ok, d, NEG_INF), axis=0)


@triton.jit
def _count_equal(keys, ties, ord_t):
    """``sampling_rows.count_equal`` over partials ``keys [QP, KR]`` with ``ties [QP]``."""
    valid = keys != NONE
    in_rec = tl.sum(((keys >> 32).to(tl.int32) == ord_t) & valid, axis=1)
    last = tl.min(keys, axis=1)
    at_end = (last != NONE) & ((last >> 32).to(tl.int32) == ord_t)
    unknown = tl.max((at_end & (ties < 0)).to(tl.int32), axis=0) > 0
    return tl.where(unknown, -1, tl.sum(tl.where(at_end, ties, in_rec.to(tl.int64)), axis=0))


@triton.jit
def _records_cut(x, valid, rec, keys, ties, XK, row, c, shift, top_p_bits, cmin, top_k, KR: tl.constexpr,
                 LARGE_K: tl.constexpr, TOP_P: tl.constexpr):
    """``sampling_rows.after_records``' cut-offs of one row (not greedy), from its merged records ``rec
    [KR]`` (decoded: ``x``, ``valid``), its partial records ``keys [QP, KR]`` with their tie counts
    ``ties [QP]`` (a top-k inside the records counts its ties there) and, with ``LARGE_K``, the top-k
    threshold found outside the records (``XK [row]``): ``(bad, zmax, zz, d, q, xk, keptk, known,
    need, dthr, d_last, decided)``, shared by the one-device and the sharded finishers."""
    zero_i = tl.sum(tl.zeros([1], tl.int64), axis=0)
    zero_f = tl.sum(tl.zeros([1], tl.float32), axis=0)
    top = _pick(x, 0, KR)
    zmax = top * c
    bad = _or(top != top, _not(tl.abs(zmax) < float("inf")))
    zz = x * c
    d = zz - zmax
    q = tl.where(valid, tl.where(bad, 0, _qmass(d, shift)), 0)
    if LARGE_K:
        xk = tl.load(XK + row).to(tl.float32)
        extra = zero_i - 1
    elif top_k > 0:
        xk = _pick(x, top_k - 1, KR)
        total = _count_equal(keys, ties, _ord32(xk))
        inside = tl.sum(((x == xk) & valid).to(tl.int64), axis=0)
        extra = tl.where(total < 0, -1, total - inside)
    else:
        xk = zero_f + NEG_INF
        extra = zero_i - 1
    keptk = valid & (x >= xk)
    dk = xk * c - zmax
    known = _or(extra >= 0, tl.min(rec, axis=0) == NONE)
    extra = tl.maximum(extra, 0)
    extra_q = extra * _qmass(dk, shift)
    z = tl.sum(tl.where(keptk, q, 0), axis=0) + extra_q
    need = top_p_bits.to(tl.float64, bitcast=True) * z.to(tl.float64)
    if TOP_P:
        tau = _tau(d, q, keptk, need, tl.where(extra > 0, dk, NEG_INF), extra_q)
        dthr = tl.where(known, tl.maximum(tau, cmin), zero_f + cmin)
    else:
        dthr = zero_f + cmin
    d_last = _pick(d, KR - 1, KR)
    outside = tl.where(known, tl.where(extra > 0, dk, NEG_INF), d_last)
    outside = tl.where(_pick(x, KR - 1, KR) < xk, NEG_INF, outside)
    decided = _or(_not(outside > NEG_INF), outside < dthr)
    return bad, zmax, zz, d, q, xk, keptk, known, need, dthr, d_last, decided


@triton.jit(do_not_specialize=["Q", "c", "shift", "top_p_bits", "cmin", "top_k"])
def _finish_records_kernel(PART, TIES, Q, SEED, OFFSET, XK, MODE, TOKEN, XTHR, ZMAX, DTHR, NEED, B1, ORNG, COUNT,
                           MERGED, s_pn, s_tn, c, shift, top_p_bits, cmin, top_k, KR: tl.constexpr,
                           QP: tl.constexpr, LARGE_K: tl.constexpr, GREEDY: tl.constexpr, TOP_P: tl.constexpr):
    """One program per row: ``sampling_rows.after_records`` on packed partial records ``(N, Q, KR)``."""
    row = tl.program_id(0).to(tl.int64)
    qi = tl.arange(0, QP)
    ki = tl.arange(0, KR)
    keys = tl.load(PART + row * s_pn + qi[:, None] * KR + ki[None, :], mask=(qi < Q)[:, None], other=NONE)
    rec = _top(tl.reshape(keys, [QP * KR]), KR)                   # [KR] merged, descending
    tl.store(MERGED + row * KR + ki, rec)
    x, gid, valid = _decode(rec)
    top = _pick(x, 0, KR)
    zero_i = tl.sum(tl.zeros([1], tl.int64), axis=0)
    tl.store(B1 + 2 * row + tl.arange(0, 2), tl.zeros([2], tl.int64))
    tl.store(ORNG + 2 * row, zero_i + INT32_LO)
    tl.store(ORNG + 2 * row + 1, zero_i + INT32_END)
    tl.store(COUNT + row, 0)
    if GREEDY:
        ok = _and(top == top, top > NEG_INF)
        tl.store(MODE + row, DONE)
        tl.store(TOKEN + row, tl.where(ok, _pick(gid, 0, KR), -1))
    else:
        ties = tl.load(TIES + row * s_tn + qi, mask=qi < Q, other=0)
        bad, zmax, zz, d, q, xk, keptk, known, need, dthr, d_last, decided = _records_cut(
            x, valid, rec, keys, ties, XK, row, c, shift, top_p_bits, cmin, top_k, KR, LARGE_K, TOP_P)
        if TOP_P:
            to_mass = _not(known)
        else:
            to_mass = _and(known, _not(known))
        mode = tl.where(bad, DONE, tl.where(to_mass, MASS, tl.where(decided, DONE, THRESH)))
        win = _winner(zz, gid, keptk & (d >= dthr), tl.load(SEED + row), tl.load(OFFSET + row), KR)
        tl.store(MODE + row, mode.to(tl.int64))
        tl.store(TOKEN + row, tl.where(_or(bad, mode != DONE), -1, _token(win)))
        tl.store(XTHR + row, xk.to(tl.float64))
        tl.store(ZMAX + row, tl.where(bad, 0.0, zmax))
        tl.store(DTHR + row, dthr)
        tl.store(NEED + row, need)


@triton.jit(do_not_specialize=["Q", "c", "shift", "top_p_bits", "cap"])
def _finish_mass_kernel(Z, H, Q, MERGED, SEED, OFFSET, LO, HI, MODE, TOKEN, XTHR, ZMAX, DTHR, NEED, B1, ORNG, COUNT,
                        s_zn, s_hn, s_hq, c, shift, top_p_bits, cap, W: tl.constexpr, KR: tl.constexpr,
                        BINS: tl.constexpr):
    """One program per row in mode MASS: ``sampling_rows.after_mass`` on partials ``Z (N, Q)``,
    ``H (N, Q, BINS)`` and the merged records."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(MODE + row) == MASS:
        bi = tl.arange(0, BINS)
        z = tl.sum(tl.zeros([1], tl.int64), axis=0)
        hist = tl.zeros([BINS], tl.int64)
        for j in range(Q):
            z += tl.load(Z + row * s_zn + j)
            hist += tl.load(H + row * s_hn + j * s_hq + bi).to(tl.int64)
        need = top_p_bits.to(tl.float64, bitcast=True) * z.to(tl.float64)
        rec = tl.load(MERGED + row * KR + tl.arange(0, KR))
        x, gid, valid = _decode(rec)
        zz = x * c
        d = zz - tl.load(ZMAX + row)
        keptk = valid & (x >= tl.load(XTHR + row).to(tl.float32))
        q = tl.where(keptk, _qmass(d, shift), 0)
        tau = _tau(d, q, keptk, need, NEG_INF, 0)
        d_last = _pick(d, KR - 1, KR)
        by_records = tau > d_last
        dthr = tl.load(DTHR + row)
        dthr = tl.where(by_records, tl.maximum(tau, dthr), dthr)
        win = _winner(zz, gid, keptk & (d >= dthr), tl.load(SEED + row), tl.load(OFFSET + row), KR)
        low = tl.cumsum(hist.to(tl.float64) * tl.load(LO + bi), axis=0)
        high = tl.cumsum(hist.to(tl.float64) * tl.load(HI + bi), axis=0)
        first = tl.min(tl.where(high >= need, bi, BINS - 1), axis=0)
        last = tl.maximum(tl.min(tl.where(low >= need, bi, BINS - 1), axis=0), first)
        count = tl.sum(tl.where((bi >= first) & (bi <= last), hist, 0), axis=0)
        d_lo = tl.where(last == BINS - 1, -(shift + 1.0), (-(last + 1)).to(tl.float64) * W * (1 + 1e-5) - 2e-6)
        d_hi = (-first).to(tl.float64) * W * (1 - 1e-5) + 2e-6
        wide = count > cap
        zero_i = tl.sum(tl.zeros([1], tl.int64), axis=0)
        o_lo = tl.where(wide, _ord32(d_lo.to(tl.float32)).to(tl.int64), zero_i + INT32_LO)
        o_hi = tl.where(wide, _ord32(d_hi.to(tl.float32)).to(tl.int64) + 1, zero_i + INT32_END)
        tl.store(NEED + row, need)
        tl.store(DTHR + row, dthr)
        tl.store(MODE + row, tl.where(by_records, DONE, tl.where(wide, REFINE, COLLECT)).to(tl.int64))
        tl.store(TOKEN + row, tl.where(by_records, _token(win), -1))
        tl.store(B1 + 2 * row, first.to(tl.int64))
        tl.store(B1 + 2 * row + 1, last.to(tl.int64))
        tl.store(ORNG + 2 * row, o_lo)
        tl.store(ORNG + 2 * row + 1, o_hi)
        tl.store(COUNT + row, count)


@triton.jit
def _finish_refine(row, above, hist, hmass, MODE, DTHR, NEED, ORNG, COUNT, cap, BINS: tl.constexpr):
    """``sampling_rows.after_refine`` of one REFINE row: the sub-bin where the exact mass crosses."""
    bi = tl.arange(0, BINS).to(tl.int64)
    o_lo = tl.load(ORNG + 2 * row)
    width = tl.maximum(tl.load(ORNG + 2 * row + 1) - o_lo, 1)
    reach = above + tl.cumsum(hmass, axis=0, reverse=True)           # [BINS]: mass of sub-bins >= j
    j = tl.max(tl.where(reach.to(tl.float64) >= tl.load(NEED + row), bi, 0), axis=0)
    count = tl.sum(tl.where(bi == j, hist, 0), axis=0)
    e0 = o_lo + (j * width + BINS - 1) // BINS
    e1 = o_lo + ((j + 1) * width + BINS - 1) // BINS
    single = _and(count > cap, e1 - e0 == 1)
    tau = _unord32(tl.minimum(tl.maximum(e0, INT32_LO), INT32_END - 1))
    dthr = tl.load(DTHR + row)
    tl.store(DTHR + row, tl.where(single, tl.maximum(tau, dthr), dthr))
    tl.store(MODE + row, tl.where(single, THRESH, tl.where(count <= cap, COLLECT, REFINE)).to(tl.int64))
    tl.store(ORNG + 2 * row, tl.where(single, o_lo, e0))
    tl.store(ORNG + 2 * row + 1, tl.where(single, tl.load(ORNG + 2 * row + 1), e1))
    tl.store(COUNT + row, tl.where(single, tl.load(COUNT + row), count))


@triton.jit(do_not_specialize=["Q", "QM", "cap"])
def _finish_refine_kernel(A, H, HM, Q, QM, MODE, DTHR, NEED, ORNG, COUNT, s_an, s_hn, s_hq, s_mn, s_mq, cap,
                          BINS: tl.constexpr):
    """One program per row in mode REFINE: partials ``A (N, Q)``, ``H (N, Q, BINS)``, ``HM (N, QM, BINS)``."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(MODE + row) == REFINE:
        bi = tl.arange(0, BINS)
        above = tl.sum(tl.zeros([1], tl.int64), axis=0)
        hist = tl.zeros([BINS], tl.int64)
        hmass = tl.zeros([BINS], tl.int64)
        for j in range(Q):
            above += tl.load(A + row * s_an + j)
            hist += tl.load(H + row * s_hn + j * s_hq + bi).to(tl.int64)
        for j in range(QM):
            hmass += tl.load(HM + row * s_mn + j * s_mq + bi)
        _finish_refine(row, above, hist, hmass, MODE, DTHR, NEED, ORNG, COUNT, cap, BINS)


@triton.jit(do_not_specialize=["Q", "C", "shift"])
def _finish_sample_kernel(BEST, A, CD, CZ, CW, CG, Q, C, MODE, TOKEN, DTHR, NEED, OUT, s_bn, s_cn, shift,
                          QP: tl.constexpr, CP: tl.constexpr):
    """One program per row: ``sampling_rows.after_sample`` on partials ``BEST, A (N, Q)`` and the
    candidates ``(d, zz, word, id) (N, C)``, whose Gumbel keys are computed here."""
    row = tl.program_id(0).to(tl.int64)
    mode = tl.load(MODE + row)
    qi = tl.arange(0, QP)
    best = tl.max(tl.load(BEST + row * s_bn + qi, mask=qi < Q, other=NONE), axis=0)
    win = best
    if mode == COLLECT:
        above = tl.sum(tl.load(A + row * s_bn + qi, mask=qi < Q, other=0), axis=0)
        ci = tl.arange(0, CP)
        at = row * s_cn + ci
        gid = tl.load(CG + at, mask=ci < C, other=-1)
        valid = gid >= 0
        d = tl.where(valid, tl.load(CD + at, mask=ci < C, other=NEG_INF), NEG_INF)
        ds = tl.sort(d, descending=True)
        live = ds > NEG_INF
        cum = tl.cumsum(tl.where(live, _qmass(ds, shift), 0), axis=0)
        reach = (above + cum).to(tl.float64) >= tl.load(NEED + row)
        tau = tl.max(tl.where(live & reach, ds, NEG_INF), axis=0)
        thr = tl.maximum(tau, tl.load(DTHR + row))
        zz = tl.load(CZ + at, mask=valid, other=0.0)
        word = tl.load(CW + at, mask=valid, other=0).to(tl.uint32)
        packed = (_ord32(_gumbel(zz, word)).to(tl.int64) << 32) | (U32 - gid)
        win = tl.maximum(best, tl.max(tl.where(valid & (d >= thr), packed, NONE), axis=0))
    tl.store(OUT + row, tl.where(mode == DONE, tl.load(TOKEN + row), _token(win)))


_RECORDS, _SAMPLE = Launcher(_finish_records_kernel), Launcher(_finish_sample_kernel)


def _key(args: tuple) -> tuple:
    """``Launcher`` key: tensors by dtype and 16-byte alignment, integers by value, floats by type."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, Tensor) else float if isinstance(a, float) else a
                 for a in args)


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def empty_plan(n: int, device) -> RowPlan:
    """A plan the finishers fill in full."""
    def e(*shape, dtype=torch.int64):
        return torch.empty(shape, dtype=dtype, device=device)
    return RowPlan(e(n), e(n), e(n, dtype=torch.float64), e(n, dtype=torch.float32), e(n, dtype=torch.float32),
                   e(n, dtype=torch.float64), e(n, 2), e(n, 2), e(n))


_PLAIN: dict = {}


def plain_plan(n: int, device) -> RowPlan:
    """The plan of plain sampling (every row THRESH, no filter): constant, so kept per ``(n, device)``;
    the passes only read it."""
    key = (n, str(device))
    plan = _PLAIN.get(key)
    if plan is None:
        if len(_PLAIN) >= 16:
            _PLAIN.clear()
        plan = _PLAIN[key] = rows.plain_plan(n, device)
    return plan


def after_records(parts: tuple, spec: Spec, xk_large, seed: Tensor, offset: Tensor):
    """``(plan, merged packed records (N, kr))`` from partial records ``(N, Q, kr)`` and ties ``(N, Q)``."""
    keys, ties = parts
    n, q, kr = keys.shape
    plan = empty_plan(n, keys.device)
    merged = torch.empty((n, kr), dtype=torch.int64, device=keys.device)
    if n:
        xk = xk_large if xk_large is not None else plan.xthr
        args = (keys, ties, q, seed, offset, xk, plan.mode, plan.token, plan.xthr, plan.zmax, plan.dthr, plan.need,
                plan.b1, plan.orng, plan.count, merged, keys.stride(0), ties.stride(0), spec.c, spec.shift,
                _bits(spec.top_p), spec.cmin, spec.top_k if spec.top_k < kr else 0)
        _RECORDS((n,), _key(args), args, dict(KR=kr, QP=triton.next_power_of_2(q), LARGE_K=xk_large is not None,
                                              GREEDY=spec.greedy, TOP_P=spec.top_p < 1.0, num_warps=4, **LAUNCH))
    return plan, merged


@lru_cache(maxsize=16)
def _bounds(bins: int, span: float, shift: int, device: torch.device) -> tuple[Tensor, Tensor]:
    return tuple(t.to(device) for t in rows._bin1_bounds(Spec(False, 0, 1.0, 0.0, 1.0, shift, 1, bins, span, 0),
                                                          torch.device("cpu")))


def after_mass(plan: RowPlan, parts: tuple, merged: Tensor, spec: Spec, seed: Tensor, offset: Tensor) -> RowPlan:
    """MASS rows from partials ``Z (N, Q)``, ``hist (N, Q, bins)`` (the plan is updated in place)."""
    z, hist = parts
    n, q = z.shape
    lo, hi = _bounds(spec.bins, spec.span, spec.shift, z.device)
    if n:
        _finish_mass_kernel[(n,)](z, hist, q, merged, seed, offset, lo, hi, plan.mode, plan.token, plan.xthr,
                                  plan.zmax, plan.dthr, plan.need, plan.b1, plan.orng, plan.count, z.stride(0),
                                  hist.stride(0), hist.stride(1), spec.c, spec.shift, _bits(spec.top_p), spec.cap,
                                  W=spec.span / (spec.bins - 1), KR=merged.shape[1], BINS=spec.bins, num_warps=4,
                                  **LAUNCH)
    return plan


def after_refine(plan: RowPlan, parts: tuple, spec: Spec) -> RowPlan:
    """REFINE rows from partials ``above (N, Q)``, ``hist (N, Q, bins)``, ``hist mass (N, Q', bins)``."""
    above, hist, hmass = parts
    n, q = above.shape
    if n:
        _finish_refine_kernel[(n,)](above, hist, hmass, q, hmass.shape[1], plan.mode, plan.dthr, plan.need,
                                    plan.orng, plan.count, above.stride(0), hist.stride(0), hist.stride(1),
                                    hmass.stride(0), hmass.stride(1), spec.cap, BINS=spec.bins, num_warps=4)
    return plan


def after_sample(plan: RowPlan, parts: tuple, spec: Spec) -> Tensor:
    """Tokens ``(N,)`` from partials ``best, above (N, Q)`` and candidates ``(N, Q', C)`` (d, zz, word, id)."""
    best, above, *cands = parts
    cand_d, cand_z, cand_w, cand_g = (t.flatten(1).contiguous() for t in cands)
    n, q = best.shape
    out = torch.empty(n, dtype=torch.int64, device=best.device)
    if n:
        c = cand_g.shape[1]
        args = (best, above, cand_d, cand_z, cand_w, cand_g, q, c, plan.mode, plan.token, plan.dthr, plan.need, out,
                best.stride(0), cand_g.stride(0), spec.shift)
        _SAMPLE((n,), _key(args), args, dict(QP=triton.next_power_of_2(q), CP=triton.next_power_of_2(max(c, 1)),
                                             num_warps=4, **LAUNCH))
    return out
