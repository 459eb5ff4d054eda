"""Triton kernels of the vocabulary statistics: the forward reads each logit once, the backward
reads it once and writes its gradient once; float32 statistics from any float input, never a
float32 copy of the logits, the logits never written.

Forward (``vocab_records``, ``kl_records``): grid ``(row blocks, splits)``. A program folds the
``[BLOCK_R, BLOCK_V]`` tiles of its column span into a running record (the online softmax state
with the value ``z`` measured from the running max; ``ops/vocab/torch.py`` defines the records)
and stores it. A row is split over several programs only when there are too few rows to fill
the GPU; the splits' records then merge with ``vocab_cpu.merge_records`` (the state algebra).
``vocab_finish`` / ``kl_finish`` turn merged records into the statistics (one elementwise launch).

Backward (``vocab_bwd``, ``kl_bwd``): the gradient of every tile from its rows' global
statistics (``m``, ``log l``, the mean); no communication.

``exp`` is ``exp2`` with ``log2(e) / T`` folded into one factor ``c`` applied to ``x - m`` (raw
logits, ``m`` formed first); the record is put in natural units of ``z = x / T`` once per row.
Same signatures and math as ``ops/vocab/torch.py``.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...core.runtime import interpreting
from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .._triton import configs
from .._triton.algebra import LOG2E, ref_max
from .torch import merge_kl_records, merge_records

LN2 = tl.constexpr(0.6931471805599453)
NEG = tl.constexpr(float("-inf"))


@triton.jit
def _fold(m, l, u, x, c, ENTROPY: tl.constexpr):
    """Fold the tile ``x [BLOCK_R, BLOCK_V]`` (raw float32 logits, ``-inf`` padded) into the running
    ``(m, l, u)`` ([BLOCK_R] each; ``u`` in log2 units, measured from ``m``)."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    ref = ref_max(m_new)
    e = (x - ref[:, None]) * c  # [BLOCK_R, BLOCK_V]
    p = tl.math.exp2(e)
    alpha = tl.math.exp2((m - ref) * c)
    if ENTROPY:
        shift = tl.where(l == 0.0, 0.0, (m - ref) * c * l)  # u moves to the new origin
        u = alpha * (u + shift) + tl.sum(tl.where(p > 0.0, p * e, 0.0), axis=1)
    l = alpha * l + tl.sum(p, axis=1)
    return m_new, l, u


@triton.jit(do_not_specialize=["col0", "span", "s_rs", "c", "inv_t"])
def _vocab_fwd_kernel(X, T, REC, N, V, col0, span, s_xn, s_rs, c, inv_t, BLOCK_R: tl.constexpr,
                      BLOCK_V: tl.constexpr, STAGES: tl.constexpr, TARGET: tl.constexpr, ENTROPY: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_R), splits)``: the record ``(m, l, u, z_t)`` of columns ``[split * span, +span)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rmask = rows < N
    split = tl.program_id(1)
    lo = split * span
    hi = tl.minimum(lo + span, V)
    xrow = X + rows.to(tl.int64) * s_xn  # [BLOCK_R]
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    u = tl.zeros([BLOCK_R], tl.float32)
    n_full = (hi - lo) // BLOCK_V
    for i in tl.range(n_full, num_stages=STAGES):  # whole tiles: no column mask
        c0 = tl.multiple_of(lo + i * BLOCK_V, BLOCK_V)
        x = tl.load(xrow[:, None] + (c0 + cols)[None, :], mask=rmask[:, None], other=float("-inf"),
                    eviction_policy="evict_first").to(tl.float32)  # [BLOCK_R, BLOCK_V]
        m, l, u = _fold(m, l, u, x, c, ENTROPY)
    if lo + n_full * BLOCK_V < hi:
        cc = lo + n_full * BLOCK_V + cols
        x = tl.load(xrow[:, None] + cc[None, :], mask=rmask[:, None] & (cc < hi)[None, :],
                    other=float("-inf")).to(tl.float32)  # [BLOCK_R, BLOCK_V]
        m, l, u = _fold(m, l, u, x, c, ENTROPY)
    zt = tl.zeros([BLOCK_R], tl.float32)
    if TARGET:
        t = tl.load(T + rows, mask=rmask, other=-1) - col0
        own = rmask & (t >= lo) & (t < hi)
        zt = tl.load(xrow + tl.where(own, t, 0), mask=own, other=0.0).to(tl.float32) * inv_t
    out = REC + split * s_rs + rows * 4
    tl.store(out, m * inv_t, mask=rmask)
    tl.store(out + 1, l, mask=rmask)
    tl.store(out + 2, u * LN2, mask=rmask)
    tl.store(out + 3, zt, mask=rmask)


@triton.jit
def _fold_kl(mp, lp, u, mq, lq, xp, xq, c):
    """Fold the tiles ``xp, xq [BLOCK_R, BLOCK_V]`` into the running KL record (``u`` in log2 units,
    measured from ``m_p - m_q``)."""
    mp_new = tl.maximum(mp, tl.max(xp, axis=1))
    mq_new = tl.maximum(mq, tl.max(xq, axis=1))
    rp, rq = ref_max(mp_new), ref_max(mq_new)
    ep = (xp - rp[:, None]) * c  # [BLOCK_R, BLOCK_V]
    eq = (xq - rq[:, None]) * c
    pp = tl.math.exp2(ep)
    ap = tl.math.exp2((mp - rp) * c)
    aq = tl.math.exp2((mq - rq) * c)
    shift = tl.where(lp == 0.0, 0.0, ((ref_max(mp) - rp) - (ref_max(mq) - rq)) * c * lp)
    u = ap * (u + shift) + tl.sum(tl.where(pp > 0.0, pp * (ep - eq), 0.0), axis=1)
    lp = ap * lp + tl.sum(pp, axis=1)
    lq = aq * lq + tl.sum(tl.math.exp2(eq), axis=1)
    return mp_new, lp, u, mq_new, lq


@triton.jit(do_not_specialize=["span", "s_rs", "c", "inv_t"])
def _kl_fwd_kernel(P, Q, REC, N, V, span, s_pn, s_qn, s_rs, c, inv_t, BLOCK_R: tl.constexpr,
                   BLOCK_V: tl.constexpr, STAGES: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_R), splits)``: the KL record ``(m_p, l_p, u, m_q, l_q)`` of a column span."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rmask = rows < N
    split = tl.program_id(1)
    lo = split * span
    hi = tl.minimum(lo + span, V)
    prow = P + rows.to(tl.int64)[:, None] * s_pn  # [BLOCK_R, 1]
    qrow = Q + rows.to(tl.int64)[:, None] * s_qn
    cols = tl.arange(0, BLOCK_V)
    mp = tl.full([BLOCK_R], float("-inf"), tl.float32)
    mq = tl.full([BLOCK_R], float("-inf"), tl.float32)
    lp = tl.zeros([BLOCK_R], tl.float32)
    lq = tl.zeros([BLOCK_R], tl.float32)
    u = tl.zeros([BLOCK_R], tl.float32)
    n_full = (hi - lo) // BLOCK_V
    for i in tl.range(n_full, num_stages=STAGES):
        cc = (tl.multiple_of(lo + i * BLOCK_V, BLOCK_V) + cols)[None, :]
        xp = tl.load(prow + cc, mask=rmask[:, None], other=float("-inf"), eviction_policy="evict_first")
        xq = tl.load(qrow + cc, mask=rmask[:, None], other=float("-inf"), eviction_policy="evict_first")
        mp, lp, u, mq, lq = _fold_kl(mp, lp, u, mq, lq, xp.to(tl.float32), xq.to(tl.float32), c)
    if lo + n_full * BLOCK_V < hi:
        cc = lo + n_full * BLOCK_V + cols
        mask = rmask[:, None] & (cc < hi)[None, :]
        xp = tl.load(prow + cc[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        xq = tl.load(qrow + cc[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        mp, lp, u, mq, lq = _fold_kl(mp, lp, u, mq, lq, xp, xq, c)
    out = REC + split * s_rs + rows * 5
    tl.store(out, mp * inv_t, mask=rmask)
    tl.store(out + 1, lp, mask=rmask)
    tl.store(out + 2, u * LN2, mask=rmask)
    tl.store(out + 3, mq * inv_t, mask=rmask)
    tl.store(out + 4, lq, mask=rmask)


@triton.jit(do_not_specialize=["N", "ignore_index"])
def _vocab_finish_kernel(REC, T, LOGP, ENT, ROWS, N, ignore_index, BLOCK: tl.constexpr, TARGET: tl.constexpr):
    """Grid ``cdiv(N, BLOCK)``: ``logp``, ``entropy`` and the backward's ``(m, log l, E_P[z] - m)``
    of merged records ``(N, 4)``."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = rows < N
    m = tl.load(REC + rows * 4, mask=mask, other=float("-inf"))
    l = tl.load(REC + rows * 4 + 1, mask=mask, other=0.0)
    u = tl.load(REC + rows * 4 + 2, mask=mask, other=0.0)
    zt = tl.load(REC + rows * 4 + 3, mask=mask, other=0.0)
    full = l != 0.0  # NaN rows count as full: NaN reaches every statistic
    log_l = tl.where(full, tl.log(tl.where(full, l, 1.0)), float("-inf"))
    rel = tl.where(full, u / tl.where(full, l, 1.0), 0.0)  # E_P[z] - m
    ref = ref_max(m)
    logp = tl.where(full, (zt - ref) - log_l, float("-inf"))
    ent = tl.where(full, log_l - rel, 0.0)
    if TARGET:
        skip = tl.load(T + rows, mask=mask, other=0) == ignore_index
        logp = tl.where(skip, 0.0, logp)
        ent = tl.where(skip, 0.0, ent)
    tl.store(LOGP + rows, logp, mask=mask)
    tl.store(ENT + rows, ent, mask=mask)
    tl.store(ROWS + rows * 3, ref, mask=mask)
    tl.store(ROWS + rows * 3 + 1, log_l, mask=mask)
    tl.store(ROWS + rows * 3 + 2, rel, mask=mask)


@triton.jit(do_not_specialize=["N"])
def _kl_finish_kernel(REC, KL, ROWS, N, BLOCK: tl.constexpr):
    """Grid ``cdiv(N, BLOCK)``: KL and the backward's ``(m_p, log l_p, m_q, log l_q, rel)`` of merged
    KL records ``(N, 5)``."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = rows < N
    mp = tl.load(REC + rows * 5, mask=mask, other=float("-inf"))
    lp = tl.load(REC + rows * 5 + 1, mask=mask, other=0.0)
    u = tl.load(REC + rows * 5 + 2, mask=mask, other=0.0)
    mq = tl.load(REC + rows * 5 + 3, mask=mask, other=float("-inf"))
    lq = tl.load(REC + rows * 5 + 4, mask=mask, other=0.0)
    pf, qf = lp != 0.0, lq != 0.0
    log_p = tl.where(pf, tl.log(tl.where(pf, lp, 1.0)), float("-inf"))
    log_q = tl.where(qf, tl.log(tl.where(qf, lq, 1.0)), float("-inf"))
    rel = tl.where(pf, u / tl.where(pf, lp, 1.0), 0.0)
    tl.store(KL + rows, tl.where(pf, tl.where(qf, rel - log_p + log_q, float("inf")), 0.0), mask=mask)
    out = ROWS + rows * 5
    tl.store(out, ref_max(mp), mask=mask)
    tl.store(out + 1, log_p, mask=mask)
    tl.store(out + 2, ref_max(mq), mask=mask)
    tl.store(out + 3, log_q, mask=mask)
    tl.store(out + 4, rel, mask=mask)


@triton.jit
def _stats_grad(x, cols, t, ref, log_l, rel, gl, gh, inv_t, TARGET: tl.constexpr, ENTROPY: tl.constexpr):
    """``(gl (onehot - P) - gh P (z - E_P[z])) / T`` of a tile ``x [BLOCK_R, BLOCK_V]``; 0 in rows
    where both coefficients are 0."""
    d = x * inv_t - ref[:, None]  # [BLOCK_R, BLOCK_V]: z - m
    p = tl.math.exp2((d - log_l[:, None]) * LOG2E)
    g = tl.zeros_like(d)
    if ENTROPY:
        g = -gh[:, None] * tl.where(d == float("-inf"), 0.0, p * (d - rel[:, None]))
    if TARGET:
        g += gl[:, None] * (tl.where(cols[None, :] == t[:, None], 1.0, 0.0) - p)
    dead = (gl == 0.0) & (gh == 0.0)
    return tl.where(dead[:, None], 0.0, g * inv_t)


@triton.jit(do_not_specialize=["col0", "span", "inv_t"])
def _vocab_bwd_kernel(X, T, ROWS, GL, GH, DX, N, V, col0, span, s_xn, s_dn, inv_t, BLOCK_R: tl.constexpr,
                      BLOCK_V: tl.constexpr, TARGET: tl.constexpr, ENTROPY: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_R), splits)``: the gradient of columns ``[split * span, +span)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rmask = rows < N
    lo = tl.program_id(1) * span
    hi = tl.minimum(lo + span, V)
    ref = tl.load(ROWS + rows * 3, mask=rmask, other=0.0)
    log_l = tl.load(ROWS + rows * 3 + 1, mask=rmask, other=0.0)
    rel = tl.load(ROWS + rows * 3 + 2, mask=rmask, other=0.0)
    gl = tl.zeros([BLOCK_R], tl.float32)
    gh = tl.zeros([BLOCK_R], tl.float32)
    t = tl.zeros([BLOCK_R], tl.int64) - 1
    if TARGET:
        gl = tl.load(GL + rows, mask=rmask, other=0.0)
        t = tl.load(T + rows, mask=rmask, other=-1).to(tl.int64) - col0
    if ENTROPY:
        gh = tl.load(GH + rows, mask=rmask, other=0.0)
    xrow = X + rows.to(tl.int64)[:, None] * s_xn  # [BLOCK_R, 1]
    drow = DX + rows.to(tl.int64)[:, None] * s_dn
    lanes = tl.arange(0, BLOCK_V)
    n_full = (hi - lo) // BLOCK_V
    for i in range(n_full):  # whole tiles: no column mask
        cols = tl.multiple_of(lo + i * BLOCK_V, BLOCK_V) + lanes
        x = tl.load(xrow + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        g = _stats_grad(x, cols, t, ref, log_l, rel, gl, gh, inv_t, TARGET, ENTROPY)
        tl.store(drow + cols[None, :], g.to(DX.dtype.element_ty, fp_downcast_rounding="rtne"), mask=rmask[:, None])
    cols = lo + n_full * BLOCK_V + lanes
    mask = rmask[:, None] & (cols < hi)[None, :]
    x = tl.load(xrow + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = _stats_grad(x, cols, t, ref, log_l, rel, gl, gh, inv_t, TARGET, ENTROPY)
    tl.store(drow + cols[None, :], g.to(DX.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _kl_grad(xp, xq, rp, log_p, rq, log_q, rel, g, inv_t):
    """``(g P_p ((p - q) - E_P[p - q]) / T, g (P_q - P_p) / T)`` of tiles ``[BLOCK_R, BLOCK_V]``;
    0 where ``g`` is."""
    ep = xp * inv_t - rp[:, None]  # [BLOCK_R, BLOCK_V]: p - m_p
    eq = xq * inv_t - rq[:, None]
    pp = tl.where(ep == float("-inf"), 0.0, tl.math.exp2((ep - log_p[:, None]) * LOG2E))
    pq = tl.where(eq == float("-inf"), 0.0, tl.math.exp2((eq - log_q[:, None]) * LOG2E))
    gp = tl.where(ep == float("-inf"), 0.0, pp * ((ep - eq) - rel[:, None]))
    k = (g * inv_t)[:, None]
    dead = (g == 0.0)[:, None]
    return tl.where(dead, 0.0, k * gp), tl.where(dead, 0.0, k * (pq - pp))


@triton.jit(do_not_specialize=["span", "inv_t"])
def _kl_bwd_kernel(P, Q, ROWS, G, DP, DQ, N, V, span, s_pn, s_qn, s_dpn, s_dqn, inv_t,
                   BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_R), splits)``: ``(dp, dq)`` of columns ``[split * span, +span)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rmask = rows < N
    lo = tl.program_id(1) * span
    hi = tl.minimum(lo + span, V)
    rp = tl.load(ROWS + rows * 5, mask=rmask, other=0.0)
    log_p = tl.load(ROWS + rows * 5 + 1, mask=rmask, other=0.0)
    rq = tl.load(ROWS + rows * 5 + 2, mask=rmask, other=0.0)
    log_q = tl.load(ROWS + rows * 5 + 3, mask=rmask, other=0.0)
    rel = tl.load(ROWS + rows * 5 + 4, mask=rmask, other=0.0)
    g = tl.load(G + rows, mask=rmask, other=0.0)
    r64 = rows.to(tl.int64)[:, None]  # [BLOCK_R, 1]
    lanes = tl.arange(0, BLOCK_V)
    for c0 in range(lo, hi, BLOCK_V):
        cols = (c0 + lanes)[None, :]
        mask = rmask[:, None] & (cols < hi)
        xp = tl.load(P + r64 * s_pn + cols, mask=mask, other=0.0).to(tl.float32)
        xq = tl.load(Q + r64 * s_qn + cols, mask=mask, other=0.0).to(tl.float32)
        gp, gq = _kl_grad(xp, xq, rp, log_p, rq, log_q, rel, g, inv_t)
        tl.store(DP + r64 * s_dpn + cols, gp.to(DP.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(DQ + r64 * s_dqn + cols, gq.to(DQ.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    return configs.VOCAB_INTERPRET_SMS if interpreting() else _device_sms(device.index or 0)


def plan(n: int, v: int, tile: tuple, device: torch.device) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_R, BLOCK_V, warps, stages, splits, span)`` for ``(N, V)`` logits and ``tile`` =
    (widest BLOCK_V, tile elements, warps, stages): short rows batched BLOCK_R per program (fewer
    while that leaves too few programs), warps cut to the tile (at least ``VOCAB_ELEMS_PER_WARP``
    elements each); a row split into ``splits`` spans of ``span`` columns (a multiple of BLOCK_V)
    when there are too few rows to fill the GPU."""
    widest, elems, warps, stages = configs.VOCAB_TILE_INTERPRET if interpreting() else tile
    programs = configs.VOCAB_PROGRAMS_PER_SM * _sms(device)
    block_v = min(widest, max(16, triton.next_power_of_2(max(v, 1))))
    block_r = max(1, min(elems // block_v, triton.next_power_of_2(max(n, 1))))
    while block_r > 1 and configs.cdiv(n, block_r) < programs:
        block_r //= 2
    warps = max(1, min(warps, block_r * block_v // configs.VOCAB_ELEMS_PER_WARP))
    splits = max(1, min(configs.cdiv(programs, configs.cdiv(max(n, 1), block_r)), configs.cdiv(max(v, 1), block_v)))
    span = configs.cdiv(configs.cdiv(max(v, 1), splits), block_v) * block_v
    return block_r, block_v, warps, stages, configs.cdiv(max(v, 1), span), span


def _unit(x: Tensor) -> Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def vocab_records(logits: Tensor, target: Optional[Tensor], col0: int, inv_t: float, entropy: bool) -> Tensor:
    """``(N, 4)`` float32 record ``(m, l, u, z_t)`` of ``logits (N, V)`` (see ``vocab_cpu.vocab_records``)."""
    logits = _unit(logits)
    n, v = logits.shape
    block_r, block_v, warps, stages, splits, span = plan(n, v, configs.VOCAB_FWD_TILE, logits.device)
    rec = torch.empty((splits, n, 4), dtype=torch.float32, device=logits.device)
    if n:
        t = target.contiguous() if target is not None else rec
        _vocab_fwd_kernel[(configs.cdiv(n, block_r), splits)](
            logits, t, rec, n, v, col0, span, logits.stride(0), n * 4, LOG2E.value * inv_t, inv_t,
            BLOCK_R=block_r, BLOCK_V=block_v, STAGES=stages, TARGET=target is not None, ENTROPY=entropy,
            num_warps=warps)
    return rec[0] if splits == 1 else merge_records(rec)


def kl_records(p: Tensor, q: Tensor, inv_t: float) -> Tensor:
    """``(N, 5)`` float32 KL record of ``p, q (N, V)`` (see ``vocab_cpu.kl_records``)."""
    p, q = _unit(p), _unit(q)
    n, v = p.shape
    block_r, block_v, warps, stages, splits, span = plan(n, v, configs.VOCAB_KL_FWD_TILE, p.device)
    rec = torch.empty((splits, n, 5), dtype=torch.float32, device=p.device)
    if n:
        _kl_fwd_kernel[(configs.cdiv(n, block_r), splits)](
            p, q, rec, n, v, span, p.stride(0), q.stride(0), n * 5, LOG2E.value * inv_t, inv_t,
            BLOCK_R=block_r, BLOCK_V=block_v, STAGES=stages, num_warps=warps)
    return rec[0] if splits == 1 else merge_kl_records(rec)


def vocab_finish(rec: Tensor, target: Optional[Tensor], ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(logp (N,), entropy (N,), rows (N, 3))`` float32 of merged records (``vocab_cpu.vocab_finish``)."""
    n = rec.shape[0]
    rec = rec.float().contiguous()
    logp, ent = (torch.empty(n, dtype=torch.float32, device=rec.device) for _ in range(2))
    rows = torch.empty((n, 3), dtype=torch.float32, device=rec.device)
    if n:
        block = configs.VOCAB_FINISH_ROWS
        t = target.contiguous() if target is not None else rec
        _vocab_finish_kernel[(configs.cdiv(n, block),)](rec, t, logp, ent, rows, n, ignore_index, BLOCK=block,
                                                        TARGET=target is not None)
    return logp, ent, rows


def kl_finish(rec: Tensor) -> tuple[Tensor, Tensor]:
    """``(kl (N,), rows (N, 5))`` float32 of merged KL records (``vocab_cpu.kl_finish``)."""
    n = rec.shape[0]
    rec = rec.float().contiguous()
    kl = torch.empty(n, dtype=torch.float32, device=rec.device)
    rows = torch.empty((n, 5), dtype=torch.float32, device=rec.device)
    if n:
        block = configs.VOCAB_FINISH_ROWS
        _kl_finish_kernel[(configs.cdiv(n, block),)](rec, kl, rows, n, BLOCK=block)
    return kl, rows


def vocab_bwd(logits: Tensor, target: Optional[Tensor], rows: Tensor, gl: Optional[Tensor], gh: Optional[Tensor],
              inv_t: float, col0: int) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype`` (``vocab_cpu.vocab_bwd``)."""
    logits = _unit(logits)
    n, v = logits.shape
    block_r, block_v, warps, stages, splits, span = plan(n, v, configs.VOCAB_BWD_TILE, logits.device)
    dx = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    if n and v:
        rows = rows.float().contiguous()
        gl_, gh_ = (rows if a is None else a.float().contiguous() for a in (gl, gh))
        t = target.contiguous() if gl is not None else rows
        _vocab_bwd_kernel[(configs.cdiv(n, block_r), splits)](
            logits, t, rows, gl_, gh_, dx, n, v, col0, span, logits.stride(0), dx.stride(0), inv_t, BLOCK_R=block_r,
            BLOCK_V=block_v, TARGET=gl is not None, ENTROPY=gh is not None, num_warps=warps, num_stages=stages)
    return dx


def kl_bwd(p: Tensor, q: Tensor, rows: Tensor, g: Tensor, inv_t: float) -> tuple[Tensor, Tensor]:
    """``(dp, dq)`` in the dtypes of ``p, q (N, V)`` (``vocab_cpu.kl_bwd``)."""
    p, q = _unit(p), _unit(q)
    n, v = p.shape
    block_r, block_v, warps, stages, splits, span = plan(n, v, configs.VOCAB_KL_BWD_TILE, p.device)
    dp = torch.empty((n, v), dtype=p.dtype, device=p.device)
    dq = torch.empty((n, v), dtype=q.dtype, device=q.device)
    if n and v:
        _kl_bwd_kernel[(configs.cdiv(n, block_r), splits)](
            p, q, rows.float().contiguous(), g.float().contiguous(), dp, dq, n, v, span, p.stride(0), q.stride(0),
            dp.stride(0), dq.stride(0), inv_t, BLOCK_R=block_r, BLOCK_V=block_v, num_warps=warps, num_stages=stages)
    return dp, dq
