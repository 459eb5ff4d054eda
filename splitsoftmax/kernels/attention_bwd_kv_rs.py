"""The plain backward's dK/dV kernel for Hopper, in Gluon: two warpgroups, each the whole tile's
work for half of a key block, the gradient products fed from registers.

A program holds a key block (``BLOCK_N`` keys of one kv head) and walks the query tiles of the ``G``
query heads that read it (the tiles across the diagonal first, then the full ones, each
head-major). Consumer warpgroup ``c`` (of two) owns keys ``n0 + c * BLOCK_N / 2 ..`` and their dK, dV
accumulators, and for every tile issues ``S^T = K Q^T`` and ``dP^T = V dO^T`` from shared memory,
takes ``P^T`` while ``dP^T`` runs, issues ``dV += P^T dO`` with ``P^T`` in registers, takes ``dS^T``
while that runs and issues ``dK += dS^T Q`` likewise, leaving both in flight into the next tile.
``P^T`` and ``dS^T`` never pass through shared memory, whose bandwidth bounds the kernel of
``attention_bwd_kv_ws`` (every operand there is read from it). The two consumers run out of step
(one's exponentials beside the other's products) on the same Q/dO tiles, which one producer warp
streams by TMA through ``STAGES`` buffers, each released when both consumers are done with it.

Tiles across the diagonal run every product in turn: both consumers take ``S^T`` from Q as it is,
meet, then consumer 0 zeroes the NaN/Inf of the Q tile in place and consumer 1 those of dO, and they
meet again before ``dP^T`` and the gradient products, so hidden pairs give exact zeros (never
``0 * NaN``). Same math, masks, order of sums and guard as the Triton kernel of
``attention_bwd_plain``; bfloat16 ``(B, H, S, D)`` operands that TMA can address.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .attention_bwd_gluon import (_mma_layout, _program_order, _store_rows,
                                  _thread_barrier, _tma_load)
from .attention_bwd_kv_ws import _tile_of, _tile_stats


@gluon.jit
def _producer(p, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """K and V once, then tiles ``[0, T)``' Q and dO, each into the ring's next buffer once both
    consumers have released it (``C``, ``CAUSAL`` unused: the partitions share one signature)."""
    (q_desc, do_desc, k_desc, v_desc, q_ring, do_ring, k_smem, v_smem, kv_bar, t_full, t_empty, guard,
     LSE, DELTA, GK, GV, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh, s_vgs,
     b, kvh, G, n0, m_start, m_full, nm, nf, Tm, T, Sq, Sk, diag, qk_scale, scale) = p
    mbarrier.expect(kv_bar, 2 * BLOCK_N * D * 2)
    _tma_load(k_desc, [b, kvh, n0, 0], kv_bar, k_smem)
    _tma_load(v_desc, [b, kvh, n0, 0], kv_bar, v_smem)
    for t in range(T):
        s = t % STAGES
        mbarrier.wait(t_empty.index(s), ((t // STAGES) & 1) ^ 1)  # a fresh barrier counts as released
        gi, m0 = _tile_of(t, Tm, nm, nf, m_start, m_full, BLOCK_M)
        mbarrier.expect(t_full.index(s), 2 * BLOCK_M * D * 2)
        _tma_load(q_desc, [b, kvh * G + gi, m0, 0], t_full.index(s), q_ring.index(s))
        _tma_load(do_desc, [b, kvh * G + gi, m0, 0], t_full.index(s), do_ring.index(s))


@gluon.jit
def _full_tile(k_t, v_t, q_t, do_t, dk, dv, lse2, delta, qk_scale, HALF: gl.constexpr, BLOCK_M: gl.constexpr,
               NW: gl.constexpr):
    """``(dk, dv)`` plus a tile whose every pair is seen: ``dP^T`` runs while ``P^T`` is taken and
    ``dV`` while ``dS^T`` is; all done on return."""
    dtype: gl.constexpr = q_t.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, NW)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    zeros_s = gl.zeros([HALF, BLOCK_M], gl.float32, s_layout)
    qk_t = warpgroup_mma(k_t, q_t.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_t, do_t.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    qk_t = warpgroup_mma_wait(1, deps=(qk_t, ))
    p_t = gl.exp2(qk_t * qk_scale - lse2[None, :])
    dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_t, dv, is_async=True)
    dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
    ds_t = p_t * (dp_t - delta[None, :])
    dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q_t, dk, is_async=True)
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    return dk, dv


@gluon.jit
def _guarded_copy(src, dst, ROWS: gl.constexpr, D: gl.constexpr, NW: gl.constexpr):
    """``dst`` = ``src`` (shared ``[ROWS, D]``) with every NaN/Inf zeroed."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    x = src.load(blocked)
    dst.store(gl.where(gl.abs(x.to(gl.float32)) < float("inf"), x, gl.zeros_like(x)))


@gluon.jit
def _consumer(p, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """Consumer warpgroup ``C`` (4 warps): dK, dV of keys ``n0 + C * BLOCK_N / 2 ..`` over every
    tile, then their store. Of the tiles across the block's diagonal, those that none of its keys'
    pairs see are skipped, those that all see run as full ones, and the rest take Q and dO through
    this warpgroup's own guarded copies."""
    (q_desc, do_desc, k_desc, v_desc, q_ring, do_ring, k_smem, v_smem, kv_bar, t_full, t_empty, guard,
     LSE, DELTA, GK, GV, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh, s_vgs,
     b, kvh, G, n0, m_start, m_full, nm, nf, Tm, T, Sq, Sk, diag, qk_scale, scale) = p
    NW: gl.constexpr = 4
    HALF: gl.constexpr = BLOCK_N // 2
    dtype: gl.constexpr = q_desc.dtype
    # S^T, dP^T, P^T, dS^T: [HALF keys, BLOCK_M queries]; dK, dV: [HALF, D]; P^T, dS^T feed them from
    # registers
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, NW)
    o_layout: gl.constexpr = _mma_layout(D, NW)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_cols: gl.constexpr = gl.SliceLayout(0, s_layout)  # [BLOCK_M]
    k_rows: gl.constexpr = gl.SliceLayout(1, s_layout)  # [HALF]
    c0 = n0 + C * HALF
    kj = c0 + gl.arange(0, HALF, layout=k_rows)
    dk = gl.zeros([HALF, D], gl.float32, o_layout)
    dv = gl.zeros([HALF, D], gl.float32, o_layout)
    mbarrier.wait(kv_bar, 0)
    k_t = k_smem.reshape([BLOCK_N, D]).slice(C * HALF, HALF)
    v_t = v_smem.reshape([BLOCK_N, D]).slice(C * HALF, HALF)
    gq = guard.index(2 * C).reshape([BLOCK_M, D])  # this warpgroup's guarded Q and dO
    gdo = guard.index(2 * C + 1).reshape([BLOCK_M, D])
    if CAUSAL:  # (only causal grids have diagonal tiles)
        for t in range(Tm):
            s = t % STAGES
            q_t = q_ring.index(s).reshape([BLOCK_M, D])
            do_t = do_ring.index(s).reshape([BLOCK_M, D])
            gi, m0 = _tile_of(t, Tm, nm, nf, m_start, m_full, BLOCK_M)
            lse2, delta = _tile_stats(LSE, DELTA, t, T, Tm, nm, nf, m_start, m_full, b, kvh * G, Sq, s_lb, s_lh,
                                      s_ls, s_eb, s_eh, s_es, q_cols, BLOCK_M)
            mbarrier.wait(t_full.index(s), (t // STAGES) & 1)
            if m0 + diag >= c0 + HALF - 1:  # every pair seen
                dk, dv = _full_tile(k_t, v_t, q_t, do_t, dk, dv, lse2, delta, qk_scale, HALF, BLOCK_M, NW)
                mbarrier.arrive(t_empty.index(s), count=1)
            elif m0 + BLOCK_M - 1 + diag >= c0:  # across the diagonal: every product in turn
                zeros_s = gl.zeros([HALF, BLOCK_M], gl.float32, s_layout)
                qk_t = warpgroup_mma(k_t, q_t.permute((1, 0)), zeros_s, use_acc=False)  # Q as it is
                _guarded_copy(q_t, gq, BLOCK_M, D, NW)
                _guarded_copy(do_t, gdo, BLOCK_M, D, NW)
                fence_async_shared()
                _thread_barrier()
                mbarrier.arrive(t_empty.index(s), count=1)
                dp_t = warpgroup_mma(v_t, gdo.permute((1, 0)), zeros_s, use_acc=False)
                qi = m0 + gl.arange(0, BLOCK_M, layout=q_cols)
                seen = kj[:, None] <= qi[None, :] + diag
                p_t = gl.where(seen, gl.exp2(qk_t * qk_scale - lse2[None, :]), 0.0)
                dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), gdo, dv)
                ds_t = gl.where(seen, p_t * (dp_t - delta[None, :]), 0.0)
                dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), gq, dk)
                _thread_barrier()  # (every warp's products have read the copies before the next)
            else:  # no pair seen
                mbarrier.arrive(t_empty.index(s), count=1)
    for t in range(Tm, T):
        s = t % STAGES
        lse2, delta = _tile_stats(LSE, DELTA, t, T, Tm, nm, nf, m_start, m_full, b, kvh * G, Sq, s_lb, s_lh,
                                  s_ls, s_eb, s_eh, s_es, q_cols, BLOCK_M)
        mbarrier.wait(t_full.index(s), (t // STAGES) & 1)
        dk, dv = _full_tile(k_t, v_t, q_ring.index(s).reshape([BLOCK_M, D]), do_ring.index(s).reshape([BLOCK_M, D]),
                            dk, dv, lse2, delta, qk_scale, HALF, BLOCK_M, NW)
        mbarrier.arrive(t_empty.index(s), count=1)
    _store_rows(GK, dk * scale, b, kvh, c0, Sk, s_kgb, s_kgh, s_kgs, o_layout, HALF, D)
    _store_rows(GV, dv, b, kvh, c0, Sk, s_vgb, s_vgh, s_vgs, o_layout, HALF, D)


@gluon.jit
def _consumer0(p, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
               CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """The first consumer (the default partition: the kernel's own warps), the lower keys."""
    _consumer(p, 0, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)


@gluon.jit
def _consumer1(p, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
               CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """The second consumer (a worker of 4 warps), the upper keys."""
    _consumer(p, 1, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)


@gluon.jit(do_not_specialize=["Sq", "Sk", "diag", "GH", "s_lb", "s_lh", "s_eb", "s_eh"])
def _attn_bwd_kv_rs(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, GK, GV,
                    s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh, s_vgs,
                    HKV, G, Sq, Sk, diag, qk_scale, scale, GH,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                    STAGES: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr):
    """Grid ``(key blocks, B * HKV)`` in the order of ``GH`` (``attention._program_order``);
    ``num_warps = 4`` (the first consumer), plus the second consumer's 4 and the producer's 1, the
    second consumer given ``REGS`` registers per thread. ``q_desc`` and ``do_desc`` read ``BLOCK_M``
    rows, ``k_desc`` and ``v_desc`` ``BLOCK_N``."""
    pid_n, pid_bh = _program_order(GH)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    n0 = pid_n * BLOCK_N
    dtype: gl.constexpr = q_desc.dtype

    # query blocks [m_start, m_full) cross the diagonal of some key of the block; from m_full on every
    # query sees every key. Tiles (query head, query block): the Tm diagonal ones (nm per head), then
    # the full ones (nf per head), each head-major (_tile_of)
    m_start = 0
    m_full = 0
    if CAUSAL:
        m_start = (gl.maximum(n0 - diag, 0) // BLOCK_M) * BLOCK_M
        m_full = gl.maximum(m_start, gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M)
    nm = gl.maximum(gl.cdiv(gl.minimum(m_full, Sq) - m_start, BLOCK_M), 0)
    nf = gl.maximum(gl.cdiv(Sq - m_full, BLOCK_M), 0)
    Tm = G * nm
    T = Tm + G * nf

    # Q, dO: [STAGES, BLOCK_M, D]; K, V: [BLOCK_N, D]
    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    t_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    t_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # each consumer's guarded copies of Q and dO for tiles across the diagonal: [4, BLOCK_M, D]
    guard = gl.allocate_shared_memory(dtype, [4 if CAUSAL else 1] + q_desc.block_type.shape, q_desc.layout)
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(t_full.index(i), count=1)
        mbarrier.init(t_empty.index(i), count=2)  # both consumers
    p = (q_desc, do_desc, k_desc, v_desc, q_ring, do_ring, k_smem, v_smem, kv_bar, t_full, t_empty, guard,
         LSE, DELTA, GK, GV, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh, s_vgs,
         b, kvh, G, n0, m_start, m_full, nm, nf, Tm, T, Sq, Sk, diag, qk_scale, scale)
    # workers: the second consumer (4 warps) and the producer (1), given the registers asked for each
    # (setmaxnreg) out of the launch's maxnreg per thread; the first consumer keeps the rest.
    gl.warp_specialize([
        (_consumer0, (p, 0, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)),
        (_consumer1, (p, 1, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)),
        (_producer, (p, 0, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)),
    ], [4, 1], [REGS, 24])
