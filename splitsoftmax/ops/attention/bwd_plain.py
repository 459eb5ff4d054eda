"""The attention backward's pair of dK/dV, then dQ: plain visibility (full or causal) and, on Hopper,
the variants' masks.

Two atomic-free kernels, seven products per tile pair: one program per key block and kv head sums
dK, dV over every query block of the G query heads that read that kv head; then one program per
query block and head walks its key blocks for dQ. On Hopper the Gluon dK/dV kernel also writes
each tile's dS and the dQ kernel reads it (``_attn_bwd_q_ds_kernel``, every mask): five products per
tile pair, for a buffer the backward holds (:func:`_ds_pieces`). On one H200 (Triton 3.6) this pair
ran 8-12% faster than ``attention_bwd``'s general pair at every plain shape timed
(docs/benchmarks/attention-backward.md), so ``attention_bwd.attn_bwd`` hands plain masks here. Its Gluon kernels (sm_90,
bfloat16) also take the variants' masks (:func:`takes`); elsewhere those take the general pair. Gradients are written
once, in the output dtype, with their inputs' strides where dense.
"""
from __future__ import annotations

import functools
import importlib
from typing import Hashable, NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .._triton import configs
from .._triton.algebra import LOG2E
from ...core.runtime import interpreting
from ...core.mask import NO_MASK, Mask, row_reach
from ...core.state import stat_dtype
from .fwd import _dot, _load_rows, _program_order
from .bwd_common import (_batch_bounds, _descriptor, _finite_or_zero, _mask_args, _seen, _sink_keys, _tile, _tma_ok,
                         q_walk, row_blocks, sink_args, sink_buffers, sink_sums)
from .decode import attn_tile, dot_precision, head_group, pad_dim
from .._triton.device import hopper, sm90, sm_count
from .._triton.launch import Launcher, Memo, auto_key, geometry


@triton.jit
def _bwd_kv_tile(dk, dv, k, v, q_src, do_src, l_base, e_base, b, h, m0, kj, Sq, diag, qk_scale,
                 s_qs, s_ds, s_ls, s_es, offs_d, offs_dv, dmask, dvmask,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr,
                 EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
                 SINK: tl.constexpr, sink):
    """``(dk, dv, w)``: dK, dV of one key block from one query block; ``MASKED``: the block crosses
    the diagonal. ``q_src``, ``do_src``: the ``(B, H, S, D)`` descriptors (``TMA``) or head
    ``(b, h)``'s base pointers. ``SINK``: ``w [BLOCK_N]`` is the tile's ``bwd_common._sink_keys``
    under the head's sink ``sink``, else 0."""
    qi = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    qmask = qi < Sq
    q = _tile(q_src, b, h, m0, qi, offs_d, qmask, dmask, s_qs, BLOCK_M, BLOCK_D, EVEN_D, TMA)  # [BLOCK_M, BLOCK_D]
    do = _tile(do_src, b, h, m0, qi, offs_dv, qmask, dvmask, s_ds, BLOCK_M, BLOCK_DV, EVEN_DV, TMA)
    lse2 = tl.load(l_base + qi * s_ls, mask=qmask, other=float("inf")) * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # empty or inactive row: p = 0
    delta = tl.load(e_base + qi * s_es, mask=qmask, other=0.0)
    qk_t = _dot(k, tl.trans(q), None, PREC)  # [BLOCK_N, BLOCK_M]
    p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
    if MASKED:
        seen = kj[:, None] <= qi[None, :] + diag  # [BLOCK_N, BLOCK_M]
        p_t = tl.where(seen, p_t, 0.0)
        do = _finite_or_zero(do)  # hidden pairs must give exact zeros, never 0 * NaN
    dv = _dot(p_t.to(do.dtype), do, dv, PREC)  # [BLOCK_N, BLOCK_DV]
    dp_t = _dot(v, tl.trans(do), None, PREC)  # [BLOCK_N, BLOCK_M]
    ds_t = p_t * (dp_t - delta[None, :])
    if MASKED:
        ds_t = tl.where(seen, ds_t, 0.0)
        q = _finite_or_zero(q)
    dk = _dot(ds_t.to(q.dtype), q, dk, PREC)  # [BLOCK_N, BLOCK_D]
    w = 0.0
    if SINK:  # (dO is guarded in masked tiles: hidden pairs give 0)
        w = _sink_keys(p_t * dp_t, lse2, sink)
    return dk, dv, w


@triton.jit(do_not_specialize=["Sq", "Sk", "diag", "GH", "s_lb", "s_lh", "s_eb", "s_eh"])
def _attn_bwd_kv_kernel(Q, K, V, DO, LSE, DELTA, GK, GV,
                        s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd,
                        s_db, s_dh, s_ds, s_dd, s_lb, s_lh, s_ls, s_eb, s_eh, s_es,
                        s_kgb, s_kgh, s_kgs, s_kgd, s_vgb, s_vgh, s_vgs, s_vgd,
                        HKV, G, Sq, Sk, diag, qk_scale, scale, GH, SNK, PDP, s_wp, s_wb, s_wh,
                        D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
                        TMA: tl.constexpr = False, SINK: tl.constexpr = False):
    """Grid ``(key blocks, B * HKV)`` in the order of ``GH`` (``attention._program_order``).
    ``SINK``: query head ``h``'s ``bwd_common._sink_keys`` over the program's tiles go to
    ``PDP[0, b, h, n0 + j]`` (strides ``s_wp`` (unused), ``s_wb, s_wh``), its sink ``SNK[h]``
    (float32); without it ``SNK, PDP`` and their strides are None."""
    pid_n, pid_bh = _program_order(GH)
    b32 = pid_bh // HKV  # (TMA coordinates are int32)
    b = b32.to(tl.int64)
    kvh = (pid_bh % HKV).to(tl.int64)
    n0 = pid_n * BLOCK_N
    kj = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    kmask = kj < Sk
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dmask = offs_d < D
    dvmask = offs_dv < DV
    k = _load_rows(K + b * s_kb + kvh * s_kh + kj[:, None] * s_ks + offs_d[None, :] * s_kd,
                   kmask, dmask, True, BLOCK_D != D)  # [BLOCK_N, BLOCK_D]
    v = _load_rows(V + b * s_vb + kvh * s_vh + kj[:, None] * s_vs + offs_dv[None, :] * s_vd,
                   kmask, dvmask, True, BLOCK_DV != DV)  # [BLOCK_N, BLOCK_DV]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # query blocks [m_start, m_full) cross the diagonal; from m_full on every query sees every key
    m_start = 0
    m_full = 0
    if CAUSAL:
        m_start = (tl.maximum(n0 - diag, 0) // BLOCK_M) * BLOCK_M
        m_full = tl.maximum(m_start, tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M)
    for gi in range(G):  # the query heads that read this kv head
        h = kvh * G + gi
        if TMA:
            q_src, do_src = Q, DO
        else:
            q_src, do_src = Q + b * s_qb + h * s_qh, DO + b * s_db + h * s_dh
        l_base = LSE + b * s_lb + h * s_lh
        e_base = DELTA + b * s_eb + h * s_eh
        h32 = h.to(tl.int32)
        sink = 0.0
        if SINK:
            sink = tl.load(SNK + h)
            acc = tl.zeros([BLOCK_N], tl.float32)
        for m0 in range(m_start, tl.minimum(m_full, Sq), BLOCK_M):
            dk, dv, w = _bwd_kv_tile(dk, dv, k, v, q_src, do_src, l_base, e_base, b32, h32, m0, kj, Sq, diag,
                                     qk_scale, s_qs, s_ds, s_ls, s_es, offs_d * s_qd, offs_dv * s_dd, dmask, dvmask,
                                     BLOCK_M, BLOCK_D, BLOCK_DV, True, BLOCK_D == D, BLOCK_DV == DV, PREC, TMA,
                                     SINK, sink)
            if SINK:
                acc += w
        for m0 in range(m_full, Sq, BLOCK_M):
            dk, dv, w = _bwd_kv_tile(dk, dv, k, v, q_src, do_src, l_base, e_base, b32, h32, m0, kj, Sq, diag,
                                     qk_scale, s_qs, s_ds, s_ls, s_es, offs_d * s_qd, offs_dv * s_dd, dmask, dvmask,
                                     BLOCK_M, BLOCK_D, BLOCK_DV, False, BLOCK_D == D, BLOCK_DV == DV, PREC, TMA,
                                     SINK, sink)
            if SINK:
                acc += w
        if SINK:
            tl.store(PDP + b * s_wb + h * s_wh + kj, acc)
    st = kmask[:, None]
    tl.store(GK + b * s_kgb + kvh * s_kgh + kj[:, None] * s_kgs + offs_d[None, :] * s_kgd, dk * scale,
             mask=st & dmask[None, :])
    tl.store(GV + b * s_vgb + kvh * s_vgh + kj[:, None] * s_vgs + offs_dv[None, :] * s_vgd, dv,
             mask=st & dvmask[None, :])


@triton.jit
def _bwd_q_tile(dq, q, do, lse2, delta, k_src, v_src, b, kvh, n0, kj, qi, Sk, diag, qk_scale, s_ks, s_vs,
                dmask, dvmask, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                CAUSAL: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                PREC: tl.constexpr, TMA: tl.constexpr):
    """dQ of one query block from one key block; ``MASKED``: keys past Sk or across the diagonal.
    ``k_src``, ``v_src``: the ``(B, Hkv, S, D)`` descriptors (``TMA``, zeros past Sk) or kv head
    ``(b, kvh)``'s base pointers with the column offsets."""
    kmask = kj < Sk
    if TMA:
        k = k_src.load([b, kvh, n0, 0]).reshape(BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        v = v_src.load([b, kvh, n0, 0]).reshape(BLOCK_N, BLOCK_DV)  # [BLOCK_N, BLOCK_DV]
    else:
        k = _load_rows(k_src + kj[:, None] * s_ks, kmask, dmask, MASKED, not EVEN_D)  # [BLOCK_N, BLOCK_D]
        v = _load_rows(v_src + kj[:, None] * s_vs, kmask, dvmask, MASKED, not EVEN_DV)  # [BLOCK_N, BLOCK_DV]
    qk = _dot(q, tl.trans(k), None, PREC)  # [BLOCK_M, BLOCK_N]
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    dp = _dot(do, tl.trans(v), None, PREC)  # [BLOCK_M, BLOCK_N]
    ds = p * (dp - delta[:, None])
    if MASKED:  # hidden pairs give exact zeros, never 0 * NaN from a NaN/Inf key or value
        ok = kmask[None, :]
        if CAUSAL:
            ok = ok & (kj[None, :] <= qi[:, None] + diag)
        ds = tl.where(ok, ds, 0.0)
        k = _finite_or_zero(k)
    return _dot(ds.to(k.dtype), k, dq, PREC)  # [BLOCK_M, BLOCK_D]


@triton.jit
def _q_keys(m0, Sq, Sk, diag, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(mid, hi)`` of query block ``m0``: key blocks from 0 to ``mid`` are seen by every row of
    the block, those from ``mid`` to ``hi`` by some (across the diagonal or past ``Sk``)."""
    hi = Sk
    full = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, tl.maximum(tl.minimum(m0 + BLOCK_M, Sq) + diag, 0))
        full = tl.minimum(hi, tl.maximum(m0 + diag + 1, 0))
    return (full // BLOCK_N) * BLOCK_N, hi


@triton.jit(do_not_specialize=["Sq", "Sk", "diag", "GH", "s_lb", "s_lh", "s_eb", "s_eh"])
def _attn_bwd_q_kernel(Q, K, V, DO, LSE, DELTA, GQ,
                       s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd,
                       s_db, s_dh, s_ds, s_dd, s_lb, s_lh, s_ls, s_eb, s_eh, s_es,
                       s_qgb, s_qgh, s_qgs, s_qgd,
                       H, G, Sq, Sk, diag, qk_scale, scale, GH,
                       D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
                       TMA: tl.constexpr = False):
    """Grid ``(query blocks, B * H)`` in the order of ``GH`` (``attention._program_order``)."""
    pid_m, pid_bh = _program_order(GH)
    if CAUSAL:  # the query blocks with the most visible keys start first: a shorter tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    b32 = pid_bh // H  # (TMA coordinates are int32)
    kvh32 = (pid_bh % H) // G
    b = b32.to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    kvh = kvh32.to(tl.int64)
    m0 = pid_m * BLOCK_M
    qi = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    qmask = qi < Sq
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dmask = offs_d < D
    dvmask = offs_dv < DV
    q = _load_rows(Q + b * s_qb + h * s_qh + qi[:, None] * s_qs + offs_d[None, :] * s_qd,
                   qmask, dmask, True, BLOCK_D != D)  # [BLOCK_M, BLOCK_D]
    do = _load_rows(DO + b * s_db + h * s_dh + qi[:, None] * s_ds + offs_dv[None, :] * s_dd,
                    qmask, dvmask, True, BLOCK_DV != DV)  # [BLOCK_M, BLOCK_DV]
    lse2 = tl.load(LSE + b * s_lb + h * s_lh + qi * s_ls, mask=qmask, other=float("inf")) * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # empty row: p = 0
    delta = tl.load(DELTA + b * s_eb + h * s_eh + qi * s_es, mask=qmask, other=0.0)
    mid, hi = _q_keys(m0, Sq, Sk, diag, BLOCK_M, BLOCK_N, CAUSAL)
    offs_n = tl.arange(0, BLOCK_N)
    if TMA:
        k_src, v_src = K, V
    else:
        k_src = K + b * s_kb + kvh * s_kh + offs_d[None, :] * s_kd
        v_src = V + b * s_vb + kvh * s_vh + offs_dv[None, :] * s_vd
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, mid, BLOCK_N):
        kj = n0 + offs_n
        dq = _bwd_q_tile(dq, q, do, lse2, delta, k_src, v_src, b32, kvh32, n0, kj, qi, Sk, diag, qk_scale, s_ks, s_vs,
                         dmask, dvmask, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, False, BLOCK_D == D, BLOCK_DV == DV,
                         PREC, TMA)
    for n0 in range(mid, hi, BLOCK_N):
        kj = n0 + offs_n
        dq = _bwd_q_tile(dq, q, do, lse2, delta, k_src, v_src, b32, kvh32, n0, kj, qi, Sk, diag, qk_scale, s_ks, s_vs,
                         dmask, dvmask, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, True, BLOCK_D == D, BLOCK_DV == DV,
                         PREC, TMA)
    tl.store(GQ + b * s_qgb + h * s_qgh + qi[:, None] * s_qgs + offs_d[None, :] * s_qgd, dq * scale,
             mask=qmask[:, None] & dmask[None, :])


@triton.jit
def _ds_col(nb, m0, dg, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_M: tl.constexpr, CAUSAL: tl.constexpr):
    """The ``dS^T`` buffer's column of query row ``m0`` (a multiple of ``BLOCK_M``) in key block
    ``nb``'s row: ``m0`` less the block's first row in the causal band (its first query block of
    ``KV_M`` rows, as the dK/dV kernel takes it) rounded down to ``BLOCK_M``; 0 where that starts past
    ``m0`` (no pair of those rows is seen: the tile is masked out)."""
    c0 = 0
    if CAUSAL:
        c0 = tl.maximum(nb * BLOCK_N - dg, 0) // KV_M * KV_M // BLOCK_M * BLOCK_M
    return tl.maximum(m0 - c0, 0)


@triton.jit(do_not_specialize=["Sq", "Sk", "diag", "lo", "GH"])
def _attn_bwd_q_ds_kernel(DS, K, GQ, KVR, QOFF, ROWS, s_qgb, s_qgh, s_qgs, s_qgd, s_kvb, s_kvc, s_off, s_r,
                          H, G, Sq, Sk, diag, lo, scale, GH,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_M: tl.constexpr,
                          CAUSAL: tl.constexpr, HAS_LO: tl.constexpr, HAS_KV: tl.constexpr, HAS_OFF: tl.constexpr,
                          HAS_ROWS: tl.constexpr, PREC: tl.constexpr):
    """``dQ = scale * dS K`` from the ``dS^T`` tiles the dK/dV kernel wrote (``DS``: the 2-D
    ``(B * H * key blocks * BLOCK_N, query columns)`` descriptor, ``[BLOCK_N, BLOCK_M]`` tiles; ``K``:
    the ``(B, Hkv, S, D)`` one, ``[1, 1, BLOCK_N, D]`` tiles, zeros past Sk), a key block's columns
    from its first row in the causal band (:func:`_ds_col`). Grid ``(query blocks, B * H)`` in the
    order of ``GH``. The key blocks every row sees whole come first; the others (a pair some row does
    not see: the mask's edges or past ``Sk``) take only the pairs the rows see (the tiles no pair of
    them sees were not written) and K with its NaN/Inf zeroed, as the dQ kernels that recompute
    ``dS``. The mask's tensors, strides and flags are ``attention_bwd._attn_bwd_q_kernel``'s (a
    softcap is in the written ``dS``)."""
    pid_m, pid_bh = _program_order(GH)
    if CAUSAL:  # the query blocks with the most visible keys start first: a shorter tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // G
    m0 = pid_m * BLOCK_M
    qi = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    kv_lo, kv_hi, dg, lw = _batch_bounds(KVR, QOFF, s_kvb, s_kvc, s_off, b, Sk, diag, lo, HAS_KV, HAS_OFF)
    rlo, rhi, first, end, ia, ib = q_walk(ROWS, s_r, m0, Sq, Sk, dg, lw, kv_lo, kv_hi, BLOCK_M, BLOCK_N, CAUSAL,
                                          HAS_LO, HAS_ROWS)
    row0 = pid_bh * tl.cdiv(Sk, BLOCK_N) * BLOCK_N  # head (b, h)'s first row of DS
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for nb in range(ia, ib):
        ds_t = DS.load([row0 + nb * BLOCK_N, _ds_col(nb, m0, dg, BLOCK_M, BLOCK_N, KV_M, CAUSAL)])  # [BLOCK_N, BLOCK_M]
        k = K.load([b, kvh, nb * BLOCK_N, 0]).reshape(BLOCK_N, D)  # [BLOCK_N, D]
        dq = _dot(tl.trans(ds_t), k, dq, PREC)
    n_pre = ia - first
    for it in range(0, n_pre + end - ib):  # blocks [first, ia), then [ib, end)
        n0 = tl.where(it < n_pre, first + it, ib + it - n_pre) * BLOCK_N
        kj = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        ok = _seen(kj[:, None], qi[None, :], rlo[None, :], rhi[None, :], dg, lw, kv_lo, kv_hi, CAUSAL, HAS_LO,
                   HAS_ROWS)
        ds_t = DS.load([row0 + n0, _ds_col(n0 // BLOCK_N, m0, dg, BLOCK_M, BLOCK_N, KV_M, CAUSAL)])
        ds_t = tl.where(ok, ds_t, 0.0).to(ds_t.dtype)
        k = _finite_or_zero(K.load([b, kvh, n0, 0]).reshape(BLOCK_N, D))
        dq = _dot(tl.trans(ds_t), k, dq, PREC)
    rows = qi.to(tl.int64)
    cols = tl.arange(0, D)
    tl.store(GQ + b.to(tl.int64) * s_qgb + h.to(tl.int64) * s_qgh + rows[:, None] * s_qgs + cols[None, :] * s_qgd,
             dq * scale, mask=(qi < Sq)[:, None])


_KV, _Q = Launcher(_attn_bwd_kv_kernel), Launcher(_attn_bwd_q_kernel)
_QDS = Launcher(_attn_bwd_q_ds_kernel)


class _Launches(NamedTuple):
    """Both launches of :func:`attn_bwd` but their tensors, a function of the operands' geometry:
    per kernel ``(grid, key, scalars, kwargs)``, None where it has nothing to write; ``tma``: the
    Triton kernels read Q/dO (dK/dV) and K/V (dQ) tiles through descriptors, ``(rows of the dK/dV
    kernel's query tiles, rows of the dQ kernel's key tiles)``; ``gluon``: the Gluon kernel each of
    the two launches (dK/dV, dQ) runs, by name, or None (their descriptors' rows: their kwargs' tile;
    their tensors after the gradients: the mask's, :func:`_mask_tensors`); ``ds``: ``(rows, columns,
    rows of its tiles, columns of the dK/dV kernel's tiles, of the dQ kernel's)`` of the ``dS^T``
    buffer the dK/dV kernel writes and the dQ kernel reads (:func:`_ds_shape`), or None."""
    kv: Optional[tuple]
    q: Optional[tuple]
    tma: Optional[tuple]
    gluon: tuple = (None, None)
    ds: Optional[tuple] = None


# launches by geometry: the host work of a repeated backward is a lookup
_LAUNCHES = Memo()


def _use_tma(q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> bool:
    """Whether the pair reads its streamed tiles through TMA: ``configs.ATTN_BWD_TMA``, 2-byte
    inputs that a descriptor can address (unpadded head dims, 16-byte strides), Hopper on or the
    interpreter."""
    return (configs.ATTN_BWD_TMA and q.dtype in (torch.float16, torch.bfloat16) and dout.dtype == q.dtype
            and (interpreting() or hopper(q)) and all(_tma_ok(t) for t in (q, k, v, dout)))


def takes(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, mask: Mask) -> bool:
    """Whether this pair computes the backward of ``mask``: plain visibility always; the variants'
    masks where both Gluon kernels run (they have the variants' rule)."""
    return mask.plain() or (_use_tma(q, k, v, dout) and all(_gluon_tile(kind, q, v)
                                                            for kind in ("bwd_kv_ws", "bwd_q_gluon")))


def fused(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, mask: Mask, sinks: Optional[Tensor]) -> bool:
    """Whether the fused five-product Gluon kernel (``gluon/bwd_fused.py``) takes the backward:
    ``configs.ATTN_BWD_FUSED``, not under deterministic algorithms (its dQ sums in arrival order),
    a Hopper GPU (sm_90), bfloat16 or float16 inputs of one dtype that TMA can address, a head dim
    (equal for keys and values) with a ``"bwd_fused"`` tile, no sinks, and a visibility (full or
    causal) and mask fields all in ``configs.ATTN_BWD_FUSED_MASKS``, and at least
    ``configs.ATTN_BWD_FUSED_MIN_WAVES`` programs (a key block of a kv head) per SM. Elsewhere the
    pair runs."""
    if not configs.ATTN_BWD_FUSED or torch.are_deterministic_algorithms_enabled() or sinks is not None:
        return False
    d = q.shape[-1]
    if (interpreting() or q.dtype not in (torch.float16, torch.bfloat16) or v.shape[-1] != d
            or ("bwd_fused", 2, d) not in configs.ATTN_TILES or not sm90(q)):
        return False
    used = ("causal" if causal else "full", *_mask_fields(mask))
    programs = configs.cdiv(k.shape[2], configs.ATTN_TILES[("bwd_fused", 2, d)][1]) * k.shape[0] * k.shape[1]
    return (_use_tma(q, k, v, dout) and all(f in configs.ATTN_BWD_FUSED_MASKS for f in used)
            and programs >= configs.ATTN_BWD_FUSED_MIN_WAVES * sm_count(q))


def _mask_fields(mask: Mask) -> tuple:
    """The variant fields ``mask`` uses: of ``("lo", "kv_range", "q_offset", "rows", "softcap")``."""
    used = (mask.lo is not None, mask.kv_range is not None, mask.q_offset is not None, mask.rows is not None,
            mask.softcap > 0)
    return tuple(f for f, u in zip(("lo", "kv_range", "q_offset", "rows", "softcap"), used) if u)


def _gluon_tile(kind: str, q: Tensor, v: Tensor) -> Optional[tuple]:
    """The tile of the Gluon kernel ``kind`` ("bwd_kv_ws", "bwd_q_gluon") if it runs here, else None:
    ``configs.ATTN_BWD_GLUON``, a Hopper GPU (sm_90: its warpgroup products), not the interpreter,
    bfloat16 inputs (the dtype its GPU tests cover), a tile listed for the head dim (equal for keys
    and values); the caller has checked the operands (``_use_tma``)."""
    d = q.shape[-1]
    if (not configs.ATTN_BWD_GLUON or interpreting() or q.dtype != torch.bfloat16 or v.shape[-1] != d
            or not sm90(q)):
        return None
    return configs.ATTN_TILES.get((kind, 2, d))


# the Gluon kernels of the pair, by name, and the modules that hold them
_GLUON_MODULES = {"_attn_bwd_kv_ws": "gluon.bwd_kv", "_attn_bwd_q_gluon": "gluon.bwd"}


@functools.lru_cache(maxsize=None)
def _gluon_launcher(name: str) -> Launcher:
    """The launcher of the Gluon kernel ``name`` (imported on first use: Gluon needs a CUDA build)."""
    return Launcher(getattr(importlib.import_module(f".{_GLUON_MODULES[name]}", __package__), name))


def _gluon_operands(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, kwargs: dict) -> tuple:
    """The Gluon descriptors ``(q, dout, k, v)`` of a launch with tile ``kwargs``."""
    descriptor = _gluon_descriptor()
    bm, bn = kwargs["BLOCK_M"], kwargs["BLOCK_N"]
    return descriptor(q, bm), descriptor(dout, bm), descriptor(k, bn), descriptor(v, bn)


def _gluon_launch(tile: tuple, grid: tuple, scalars: tuple, tensors: tuple, causal: bool, d: int, dtypes,
                  **options) -> tuple:
    """``(grid, key, scalars, kwargs)`` of a Gluon kernel's launch (its tile ``tile``; ``options``
    beside it, such as ``maxnreg``)."""
    bm, bn, warps, stages = tile
    return (grid, (auto_key((*tensors, *scalars)), dtypes), scalars,
            dict(BLOCK_M=bm, BLOCK_N=bn, D=d, CAUSAL=causal, STAGES=stages, num_warps=warps, **options))


def _mask_tensors(mask: Mask, q: Tensor, k: Tensor, lse: Tensor) -> tuple:
    """``(KVR, QOFF, ROWS, RB)`` of ``mask`` as the Gluon kernels read them (``lse`` standing in for
    absent ones), ``RB`` the documents' row blocks of the dK/dV kernel's key blocks."""
    kvr, off, rows, _, flags = _mask_args(mask, q, lse)
    rb = lse
    if flags["HAS_ROWS"]:
        rb = row_blocks(rows, k.shape[2], configs.ATTN_TILES[("bwd_kv_ws", 2, q.shape[-1])][1])
    return kvr, off, rows, rb


def _ds_shape(q: Tensor, k: Tensor, gkv: Optional[tuple], grads: tuple, mask: Mask, causal: bool,
              diag: int) -> Optional[tuple]:
    """``(rows, columns)`` of the bfloat16 ``dS^T`` buffer through which the Gluon dK/dV kernel (tile
    ``gkv``) hands every tile's ``dS`` to the dQ kernel, which then takes one product per tile pair
    instead of three: ``configs.ATTN_BWD_DS``, all three gradients wanted and the buffer (``B * H``
    heads of ``Sk`` rows by :func:`_ds_cols`) within ``configs.ATTN_BWD_DS_MAX_BYTES``; else None."""
    if not (configs.ATTN_BWD_DS and gkv and all(g.numel() for g in grads)):
        return None
    b, h, sq = q.shape[:3]
    rows = b * h * configs.cdiv(k.shape[2], gkv[1]) * gkv[1]
    cols = _ds_cols(sq, gkv, q.shape[-1], mask, causal, diag)
    return (rows, cols) if rows * cols * q.element_size() <= configs.ATTN_BWD_DS_MAX_BYTES else None


def _ds_cols(sq: int, gkv: tuple, d: int, mask: Mask, causal: bool, diag: int) -> int:
    """Columns of the ``dS^T`` buffer. A causal key block's row holds the query rows from the band's
    first (``n0 - diag``, rounded down to the dQ kernel's tile) on: at most ``Sq`` (rounded up to
    tiles), fewer where the host bounds the rows that see a key block, ``BLOCK_N + diag - lo`` under a
    window and ``BLOCK_N + diag + reach`` with documents whose rows lie at most ``reach`` past their
    document's start (:func:`_doc_reach`), plus a tile on each side and the rounding."""
    bm, bn = gkv[:2]
    dense = configs.cdiv(sq, bm) * bm
    rows = sq
    if causal and mask.lo is not None:
        rows = min(rows, max(bn + diag - mask.lo, 0))
    reach = _doc_reach(mask)
    if causal and reach is not None and mask.q_offset is None:
        rows = min(rows, max(bn + diag + reach, 0))
    return min(dense, configs.cdiv(rows + 2 * bm + configs.ATTN_TILES[("bwd_q_ds", 2, d)][0], bm) * bm)


def _doc_reach(mask: Mask) -> Optional[int]:
    """The reach of ``mask.rows`` as noted where the host made it (:func:`row_reach`), rounded up to
    256 rows (a plan serves every packing within that), or None."""
    reach = row_reach(mask.rows) if mask.rows is not None else None
    return None if reach is None else configs.cdiv(reach + 1, 256) * 256


def _launches(q, k, v, dout, lse, delta, dq, dk, dv, scale: float, causal: bool, diag: int,
              mask: Mask = NO_MASK, piece: Optional[tuple] = None, sink: bool = False) -> _Launches:
    """The launches of :func:`attn_bwd` for these operands and gradient buffers (the variants' masks
    only where :func:`takes` them: on the Gluon kernels); ``piece``: the operands are those of a
    piece of :func:`_ds_pieces`, the mask's those of the whole; ``sink``: the dK/dV kernel also sums
    the sinks' gradient (``SINK``; its operands come after the scalars, :func:`_run`)."""
    b, h, sq, d = q.shape
    hkv, sk, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    tma = _use_tma(q, k, v, dout)
    common = dict(D=d, DV=dv_, BLOCK_D=pad_dim(d), BLOCK_DV=pad_dim(dv_), CAUSAL=causal,
                  PREC=dot_precision(q.dtype), TMA=tma)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(), *delta.stride())
    stats = (*lse.stride(), *delta.stride())
    dtypes = (q.dtype, dout.dtype)  # (the descriptors' element types)
    kv = qp = None
    kv_rows = q_rows = 0
    gkv, gq = (_gluon_tile(kind, q, v) if tma else None for kind in ("bwd_kv_ws", "bwd_q_gluon"))
    # the Gluon kernels' mask: its tensors (after the gradients), strides, scalars and flags
    mts = _mask_tensors(mask, q, k, lse)
    if piece:
        mts = _mask_piece(mts, mask, piece)
    mstrides, flags = _mask_args(mask, q, lse)[3:]
    lo, cap2 = mask.lo if mask.lo is not None else 0, mask.softcap * LOG2E.value
    ds = _ds_shape(q, k, gkv, (dq, dk, dv), mask, causal, diag)
    if (dk.numel() or dv.numel()) and gkv:
        nkb = configs.cdiv(sk, gkv[1])
        # three warpgroups of num_warps (and a producer warp) per program, their registers within an SM's
        scalars = (*stats, *dk.stride()[:3], *dv.stride()[:3], *mstrides, hkv, h // hkv, sq, sk, diag, lo,
                   scale * LOG2E.value, scale, cap2, head_group(nkb, b * hkv, q, causal, 3 * gkv[2]))
        kv = _gluon_launch(gkv, (nkb, b * hkv), scalars, (lse, delta, dk, dv, *mts), causal, d, dtypes,
                           maxnreg=configs.ATTN_BWD_KV_WS_MAXNREG, DS_OUT=ds is not None,
                           DS_ALIGN=configs.ATTN_TILES[("bwd_q_ds", 2, d)][0], **flags,
                           **({"SINK": True} if sink else {}))
    elif dk.numel() or dv.numel():
        bm, bn, warps, stages = attn_tile("bwd_kv", q.dtype, d, dv_)
        kv_rows = bm
        nkb = configs.cdiv(sk, bn)
        scalars = (*strides, *dk.stride(), *dv.stride(), hkv, h // hkv, sq, sk, diag, scale * LOG2E.value, scale,
                   head_group(nkb, b * hkv, q, causal, warps))
        kv = ((nkb, b * hkv), (auto_key((q, k, v, dout, lse, delta, dk, dv, *scalars)), dtypes),
              scalars, dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common,
                            **({"SINK": True} if sink else {})))
    if ds:
        bm, warps, stages, *maxnreg = configs.ATTN_TILES[("bwd_q_ds", 2, d)]
        nqb = configs.cdiv(sq, bm)
        scalars = (*dq.stride(), *mstrides, h, h // hkv, sq, sk, diag, lo, scale,
                   head_group(nqb, b * h, q, causal, warps))
        qp = ((nqb, b * h), (auto_key((dq, *mts[:3], *scalars)), dtypes), scalars,
              dict(D=d, BLOCK_M=bm, BLOCK_N=gkv[1], KV_M=gkv[0], CAUSAL=causal, PREC=common["PREC"], num_warps=warps,
                   num_stages=stages, **({"maxnreg": maxnreg[0]} if maxnreg else {}),
                   **{f: flags[f] for f in ("HAS_LO", "HAS_KV", "HAS_OFF", "HAS_ROWS")}))
        ds = (*ds, gkv[1], gkv[0], bm)
    elif dq.numel() and gq:
        nqb = configs.cdiv(sq, gq[0])
        scalars = (*stats, *dq.stride()[:3], *mstrides, h, h // hkv, sq, sk, diag, lo, scale * LOG2E.value, scale, cap2,
                   head_group(nqb, b * h, q, causal, gq[2]))
        qp = _gluon_launch(gq, (nqb, b * h), scalars, (lse, delta, dq, *mts[:3]), causal, d, dtypes, **flags)
    elif dq.numel():
        bm, bn, warps, stages = attn_tile("bwd_q", q.dtype, d, dv_)
        q_rows = bn
        nqb = configs.cdiv(sq, bm)
        scalars = (*strides, *dq.stride(), h, h // hkv, sq, sk, diag, scale * LOG2E.value, scale,
                   head_group(nqb, b * h, q, causal, warps))
        qp = ((nqb, b * h), (auto_key((q, k, v, dout, lse, delta, dq, *scalars)), dtypes), scalars,
              dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common))
    gluon = ("_attn_bwd_kv_ws" if kv is not None and gkv else None,
             "_attn_bwd_q_gluon" if qp is not None and gq and not ds else None)
    return _Launches(kv, qp, (kv_rows, q_rows) if tma else None, gluon, ds)


def attn_bwd(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, scale: float,
             causal: bool, diag: int = 0, out_dtype: Optional[torch.dtype] = None,
             mask: Mask = NO_MASK, sinks: Optional[Tensor] = None) -> tuple:
    """Gradients ``(dq (B,H,Sq,D), dk (B,Hkv,Sk,D), dv (B,Hkv,Sk,Dv))`` in ``out_dtype`` (float32 by
    default), each with its input's strides where dense. ``lse``, ``delta = rowsum(dout * out) - dlse``
    ``(B, H, Sq)``: the rows' global statistics; rows with ``lse = -inf`` contribute nothing.
    ``mask``: the variants' visibility (``attention_bwd.attn_bwd``'s rule), where :func:`takes` it.
    ``sinks (H,)``: a fourth result, ``bwd.attn_bwd``'s sums for the sinks' gradient."""
    od = out_dtype or stat_dtype(q.dtype)
    dq, dk, dv = torch.empty_like(q, dtype=od), torch.empty_like(k, dtype=od), torch.empty_like(v, dtype=od)
    mts = () if mask.plain() else tuple(t for t in (mask.kv_range, mask.q_offset, mask.rows) if t is not None)
    geo = _key(q, k, v, dout, lse, delta, od, scale, causal, diag, mask, mts, sinks is not None)
    hit = _LAUNCHES.get(geo)
    if hit is None:
        plan = _plan(q, k, v, dout, lse, delta, dq, dk, dv, scale, causal, diag, mask, sinks is not None)
        hit = _LAUNCHES.put(geo, (plan, tuple({} for _ in plan)))
    plan, bounds = hit
    kv = plan[0][1].kv
    sink = sink_buffers(sinks, q, _GLUON_PARTS if plan[0][1].gluon[0] else 1,
                        configs.cdiv(k.shape[2], kv[3]["BLOCK_N"]) * kv[3]["BLOCK_N"]) if kv else None
    ops = (q, k, v, dout, lse, delta, dq, dk, dv, *_sink_ops(sink, q))
    mts = _mask_tensors(mask, q, k, lse) if mts else None
    _run_pieces(plan, ops, mask, mts, bounds)
    return sink_sums((dq, dk, dv), sink)


def settings(q: Tensor, v: Tensor) -> tuple:
    """What the pair's launches read besides their operands' geometry and the call's scalars and mask
    (part of the keys of :data:`_LAUNCHES`: tests change them)."""
    d, dv = q.shape[-1], v.shape[-1]
    return (configs.ATTN_BWD_TMA, configs.ATTN_BWD_GLUON, configs.ATTN_BWD_DS, configs.ATTN_BWD_DS_MAX_BYTES,
            configs.ATTN_BWD_DS_MIN_WAVES, configs.ATTN_ORDER_WAVES, configs.ATTN_ORDER_MAX_WAVES,
            attn_tile("bwd_kv", q.dtype, d, dv), attn_tile("bwd_q", q.dtype, d, dv),
            *(configs.ATTN_TILES.get((kind, 2, d)) for kind in ("bwd_kv_ws", "bwd_q_gluon", "bwd_q_ds")))


def bound(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, stats: Tensor, scale: float, causal: bool,
          diag: int) -> Optional[tuple]:
    """The plain backward's launches that a call of :func:`attn_bwd` with these operands, gradients in
    ``q.dtype`` and fresh ``lse``, ``delta`` like ``stats`` (contiguous float32 ``(B, H, Sq)``) bound:
    ``(plan, bounds)`` for :func:`run_bound`, or None where none has run at this geometry."""
    return _LAUNCHES.get(_key(q, k, v, dout, stats, stats, q.dtype, scale, causal, diag, NO_MASK, (), False))


def _key(q, k, v, dout, lse, delta, od: torch.dtype, scale: float, causal: bool, diag: int, mask: Mask, mts: tuple,
         sink: bool) -> tuple:
    """The key of :data:`_LAUNCHES` of :func:`attn_bwd`'s launches (``mts``: the mask's tensors)."""
    return (geometry(q, k, v, dout, lse, delta, *mts), od, scale, causal, diag, mask.lo, mask.softcap,
            tuple(t is None for t in (mask.kv_range, mask.q_offset, mask.rows)), _doc_reach(mask), settings(q, v),
            sink)


def run_bound(hit: tuple, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor) -> tuple:
    """``(dq, dk, dv)`` in ``q.dtype`` of the plain backward through the launches of :func:`bound`
    ``hit`` (the operands of the geometry it was bound for)."""
    plan, bounds = hit
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _run_pieces(plan, (q, k, v, dout, lse, delta, dq, dk, dv), NO_MASK, None, bounds)
    return dq, dk, dv


# the parts of a Gluon dK/dV program's walk that write the sinks' sums apart: (score warpgroup, its
# masked or interior tiles)
_GLUON_PARTS = 4


def _sink_ops(sink: Optional[tuple], q: Tensor) -> tuple:
    """The sinks' two operands in a launch's ``ops`` (after the gradients): their values as a ``(B, H)``
    view (batch stride 0: a piece's view starts at its first head) and the buffer of
    ``bwd_common.sink_buffers``; none without sinks."""
    if sink is None:
        return ()
    return sink[0].expand(q.shape[0], -1), sink[1]


def _run_pieces(plan: tuple, ops: tuple, mask: Mask, mts: Optional[tuple], bounds: Optional[tuple] = None) -> None:
    """Make the launches of each piece of ``plan`` on its views of ``ops`` (all of them for a piece
    None; after the gradients, the sinks' operands of :func:`_sink_ops` where there are sinks); a
    part of one kv head's query heads (:func:`_is_part`) writes its dK, dV into float32 buffers,
    summed over the kv head's parts in order into its gradients after its last part. ``bounds``: per
    piece, where :func:`_run` keeps its bound launches (None: the launchers' path)."""
    acc = None
    for i, (piece, run) in enumerate(plan):
        views = _piece(ops, piece)
        pm = _mask_piece(mts, mask, piece)
        sink = {"sink": views[9:]} if views[9:] else {}
        if bounds is not None:
            sink["bound"] = bounds[i]
        if not _is_part(piece):
            _run(run, *views[:9], pm, **sink)
            continue
        part = _part_grads(views[7:9])
        _run(run, *views[:7], *part, pm, **sink)
        acc = part if acc is None else [a.add_(p) for a, p in zip(acc, part)]
        if piece[5] == ops[0].shape[1] // ops[1].shape[1]:  # the kv head's last part
            for view, a in zip(views[7:9], acc):
                view.copy_(a)
            acc = None


def _plan(q, k, v, dout, lse, delta, dq, dk, dv, scale: float, causal: bool, diag: int, mask: Mask,
          sink: bool = False) -> tuple:
    """``((piece, launches), ..)`` of :func:`attn_bwd`: the launches (:func:`_launches`) on the whole
    operands (``piece`` None), or on each piece of :func:`_ds_pieces` (a part's dK, dV: float32
    buffers, :func:`_part_grads`); ``sink``: with the sums of the sinks' gradient."""
    ops = (q, k, v, dout, lse, delta, dq, dk, dv)
    pieces = _ds_pieces(q, k, v, dout, (dq, dk, dv), mask, causal, diag) or (None,)
    plan = []
    for p in pieces:
        views = _piece(ops, p)
        if _is_part(p):
            views = (*views[:7], *_part_grads(views[7:]))
        plan.append((p, _launches(*views, scale, causal, diag, mask, p, sink)))
    return tuple(plan)


def _is_part(piece: Optional[tuple]) -> bool:
    """Whether ``piece`` (of :func:`_ds_pieces`) holds a part of one kv head's query heads."""
    return piece is not None and len(piece) == 6


def _part_grads(like: tuple) -> list:
    """float32 buffers for a part's ``(dk, dv)`` (``like``: the kv head's views): the sum over its
    parts is taken in float32 and rounded once."""
    return [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in like]


def _ds_pieces(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, grads: tuple, mask: Mask, causal: bool,
               diag: int) -> tuple:
    """``(b0, b1, kvh0, kvh1)`` pieces (batch elements, kv heads) taken one after another where the
    whole ``dS^T`` buffer (:func:`_ds_shape`) passes ``configs.ATTN_BWD_DS_MAX_BYTES`` and each
    piece's is within it: whole batch elements while they fit, else kv heads of one, else
    ``(b, b + 1, kvh, kvh + 1, g0, g1)``: query heads ``[g0, g1)`` of one kv head's (a part, whose dK
    and dV the kv head's other parts add to); each piece's dK/dV grid at least
    ``configs.ATTN_BWD_DS_MIN_WAVES`` waves. Empty: one launch pair on the whole."""
    gkv = (_gluon_tile("bwd_kv_ws", q, v) if configs.ATTN_BWD_DS and all(g.numel() for g in grads)
           and _use_tma(q, k, v, dout) else None)
    if not gkv:
        return ()
    b, h, sq = q.shape[:3]
    hkv, nkb = k.shape[1], configs.cdiv(k.shape[2], gkv[1])
    unit = h // hkv * nkb * gkv[1] * _ds_cols(sq, gkv, q.shape[-1], mask, causal, diag) * q.element_size()  # (b, kvh)
    per, g = configs.ATTN_BWD_DS_MAX_BYTES // unit, h // hkv
    if per == 0:  # one (batch element, kv head) does not fit: parts of its query heads, if one fits
        per_g = configs.ATTN_BWD_DS_MAX_BYTES // (unit // g)
        if per_g == 0 or nkb < configs.ATTN_BWD_DS_MIN_WAVES * sm_count(q):
            return ()
        return tuple((i, i + 1, j, j + 1, a, min(a + per_g, g)) for i in range(b) for j in range(hkv)
                     for a in range(0, g, per_g))
    if per >= b * hkv or nkb * min(per, hkv) < configs.ATTN_BWD_DS_MIN_WAVES * sm_count(q):
        return ()
    if per >= hkv:
        n = per // hkv
        return tuple((i, min(i + n, b), 0, hkv) for i in range(0, b, n))
    return tuple((i, i + 1, j, min(j + per, hkv)) for i in range(b) for j in range(0, hkv, per))


def _piece(ops: tuple, piece: Optional[tuple]) -> tuple:
    """``(q, k, v, dout, lse, delta, dq, dk, dv)`` (and the sinks' ``(B, H)`` values and ``(parts, B, H,
    keys)`` buffer, :func:`_sink_ops`) of batch elements ``[b0, b1)`` and kv heads ``[kvh0, kvh1)``
    (with their query heads, or those ``[g0, g1)`` of each of a part): views; all of ``ops`` where
    ``piece`` is None."""
    if piece is None:
        return ops
    b0, b1, h0, h1 = piece[:4]
    g = ops[0].shape[1] // ops[1].shape[1]
    g0, g1 = piece[4:] if _is_part(piece) else (0, g)
    kv = (slice(b0, b1), slice(h0, h1))
    qh = (slice(b0, b1), slice(h0 * g + g0, (h1 - 1) * g + g1))
    return tuple(t[kv] if i in (1, 2, 7, 8) else t[(slice(None), *qh)] if i == 10 else t[qh]
                 for i, t in enumerate(ops))


def _mask_piece(mts: Optional[tuple], mask: Mask, piece: Optional[tuple]) -> Optional[tuple]:
    """The mask's tensors of :func:`_mask_tensors` for batch elements ``[b0, b1)`` of ``piece``: the
    key ranges and offsets sliced (views), the document rows shared by every batch element; ``mts``
    itself where it or ``piece`` is None."""
    if mts is None or piece is None:
        return mts
    kvr, off, rows, rb = mts
    b0, b1 = piece[:2]
    return (kvr[b0:b1] if mask.kv_range is not None else kvr, off[b0:b1] if mask.q_offset is not None else off,
            rows, rb)


def _ds_descriptor(ds: Tensor, block: tuple) -> TensorDescriptor:
    """The Triton descriptor of the 2-D ``dS^T`` buffer reading ``block`` tiles (``__post_init__``'s
    checks skipped: the buffer is dense and aligned, and they cost host time on every call)."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.padding = ds, list(ds.shape), list(ds.stride()), "zero"
    desc.block_shape = list(block)
    return desc


def _run(run: _Launches, q, k, v, dout, lse, delta, dq, dk, dv, mts: Optional[tuple] = None,
         sink: tuple = (), bound: Optional[dict] = None) -> None:
    """Make the launches ``run`` (of :func:`_launches`) on these tensors (``mts``: the mask's, of
    :func:`_mask_tensors`; None: a plain mask's, ``lse`` standing in; ``sink``: the sinks' two
    operands of :func:`_sink_ops` where ``run`` sums their gradient). ``bound``: where the launches
    bound to this geometry are kept (:meth:`Launcher.bind`), by kernel and the sinks' alignment."""
    mts = mts or (lse,) * 4
    ds = torch.empty(run.ds[:2], dtype=q.dtype, device=q.device) if run.ds else None
    if run.kv is not None:
        salign = tuple(t.data_ptr() % 16 == 0 for t in sink)  # (a piece's views of them start anywhere)
        if run.gluon[0]:
            live = (q, dout, k, v, lse, delta, dk, dv, *mts, ds if run.ds else k, *sink)
        else:
            live = (q, k, v, dout, lse, delta, dk, dv, *sink)
        _launch(bound, ("kv", salign), _kv_launch, (run, q, k, v, dout, lse, delta, dk, dv, mts, ds, sink, salign),
                live)
    if run.q is not None:
        if run.ds:
            live = (ds, k, dq, *mts[:3])
        elif run.gluon[1]:
            live = (q, dout, k, v, lse, delta, dq, *mts[:3])
        else:
            live = (q, k, v, dout, lse, delta, dq)
        _launch(bound, "q", _q_launch, (run, q, k, v, dout, lse, delta, dq, mts, ds), live)


def _launch(bound: Optional[dict], name: Hashable, make, args: tuple, live: tuple) -> None:
    """Launch ``make(*args)`` (``(launcher, grid, key, arguments, kwargs)``): through the bound launch
    ``bound`` keeps under ``name`` (bound on its first use), or without ``bound`` the launcher's path."""
    hit = None if bound is None else bound.get(name)
    if hit is None:
        launcher, grid, key, launch_args, kwargs = make(*args)
        if bound is None:
            launcher(grid, key, launch_args, kwargs)
            return
        hit = bound[name] = launcher.bind(grid, key, launch_args, kwargs)
    hit(*live)


def _kv_launch(run: _Launches, q, k, v, dout, lse, delta, dk, dv, mts: tuple, ds, sink: tuple, salign: tuple):
    """The dK/dV launch of ``run`` on these tensors: ``(launcher, grid, key, arguments, kwargs)``."""
    grid, key, scalars, kwargs = run.kv
    if sink:
        key = (key, *salign)
    sk = sink_args(sink or None)
    if run.gluon[0]:
        ops = _gluon_operands(q, k, v, dout, kwargs)
        ds_desc = _gluon_tile_descriptor()(ds, run.ds[2:4]) if run.ds else ops[2]  # (unread without DS_OUT)
        return (_gluon_launcher(run.gluon[0]), grid, key, (*ops, lse, delta, dk, dv, *mts, ds_desc, *scalars, *sk),
                kwargs)
    qt, dt = (_descriptor(q, run.tma[0]), _descriptor(dout, run.tma[0])) if run.tma else (q, dout)
    return _KV, grid, key, (qt, k, v, dt, lse, delta, dk, dv, *scalars, *sk), kwargs


def _q_launch(run: _Launches, q, k, v, dout, lse, delta, dq, mts: tuple, ds):
    """The dQ launch of ``run`` on these tensors: ``(launcher, grid, key, arguments, kwargs)``."""
    grid, key, scalars, kwargs = run.q
    if run.ds:
        return (_QDS, grid, key, (_ds_descriptor(ds, (run.ds[2], run.ds[4])), _descriptor(k, run.ds[2]), dq,
                                  *mts[:3], *scalars), kwargs)
    if run.gluon[1]:
        return (_gluon_launcher(run.gluon[1]), grid, key, (*_gluon_operands(q, k, v, dout, kwargs), lse, delta, dq,
                                                           *mts[:3], *scalars), kwargs)
    kt, vt = (_descriptor(k, run.tma[1]), _descriptor(v, run.tma[1])) if run.tma else (k, v)
    return _Q, grid, key, (q, kt, vt, dout, lse, delta, dq, *scalars), kwargs


@functools.lru_cache(maxsize=None)
def _gluon_tile_descriptor():
    """Gluon's 2-D tile descriptor maker (imported on first use: Gluon needs a CUDA build)."""
    from .gluon.bwd import tile_descriptor
    return tile_descriptor


@functools.lru_cache(maxsize=None)
def _gluon_descriptor():
    """Gluon's ``(B, H, S, D)`` descriptor maker (imported on first use: Gluon needs a CUDA build)."""
    from .gluon.bwd import descriptor
    return descriptor
