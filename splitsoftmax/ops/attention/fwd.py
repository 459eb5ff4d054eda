"""Triton attention: partial-state forward (optionally merged in place), split-KV decode.

The backward is :mod:`splitsoftmax.ops.attention.bwd`.

Layouts are SDPA's: ``q (B, H, Sq, D)``, ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)``, any
strides; a forward's output is laid out like ``q`` (a ``(B, Sq, H, Dv)`` tensor's view when ``q`` is a
``(B, Sq, H, D)`` tensor's, as Hugging Face passes them). Query head ``h`` reads kv head
``h // (H // Hkv)`` (K/V are never repeated). Causal: query ``i`` sees key ``j`` iff ``j <= i + diag``;
the forward's ``mask`` (splitsoftmax.core.mask.Mask) narrows each row to one key interval and caps the
scores (see splitsoftmax.ops.attention.kernel_mask): a program loops over the union of its rows'
intervals, unmasked inside their intersection, masked at the edges only.

Forward program = ``BLOCK_M`` query rows x one key range. It walks K/V tiles with the online
recurrence ``(m, l, o)`` in the log2 domain (``exp2``; ``log2(e)`` folded into the score scale and
so into ``alpha``) and converts ``lse`` to the natural log at the boundary. Key tiles wholly
visible to every row run unmasked; only the tiles crossing the diagonal or the end of the range
are masked; tiles wholly above the diagonal are never visited. With few query rows (decode) the
G query heads of a kv head are packed into one program's rows (``PACK``), and when too few
programs would run the keys are split across programs whose partial ``(out, lse)`` are merged
by the fused merge kernel (flash-decoding); see ``splitsoftmax.ops.attention.decode``. Where TMA can
address the inputs (``_tma_operands``: 2-byte dtypes, unpadded head dims, 16-byte strides, Hopper
or later, rows not packed) the forward reads its Q/K/V tiles, V beside K, through ``(B, H, S, D)``
tensor descriptors (zeros past S), or 2-D row views where no tile crosses the end of a head
(``(B * H * S, D)`` of contiguous tensors, ``(B * S, H * D)`` of ``(B, S, H, D)`` ones, at batch 1 with
any length), and stores its output through one where it writes it directly (one split, no running
state); the results are the pointer path's bit for bit. On sm_90, bfloat16 rows of the plain mask
written directly take the warp-specialized Gluon kernel instead (``attention_fwd_gluon``) from
``configs.ATTN_FWD_GLUON_MIN_SQ`` queries on.

Masked tiles multiply hidden keys' values by ``p = 0``, and ``0 * NaN`` is NaN: a NaN/Inf value that
a row may not see must not reach it. Such a value makes a NaN in every row of the tile's product,
so the masked tiles run unguarded and a sum of the result decides, rarely, to run them again with
the guard (:func:`_guarded_pv`): from the state before them (causal), or from the start (variants,
whose masked edge tiles run first).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from ...core.mask import NO_MASK, Mask
from ...core.state import stat_dtype
from .._triton import configs
from .kernel_mask import KernelMask, band_tiles, capped, kernel_mask, row_bounds
from .decode import Plan, dot_precision, head_group, pad_dim, plan, plan_settings
from .._triton.device import hopper, sm90, sm_count
from .._triton.launch import Launcher, Memo, auto_key, fits_int32, geometry
from ...core.runtime import heads_inner, interpreting
from ..merge.kernel import merge_into, merge_launch
from .._triton.algebra import LOG2E, inv_or_zero, lse2_of, online_step, ref_max, rescale

# Triton 3.6's interpreter multiplies bf16 tiles as raw integers: there, tl.dot runs on float32
# copies of the (already rounded) operands, which is the same product.
_DOT_F32 = tl.constexpr(interpreting())


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr):
    """``acc + a @ b`` with float32 accumulation."""
    if _DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc, input_precision=PREC)
    return out


@triton.jit
def _program_order(GH):
    """``(block, head)`` of this program of a ``(blocks, heads, ...)`` grid, in launch order (dim 0
    fastest): heads in groups of ``GH`` (``decode.head_group``), within a group block-major and
    head-minor. ``GH = 1`` is the grid's own order."""
    nb = tl.num_programs(0)
    lin = tl.program_id(1) * nb + tl.program_id(0)
    group = lin // (GH * nb)
    r = lin - group * GH * nb
    gh = tl.minimum(GH, tl.num_programs(1) - group * GH)
    blk = r // gh
    return blk, group * GH + (r - blk * gh)


@triton.jit
def _load_rows(ptrs, rmask, cmask, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Load a 2-D tile, masking rows and/or padded columns only when asked (0 elsewhere)."""
    if MASK_ROWS and MASK_COLS:
        x = tl.load(ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0)
    elif MASK_ROWS:
        x = tl.load(ptrs, mask=rmask[:, None], other=0.0)
    elif MASK_COLS:
        x = tl.load(ptrs, mask=cmask[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _tma_load(desc, b, h, row0, hcol, start, ROWS: tl.constexpr, COLS: tl.constexpr, ROW2D: tl.constexpr):
    """Tile ``[ROWS, COLS]`` of rows ``start ..`` of head ``(b, h)`` through a TMA descriptor: where
    ``ROW2D`` a 2-D row view, whose head starts at row ``row0`` and column ``hcol * COLS`` (``(B * H *
    S, D)`` with ``hcol = 0``, or ``(B * S, H * D)`` with ``hcol = h``), else the ``(B, H, S, D)``
    tensor (zeros past S)."""
    if ROW2D:
        x = desc.load([row0 + start, hcol * COLS])
    else:
        x = desc.load([b, h, start, 0]).reshape(ROWS, COLS)
    return x


@triton.jit
def _tma_store(desc, x, b, h, row0, hcol, start, ROW2D: tl.constexpr):
    """Store tile ``x [ROWS, COLS]`` at rows ``start ..`` of head ``(b, h)`` (see :func:`_tma_load`;
    the ``(B, H, S, D)`` form drops rows past S)."""
    if ROW2D:
        desc.store([row0 + start, hcol * x.shape[1]], x)
    else:
        desc.store([b, h, start, 0], x.reshape(1, 1, x.shape[0], x.shape[1]))


@triton.jit
def _load_tile(src, b, h, row0, hcol, start, rmask, cmask, ROWS: tl.constexpr, COLS: tl.constexpr,
               MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr, TMA: tl.constexpr, ROW2D: tl.constexpr):
    """Tile ``[ROWS, COLS]`` of rows ``start ..`` of head ``(b, h)``: with ``TMA`` through the
    descriptor ``src`` (see :func:`_tma_load`; 0 past ``rmask`` where ``MASK_ROWS``), else through
    the pointers ``src`` (see :func:`_load_rows`)."""
    if TMA:
        x = _tma_load(src, b, h, row0, hcol, start, ROWS, COLS, ROW2D)
        if MASK_ROWS:
            x = tl.where(rmask[:, None], x, 0.0).to(x.dtype)
    else:
        x = _load_rows(src, rmask, cmask, MASK_ROWS, MASK_COLS)
    return x


@triton.jit
def _kv_src(k_base, v_base, kj, s_ks, s_vs, TMA: tl.constexpr):
    """What :func:`_fwd_tile` reads key tile ``kj`` from: the descriptors, or the tile's pointers."""
    if TMA:
        src = k_base, v_base
    else:
        src = k_base + kj[:, None] * s_ks, v_base + kj[:, None] * s_vs
    return src


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_src, v_src, kb, kvh, kv_row0, kv_hcol, start, kj, pos, hi, diag, lo_r, hi_r,
              qk_scale, cap_in, cap_out, dmask, dvmask,
              CAUSAL: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
              POS_SCALE: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, ROW2D: tl.constexpr,
              GUARD: tl.constexpr, BAND: tl.constexpr, SOFTCAP: tl.constexpr, SOFTCAP_APPROX: tl.constexpr):
    """One K/V tile of the online recurrence; ``MASKED`` tiles mask keys >= hi and the diagonal, or
    with ``BAND`` every key outside the row's ``[lo_r, hi_r)`` (``hi`` then only bounds the loads).
    ``k_src, v_src``: the tile's pointers, or with ``TMA`` descriptors read at ``(kb, kvh, start)``
    (row ``kv_row0 + start`` of the row views where ``ROW2D``); ``kj = start + arange(BLOCK_N)``.
    ``GUARD``: a masked tile keeps NaN/Inf values from the rows that do not see them.
    ``SOFTCAP``: scores ``c * tanh(s / c)`` (see attn_mask.capped)."""
    kmask = kj < hi  # [BLOCK_N]
    # (TMA reads zeros past Sk, and row views never cross it; keys past hi need no zeros in K, whose
    # scores are masked, nor in V when CAUSAL or BAND, where the guarded pass (see _attn_fwd_kernel) keeps
    # non-finite values from the rows that may not see them)
    k = _load_tile(k_src, kb, kvh, kv_row0, kv_hcol, start, kmask, dmask, kj.shape[0], q.shape[1],
                   MASKED and not TMA, not EVEN_D, TMA, ROW2D)
    if TMA:  # V beside K: one barrier for both, and V ready before its product
        v = _load_tile(v_src, kb, kvh, kv_row0, kv_hcol, start, kmask, dvmask, kj.shape[0], acc.shape[1],
                       MASKED and not (CAUSAL or BAND), not EVEN_DV, TMA, ROW2D)  # [BLOCK_N, BLOCK_DV]
    qk = _dot(q, tl.trans(k), None, PREC)  # [BLOCK_M, BLOCK_N]
    if SOFTCAP:
        qk = capped(qk, cap_in, cap_out, SOFTCAP_APPROX)  # [BLOCK_M, BLOCK_N], scaled (log2 domain)
    if MASKED:
        if BAND:
            ok = (kj[None, :] >= lo_r[:, None]) & (kj[None, :] < hi_r[:, None])
        else:
            ok = kmask[None, :]
            if CAUSAL:
                ok = ok & (kj[None, :] <= pos[:, None] + diag)
        if SOFTCAP:
            s = tl.where(ok, qk, float("-inf"))
        else:
            s = tl.where(ok, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = ref_max(m_new)  # empty so far: exp2(-inf - 0) = 0
    elif SOFTCAP:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = m_new
        s = qk
    else:
        if POS_SCALE:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk * qk_scale, 1))
        m_use = m_new
        s = qk * qk_scale
    p, alpha, l_i = online_step(l_i, m_i, m_use, s)  # [BLOCK_M, BLOCK_N], [BLOCK_M], [BLOCK_M]
    if not TMA:
        v = _load_tile(v_src, kb, kvh, kv_row0, kv_hcol, start, kmask, dvmask, kj.shape[0], acc.shape[1], MASKED,
                       not EVEN_DV, TMA, ROW2D)  # [BLOCK_N, BLOCK_DV]
    acc = acc * alpha[:, None]
    if MASKED and (CAUSAL or BAND) and GUARD:
        acc = _guarded_pv(acc, p, v, PREC)
    else:
        acc = _dot(p.to(v.dtype), v, acc, PREC)  # [BLOCK_M, BLOCK_DV]
    return acc, l_i, m_new


@triton.jit
def _guarded_pv(acc, p, v, PREC: tl.constexpr):
    """``acc + p @ v`` where keys with a NaN/Inf value count only for the rows that see them
    (``p > 0``), whose result is NaN; ``p [BLOCK_M, BLOCK_N]``, ``v [BLOCK_N, BLOCK_DV]``."""
    z = tl.sum(v.to(tl.float32) * 0.0, 1)  # [BLOCK_N]: NaN where the key's value holds a NaN/Inf, else 0
    bad = z != z
    hit = tl.sum(tl.where(bad[None, :], p, 0.0), 1) > 0  # [BLOCK_M] rows that see one
    out = _dot(p.to(v.dtype), tl.where(tl.abs(v) < float("inf"), v, 0.0).to(v.dtype), acc, PREC)
    return tl.where(hit[:, None], float("nan"), out)


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, k_base, v_base, b32, kvh, kv_row0, kv_hcol, first, end, hi, pos, diag, lo_r, hi_r,
              qk_scale, cap_in, cap_out, dmask, dvmask, s_ks, s_vs, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              MASKED: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, POS_SCALE: tl.constexpr,
              PREC: tl.constexpr, TMA: tl.constexpr, ROW2D: tl.constexpr, GUARD: tl.constexpr, BAND: tl.constexpr,
              SOFTCAP: tl.constexpr, SOFTCAP_APPROX: tl.constexpr):
    """The state ``(acc [BLOCK_M, BLOCK_DV], l [BLOCK_M], m [BLOCK_M])`` of query tile ``q`` carried
    over the key tiles starting at ``first, first + BLOCK_N, .. < end`` (see :func:`_fwd_tile`).
    The rare ``GUARD`` pass is not pipelined: no buffers of its own, so that two programs of the
    64x64 tile still fit in an SM's shared memory (tests/test_attention_smem.py)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in tl.range(first, end, BLOCK_N, num_stages=1 if GUARD else None):
        kj = start + offs_n  # [BLOCK_N]
        k_src, v_src = _kv_src(k_base, v_base, kj, s_ks, s_vs, TMA)
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_src, v_src, b32, kvh, kv_row0, kv_hcol, start, kj, pos, hi, diag,
                                  lo_r, hi_r, qk_scale, cap_in, cap_out, dmask, dvmask, CAUSAL=CAUSAL, MASKED=MASKED,
                                  EVEN_D=EVEN_D, EVEN_DV=EVEN_DV, POS_SCALE=POS_SCALE, PREC=PREC, TMA=TMA, ROW2D=ROW2D,
                                  GUARD=GUARD, BAND=BAND, SOFTCAP=SOFTCAP, SOFTCAP_APPROX=SOFTCAP_APPROX)
    return acc, l_i, m_i


@triton.jit
def _fwd_edges(acc, l_i, m_i, q, k_base, v_base, b32, kvh, kv_row0, kv_hcol, a0, a1, a2, end, diag, lo_r, hi_r,
               qk_scale, cap_in, cap_out, dmask, dvmask, s_ks, s_vs, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, POS_SCALE: tl.constexpr, PREC: tl.constexpr,
               TMA: tl.constexpr, ROW2D: tl.constexpr, GUARD: tl.constexpr, SOFTCAP: tl.constexpr,
               SOFTCAP_APPROX: tl.constexpr):
    """The masked tiles of rows ``[lo_r, hi_r)`` (see attn_mask.band_tiles): ``[a0, a1)`` below the
    unmasked ones, then ``[a2, end)`` above them."""
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, b32, kvh, kv_row0, kv_hcol, a0, a1, end, lo_r, diag,
                              lo_r, hi_r, qk_scale, cap_in, cap_out, dmask, dvmask, s_ks, s_vs, BLOCK_N=BLOCK_N,
                              CAUSAL=CAUSAL, MASKED=True, EVEN_D=EVEN_D, EVEN_DV=EVEN_DV, POS_SCALE=POS_SCALE,
                              PREC=PREC, TMA=TMA, ROW2D=ROW2D, GUARD=GUARD, BAND=True, SOFTCAP=SOFTCAP,
                              SOFTCAP_APPROX=SOFTCAP_APPROX)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, b32, kvh, kv_row0, kv_hcol, a2, end, end, lo_r, diag,
                              lo_r, hi_r, qk_scale, cap_in, cap_out, dmask, dvmask, s_ks, s_vs, BLOCK_N=BLOCK_N,
                              CAUSAL=CAUSAL, MASKED=True, EVEN_D=EVEN_D, EVEN_DV=EVEN_DV, POS_SCALE=POS_SCALE,
                              PREC=PREC, TMA=TMA, ROW2D=ROW2D, GUARD=GUARD, BAND=True, SOFTCAP=SOFTCAP,
                              SOFTCAP_APPROX=SOFTCAP_APPROX)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Sq", "Sk", "diag", "chunk", "lo_off", "kstart", "GH", "s_lb", "s_lh", "s_lsplit"])
def _attn_fwd_kernel(Q, K, V, O, L,
                     s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd,
                     s_ob, s_oh, s_os, s_od, s_osplit, s_lb, s_lh, s_ls, s_lsplit,
                     NH, G, Sq, Sk, diag, chunk, qk_scale, KVR, QOFF, ROWS, lo_off, kstart, cap_in, cap_out, GH,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     PACK: tl.constexpr, ACC: tl.constexpr, POS_SCALE: tl.constexpr, PREC: tl.constexpr,
                     TMA: tl.constexpr = False, O_TMA: tl.constexpr = False, ROW2D: tl.constexpr = False,
                     TRIGGER: tl.constexpr = False, SEQ_ROWS: tl.constexpr = False, WINDOW: tl.constexpr = False,
                     KV_RANGE: tl.constexpr = False, Q_OFFSET: tl.constexpr = False, ROW_BOUNDS: tl.constexpr = False,
                     SOFTCAP: tl.constexpr = False, SOFTCAP_APPROX: tl.constexpr = False):
    """Grid ``(row blocks, B * NH, splits)``, taken in the order of ``GH`` (:func:`_program_order`);
    split ``s`` covers keys ``kstart + s * chunk ..``.
    ``TMA`` (not with ``PACK``; ``BLOCK_D == D``, ``BLOCK_DV == DV``): ``Q, K, V`` are tensor
    descriptors, else pointers; ``O_TMA`` (with ``TMA``, not ``ACC``, one split): ``O`` is one too.
    Descriptors are ``(B, H, S, D)``, or where ``ROW2D`` (no tile crossing the end of a head) 2-D row
    views: ``(B * H * S, D)`` of contiguous heads, or with ``SEQ_ROWS`` ``(B * S, H * D)`` of
    ``(B, S, H, D)`` tensors. ``TRIGGER``: let the kernel launched after this one under programmatic
    dependent launch (the split-KV merge) start now; it waits on the GPU for this grid's results.
    The mask's fields (attn_mask.row_bounds: ``WINDOW``, ``KV_RANGE``, ``Q_OFFSET``, ``ROW_BOUNDS``)
    give each row a key interval; ``SOFTCAP`` caps the scores (``cap_in``, ``cap_out``)."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    pid_m, pid_bh = _program_order(GH)
    if CAUSAL:  # the query blocks with the most visible keys start first: a shorter tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_s = tl.program_id(2)
    b = (pid_bh // NH).to(tl.int64)
    hh = pid_bh % NH
    r0 = pid_m * BLOCK_M
    r = r0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] program rows
    if PACK:  # rows are (query head of this kv group, position) pairs
        n_rows = G * Sq
        head = (hh * G + r // Sq).to(tl.int64)
        pos = r % Sq
        kvh = hh
        r1 = tl.minimum(r0 + BLOCK_M, n_rows) - 1
        same = (r0 // Sq) == (r1 // Sq)
        pos_lo = tl.where(same, r0 % Sq, 0)
        pos_hi = tl.where(same, r1 % Sq, Sq - 1)
    else:
        n_rows = Sq
        head = hh.to(tl.int64) + tl.zeros([BLOCK_M], tl.int64)
        pos = r
        kvh = hh // G
        pos_lo = r0
        pos_hi = tl.minimum(r0 + BLOCK_M, Sq) - 1
    row_ok = r < n_rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dmask = offs_d < D
    dvmask = offs_dv < DV
    b32 = b.to(tl.int32)
    if SEQ_ROWS:  # where this head's rows start in the (B * S, H * D) row views (ROW2D)
        q_row0 = b32 * Sq
        kv_row0 = b32 * Sk
        q_hcol = hh
        kv_hcol = kvh
    else:  # ... or in the (B * H * S, D) ones
        q_row0 = (b32 * NH + hh) * Sq
        kv_row0 = (b32 * (NH // G) + kvh) * Sk
        q_hcol = 0
        kv_hcol = 0
    if TMA:
        q = _tma_load(Q, b32, hh, q_row0, q_hcol, r0, BLOCK_M, BLOCK_D, ROW2D)  # [BLOCK_M, BLOCK_D], zeros past Sq
    else:
        q_ptrs = Q + b * s_qb + head[:, None] * s_qh + pos[:, None] * s_qs + offs_d[None, :] * s_qd
        q = _load_rows(q_ptrs, row_ok, dmask, True, BLOCK_D != D)  # [BLOCK_M, BLOCK_D]
    # key range of this program: its split, cut at the last key any of its rows may see
    lo = kstart + pid_s * chunk
    hi = tl.minimum(Sk, lo + chunk)
    if TMA:
        k_base, v_base = K, V
    else:
        k_base = K + b * s_kb + kvh.to(tl.int64) * s_kh + offs_d[None, :] * s_kd
        v_base = V + b * s_vb + kvh.to(tl.int64) * s_vh + offs_dv[None, :] * s_vd
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if WINDOW or KV_RANGE or Q_OFFSET or ROW_BOUNDS:  # each row's interval [lo_r, hi_r)
        lo_r, hi_r = row_bounds(pos, row_ok, b, lo, hi, Sq, diag, lo_off, KVR, QOFF, ROWS, CAUSAL, WINDOW, KV_RANGE,
                                Q_OFFSET, ROW_BOUNDS)  # [BLOCK_M] each
        a0, a1, a2, end = band_tiles(lo_r, hi_r, row_ok, BLOCK_N)
        # the masked tiles at the intervals' edges first, so that the bounds are dead in the unmasked loop
        acc, l_i, m_i = _fwd_edges(acc, l_i, m_i, q, k_base, v_base, b32, kvh, kv_row0, kv_hcol, a0, a1, a2, end, diag,
                                   lo_r, hi_r, qk_scale, cap_in, cap_out, dmask, dvmask, s_ks, s_vs, BLOCK_N=BLOCK_N,
                                   CAUSAL=CAUSAL, EVEN_D=BLOCK_D == D, EVEN_DV=BLOCK_DV == DV, POS_SCALE=POS_SCALE,
                                   PREC=PREC, TMA=TMA, ROW2D=ROW2D, GUARD=False, SOFTCAP=SOFTCAP,
                                   SOFTCAP_APPROX=SOFTCAP_APPROX)
        acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, b32, kvh, kv_row0, kv_hcol, a1, a2, end, pos, diag,
                                  pos, pos, qk_scale, cap_in, cap_out, dmask, dvmask, s_ks, s_vs, BLOCK_N=BLOCK_N,
                                  CAUSAL=CAUSAL, MASKED=False, EVEN_D=BLOCK_D == D, EVEN_DV=BLOCK_DV == DV,
                                  POS_SCALE=POS_SCALE, PREC=PREC, TMA=TMA, ROW2D=ROW2D, GUARD=False, BAND=True,
                                  SOFTCAP=SOFTCAP, SOFTCAP_APPROX=SOFTCAP_APPROX)
        # a NaN/Inf value a row cannot see must not reach it through 0 * NaN in a masked tile; such a
        # value makes a NaN in every row of that tile's product (p >= 0) and so of the result
        if not (tl.abs(tl.sum(tl.sum(acc, 1), 0)) < float("inf")):  # rare: all again, the edges guarded
            lo_r, hi_r = row_bounds(pos, row_ok, b, lo, hi, Sq, diag, lo_off, KVR, QOFF, ROWS, CAUSAL, WINDOW,
                                    KV_RANGE, Q_OFFSET, ROW_BOUNDS)
            acc, l_i, m_i = _fwd_edges(tl.zeros_like(acc), tl.zeros_like(l_i), tl.zeros_like(m_i) - float("inf"), q,
                                       k_base, v_base, b32, kvh, kv_row0, kv_hcol, a0, a1, a2, end, diag, lo_r, hi_r,
                                       qk_scale, cap_in, cap_out, dmask, dvmask, s_ks, s_vs, BLOCK_N=BLOCK_N,
                                       CAUSAL=CAUSAL, EVEN_D=BLOCK_D == D, EVEN_DV=BLOCK_DV == DV, POS_SCALE=POS_SCALE,
                                       PREC=PREC, TMA=TMA, ROW2D=ROW2D, GUARD=True, SOFTCAP=SOFTCAP,
                                       SOFTCAP_APPROX=SOFTCAP_APPROX)
            acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, b32, kvh, kv_row0, kv_hcol, a1, a2, end, pos,
                                      diag, pos, pos, qk_scale, cap_in, cap_out, dmask, dvmask, s_ks, s_vs,
                                      BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, MASKED=False, EVEN_D=BLOCK_D == D,
                                      EVEN_DV=BLOCK_DV == DV, POS_SCALE=POS_SCALE, PREC=PREC, TMA=TMA, ROW2D=ROW2D,
                                      GUARD=True, BAND=True, SOFTCAP=SOFTCAP, SOFTCAP_APPROX=SOFTCAP_APPROX)
    else:
        full_hi = hi
        if CAUSAL:
            hi = tl.minimum(hi, pos_hi + diag + 1)
            full_hi = tl.minimum(hi, pos_lo + diag + 1)
        mid = lo + (tl.maximum(full_hi - lo, 0) // BLOCK_N) * BLOCK_N
        # tiles every row sees whole, then those crossing the diagonal or the range end (masked)
        acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, b32, kvh, kv_row0, kv_hcol, lo, mid, hi, pos, diag,
                                  pos, pos, qk_scale, cap_in, cap_out, dmask, dvmask, s_ks, s_vs, BLOCK_N=BLOCK_N,
                                  CAUSAL=CAUSAL, MASKED=False, EVEN_D=BLOCK_D == D, EVEN_DV=BLOCK_DV == DV,
                                  POS_SCALE=POS_SCALE, PREC=PREC, TMA=TMA, ROW2D=ROW2D, GUARD=False, BAND=False,
                                  SOFTCAP=SOFTCAP, SOFTCAP_APPROX=SOFTCAP_APPROX)
        acc0, l0, m0 = acc, l_i, m_i
        acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_base, v_base, b32, kvh, kv_row0, kv_hcol, mid, hi, hi, pos, diag,
                                  pos, pos, qk_scale, cap_in, cap_out, dmask, dvmask, s_ks, s_vs, BLOCK_N=BLOCK_N,
                                  CAUSAL=CAUSAL, MASKED=True, EVEN_D=BLOCK_D == D, EVEN_DV=BLOCK_DV == DV,
                                  POS_SCALE=POS_SCALE, PREC=PREC, TMA=TMA, ROW2D=ROW2D, GUARD=False, BAND=False,
                                  SOFTCAP=SOFTCAP, SOFTCAP_APPROX=SOFTCAP_APPROX)
        if CAUSAL:  # a NaN/Inf value a row cannot see must not reach it through 0 * NaN in a diagonal tile
            if not (tl.abs(tl.sum(tl.sum(acc, 1), 0)) < float("inf")):  # rare: the masked tiles again, guarded
                acc, l_i, m_i = _fwd_loop(acc0, l0, m0, q, k_base, v_base, b32, kvh, kv_row0, kv_hcol, mid, hi, hi, pos,
                                          diag, pos, pos, qk_scale, cap_in, cap_out, dmask, dvmask, s_ks, s_vs,
                                          BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, MASKED=True, EVEN_D=BLOCK_D == D,
                                          EVEN_DV=BLOCK_DV == DV, POS_SCALE=POS_SCALE, PREC=PREC, TMA=TMA, ROW2D=ROW2D,
                                          GUARD=True, BAND=False, SOFTCAP=SOFTCAP, SOFTCAP_APPROX=SOFTCAP_APPROX)
    # epilogue: (out, lse) of this block; an empty row (l exactly 0) is (0, -inf); a NaN l stays NaN,
    # never "empty": merges skip empty parts, and a NaN must reach the rows that depend on it
    out = acc / tl.where(l_i != 0, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_DV]
    lse2 = lse2_of(m_i, l_i)
    l_ptrs = L + pid_s * s_lsplit + b * s_lb + head * s_lh + pos * s_ls
    if O_TMA:
        _tma_store(O, out.to(O.dtype), b32, hh, q_row0, q_hcol, r0, ROW2D)
    else:
        o_ptrs = O + pid_s * s_osplit + b * s_ob + head[:, None] * s_oh + pos[:, None] * s_os + offs_dv[None, :] * s_od
        st_mask = row_ok[:, None] & dvmask[None, :]
        if ACC:  # merge into the running float32 state (out, lse) held at O, L
            old2 = tl.load(l_ptrs, mask=row_ok, other=float("-inf")) * LOG2E
            _, m2, w_old, w_new = rescale(old2, lse2)
            tot = w_old + w_new
            inv = inv_or_zero(tot)  # [BLOCK_M]
            o_old = tl.load(o_ptrs, mask=st_mask & (w_old > 0)[:, None], other=0.0)
            out = o_old * (w_old * inv)[:, None] + out * (w_new * inv)[:, None]
            lse2 = lse2_of(m2, tot)
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=st_mask)
    tl.store(l_ptrs, lse2 * 0.6931471805599453, mask=row_ok)


def _descriptor(t: Tensor, shape: list, strides: list, block: list) -> TensorDescriptor:
    """A TMA descriptor of ``t`` without ``TensorDescriptor.__post_init__``, which repeats checks that
    :func:`_tma_operands` has made (and costs host time on every call)."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.padding = t, shape, strides, block, "zero"
    return desc


def _tma_ok(t: Tensor) -> bool:
    """Whether TMA can address ``t``: unit last stride, unpadded last dim, 16-byte base and strides."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.shape[-1] == pad_dim(t.shape[-1]) and t.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 for st in t.stride()[:-1]))


def _row_layout(t: Tensor) -> Optional[str]:
    """How ``t (B, H, S, D)`` is a 2-D row view with int32 row coordinates: ``"heads"`` where it is
    contiguous (``(B * H * S, D)``), ``"seq"`` where it is a view of a ``(B, S, H, D)`` tensor (heads
    side by side in a row, batch elements back to back: ``(B * S, H * D)``), else None."""
    b, h, s, d = t.shape
    if b * h * s >= 2 ** 31:
        return None
    if t.is_contiguous():
        return "heads"
    sb, sh, ss, _ = t.stride()
    return "seq" if sh == d and ss >= h * d and (sb == s * ss or b == 1) else None


def _row_spec(t: Tensor, layout: str, rows: int) -> tuple:
    """``(shape, strides, block)`` of the 2-D row-view descriptor of ``t`` in ``layout`` (see
    :func:`_row_layout`), ``rows`` per tile."""
    b, h, s, d = t.shape
    if layout == "heads":
        return [b * h * s, d], [d, 1], [rows, d]
    return [b * s, h * d], [t.stride(2), 1], [rows, d]


def _tma_specs(q: Tensor, k: Tensor, v: Tensor, out: Tensor, p: Plan, store: bool) -> Optional[tuple]:
    """``(specs, o_tma, row2d, seq_rows)``: ``specs`` gives, for each of q, k, v and out, the
    ``(shape, strides, block)`` of its TMA descriptor (None for ``out`` unless ``o_tma``); None where
    the pointer path runs: packed rows, float32, padded head dims, strides or bases TMA cannot
    address (16-byte units), a GPU before Hopper, or ``configs.ATTN_TMA`` off. ``row2d``: 2-D row
    views (``configs.ATTN_TMA_ROWS``; every operand in one :func:`_row_layout`, no tile crossing the
    end of a head or, for ``(B, S, H, D)`` views at batch 1, of the tensor), ``seq_rows`` the
    ``(B * S, H * D)`` kind; else ``(B, H, S, D)`` descriptors. A function of the operands' shapes,
    strides, dtypes and alignment alone."""
    if not configs.ATTN_TMA or p.pack or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if q.is_cuda and not hopper(q):
        return None
    if not (_tma_ok(q) and _tma_ok(k) and _tma_ok(v)):
        return None
    store = store and configs.ATTN_TMA_STORE and _tma_ok(out)
    bm, bn = p.tile[:2]
    ops = [(q, bm), (k, bn), (v, bn)] + ([(out, bm)] if store else [])
    layout = _row_layout(q) if configs.ATTN_TMA_ROWS else None
    whole = q.shape[2] % bm == 0 and k.shape[2] % bn == 0
    row2d = (layout is not None and (whole or (layout == "seq" and q.shape[0] == 1))
             and all(_row_layout(t) == layout for t, _ in ops[1:]))
    if row2d:
        specs = [_row_spec(t, layout, rows) for t, rows in ops]
    else:
        specs = [(list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]]) for t, rows in ops]
    if not store:
        specs.append(None)
    return tuple(specs), store, row2d, row2d and layout == "seq"


def _operands(tensors: tuple, specs) -> tuple:
    """``tensors`` with those that ``specs`` (from :func:`_tma_specs`) names given as TMA descriptors."""
    return tuple(t if s is None else _descriptor(t, *s) for t, s in zip(tensors, specs))


def _tma_operands(q: Tensor, k: Tensor, v: Tensor, out: Tensor, p: Plan, store: bool) -> Optional[tuple]:
    """``(Q, K, V, O, o_tma, row2d, seq_rows)``: the forward's operands as TMA descriptors (``O`` too
    where ``o_tma``, else ``out`` itself) by :func:`_tma_specs`, or None where the pointer path runs."""
    tma = _tma_specs(q, k, v, out, p, store)
    return None if tma is None else (*_operands((q, k, v, out), tma[0]), *tma[1:])


_FWD = Launcher(_attn_fwd_kernel)


def _split_strides(t: Tensor, h: int, sq: int) -> tuple:
    """Strides ``(split, b, h, s, *rest)`` of partials ``t (nsplit, B * H * Sq, *rest)``."""
    st = t.stride()
    return (st[0], h * sq * st[1], sq * st[1], *st[1:])


def _kernel_mask(mask: Mask, q: Tensor, scale: float, lse: Tensor) -> KernelMask:
    """``mask`` as kernel arguments; softcap through ``tanh.approx`` for 16-bit inputs on NVIDIA GPUs
    where ``configs.ATTN_SOFTCAP_APPROX``."""
    approx = (configs.ATTN_SOFTCAP_APPROX and q.is_cuda and torch.version.hip is None
              and q.dtype in (torch.float16, torch.bfloat16))
    return kernel_mask(mask, q, scale, lse, approx)


class _FwdLaunch(NamedTuple):
    """Everything of one forward launch but its tensors, a function of their geometry."""
    grid: tuple
    key: tuple
    specs: tuple    # TMA descriptor of q, k, v, out: (shape, strides, block), or None (the tensor)
    scalars: tuple  # the arguments between ``lse`` and the mask's tensors
    tail: tuple     # the arguments after the mask's tensors
    kwargs: dict


# launches of the plain mask by geometry: the host work of a repeated call is a lookup
_FWD_LAUNCHES = Memo()


def _fwd_launch(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool, diag: int,
                p: Plan, acc: bool, split_dim: bool, km: KernelMask) -> _FwdLaunch:
    """The launch of :func:`launch_fwd` for these operands."""
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    bm, bn, warps, stages = p.tile
    so = _split_strides(out, h, sq) if split_dim else (0, *out.stride())
    sl = _split_strides(lse, h, sq) if split_dim else (0, *lse.stride())
    grid = (configs.cdiv(g * sq if p.pack else sq, bm), b * (hkv if p.pack else h), p.nsplit)
    tma = _tma_specs(q, k, v, out, p, store=not (acc or split_dim))
    specs, o_tma, row2d, seq = tma if tma else ((None,) * 4, False, False, False)
    strides = (*q.stride(), *k.stride(), *v.stride(), *so[1:], so[0], *sl[1:], sl[0], hkv if p.pack else h, g)
    gh = 1 if p.pack else head_group(grid[0], grid[1], q, causal, warps)
    key = (strides, fits_int32(sq, sk, diag, p.chunk, km.lo_off, p.start, gh), q.dtype, k.dtype, v.dtype, out.dtype,
           lse.dtype, *(t.data_ptr() % 16 == 0 for t in (q, k, v, out, lse, km.kvr, km.qoff, km.rows)))
    kwargs = dict(D=d, DV=dv, BLOCK_D=pad_dim(d), BLOCK_DV=pad_dim(dv), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
                  PACK=p.pack, ACC=acc, POS_SCALE=scale > 0, PREC=dot_precision(q.dtype), TMA=tma is not None,
                  O_TMA=o_tma, ROW2D=row2d, TRIGGER=split_dim and configs.ATTN_SPLIT_TRIGGER and hopper(q),
                  SEQ_ROWS=seq, **km.flags, num_warps=warps, num_stages=stages)
    return _FwdLaunch(grid, key, specs, (*strides, sq, sk, diag, p.chunk, scale * LOG2E.value),
                      (km.lo_off, p.start, km.cap_in, km.cap_out, gh), kwargs)


class _GluonFwdLaunch(NamedTuple):
    """A launch of the Gluon forward (``attention_fwd_gluon``), a function of its operands' geometry."""
    grid: tuple
    key: tuple
    rows: tuple     # the descriptors' rows: (query tile, key tile)
    scalars: tuple  # the arguments after ``out`` and ``lse``
    kwargs: dict


def gluon_fwd_length(sq: int, causal: bool) -> bool:
    """Whether ``configs.ATTN_FWD_GLUON`` is on and ``sq`` queries reach its least length
    (``configs.ATTN_FWD_GLUON_MIN_SQ``: full, causal)."""
    return configs.ATTN_FWD_GLUON and sq >= configs.ATTN_FWD_GLUON_MIN_SQ[causal]


def _gluon_fwd_tile(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float, causal: bool, p: Plan, acc: bool,
                    split_dim: bool) -> Optional[tuple]:
    """The Gluon forward's tile if it runs this launch of the plain mask, else None:
    :func:`gluon_fwd_length`, a Hopper GPU (sm_90: its warpgroup products), not the interpreter,
    bfloat16 inputs (the dtype its GPU tests cover) with equal head dims and a tile listed for them,
    one split written directly or (``acc``, ``configs.ATTN_FWD_GLUON_ACC``) merged into a float32
    running state (no partials), rows not packed, a positive scale, TMA-addressable inputs and an
    output with unit last stride."""
    d = q.shape[-1]
    if acc and not (configs.ATTN_FWD_GLUON_ACC and out.dtype == torch.float32):
        return None
    if (not gluon_fwd_length(q.shape[2], causal) or interpreting() or split_dim or p.pack
            or p.nsplit != 1 or scale <= 0 or not (q.dtype == k.dtype == v.dtype == torch.bfloat16)
            or v.shape[-1] != d or out.stride(-1) != 1 or not sm90(q)
            or not (_tma_ok(q) and _tma_ok(k) and _tma_ok(v))):
        return None
    return configs.ATTN_TILES.get(("fwd_gluon", 2, d))


def _gluon_fwd_launch(q: Tensor, k: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool, diag: int,
                      tile: tuple, km: KernelMask, acc: bool) -> _GluonFwdLaunch:
    """The Gluon forward's launch for these operands (its tile ``tile``: each consumer's) under the
    mask's kernel arguments ``km``; ``acc``: merged into the state in ``out``, ``lse``."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bm, bn, warps, stages = tile
    nb = configs.cdiv(sq, 2 * bm)
    tiles = nb * b * h
    grid = (min(tiles, sm_count(q)) if configs.ATTN_FWD_GLUON_PERSISTENT else tiles,)
    f = km.flags
    mask_strides = (*(km.kvr.stride() if f["KV_RANGE"] else (0, 0)), km.qoff.stride(0) if f["Q_OFFSET"] else 0,
                    km.rows.stride(0) if f["ROW_BOUNDS"] else 0)
    scalars = (*out.stride()[:3], *lse.stride(), *mask_strides, h, h // hkv, nb, b * h, sq, sk, diag, km.lo_off,
               scale * LOG2E.value, km.cap_in, km.cap_out, head_group(nb, b * h, q, causal, 2 * warps))
    # maxnreg: the second consumer's warpgroup and the producer's, within an SM's registers
    return _GluonFwdLaunch(grid, (auto_key((out, lse, km.kvr, km.qoff, km.rows, *scalars)), q.dtype), (bm, bn),
                           scalars, dict(BLOCK_M=bm, BLOCK_N=bn, D=d, CAUSAL=causal, STAGES=stages, **f, ACC=acc,
                                         num_warps=warps, maxnreg=configs.ATTN_FWD_GLUON_MAXNREG))


@functools.lru_cache(maxsize=None)
def _gluon_fwd_launcher() -> Launcher:
    """The Gluon forward's launcher (imported on first use: Gluon needs a CUDA build)."""
    from .gluon.fwd import _attn_fwd_gluon
    return Launcher(_attn_fwd_gluon)


_TILE_COUNTERS: dict = {}


def tile_counter(t: Tensor) -> Tensor:
    """The Gluon forward's tile counter for ``t``'s device and its current stream: two int32 zeros,
    which every launch leaves zero (launches on one stream run in turn; each stream has its own)."""
    index = t.get_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    ctr = _TILE_COUNTERS.get(key)
    if ctr is None:
        ctr = _TILE_COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=t.device)
    return ctr


def _gluon_fwd_args(run: _GluonFwdLaunch, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    mask_tensors: tuple, counter: bool = True) -> tuple:
    """The Gluon forward's arguments for ``run`` on these operands (``mask_tensors``: the mask's
    ``(kvr, qoff, rows)``; the tile counter a stand-in of its dtype unless ``counter``)."""
    descriptor = _gluon_descriptor()
    bm, bn = run.rows
    ctr = tile_counter(q) if counter else torch.zeros(2, dtype=torch.int32)
    return (descriptor(q, bm), descriptor(k, bn), descriptor(v, bn), out, lse, ctr, *mask_tensors, *run.scalars)


@functools.lru_cache(maxsize=None)
def _gluon_descriptor():
    """The Gluon descriptor maker (imported on first use: Gluon needs a CUDA build)."""
    from .gluon.bwd import descriptor
    return descriptor


def _run_gluon_fwd(run: _GluonFwdLaunch, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   mask_tensors: tuple, bound=None) -> None:
    """Launch ``run`` on these operands (``mask_tensors``: the mask's ``(kvr, qoff, rows)``), through
    ``bound`` (its :func:`_bind`) where given."""
    if bound is not None:
        bound(q, k, v, out, lse, tile_counter(q), *mask_tensors)
        return
    _gluon_fwd_launcher()(run.grid, run.key, _gluon_fwd_args(run, q, k, v, out, lse, mask_tensors), run.kwargs)


def _bind(run, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask_tensors: tuple):
    """``run`` (a Triton or Gluon forward launch) bound to its geometry (:meth:`Launcher.bind`);
    called with ``(q, k, v, out, lse, [tile counter,] kvr, qoff, rows)``."""
    if isinstance(run, _GluonFwdLaunch):
        return _gluon_fwd_launcher().bind(run.grid, run.key, _gluon_fwd_args(run, q, k, v, out, lse, mask_tensors,
                                                                             counter=q.is_cuda), run.kwargs)
    return _FWD.bind(run.grid, run.key, (*_operands((q, k, v, out), run.specs), lse, *run.scalars, *mask_tensors,
                                         *run.tail), run.kwargs)


def _settings(d: int) -> tuple:
    """The settings a plain forward's launch reads beside its geometry (part of the keys of
    :data:`_FWD_LAUNCHES`: tests change them)."""
    return (configs.ATTN_TMA, configs.ATTN_TMA_STORE, configs.ATTN_TMA_ROWS, configs.ATTN_SPLIT_TRIGGER,
            configs.ATTN_ORDER_WAVES, configs.ATTN_ORDER_MAX_WAVES, configs.ATTN_FWD_GLUON,
            configs.ATTN_FWD_GLUON_MIN_SQ, configs.ATTN_FWD_GLUON_PERSISTENT, configs.ATTN_FWD_GLUON_ACC,
            configs.ATTN_TILES.get(("fwd_gluon", 2, d)))


def _plain_launch(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool, diag: int,
                  p: Plan, acc: bool, split_dim: bool) -> tuple:
    """``(bound launch, Gluon launch or None)`` of a plain-mask forward into ``out``, ``lse`` (as
    :func:`launch_fwd` takes them), kept under their geometry: its arguments are ``lse`` as the
    absent mask tensors, and constants."""
    geo = (geometry(q, k, v, out, lse), scale, causal, diag, p, acc, split_dim, _settings(q.shape[-1]))
    hit = _FWD_LAUNCHES.get(geo)
    if hit is None:
        km = _kernel_mask(NO_MASK, q, scale, lse)
        tile = _gluon_fwd_tile(q, k, v, out, scale, causal, p, acc, split_dim)
        run = _launch_of(q, k, v, out, lse, scale, causal, diag, p, acc, split_dim, km, tile)
        hit = _FWD_LAUNCHES.put(geo, (_bind(run, q, k, v, out, lse, (lse, lse, lse)),
                                      run if isinstance(run, _GluonFwdLaunch) else None))
    return hit


def _run_plain(hit: tuple, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> None:
    """Launch :func:`_plain_launch`'s ``hit`` on these operands."""
    bound, gluon = hit
    if gluon is None:
        bound(q, k, v, out, lse, lse, lse, lse)
    else:
        _run_gluon_fwd(gluon, q, k, v, out, lse, (lse, lse, lse), bound)


def launch_fwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool,
               diag: int, p: Plan, *, acc: bool = False, split_dim: bool = False, mask: Mask = NO_MASK) -> None:
    """Run the forward kernel into ``out (B, H, Sq, Dv)``, ``lse (B, H, Sq)`` (any strides).

    ``split_dim``: they are ``p.nsplit`` partials ``(nsplit, B * H * Sq, Dv)``, ``(nsplit, B * H * Sq)``
    instead, split ``s`` covering keys ``p.start + [s * p.chunk, (s + 1) * p.chunk)``. ``acc``: merge
    into the state already in ``out``/``lse``. ``mask``: the variant's visibility (splitsoftmax.core.mask).
    """
    if mask is NO_MASK:  # its kernel arguments are ``lse`` as the absent tensors, and constants
        _run_plain(_plain_launch(q, k, v, out, lse, scale, causal, diag, p, acc, split_dim), q, k, v, out, lse)
        return
    km = _kernel_mask(mask, q, scale, lse)
    kvr, qoff, rows = km.kvr, km.qoff, km.rows
    tile = configs.ATTN_FWD_GLUON_VARIANTS and _gluon_fwd_tile(q, k, v, out, scale, causal, p, acc, split_dim)
    run = _launch_of(q, k, v, out, lse, scale, causal, diag, p, acc, split_dim, km, tile)
    if isinstance(run, _GluonFwdLaunch):
        _run_gluon_fwd(run, q, k, v, out, lse, (kvr, qoff, rows))
        return
    _FWD(run.grid, run.key, (*_operands((q, k, v, out), run.specs), lse, *run.scalars, kvr, qoff, rows, *run.tail),
         run.kwargs)


def _launch_of(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool, diag: int,
               p: Plan, acc: bool, split_dim: bool, km: KernelMask, tile: Optional[tuple]):
    """The forward's launch: the Gluon kernel's with its tile ``tile``, else (None) the Triton kernel's."""
    if tile:
        return _gluon_fwd_launch(q, k, out, lse, scale, causal, diag, tile, km, acc)
    return _fwd_launch(q, k, v, out, lse, scale, causal, diag, p, acc, split_dim, km)


def _split_fwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool,
               diag: int, p: Plan, acc: bool, mask: Mask, run: Optional["_Plain"] = None) -> None:
    """Flash-decoding: ``p.nsplit`` float32 partials (plus the running state when ``acc``), merged;
    ``run``: a plain forward's, which keeps the launches (bound by its first call)."""
    b, h, sq, _ = q.shape
    r, dv = b * h * sq, v.shape[-1]
    outs = q.new_empty((p.nsplit + acc, r, dv), dtype=torch.float32)  # (new_empty: no device argument to parse)
    lses = q.new_empty((p.nsplit + acc, r), dtype=torch.float32)
    if acc:
        outs[0].view(out.shape).copy_(out)
        lses[0].view(lse.shape).copy_(lse)
    parts = (outs[1:], lses[1:]) if acc else (outs, lses)
    if run is None:
        launch_fwd(q, k, v, *parts, scale, causal, diag, p, split_dim=True, mask=mask)
    else:
        if run.fwd is None:
            run.fwd = _plain_launch(q, k, v, *parts, scale, causal, diag, p, False, True)
        _run_plain(run.fwd, q, k, v, *parts)
    if out.is_contiguous() and lse.is_contiguous():
        if run is None:
            merge_into(outs, lses, out, lse, rows=(dv, 1, 1))
            return
        if run.merge is None:
            run.merge = merge_launch(outs, lses, out, lse, rows=(dv, 1, 1))
        run.merge(outs, lses, out, lse)
        return
    dst_o = torch.empty((r, dv), dtype=out.dtype, device=q.device)
    dst_l = torch.empty((r,), dtype=lse.dtype, device=q.device)
    merge_into(outs, lses, dst_o, dst_l)
    out.copy_(dst_o.view(out.shape))
    lse.copy_(dst_l.view(lse.shape))


class _Plain:
    """A plain forward of one geometry (:func:`attn_fwd`): its plan, and the launches its first call
    bound (the forward's, into the partials where the keys are split, and the merge's)."""

    __slots__ = ("p", "fwd", "merge")

    def __init__(self, p: Plan):
        self.p, self.fwd, self.merge = p, None, None


def _plain_key(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float, causal: bool, diag: int) -> tuple:
    """The key of a plain forward's :class:`_Plain` in :data:`_FWD_LAUNCHES`."""
    return ("plain", geometry(q, k, v), out.dtype, out.stride(), scale, causal, diag, plan_settings(q),
            _settings(q.shape[-1]))


def _plain_fwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool,
               diag: int) -> None:
    """The plain forward into ``out``, ``lse`` (as :func:`attn_fwd` allocates them): one lookup of
    everything but the operands, by their geometry."""
    key = _plain_key(q, k, v, out, scale, causal, diag)
    run = _FWD_LAUNCHES.get(key)
    if run is None:
        run = _FWD_LAUNCHES.put(key, _Plain(plan(q, k, v, causal, diag)))
    _run_plain_fwd(run, q, k, v, out, lse, scale, causal, diag)


def _run_plain_fwd(run: _Plain, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                   causal: bool, diag: int) -> None:
    """Run the plain forward ``run`` on these operands (launches bound by its first call)."""
    if run.p.nsplit > 1:
        _split_fwd(q, k, v, out, lse, scale, causal, diag, run.p, False, NO_MASK, run)
        return
    if run.fwd is None:
        run.fwd = _plain_launch(q, k, v, out, lse, scale, causal, diag, run.p, False, False)
    _run_plain(run.fwd, q, k, v, out, lse)


def attn_runner(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Optional["LeanForward"]:
    """The plain forward of these operands' geometry (and of the settings it reads) as one call (a
    :class:`LeanForward`), or None where the forward launches nothing (no rows or no keys) or has not
    run at this geometry (its launches are bound by a call of :func:`attn_fwd`)."""
    b, h, sq, _ = q.shape
    if b * h * sq == 0 or k.shape[2] == 0:
        return None
    run = _FWD_LAUNCHES.get(_plain_key(q, k, v, _empty_out(q, v.shape[-1], q.dtype), scale, causal, 0))
    if run is None:
        return None
    inner = heads_inner(q)
    return LeanForward(run, _lean_settings(q), inner, (b, sq, h, v.shape[-1]) if inner else (b, h, sq, v.shape[-1]),
                       (b, h, sq), scale, causal)


def _lean_settings(q: Tensor) -> tuple:
    """What a :class:`LeanForward` of ``q``'s geometry read when it was made."""
    return plan_settings(q), _settings(q.shape[-1])


class LeanForward:
    """:func:`attn_runner`'s runner: ``run(q, k, v) -> (out, lse)`` as ``attn_fwd(q, k, v, scale, causal,
    out_dtype=q.dtype)`` returns them (the outputs made, the bound launches run), for operands of the
    geometry it was made for while ``run.fresh(q)`` (no setting it read has changed)."""

    __slots__ = ("run", "settings", "inner", "shape", "lse_shape", "scale", "causal")

    def __init__(self, run: _Plain, settings: tuple, inner: bool, shape: tuple, lse_shape: tuple, scale: float,
                 causal: bool):
        self.run, self.settings, self.inner, self.shape, self.lse_shape = run, settings, inner, shape, lse_shape
        self.scale, self.causal = scale, causal

    def fresh(self, q: Tensor) -> bool:
        """Whether the settings it read are still those in force."""
        return self.settings == _lean_settings(q)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        out = q.new_empty(self.shape).transpose(1, 2) if self.inner else q.new_empty(self.shape)
        lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        _run_plain_fwd(self.run, q, k, v, out, lse, self.scale, self.causal, 0)
        return out, lse


def _empty_out(q: Tensor, dv: int, dtype: torch.dtype) -> Tensor:
    """``out (B, H, Sq, Dv)`` laid out like ``q``: a view of a ``(B, Sq, H, Dv)`` tensor where ``q``
    is one of a ``(B, Sq, H, D)`` tensor (so ``out.transpose(1, 2).contiguous()`` copies nothing),
    else contiguous."""
    b, h, sq, _ = q.shape
    if heads_inner(q):
        return q.new_empty((b, sq, h, dv), dtype=dtype).transpose(1, 2)
    return q.new_empty((b, h, sq, dv), dtype=dtype)


def attn_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, diag: int = 0,
             out_dtype: Optional[torch.dtype] = None, mask: Mask = NO_MASK) -> tuple[Tensor, Tensor]:
    """Partial attention ``(out (B, H, Sq, Dv), lse (B, H, Sq))``; empty rows ``(0, -inf)``.

    ``out`` is float32 unless ``out_dtype``, laid out like ``q`` (a ``(B, Sq, H, Dv)`` tensor's view
    when ``q`` is a ``(B, Sq, H, D)`` tensor's); ``lse`` float32, contiguous. ``mask``: the
    variant's visibility and softcap (splitsoftmax.core.mask). Splits the keys across programs
    (flash-decoding) when too few programs would run otherwise.
    """
    b, h, sq, _ = q.shape
    dt = stat_dtype(q.dtype)
    out = _empty_out(q, v.shape[-1], out_dtype or dt)
    lse = q.new_empty((b, h, sq), dtype=dt)
    if lse.numel() == 0:
        return out, lse
    if k.shape[2] == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    if mask is NO_MASK:
        _plain_fwd(q, k, v, out, lse, scale, causal, diag)
        return out, lse
    p = plan(q, k, v, causal, diag, mask)
    if p.nsplit == 1:
        launch_fwd(q, k, v, out, lse, scale, causal, diag, p, mask=mask)
    else:
        _split_fwd(q, k, v, out, lse, scale, causal, diag, p, False, mask)
    return out, lse


def attn_fwd_acc(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, diag: int,
                 acc_out: Tensor, acc_lse: Tensor, mask: Mask = NO_MASK) -> None:
    """Merge this block's attention into the running float32 state in place (a ring step).

    ``acc_out (B, H, Sq, Dv)`` and ``acc_lse (B, H, Sq)`` are float32 (any strides); the result is
    ``merge_out_lse`` of the stack of the old state and ``attn_fwd(q, k, v, ..., mask=mask)``.
    """
    if k.shape[2] == 0 or acc_lse.numel() == 0:
        return
    p = plan(q, k, v, causal, diag, mask)
    if p.nsplit == 1:
        launch_fwd(q, k, v, acc_out, acc_lse, scale, causal, diag, p, acc=True, mask=mask)
    else:
        _split_fwd(q, k, v, acc_out, acc_lse, scale, causal, diag, p, True, mask)
