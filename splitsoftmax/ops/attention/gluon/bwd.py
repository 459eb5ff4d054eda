"""The plain backward's dQ kernel for Hopper, written in Gluon, and the helpers of the Gluon kernels.

Triton waits for each of the backward's score-shaped products (``S = Q K^T``, ``dP = dO V^T``) right
after issuing it, so the tensor cores idle while the exponentials are taken. The dQ kernel (one
program per query block and head, K and V streamed by TMA through ``STAGES`` buffers) issues both,
waits for the first only, takes ``P`` while ``dP`` runs and leaves ``dQ += dS K`` in flight; key
blocks across the diagonal (or past ``Sk``) run in a loop of their own, every product in turn. Same
math, masks and non-finite guard as the Triton dQ kernel in ``attention_bwd_plain``; 2-byte inputs,
TMA-addressable (B, H, S, D) operands. The dK/dV kernel is ``attention_bwd_kv_ws``'s.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..._triton.algebra import LOG2E

# Names that changed across the Triton versions this package takes: the TMA load of a tile into
# shared memory and its store (`async_load`, `async_store` in newer releases) and the barrier of a
# program's threads (`barrier`)
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
_thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def _finite_or_zero_smem(tile, ROWS: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
    """Replace every NaN/Inf of the ``[ROWS, D]`` shared tile by 0, in place (the guard of masked tiles)."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    x = tile.load(blocked)
    tile.store(gl.where(gl.abs(x.to(gl.float32)) < float("inf"), x, gl.zeros_like(x)))


@gluon.jit
def _row_stats(LSE, DELTA, l_off, e_off, m0, Sq, s_ls, s_es, layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """``(lse * log2(e), delta)`` of query rows ``m0 + [0, BLOCK_M)``: rows past ``Sq`` and empty rows
    (``lse = -inf``) get ``+inf``, so that their ``p`` is 0."""
    qi = m0 + gl.arange(0, BLOCK_M, layout=layout)
    qmask = qi < Sq
    lse2 = gl.load(LSE + l_off + qi * s_ls, mask=qmask, other=float("inf")) * LOG2E
    lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
    delta = gl.load(DELTA + e_off + qi * s_es, mask=qmask, other=0.0)
    return lse2, delta


@gluon.jit
def _tanh(x):
    """``tanh(x)`` from one ``exp2`` (saturates to +-1; NaN stays NaN): ``attention_bwd._tanh``."""
    return 1.0 - 2.0 / (gl.exp2(x * 2.8853900817779268) + 1.0)


@gluon.jit
def _probs(qk, lse2, cs, cap2, SOFTCAP: gl.constexpr):
    """``(p, t)`` of scores ``qk`` (any tile; ``lse2`` broadcast to it): ``p = exp2(qk * cs - lse2)``,
    or with ``SOFTCAP`` ``t = tanh(qk * cs)`` (``cs = scale / c``) and ``p = exp2(t * cap2 - lse2)``
    (``cap2 = c * log2(e)``); ``t`` is ``p`` where unused."""
    if SOFTCAP:
        t = _tanh(qk * cs)
        p = gl.exp2(t * cap2 - lse2)
    else:
        p = gl.exp2(qk * cs - lse2)
        t = p
    return p, t


@gluon.jit
def _score_grad(p, t, dp, delta, SOFTCAP: gl.constexpr):
    """``dS`` (without the scale) of probabilities ``p`` and ``dP``: ``p (dP - delta)``, times
    ``1 - t^2`` under a softcap."""
    ds = p * (dp - delta)
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return ds


@gluon.jit
def _seen(kk, ii, rlo, rhi, dg, lw, kv_lo, kv_hi, CAUSAL: gl.constexpr, HAS_LO: gl.constexpr,
          HAS_ROWS: gl.constexpr):
    """Whether key ``kk`` is visible to row ``ii`` (broadcastable int tiles; ``rlo, rhi`` the rows'
    document bounds, ``dg``/``lw`` the band edges with the row's offset folded in):
    ``attention_bwd._seen``."""
    ok = (kk >= kv_lo) & (kk < kv_hi)
    if CAUSAL:
        ok = ok & (kk <= ii + dg)
    if HAS_LO:
        ok = ok & (kk >= ii + lw)
    if HAS_ROWS:
        ok = ok & (kk >= rlo) & (kk < rhi)
    return ok


@gluon.jit
def _batch_bounds(KVR, QOFF, s_kvb, s_kvc, s_off, b, Sk, diag, lo, HAS_KV: gl.constexpr, HAS_OFF: gl.constexpr):
    """``(kv_lo, kv_hi, dg, lw)`` of batch element ``b``: its key range (clipped to ``[0, Sk]``) and
    the band edges ``diag + off``, ``lo + off`` (``attention_bwd._batch_bounds``)."""
    kv_lo = 0
    kv_hi = Sk
    if HAS_KV:
        kv_lo = gl.maximum(gl.load(KVR + b * s_kvb), 0)
        kv_hi = gl.minimum(gl.load(KVR + b * s_kvb + s_kvc), Sk)
    off = 0
    if HAS_OFF:
        off = gl.load(QOFF + b * s_off)
    return kv_lo, kv_hi, diag + off, lo + off


@gluon.jit
def _doc_rows(ROWS, s_r, qi, Sq, HAS_ROWS: gl.constexpr):
    """``(rlo, rhi)``: the document bounds of rows ``qi`` (0 past ``Sq``), or ``qi`` twice unused."""
    if HAS_ROWS:
        rlo = gl.load(ROWS + qi, mask=qi < Sq, other=0)
        rhi = gl.load(ROWS + s_r + qi, mask=qi < Sq, other=0)
    else:
        rlo = qi
        rhi = qi
    return rlo, rhi


@gluon.constexpr_function
def _mma_layout(n, num_warps):
    """The accumulator layout of ``[rows, n]`` warpgroup products, the rows split over the warps."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _buffers(held_a, held_b, ring_a, ring_b, STAGES: gl.constexpr):
    """A program's shared memory: the tiles of descriptors ``held_a``, ``held_b`` (loaded once, one
    barrier) and those of ``ring_a``, ``ring_b`` streamed through ``STAGES`` buffers (a barrier each)."""
    dtype: gl.constexpr = held_a.dtype
    a = gl.allocate_shared_memory(dtype, held_a.block_type.shape, held_a.layout)
    b = gl.allocate_shared_memory(dtype, held_b.block_type.shape, held_b.layout)
    ra = gl.allocate_shared_memory(dtype, [STAGES] + ring_a.block_type.shape, ring_a.layout)
    rb = gl.allocate_shared_memory(dtype, [STAGES] + ring_b.block_type.shape, ring_b.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    return a, b, ra, rb, bar, bars


@gluon.jit
def _invalidate(bar, bars, STAGES: gl.constexpr):
    """Retire a program's barriers: ``bar`` and the ``STAGES`` of ``bars``."""
    mbarrier.invalidate(bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _store_rows(G, tile, b, h, r0, n, s_b, s_h, s_s, layout: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr):
    """Store ``tile [ROWS, D]`` (``layout``) as rows ``r0 ..`` (those below ``n``) of head ``(b, h)``
    of the gradient ``G`` (unit last stride), in its dtype."""
    rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    gl.store(G + b.to(gl.int64) * s_b + h.to(gl.int64) * s_h + rows[:, None].to(gl.int64) * s_s + cols[None, :],
             tile.to(G.dtype.element_ty), mask=(rows < n)[:, None] & (cols < D)[None, :])


@gluon.jit
def _program_order(GH):
    """``attention._program_order`` (the same launch order) in Gluon."""
    nb = gl.num_programs(0)
    return launch_order(gl.program_id(1) * nb + gl.program_id(0), nb, gl.num_programs(1), GH)


@gluon.jit
def launch_order(lin, nb, nheads, GH):
    """``(block, head)`` at position ``lin`` of the launch order over ``nb`` blocks by ``nheads``
    heads: heads in groups of ``GH``, block-major and head-minor within a group."""
    group = lin // (GH * nb)
    r = lin - group * GH * nb
    gh = gl.minimum(GH, nheads - group * GH)
    blk = r // gh
    return blk, group * GH + (r - blk * gh)


@gluon.jit
def _key_block(u, walk):
    """Key block of step ``u`` of a dQ program's ``walk``: the ``n_in`` interior blocks from ``ia``,
    then the masked ones, ``first ..`` (``n_pre`` of them) and ``ib ..``."""
    first, n_pre, ib, ia, n_in = walk
    j = u - n_in
    return gl.where(u < n_in, ia + u, gl.where(j < n_pre, first + j, ib + j - n_pre))


@gluon.jit
def _load_step(k_desc, v_desc, k_smem, v_smem, bars, u, T, walk, b, kvh, BLOCK_N: gl.constexpr,
               D: gl.constexpr, STAGES: gl.constexpr):
    """Start the TMA loads of step ``u``'s K and V into buffer ``u % STAGES`` (nothing past ``T``)."""
    s = u % STAGES
    n0 = _key_block(u, walk) * BLOCK_N
    mbarrier.expect(bars.index(s), 2 * BLOCK_N * D * 2, pred=u < T)
    _tma_load(k_desc, [b, kvh, n0, 0], bars.index(s), k_smem.index(s), pred=u < T)
    _tma_load(v_desc, [b, kvh, n0, 0], bars.index(s), v_smem.index(s), pred=u < T)


@gluon.jit
def _q_walk(m0, qi, rlo, rhi, Sq, dg, lw, kv_lo, kv_hi, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            CAUSAL: gl.constexpr, HAS_LO: gl.constexpr, HAS_ROWS: gl.constexpr):
    """Key blocks of query rows ``qi = m0 + [0, BLOCK_M)``: ``(first, end, ia, ib)``, blocks
    ``[first, end)`` hold a key one of the rows sees, ``[ia, ib)`` only keys every row sees
    (``attention_bwd.q_walk``, in Gluon)."""
    qmask = qi < Sq
    last = gl.minimum(m0 + BLOCK_M, Sq) - 1
    k_lo = kv_lo
    k_hi = kv_hi
    f_lo = kv_lo
    f_hi = kv_hi
    if CAUSAL:
        k_hi = gl.minimum(k_hi, last + dg + 1)
        f_hi = gl.minimum(f_hi, m0 + dg + 1)
    if HAS_LO:
        k_lo = gl.maximum(k_lo, m0 + lw)
        f_lo = gl.maximum(f_lo, last + lw)
    if HAS_ROWS:
        k_lo = gl.maximum(k_lo, gl.min(gl.where(qmask, rlo, kv_hi), 0))
        k_hi = gl.minimum(k_hi, gl.max(gl.where(qmask, rhi, 0), 0))
        f_lo = gl.maximum(f_lo, gl.max(gl.where(qmask, rlo, 0), 0))
        f_hi = gl.minimum(f_hi, gl.min(gl.where(qmask, rhi, kv_hi), 0))
    k_hi = gl.maximum(k_hi, k_lo)
    first = k_lo // BLOCK_N
    end = gl.where(k_hi == k_lo, first, gl.cdiv(k_hi, BLOCK_N))
    ia = gl.minimum(gl.maximum(gl.cdiv(f_lo, BLOCK_N), first), end)
    ib = gl.minimum(gl.maximum(gl.maximum(f_hi, 0) // BLOCK_N, ia), end)
    return first, end, ia, ib


@gluon.jit(do_not_specialize=["Sq", "Sk", "diag", "lo", "GH", "s_lb", "s_lh", "s_eb", "s_eh"])
def _attn_bwd_q_gluon(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, GQ, KVR, QOFF, ROWS,
                      s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_qgb, s_qgh, s_qgs, s_kvb, s_kvc, s_off, s_r,
                      H, G, Sq, Sk, diag, lo, qk_scale, scale, cap2, GH,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                      STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_KV: gl.constexpr, HAS_OFF: gl.constexpr,
                      HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr, num_warps: gl.constexpr):
    """dQ of one query block and head over its key blocks: grid ``(query blocks, B * H)`` in the order
    of ``GH``, causal grids' longest blocks first. ``S`` and ``dP`` are issued together and ``P`` is
    taken while ``dP`` runs; the interior key blocks come first, then the masked ones (a key some row
    of the block does not see, or past ``Sk``), every product in turn, K guarded in place for the
    ``dS K`` product. The mask's tensors and strides are ``attention_bwd._attn_bwd_q_kernel``'s,
    read where their flag is set; ``cap2 = softcap * log2(e)``."""
    pid_m, pid_bh = _program_order(GH)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    b = pid_bh // H
    h = pid_bh % H
    kvh = h // G
    m0 = pid_m * BLOCK_M
    dtype: gl.constexpr = q_desc.dtype

    # S, dP: [BLOCK_M queries, BLOCK_N keys]; dQ: [BLOCK_M, D]; dS feeds it from registers
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, num_warps)
    o_layout: gl.constexpr = _mma_layout(D, num_warps)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_rows: gl.constexpr = gl.SliceLayout(1, s_layout)  # [BLOCK_M]
    k_cols: gl.constexpr = gl.SliceLayout(0, s_layout)  # [BLOCK_N]
    q_smem, do_smem, k_smem, v_smem, q_bar, bars = _buffers(q_desc, do_desc, k_desc, v_desc, STAGES)

    qi = m0 + gl.arange(0, BLOCK_M, layout=q_rows)
    kv_lo, kv_hi, dg, lw = _batch_bounds(KVR, QOFF, s_kvb, s_kvc, s_off, b, Sk, diag, lo, HAS_KV, HAS_OFF)
    rlo, rhi = _doc_rows(ROWS, s_r, qi, Sq, HAS_ROWS)
    # steps: the n_in interior key blocks [ia, ib), then the masked ones [first, ia) and [ib, end)
    first, end, ia, ib = _q_walk(m0, qi, rlo, rhi, Sq, dg, lw, kv_lo, kv_hi, BLOCK_M, BLOCK_N, CAUSAL, HAS_LO,
                                 HAS_ROWS)
    n_in = ib - ia
    walk = (first, ia - first, ib, ia, n_in)
    T = n_in + ia - first + end - ib
    cs = qk_scale
    if SOFTCAP:
        cs = scale / cap2 * LOG2E  # s / c

    mbarrier.expect(q_bar, 2 * BLOCK_M * D * 2)
    _tma_load(q_desc, [b, h, m0, 0], q_bar, q_smem)
    _tma_load(do_desc, [b, h, m0, 0], q_bar, do_smem)
    for i in gl.static_range(STAGES - 1):
        _load_step(k_desc, v_desc, k_smem, v_smem, bars, i, T, walk, b, kvh, BLOCK_N, D, STAGES)
    lse2, delta = _row_stats(LSE, DELTA, b * s_lb + h * s_lh, b * s_eb + h * s_eh, m0, Sq, s_ls, s_es, q_rows,
                             BLOCK_M)
    zeros_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, D], gl.float32, o_layout))
    mbarrier.wait(q_bar, 0)
    q_t = q_smem.reshape([BLOCK_M, D])
    do_t = do_smem.reshape([BLOCK_M, D])
    for t in range(n_in):
        s = t % STAGES
        k_t = k_smem.index(s).reshape([BLOCK_N, D])
        v_t = v_smem.index(s).reshape([BLOCK_N, D])
        mbarrier.wait(bars.index(s), (t // STAGES) & 1)
        qk = warpgroup_mma(q_t, k_t.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_t, v_t.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(1, deps=(qk, ))  # dP runs on while P is taken
        p, c = _probs(qk, lse2[:, None], cs, cap2, SOFTCAP)
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        ds = _score_grad(p, c, dp, delta[:, None], SOFTCAP)
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_t, dq, is_async=True)
        # every product of step t - 1 is done, in every warp past the barrier: refill its buffers
        _thread_barrier()
        _load_step(k_desc, v_desc, k_smem, v_smem, bars, t + STAGES - 1, T, walk, b, kvh, BLOCK_N, D, STAGES)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    for t in range(n_in, T):
        s = t % STAGES
        k_t = k_smem.index(s).reshape([BLOCK_N, D])
        v_t = v_smem.index(s).reshape([BLOCK_N, D])
        kj = _key_block(t, walk) * BLOCK_N + gl.arange(0, BLOCK_N, layout=k_cols)
        mbarrier.wait(bars.index(s), (t // STAGES) & 1)
        qk = warpgroup_mma(q_t, k_t.permute((1, 0)), zeros_s, use_acc=False)
        dp = warpgroup_mma(do_t, v_t.permute((1, 0)), zeros_s, use_acc=False)
        ok = _seen(kj[None, :], qi[:, None], rlo[:, None], rhi[:, None], dg, lw, kv_lo, kv_hi, CAUSAL, HAS_LO,
                   HAS_ROWS)
        p, c = _probs(qk, lse2[:, None], cs, cap2, SOFTCAP)
        ds = gl.where(ok, _score_grad(p, c, dp, delta[:, None], SOFTCAP), 0.0)
        _finite_or_zero_smem(k_t, BLOCK_N, D, num_warps)  # hidden pairs: exact zeros, never 0 * NaN
        fence_async_shared()
        _thread_barrier()
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_t, dq)
        _thread_barrier()
        _load_step(k_desc, v_desc, k_smem, v_smem, bars, t + STAGES - 1, T, walk, b, kvh, BLOCK_N, D, STAGES)
    _invalidate(q_bar, bars, STAGES)
    _store_rows(GQ, dq * scale, b, h, m0, Sq, s_qgb, s_qgh, s_qgs, o_layout, BLOCK_M, D)


def descriptor(t, rows: int):
    """The Gluon ``(B, H, S, D)`` descriptor of 2-byte ``t`` reading ``[1, 1, rows, D]`` tiles (zeros
    past S), its tiles laid out for the tensor cores; a dim of one element gets a valid stride. The
    caller has checked that TMA can address ``t`` (``__post_init__``'s checks cost host time)."""
    strides = list(t.stride())
    for i in (2, 1, 0):
        if t.shape[i] == 1:
            strides[i] = strides[i + 1] * t.shape[i + 1]
    block = (1, 1, rows, t.shape[-1])
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(_DEFAULTS)
    desc.base, desc.shape, desc.strides, desc.block_shape = t, list(t.shape), strides, list(block)
    desc.layout = _smem_layout(block, t.dtype)
    return desc


def tile_descriptor(t, block: tuple):
    """The Gluon descriptor of 2-D 2-byte ``t`` (unit last stride, 16-byte aligned) reading and
    writing ``block`` tiles, laid out for the tensor cores."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(_DEFAULTS)
    desc.base, desc.shape, desc.strides, desc.block_shape = t, list(t.shape), list(t.stride()), list(block)
    desc.layout = _smem_layout(tuple(block), t.dtype)
    return desc


# the descriptor's fields that have defaults (newer releases add some)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TensorDescriptor) if f.default is not dataclasses.MISSING}


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple, dtype):
    """The tensor cores' shared layout of a ``block`` tile of 16-bit ``dtype``."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
