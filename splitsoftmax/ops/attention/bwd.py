"""Triton attention backward: dQ, dK, dV of one Q/K/V block pair, with the variants' masks.

Layouts are SDPA's, any strides (``(B, H, S, D)`` views of ``(B, S, H, D)`` tensors run with no
copy); query head ``h`` reads kv head ``h // G``. A row's statistics ``lse`` and
``delta = rowsum(dout * out) - dlse`` are its global ones, so a shard needs only its own K/V.

Visibility is ``causal, diag`` and a :class:`~splitsoftmax.mask.Mask` (window edge ``lo``,
``q_offset``, ``kv_range``, document ``rows``, ``softcap``). The row intervals of ``Mask.rows`` must
be nondecreasing in the row (packed documents in order, as every plan makes them): the dK/dV
programs find the query rows of their key block by binary search.

Two paths, the same math:

- **atomic** (``configs.ATTN_BWD_ATOMIC``, where TMA can address every operand: Hopper on, 2-byte
  inputs, head dims 16..128 unpadded): one program per key block and kv head holds dK, dV in registers over
  every query block of the G query heads that read its kv head and adds each tile's dQ into a
  float32 buffer with a TMA reduction: five products per tile pair. dQ is cast to the output dtype
  once at the end.
- **deterministic** (the default; always under ``torch.use_deterministic_algorithms(True)``): the
  dK/dV programs without the dQ product, then one dQ program per query block walking its key
  blocks (seven products per tile pair, no atomics anywhere): bitwise reproducible. On one H200
  (Triton 3.6) it ran faster than the atomic path at every shape timed (configs.py has the numbers).
  Plain visibility (no variant mask) takes ``attention_bwd_plain``'s pair of the same form, which
  ran faster still, and so do the variants' masks where that pair's Gluon kernels run (Hopper,
  bfloat16).

- **fused** (``configs.ATTN_BWD_FUSED``, never deterministic; sm_90, 2-byte inputs, D=128, the masks
  of ``configs.ATTN_BWD_FUSED_MASKS``, no sinks): one Gluon kernel of five products per tile pair
  (``gluon/bwd_fused.py``), dQ reduce-added in float32 by TMA; ``bwd_plain.fused`` decides.

When too few dK/dV programs would run for two per SM (batch 1, a few kv heads), each key block's
work is split across programs by query heads (then by query range); their dK/dV partials are added
into float32 buffers by TMA reductions (atomic path) or summed in split order (deterministic path).

Per program, the query blocks (dK/dV) or key blocks (dQ) that no pair of the tile sees are not
visited; interior tiles, wholly visible to every row, run without a mask; the others mask each pair
and keep a NaN/Inf in a hidden position from the rows that do not see it (``0 * NaN`` is NaN).
Softcap ``c``: scores ``c * tanh(s / c)``; the score gradient is multiplied by ``1 - tanh^2``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .._triton import configs
from .._triton.algebra import LOG2E
from ...core.runtime import interpreting
from ...core.mask import NO_MASK, Mask
from ...core.state import stat_dtype
from .decode import attn_tile, dot_precision, head_group, pad_dim
from .._triton.device import hopper, sm_count
from .bwd_common import (_batch_bounds, _descriptor, _finite_or_zero, _mask_args, _seen, _sink_flush, _sink_keys,
                         _tile, _tma_ok, q_walk, row_blocks, sink_args, sink_buffers, sink_sums)
from . import bwd_plain as attention_bwd_plain, prep as attention_prep
from .fwd import _dot, _load_rows as _load, _program_order
from .._triton.launch import Launcher, fits_int32


@triton.jit
def _tanh(x):
    """``tanh(x)`` from one ``exp2`` (saturates to +-1; NaN stays NaN)."""
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _kv_tile(dk, dv, k, ks, v, cs, Q, DO, GQ, LSE, DELTA, ROWS, SNK, s_r, b, b64, h, m0, kj,
             s_qb, s_qh, s_qs, s_db, s_dh, s_ds, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, offs_d, offs_dv, dmask, dvmask,
             Sq, dg, lw, kv_lo, kv_hi, scale, cap2,
             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_LO: tl.constexpr, HAS_ROWS: tl.constexpr, SOFTCAP: tl.constexpr,
             EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, TMA: tl.constexpr, DQ_ATOMIC: tl.constexpr,
             GUARD: tl.constexpr, PREC: tl.constexpr, SINK: tl.constexpr):
    """``(dk, dv, w)``: dK, dV ``[BLOCK_N, BLOCK_D(V)]`` of key block ``kj`` from query block ``m0``
    of head ``h`` (and with ``DQ_ATOMIC`` that block's dQ, from ``ks``: ``k`` with its non-finite
    entries zeroed, added into the float32 descriptor ``GQ``); ``cs`` scales the scores (``s / c``
    with softcap). ``MASKED``: every pair is checked against the visibility rule; ``GUARD``: and a
    NaN/Inf in a row of Q or dO reaches no key the row does not see. ``SINK``: ``w [BLOCK_N]`` is the
    tile's ``bwd_common._sink_keys`` under the head's sink ``SNK[h]``, else 0."""
    qi = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    qmask = qi < Sq
    if TMA:
        q_src = Q
        do_src = DO
    else:
        q_src = Q + b64 * s_qb + h * s_qh
        do_src = DO + b64 * s_db + h * s_dh
    l_base = LSE + b64 * s_lb + h * s_lh
    e_base = DELTA + b64 * s_eb + h * s_eh
    q = _tile(q_src, b, h, m0, qi, offs_d, qmask, dmask, s_qs, BLOCK_M, BLOCK_D, EVEN_D, TMA)
    do = _tile(do_src, b, h, m0, qi, offs_dv, qmask, dvmask, s_ds, BLOCK_M, BLOCK_DV, EVEN_DV, TMA)
    lse2 = tl.load(l_base + qi * s_ls, mask=qmask, other=float("inf")) * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # empty or inactive row: p = 0
    delta = tl.load(e_base + qi * s_es, mask=qmask, other=0.0) * scale  # [BLOCK_M]
    qk_t = _dot(k, tl.trans(q), None, PREC)  # [BLOCK_N, BLOCK_M]
    if SOFTCAP:
        t = _tanh(qk_t * cs)
        p_t = tl.math.exp2(t * cap2 - lse2[None, :])
    else:
        p_t = tl.math.exp2(qk_t * cs - lse2[None, :])
    if MASKED:
        rlo = 0
        rhi = 0
        if HAS_ROWS:
            rlo = tl.load(ROWS + qi, mask=qmask, other=0)[None, :]
            rhi = tl.load(ROWS + s_r + qi, mask=qmask, other=0)[None, :]
        seen = _seen(kj[:, None], qi[None, :], rlo, rhi, dg, lw, kv_lo, kv_hi, CAUSAL, HAS_LO, HAS_ROWS)
        p_t = tl.where(seen, p_t, 0.0)
        if GUARD:
            do = _finite_or_zero(do)  # hidden pairs must give exact zeros, never 0 * NaN
    dv = _dot(p_t.to(do.dtype), do, dv, PREC)  # [BLOCK_N, BLOCK_DV]
    dp_t = _dot(v, tl.trans(do), None, PREC)  # [BLOCK_N, BLOCK_M]
    ds_t = p_t * (dp_t * scale - delta[None, :])  # the score gradient, times the scale
    if SOFTCAP:
        ds_t = ds_t * (1.0 - t * t)
    if MASKED:
        ds_t = tl.where(seen, ds_t, 0.0)
        if GUARD:
            q = _finite_or_zero(q)
    ds = ds_t.to(q.dtype)
    dk = _dot(ds, q, dk, PREC)  # [BLOCK_N, BLOCK_D]
    if DQ_ATOMIC:
        dq = _dot(tl.trans(ds), ks, None, PREC)  # [BLOCK_M, BLOCK_D]
        GQ.atomic_add([b, h, m0, 0], dq.reshape(1, 1, BLOCK_M, BLOCK_D))
    w = 0.0
    if SINK:
        pdp_t = p_t * dp_t
        if MASKED:
            pdp_t = tl.where(seen, pdp_t, 0.0)
        w = _sink_keys(pdp_t, lse2, tl.load(SNK + h))
    return dk, dv, w


@triton.jit
def _kv_rows(RB, pid_n, n0, n1, Sq, dg, lw, kv_lo, kv_hi, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
             HAS_LO: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Query blocks of key block ``[n0, n1)``: ``(first, end, ia, ib)``, blocks ``[first, end)``
    hold a row that sees one of its keys, ``[ia, ib)`` (inside) only rows that see all of them."""
    r_lo = 0
    r_hi = Sq
    f_lo = 0
    f_hi = Sq
    if CAUSAL:
        r_lo = tl.maximum(r_lo, n0 - dg)
        f_lo = tl.maximum(f_lo, n1 - 1 - dg)
    if HAS_LO:
        r_hi = tl.minimum(r_hi, n1 - lw)
        f_hi = tl.minimum(f_hi, n0 - lw + 1)
    if HAS_ROWS:
        r_lo = tl.maximum(r_lo, tl.load(RB + pid_n * 4))
        r_hi = tl.minimum(r_hi, tl.load(RB + pid_n * 4 + 1))
        f_lo = tl.maximum(f_lo, tl.load(RB + pid_n * 4 + 2))
        f_hi = tl.minimum(f_hi, tl.load(RB + pid_n * 4 + 3))
    r_hi = tl.where((kv_hi <= n0) | (kv_lo >= n1) | (kv_lo >= kv_hi), 0, tl.maximum(r_hi, 0))  # no key in range
    f_hi = tl.where((n0 < kv_lo) | (n1 > kv_hi), 0, f_hi)  # some keys out of range: every tile masked
    first = tl.minimum(r_lo, r_hi) // BLOCK_M
    end = tl.where(r_lo >= r_hi, first, tl.maximum(tl.cdiv(r_hi, BLOCK_M), first))  # no row sees a key: none
    ia = tl.minimum(tl.maximum(tl.cdiv(f_lo, BLOCK_M), first), end)
    ib = tl.where(f_hi >= Sq, end, tl.maximum(f_hi, 0) // BLOCK_M)  # rows past Sq have p = 0
    ib = tl.minimum(tl.maximum(ib, ia), end)
    return first, end, ia, ib


@triton.jit(do_not_specialize=["Sq", "Sk", "diag", "lo", "GH", "s_lb", "s_lh", "s_eb", "s_eh"])
def _attn_bwd_kv_kernel(Q, K, KS, V, DO, LSE, DELTA, GQ, GK, GV, KVR, QOFF, ROWS, RB,
                        s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_db, s_dh, s_ds,
                        s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_kgp, s_kgb, s_kgh, s_kgs, s_vgp, s_vgb, s_vgh, s_vgs,
                        s_kvb, s_kvc, s_off, s_r,
                        HKV, G, NH, NQ, Sq, Sk, diag, lo, qk_scale, scale, cap2, GH, SNK, PDP, s_wp, s_wb, s_wh,
                        D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_LO: tl.constexpr,
                        HAS_KV: tl.constexpr, HAS_OFF: tl.constexpr, HAS_ROWS: tl.constexpr,
                        SOFTCAP: tl.constexpr, TMA: tl.constexpr, DQ_ATOMIC: tl.constexpr,
                        DKV_ATOMIC: tl.constexpr, GUARD: tl.constexpr, PREC: tl.constexpr,
                        SINK: tl.constexpr = False):
    """Grid ``(key blocks, B * HKV * NH * NQ)``: key block ``pid_n`` of kv head ``(b, kvh)``, split
    ``(sh, sq)`` taking query heads ``[sh * G // NH, (sh + 1) * G // NH)`` of the group and piece
    ``sq`` of ``NQ`` of the query blocks. ``TMA``: ``Q, K, V, DO`` (and ``GQ``, ``GK``, ``GV`` where
    atomic) are ``(B, H, S, D)`` descriptors, else pointers. ``DKV_ATOMIC``: dK/dV are added into
    float32 buffers, else stored (at split ``s_kgp * split`` when partials). Taken in the order of
    ``GH`` (``attention._program_order``). ``SINK``: each query head's ``bwd_common._sink_keys`` over
    the program's masked tiles go to ``PDP[sp, b, h, n0 + j]``, over its interior ones to
    ``PDP[NQ + sp, b, h, n0 + j]`` (strides ``s_wp, s_wb, s_wh``; the sinks ``SNK (H,)`` float32);
    without it ``SNK, PDP`` and their strides are None."""
    pid_n, pid = _program_order(GH)
    ns = NH * NQ
    split = pid % ns
    b = pid // ns // HKV
    kvh = pid // ns % HKV
    sh = split // NQ
    sp = split % NQ
    n0 = pid_n * BLOCK_N
    kj = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dmask = offs_d < D
    dvmask = offs_dv < DV
    b64 = b.to(tl.int64)
    if TMA:
        k_src = K
        v_src = V
    else:
        k_src = K + b64 * s_kb + kvh * s_kh
        v_src = V + b64 * s_vb + kvh * s_vh
    kmask = kj < Sk
    k = _tile(k_src, b, kvh, n0, kj, offs_d, kmask, dmask, s_ks, BLOCK_N, BLOCK_D, D == BLOCK_D, TMA)
    v = _tile(v_src, b, kvh, n0, kj, offs_dv, kmask, dvmask, s_vs, BLOCK_N, BLOCK_DV, DV == BLOCK_DV, TMA)
    ks = k
    if DQ_ATOMIC:  # dQ multiplies K with its non-finite entries zeroed: hidden pairs give exact zeros
        ks = KS.load([b, kvh, n0, 0]).reshape(BLOCK_N, BLOCK_D)
    cs = qk_scale
    if SOFTCAP:
        cs = scale / cap2 * LOG2E  # s / c
    kv_lo, kv_hi, dg, lw = _batch_bounds(KVR, QOFF, s_kvb, s_kvc, s_off, b, Sk, diag, lo, HAS_KV, HAS_OFF)
    first, end, ia, ib = _kv_rows(RB, pid_n, n0, n0 + BLOCK_N, Sq, dg, lw, kv_lo, kv_hi, BLOCK_M, CAUSAL,
                                  HAS_LO, HAS_ROWS)
    # this split's piece [pa, pb) of the query blocks; masked blocks [pa, ia) + [ib, pb), inside [ia, ib)
    cnt = end - first
    pa = first + sp * cnt // NQ
    pb = first + (sp + 1) * cnt // NQ
    ia = tl.minimum(tl.maximum(ia, pa), pb)
    ib = tl.minimum(tl.maximum(ib, ia), pb)
    n_pre = ia - pa
    n_masked = n_pre + pb - ib
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # (head, query block) pairs of the query heads that read this kv head, as flat loops: masked
    # blocks of every head, then interior blocks of every head (nested loops cost spills)
    g0 = sh * G // NH
    n_in = ib - ia
    n_heads = (sh + 1) * G // NH - g0
    if SINK:
        acc = tl.zeros([BLOCK_N], tl.float32)
        w_base = PDP + sp * s_wp + b64 * s_wb + kj
    for it in tl.range(0, n_heads * n_masked):
        h = kvh * G + g0 + it // n_masked
        j = it % n_masked
        m0 = tl.where(j < n_pre, pa + j, ib + j - n_pre) * BLOCK_M
        dk, dv, w = _kv_tile(dk, dv, k, ks, v, cs, Q, DO, GQ, LSE, DELTA, ROWS, SNK, s_r, b, b64, h, m0, kj,
                             s_qb, s_qh, s_qs, s_db, s_dh, s_ds, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, offs_d, offs_dv,
                             dmask, dvmask, Sq, dg, lw, kv_lo, kv_hi, scale, cap2, BLOCK_M, BLOCK_D, BLOCK_DV, True,
                             CAUSAL, HAS_LO, HAS_ROWS, SOFTCAP, D == BLOCK_D, DV == BLOCK_DV, TMA, DQ_ATOMIC, GUARD,
                             PREC, SINK)
        if SINK:
            acc = _sink_flush(w_base + h * s_wh, acc + w, j == n_masked - 1)
    for it in tl.range(0, n_heads * n_in):
        h = kvh * G + g0 + it // n_in
        m0 = (ia + it % n_in) * BLOCK_M
        dk, dv, w = _kv_tile(dk, dv, k, ks, v, cs, Q, DO, GQ, LSE, DELTA, ROWS, SNK, s_r, b, b64, h, m0, kj,
                             s_qb, s_qh, s_qs, s_db, s_dh, s_ds, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, offs_d, offs_dv,
                             dmask, dvmask, Sq, dg, lw, kv_lo, kv_hi, scale, cap2, BLOCK_M, BLOCK_D, BLOCK_DV, False,
                             CAUSAL, HAS_LO, HAS_ROWS, SOFTCAP, D == BLOCK_D, DV == BLOCK_DV, TMA, DQ_ATOMIC, GUARD,
                             PREC, SINK)
        if SINK:
            acc = _sink_flush(w_base + NQ * s_wp + h * s_wh, acc + w, it % n_in == n_in - 1)
    if DKV_ATOMIC:
        GK.atomic_add([b, kvh, n0, 0], dk.reshape(1, 1, BLOCK_N, BLOCK_D))
        GV.atomic_add([b, kvh, n0, 0], dv.reshape(1, 1, BLOCK_N, BLOCK_DV))
    else:
        st = kmask[:, None]
        gk = GK + split * s_kgp + b64 * s_kgb + kvh * s_kgh + kj[:, None] * s_kgs + offs_d[None, :]
        tl.store(gk, dk.to(GK.dtype.element_ty), mask=st & dmask[None, :])
        gv = GV + split * s_vgp + b64 * s_vgb + kvh * s_vgh + kj[:, None] * s_vgs + offs_dv[None, :]
        tl.store(gv, dv.to(GV.dtype.element_ty), mask=st & dvmask[None, :])


@triton.jit
def _q_tile(dq, q, do, lse2, delta, k_base, v_base, kj, qi, rlo, rhi, dg, lw, kv_lo, kv_hi, qk_scale, scale, cs,
            cap2, dmask, dvmask, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_LO: tl.constexpr,
            HAS_ROWS: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
            PREC: tl.constexpr):
    """dQ ``[BLOCK_M, BLOCK_D]`` of query block ``qi`` from key block ``kj``; ``MASKED``: every pair
    checked against the visibility rule (keys past the range included)."""
    kmask = kj < kv_hi
    k = _load(k_base, kmask, dmask, MASKED, not EVEN_D)  # [BLOCK_N, BLOCK_D]
    v = _load(v_base, kmask, dvmask, MASKED, not EVEN_DV)  # [BLOCK_N, BLOCK_DV]
    qk = _dot(q, tl.trans(k), None, PREC)  # [BLOCK_M, BLOCK_N]
    if SOFTCAP:
        t = _tanh(qk * cs)
        p = tl.math.exp2(t * cap2 - lse2[:, None])
    else:
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    dp = _dot(do, tl.trans(v), None, PREC)  # [BLOCK_M, BLOCK_N]
    ds = p * (dp * scale - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    if MASKED:  # hidden pairs give exact zeros, never 0 * NaN from a NaN/Inf key or value
        seen = _seen(kj[None, :], qi[:, None], rlo[:, None], rhi[:, None], dg, lw, kv_lo, kv_hi, CAUSAL, HAS_LO,
                     HAS_ROWS)
        ds = tl.where(seen, ds, 0.0)
        k = _finite_or_zero(k)
    return _dot(ds.to(k.dtype), k, dq, PREC)


@triton.jit(do_not_specialize=["Sq", "Sk", "diag", "lo", "GH", "s_lb", "s_lh", "s_eb", "s_eh"])
def _attn_bwd_q_kernel(Q, K, V, DO, LSE, DELTA, GQ, KVR, QOFF, ROWS,
                       s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_db, s_dh, s_ds,
                       s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_qgb, s_qgh, s_qgs, s_kvb, s_kvc, s_off, s_r,
                       H, G, Sq, Sk, diag, lo, qk_scale, scale, cap2, GH,
                       D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_LO: tl.constexpr,
                       HAS_KV: tl.constexpr, HAS_OFF: tl.constexpr, HAS_ROWS: tl.constexpr,
                       SOFTCAP: tl.constexpr, PREC: tl.constexpr):
    """Grid ``(query blocks, B * H)`` in the order of ``GH`` (``attention._program_order``), the
    blocks with the most keys first where causal."""
    pid_m, pid_bh = _program_order(GH)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    b64 = b.to(tl.int64)
    kvh = h // G
    m0 = pid_m * BLOCK_M
    qi = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    qmask = qi < Sq
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dmask = offs_d < D
    dvmask = offs_dv < DV
    q = _load(Q + b64 * s_qb + h * s_qh + qi[:, None] * s_qs + offs_d[None, :], qmask, dmask, True, BLOCK_D != D)
    do = _load(DO + b64 * s_db + h * s_dh + qi[:, None] * s_ds + offs_dv[None, :], qmask, dvmask, True,
               BLOCK_DV != DV)
    lse2 = tl.load(LSE + b64 * s_lb + h * s_lh + qi * s_ls, mask=qmask, other=float("inf")) * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # empty or inactive row: p = 0
    delta = tl.load(DELTA + b64 * s_eb + h * s_eh + qi * s_es, mask=qmask, other=0.0) * scale
    kv_lo, kv_hi, dg, lw = _batch_bounds(KVR, QOFF, s_kvb, s_kvc, s_off, b, Sk, diag, lo, HAS_KV, HAS_OFF)
    rlo, rhi, first, end, ia, ib = q_walk(ROWS, s_r, m0, Sq, Sk, dg, lw, kv_lo, kv_hi, BLOCK_M, BLOCK_N, CAUSAL,
                                          HAS_LO, HAS_ROWS)
    n_pre = ia - first
    cs = qk_scale
    if SOFTCAP:
        cs = scale / cap2 * LOG2E
    offs_n = tl.arange(0, BLOCK_N)
    k_base = K + b64 * s_kb + kvh * s_kh + offs_d[None, :]
    v_base = V + b64 * s_vb + kvh * s_vh + offs_dv[None, :]
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for it in tl.range(0, n_pre + end - ib):
        kj = tl.where(it < n_pre, first + it, ib + it - n_pre) * BLOCK_N + offs_n
        dq = _q_tile(dq, q, do, lse2, delta, k_base + kj[:, None] * s_ks, v_base + kj[:, None] * s_vs, kj, qi, rlo,
                     rhi, dg, lw, kv_lo, kv_hi, qk_scale, scale, cs, cap2, dmask, dvmask, True, CAUSAL, HAS_LO,
                     HAS_ROWS, SOFTCAP, BLOCK_D == D, BLOCK_DV == DV, PREC)
    for nb in tl.range(ia, ib):
        kj = nb * BLOCK_N + offs_n
        dq = _q_tile(dq, q, do, lse2, delta, k_base + kj[:, None] * s_ks, v_base + kj[:, None] * s_vs, kj, qi, rlo,
                     rhi, dg, lw, kv_lo, kv_hi, qk_scale, scale, cs, cap2, dmask, dvmask, False, CAUSAL, HAS_LO,
                     HAS_ROWS, SOFTCAP, BLOCK_D == D, BLOCK_DV == DV, PREC)
    tl.store(GQ + b64 * s_qgb + h * s_qgh + qi[:, None] * s_qgs + offs_d[None, :], dq.to(GQ.dtype.element_ty),
             mask=qmask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["R", "NZ"])
def _attn_bwd_pre_kernel(K, KS, Z, s_kb, s_kh, s_ks, HKV, Sk, R, NZ, KPROG, D: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_Z: tl.constexpr):
    """Programs ``[0, KPROG)``: ``KS (R = B * HKV * Sk, D)`` = ``K`` (any strides) with its non-finite
    entries zeroed; the rest: ``Z[:NZ] = 0`` (the float32 buffers the reductions add into)."""
    pid = tl.program_id(0)
    if pid < KPROG:
        rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        cols = tl.arange(0, D)
        s = rows % Sk
        b = rows // Sk // HKV
        h = rows // Sk % HKV
        m = (rows < R)[:, None]
        x = tl.load(K + (b * s_kb + h * s_kh + s * s_ks)[:, None] + cols[None, :], mask=m, other=0.0)
        tl.store(KS + rows[:, None] * D + cols[None, :], _finite_or_zero(x), mask=m)
    else:
        offs = (pid - KPROG).to(tl.int64) * BLOCK_Z + tl.arange(0, BLOCK_Z)
        tl.store(Z + offs, tl.zeros([BLOCK_Z], tl.float32), mask=offs < NZ)


_PRE = Launcher(_attn_bwd_pre_kernel)
_KV = Launcher(_attn_bwd_kv_kernel)
_Q = Launcher(_attn_bwd_q_kernel)


def deterministic() -> bool:
    """Whether torch asks for deterministic algorithms: then the backward adds nothing atomically."""
    return torch.are_deterministic_algorithms_enabled()


def _atomic(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the five-product backward runs (TMA loads and reductions): ``configs.ATTN_BWD_ATOMIC``,
    not deterministic, 2-byte inputs, unpadded head dims up to ``configs.ATTN_BWD_ATOMIC_MAX_DIM``,
    TMA-addressable, Hopper on (or the interpreter)."""
    if not configs.ATTN_BWD_ATOMIC or deterministic() or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not (interpreting() or hopper(q)):
        return False
    return (max(q.shape[-1], v.shape[-1]) <= configs.ATTN_BWD_ATOMIC_MAX_DIM
            and _tma_ok(q) and _tma_ok(k) and _tma_ok(v))


def splits(q: Tensor, k: Tensor, tile: tuple) -> tuple[int, int]:
    """``(NH, NQ)``: how the dK/dV work of a key block is split across programs (query heads, then
    query range) so that at least ``configs.ATTN_BWD_PROGRAMS_PER_SM`` programs per SM run."""
    b, h, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bm, bn = tile[:2]
    programs = b * hkv * configs.cdiv(sk, bn)
    want = configs.cdiv(configs.ATTN_BWD_PROGRAMS_PER_SM * sm_count(q), max(programs, 1))
    if want <= 1:
        return 1, 1
    nh = min(h // hkv, want)
    nq = max(1, min(configs.cdiv(want, nh), configs.cdiv(sq, bm) // configs.ATTN_BWD_SPLIT_MIN_BLOCKS))
    return nh, nq


def _key(args: tuple, ints: tuple) -> tuple:
    """The launch-cache key (see :mod:`splitsoftmax.kernels.launch`) of ``args``: each tensor's dtype
    and 16-byte alignment, each descriptor's dtype, the specialised integers by value."""
    parts = []
    for a in args:
        if isinstance(a, Tensor):
            parts.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, TensorDescriptor):
            parts.append(("desc", a.base.dtype))
    return (*parts, *ints)


def _dense_strides(t: Tensor) -> tuple:
    """``t``'s strides where its elements fill ``t.numel()`` consecutive slots in some dim order
    (what ``torch.empty_like`` keeps), else the contiguous strides."""
    dims = sorted((i for i in range(t.dim()) if t.shape[i] > 1), key=lambda i: t.stride(i))
    want, ok = 1, True
    for i in dims:
        ok = ok and t.stride(i) == want
        want *= t.shape[i]
    if ok:
        return t.stride()
    strides, want = [], 1
    for n in reversed(t.shape):
        strides.append(want)
        want *= max(n, 1)
    return tuple(reversed(strides))


def _zeroed(q: Tensor, k: Tensor, v: Tensor, ns: int) -> tuple:
    """``(ks, ws, dq, dk, dv)`` of the atomic path: ``ks`` the sanitised copy of ``k`` the
    pre-pass writes, ``ws`` the flat float32 workspace it zeroes, holding ``dq`` (with ``q``'s dense
    strides) and, where the dK/dV work is split, ``dk``, ``dv`` to add into (else ``None``)."""
    f32 = torch.float32
    sizes = [q.numel()] + ([k.numel(), v.numel()] if ns > 1 else [])
    ws = torch.empty(sum(sizes), dtype=f32, device=q.device)
    views, at = [], 0
    for t, n in zip((q, k, v), sizes):
        views.append(ws[at:at + n].as_strided(t.shape, _dense_strides(t)))
        at += n
    ks = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return (ks, ws, *views, *([None, None] if ns == 1 else []))


def _pre(k: Tensor, ks: Tensor, ws: Tensor) -> None:
    """One launch: ``ks`` = ``k`` with non-finite entries zeroed, ``ws`` zeroed."""
    b, hkv, sk, d = k.shape
    r = b * hkv * sk
    block_r = max(1, configs.ATTN_PREP_TILE_ELEMS // d)
    block_z = configs.ATTN_PREP_TILE_ELEMS
    kprog = configs.cdiv(r, block_r)
    args = (k, ks, ws, *k.stride()[:3], hkv, sk, r, ws.numel(), kprog)
    key = _key(args[:3], (*args[3:6], hkv, sk, kprog, fits_int32(r, ws.numel())))
    _PRE((kprog + configs.cdiv(ws.numel(), block_z),), key, args, dict(D=d, BLOCK_R=block_r, BLOCK_Z=block_z))


def _buffers(q: Tensor, k: Tensor, v: Tensor, od: torch.dtype, ns: int) -> tuple:
    """``(dq, dk, dv)`` of the deterministic path: dQ in ``od``, dK/dV in ``od`` (one split) or
    ``(ns, ...)`` float32 partials; each with its input's strides where that is dense."""
    dq = torch.empty_like(q, dtype=od)
    if ns == 1:
        return dq, torch.empty_like(k, dtype=od), torch.empty_like(v, dtype=od)
    f32 = torch.float32
    return (dq, torch.empty((ns, *k.shape), dtype=f32, device=k.device),
            torch.empty((ns, *v.shape), dtype=f32, device=v.device))


def _grad_strides(t: Tensor) -> tuple:
    """``(split, b, h, s)`` strides of a gradient buffer ``(B, H, S, D)`` or partials ``(ns, B, H, S, D)``."""
    return t.stride()[:4] if t.dim() == 5 else (0, *t.stride()[:3])


def _launch_kv(q, k, ks, v, dout, lse, delta, dq, dk, dv, scale: float, causal: bool, diag: int, mask: Mask,
               tile: tuple, nh: int, nq: int, atomic: bool, sink: Optional[tuple] = None) -> None:
    """The dK/dV kernel over every key block (with dQ, from ``ks``, added into ``dq`` where ``atomic``;
    with ``sink`` (``bwd_common.sink_buffers``) the sums of the sinks' gradient into its buffer)."""
    b, h, sq, d = q.shape
    hkv, sk, dvd = k.shape[1], k.shape[2], v.shape[-1]
    bm, bn, warps, stages = tile
    kvr, off, rows, mstrides, flags = _mask_args(mask, q, lse)
    rb = row_blocks(rows, sk, bn) if flags["HAS_ROWS"] else lse
    dkv_atomic = atomic and nh * nq > 1
    if atomic:
        ops = (_descriptor(q, bm), _descriptor(k, bn), _descriptor(ks, bn), _descriptor(v, bn), _descriptor(dout, bm),
               lse, delta, _descriptor(dq, bm))
    else:
        ops = (q, k, k, v, dout, lse, delta, lse)
    grads = (_descriptor(dk, bn), _descriptor(dv, bn)) if dkv_atomic else (dk, dv)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *lse.stride(),
               *delta.stride(), *_grad_strides(dk), *_grad_strides(dv), *mstrides, hkv, h // hkv, nh, nq)
    lo = mask.lo if mask.lo is not None else 0
    grid = (configs.cdiv(sk, bn), b * hkv * nh * nq)
    gh = head_group(*grid, q, causal, warps)
    args = (*ops, *grads, kvr, off, rows, rb, *strides, sq, sk, diag, lo, scale * LOG2E.value, scale, mask.softcap * LOG2E.value,
            gh, *sink_args(sink))
    key = _key((*args[:14], *args[-5:-3]), (*strides, *args[-3:], fits_int32(sq, sk, diag, lo, gh)))
    _KV(grid, key, args,
        dict(D=d, DV=dvd, BLOCK_D=pad_dim(d), BLOCK_DV=pad_dim(dvd), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
             TMA=atomic, DQ_ATOMIC=atomic, DKV_ATOMIC=dkv_atomic, GUARD=configs.ATTN_BWD_GUARD,
             PREC=dot_precision(q.dtype), **flags, **({"SINK": True} if sink is not None else {}),
             num_warps=warps, num_stages=stages))


def _launch_q(q, k, v, dout, lse, delta, dq, scale: float, causal: bool, diag: int, mask: Mask) -> None:
    """The deterministic dQ kernel over every query block."""
    b, h, sq, d = q.shape
    hkv, sk, dvd = k.shape[1], k.shape[2], v.shape[-1]
    bm, bn, warps, stages = attn_tile("bwd_q", q.dtype, d, dvd)
    kvr, off, rows, mstrides, flags = _mask_args(mask, q, lse)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *lse.stride(),
               *delta.stride(), *dq.stride()[:3], *mstrides, h, h // hkv)
    lo = mask.lo if mask.lo is not None else 0
    grid = (configs.cdiv(sq, bm), b * h)
    gh = head_group(*grid, q, causal, warps)
    args = (q, k, v, dout, lse, delta, dq, kvr, off, rows, *strides, sq, sk, diag, lo, scale * LOG2E.value, scale,
            mask.softcap * LOG2E.value, gh)
    key = _key(args[:10], (*strides, fits_int32(sq, sk, diag, lo, gh)))
    _Q(grid, key, args,
       dict(D=d, DV=dvd, BLOCK_D=pad_dim(d), BLOCK_DV=pad_dim(dvd), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
            PREC=dot_precision(q.dtype), **flags, num_warps=warps, num_stages=stages))


def attn_bwd(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, scale: float,
             causal: bool, diag: int = 0, mask: Mask = NO_MASK, out_dtype: Optional[torch.dtype] = None,
             sinks: Optional[Tensor] = None) -> tuple:
    """Gradients ``(dq (B,H,Sq,D), dk (B,Hkv,Sk,D), dv (B,Hkv,Sk,Dv))`` of one Q/K/V block pair.

    ``lse`` and ``delta = rowsum(dout * out) - dlse`` ``(B, H, Sq)`` are the rows' global statistics;
    rows with ``lse = -inf`` contribute nothing. Query ``i`` of element ``b`` sees key ``j`` by the
    rule of :mod:`splitsoftmax.mask` (causal: ``j <= i + q_offset[b] + diag``). Gradients are float32
    unless ``out_dtype``, with their input's strides where that is dense (so a ``(B, H, S, D)`` view
    of ``(B, S, H, D)`` gets one too). GQA sums dK/dV over the query heads of each kv head.
    ``sinks (H,)``: a fourth result, float32 ``(H,)``: the sum over the rows and these keys of
    ``p_sink P_ij (dout_i . v_j)``, ``p_sink = exp(sinks[h] - lse)`` (``bwd_common.sink_sums``).
    """
    q, k, v, dout = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, dout))
    od = out_dtype or stat_dtype(q.dtype)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        zeros = (torch.zeros_like(q, dtype=od), torch.zeros_like(k, dtype=od), torch.zeros_like(v, dtype=od))
        return sink_sums(zeros, sink_buffers(sinks, q, 1, 0))
    if attention_bwd_plain.fused(q, k, v, dout, causal, mask, sinks):  # one kernel, dQ in arrival order
        from .gluon.bwd_fused import attn_bwd as fused_bwd
        return fused_bwd(q, k, v, dout, lse, delta, scale, causal, diag, od, mask)
    atomic = _atomic(q, k, v)
    if not atomic and attention_bwd_plain.takes(q, k, v, dout, mask):  # faster where both apply
        return attention_bwd_plain.attn_bwd(q, k, v, dout, lse, delta, scale, causal, diag, od, mask, sinks)
    if atomic and not _tma_ok(dout):
        dout = dout.contiguous()
    tile = attn_tile("bwd" if atomic else "bwd_kv", q.dtype, q.shape[-1], v.shape[-1])
    nh, nq = splits(q, k, tile)
    # the sinks' sums: masked and interior tiles of each query piece apart
    sink = sink_buffers(sinks, q, 2 * nq, configs.cdiv(k.shape[2], tile[1]) * tile[1])
    if not atomic:
        dq, dk, dv = _buffers(q, k, v, od, nh * nq)
        _launch_kv(q, k, k, v, dout, lse, delta, dq, dk, dv, scale, causal, diag, mask, tile, nh, nq, False, sink)
        _launch_q(q, k, v, dout, lse, delta, dq, scale, causal, diag, mask)
        if dk.dim() == 5:  # partials of the splits, summed in split order
            dk, dv = (torch.empty_like(t, dtype=od).copy_(p.sum(0)) for t, p in ((k, dk), (v, dv)))
        return sink_sums((dq, dk, dv), sink)
    ks, ws, dq, dk, dv = _zeroed(q, k, v, nh * nq)
    if dk is None:
        dk, dv = torch.empty_like(k, dtype=od), torch.empty_like(v, dtype=od)
    _pre(k, ks, ws)
    _launch_kv(q, k, ks, v, dout, lse, delta, dq, dk, dv, scale, causal, diag, mask, tile, nh, nq, True, sink)
    return sink_sums((dq.to(od), dk.to(od), dv.to(od)), sink)


def attn_bwd_runner(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, scale: float,
                    causal: bool, diag: int) -> Optional["LeanBackward"]:
    """The plain backward of these operands' geometry (and of the settings it reads) as one call (a
    :class:`LeanBackward`), for the autograd formula of a plain attention ``(out, lse) = attn_fwd(q, k,
    v, scale, causal, diag)`` with no gradient through ``lse``: None where that backward takes
    another path than :mod:`bwd_plain`'s pair (the fused or atomic kernels, a copy of an operand
    whose last stride is not 1), or where its launches have not been bound at this geometry (by a
    call of the op's backward)."""
    if configs.ATTN_BWD_FUSED or configs.ATTN_BWD_ATOMIC or lse.dtype != torch.float32 or not lse.is_contiguous():
        return None
    if not (q.numel() and k.numel() and v.numel()) or any(t.stride(-1) != 1 for t in (q, k, v, out, dout)):
        return None
    stats = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)  # (like prep's outputs)
    pair = attention_bwd_plain.bound(q, k, v, dout, stats, scale, causal, diag)
    prep = attention_prep.bound(out, dout, lse)
    if pair is None or prep is None:
        return None
    return LeanBackward(pair, prep, _lean_settings(q, v))


def _lean_settings(q: Tensor, v: Tensor) -> tuple:
    """What a :class:`LeanBackward` of ``q``, ``v``'s geometry read when it was made."""
    return configs.ATTN_BWD_FUSED, configs.ATTN_BWD_ATOMIC, attention_bwd_plain.settings(q, v)


class LeanBackward:
    """:func:`attn_bwd_runner`'s runner: ``run(q, k, v, out, lse, dout) -> (dq, dk, dv)`` in
    ``q.dtype`` with the strides ``torch.empty_like`` gives ``q, k, v`` (the rows' statistics and the
    gradients made, the bound prep and pair run), for operands of the geometry it was made for while
    ``run.fresh(q, v)`` (no setting it read has changed)."""

    __slots__ = ("pair", "prep", "settings")

    def __init__(self, pair: tuple, prep, settings: tuple):
        self.pair, self.prep, self.settings = pair, prep, settings

    def fresh(self, q: Tensor, v: Tensor) -> bool:
        """Whether the settings it read are still those in force."""
        return self.settings == _lean_settings(q, v)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor) -> tuple:
        stats, delta = torch.empty_like(lse), torch.empty_like(lse)
        self.prep(out, dout, lse, lse, stats, delta)
        return attention_bwd_plain.run_bound(self.pair, q, k, v, dout, stats, delta)
