"""The plain backward's dK/dV kernel for Hopper, in Gluon and warp-specialized: two warpgroups take
the scores of alternate query tiles, a third takes the gradients of all.

A program holds a key block (``BLOCK_N`` keys of one kv head) and walks the query tiles of the ``G``
query heads that read it (the tiles across the diagonal first, then the full ones, each
head-major). Triton waits for each score-shaped product right after issuing it and one warpgroup
holding both the dK/dV accumulators and the score tiles spills or idles, so the work is split by
role:

- score warpgroup ``C`` (of two; tiles ``C, C + 2, ..``) issues ``S^T = K Q^T`` and ``dP^T = V dO^T``,
  takes ``P^T`` while ``dP^T`` runs, then ``dS^T``, and hands both over through its shared buffer;
- the gradient warpgroup issues ``dV += P^T dO`` and ``dK += dS^T Q`` of every tile in turn, all
  operands in shared memory, and holds the two ``[BLOCK_N, D]`` float32 accumulators;
- one producer warp loads K and V once, then streams the Q and dO tiles by TMA through ``STAGES``
  buffers, each released when its score warpgroup and the gradient warpgroup have arrived on it.

The two score warpgroups run out of step, so one's exponentials run beside the other's products and
the gradient products. Tiles across the diagonal run in turn: ``S^T`` reads Q as it is, then the
score warpgroup zeroes every NaN/Inf of the Q and dO tiles in place before ``dP^T`` and the
hand-over, so hidden pairs give exact zeros (never ``0 * NaN``). Same math, masks, order of sums
and guard as the Triton kernel of ``attention_bwd_plain``; bfloat16 ``(B, H, S, D)`` operands that
TMA can address.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .attention_bwd_gluon import (_finite_or_zero_smem, _mma_layout, _program_order, _row_stats, _store_rows,
                                  _thread_barrier, _tma_load)


@gluon.jit
def _tile_of(t, Tm, nm, nf, m_start, m_full, BLOCK_M: gl.constexpr):
    """``(query head within the group, first query row)`` of tile ``t``: the ``Tm`` diagonal tiles
    (``nm`` per head) come first, then the full ones (``nf`` per head), each head-major."""
    u = t - Tm
    if t < Tm:
        gi = t // nm
        m0 = m_start + (t - gi * nm) * BLOCK_M
    else:
        gi = u // gl.maximum(nf, 1)
        m0 = m_full + (u - gi * nf) * BLOCK_M
    return gi, m0


@gluon.jit
def _tile_stats(LSE, DELTA, t, T, Tm, nm, nf, m_start, m_full, b, h0, Sq, s_lb, s_lh, s_ls, s_eb, s_eh, s_es,
                layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """:func:`_row_stats` of tile ``t``, clamped to ``[0, T)`` (nothing is read when ``T == 0``)."""
    gi, m0 = _tile_of(gl.maximum(gl.minimum(t, T - 1), 0), Tm, nm, nf, m_start, m_full, BLOCK_M)
    h = h0 + gi
    return _row_stats(LSE, DELTA, b * s_lb + h * s_lh, b * s_eb + h * s_eh, m0, Sq, s_ls, s_es, layout, BLOCK_M)


@gluon.jit
def _producer(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
              STAGES: gl.constexpr):
    """K and V once, then tiles ``[0, T)``' Q and dO, each into the ring's next buffer once its score
    warpgroup and the gradient warpgroup have released it (``CAUSAL`` unused: the partitions share
    one signature)."""
    (q_desc, do_desc, k_desc, v_desc, q_ring, do_ring, k_smem, v_smem, p_ring, ds_ring, kv_bar, t_full, t_empty,
     h_full, h_empty, LSE, DELTA, GK, GV, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh,
     s_vgs, b, kvh, G, n0, m_start, m_full, nm, nf, Tm, T, Sq, Sk, diag, qk_scale, scale) = p
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
def _hand_over(p_ring, ds_ring, h_full, h_empty, t, p_t, ds_t):
    """Write tile ``t``'s ``P^T`` and ``dS^T`` (``[BLOCK_N, BLOCK_M]``) into hand-over buffer
    ``t % 2`` (its score warpgroup's) once the gradient warpgroup has released it, and signal them
    written."""
    u = t % 2
    mbarrier.wait(h_empty.index(u), ((t // 2) & 1) ^ 1)
    p_ring.index(u).store(p_t.to(p_ring.dtype))
    ds_ring.index(u).store(ds_t.to(ds_ring.dtype))
    fence_async_shared()
    _thread_barrier()  # every warp's part is written before the one arrival
    mbarrier.arrive(h_full.index(u), count=1)


@gluon.jit
def _scores(p, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
            CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """Score warpgroup ``C`` of two (4 warps): ``P^T`` and ``dS^T`` of tiles ``C, C + 2, ..``, the
    diagonal ones first, guarded, then the full ones with ``dP^T`` running while ``P^T`` is taken.
    Each hands over through buffer ``C``; the two run out of step, one's products beside the other's
    exponentials."""
    (q_desc, do_desc, k_desc, v_desc, q_ring, do_ring, k_smem, v_smem, p_ring, ds_ring, kv_bar, t_full, t_empty,
     h_full, h_empty, LSE, DELTA, GK, GV, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh,
     s_vgs, b, kvh, G, n0, m_start, m_full, nm, nf, Tm, T, Sq, Sk, diag, qk_scale, scale) = p
    NW: gl.constexpr = 4
    # S^T, dP^T, P^T, dS^T: [BLOCK_N keys, BLOCK_M queries]
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, NW)
    q_cols: gl.constexpr = gl.SliceLayout(0, s_layout)  # [BLOCK_M]
    k_rows: gl.constexpr = gl.SliceLayout(1, s_layout)  # [BLOCK_N]
    kj = n0 + gl.arange(0, BLOCK_N, layout=k_rows)
    zeros_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    lse2, delta = _tile_stats(LSE, DELTA, C, T, Tm, nm, nf, m_start, m_full, b, kvh * G, Sq, s_lb, s_lh, s_ls,
                              s_eb, s_eh, s_es, q_cols, BLOCK_M)
    mbarrier.wait(kv_bar, 0)
    k_t = k_smem.reshape([BLOCK_N, D])
    v_t = v_smem.reshape([BLOCK_N, D])
    if CAUSAL:  # (only causal grids have diagonal tiles)
        for t in range(C, Tm, 2):
            s = t % STAGES
            q_t = q_ring.index(s).reshape([BLOCK_M, D])
            do_t = do_ring.index(s).reshape([BLOCK_M, D])
            mbarrier.wait(t_full.index(s), (t // STAGES) & 1)
            qk_t = warpgroup_mma(k_t, q_t.permute((1, 0)), zeros_s, use_acc=False)
            _finite_or_zero_smem(q_t, BLOCK_M, D, NW)
            _finite_or_zero_smem(do_t, BLOCK_M, D, NW)
            fence_async_shared()
            _thread_barrier()
            dp_t = warpgroup_mma(v_t, do_t.permute((1, 0)), zeros_s, use_acc=False)
            mbarrier.arrive(t_empty.index(s), count=1)
            qi = m_start + (t % nm) * BLOCK_M + gl.arange(0, BLOCK_M, layout=q_cols)
            seen = kj[:, None] <= qi[None, :] + diag
            p_t = gl.where(seen, gl.exp2(qk_t * qk_scale - lse2[None, :]), 0.0)
            _hand_over(p_ring, ds_ring, h_full, h_empty, t, p_t, gl.where(seen, p_t * (dp_t - delta[None, :]), 0.0))
            lse2, delta = _tile_stats(LSE, DELTA, t + 2, T, Tm, nm, nf, m_start, m_full, b, kvh * G, Sq, s_lb,
                                      s_lh, s_ls, s_eb, s_eh, s_es, q_cols, BLOCK_M)
    t0 = Tm + (Tm + C) % 2  # this warpgroup's first full tile
    if CAUSAL:
        lse2, delta = _tile_stats(LSE, DELTA, t0, T, Tm, nm, nf, m_start, m_full, b, kvh * G, Sq, s_lb, s_lh,
                                  s_ls, s_eb, s_eh, s_es, q_cols, BLOCK_M)
    for t in range(t0, T, 2):
        qk_t, dp_t = _issue_scores(k_t, v_t, q_ring, do_ring, t_full, t, zeros_s, BLOCK_M, D, STAGES)
        qk_t = warpgroup_mma_wait(1, deps=(qk_t, ))  # dP^T runs on while P^T is taken
        p_t = gl.exp2(qk_t * qk_scale - lse2[None, :])
        dp_t = warpgroup_mma_wait(0, deps=(dp_t, ))
        mbarrier.arrive(t_empty.index(t % STAGES), count=1)
        _hand_over(p_ring, ds_ring, h_full, h_empty, t, p_t, p_t * (dp_t - delta[None, :]))
        lse2, delta = _tile_stats(LSE, DELTA, t + 2, T, Tm, nm, nf, m_start, m_full, b, kvh * G, Sq, s_lb, s_lh,
                                  s_ls, s_eb, s_eh, s_es, q_cols, BLOCK_M)


@gluon.jit
def _issue_scores(k_t, v_t, q_ring, do_ring, t_full, t, zeros_s, BLOCK_M: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr):
    """Issue tile ``t``'s ``S^T = K Q^T`` and ``dP^T = V dO^T`` (``[BLOCK_N, BLOCK_M]``, asynchronous)
    once its Q and dO have landed."""
    s = t % STAGES
    mbarrier.wait(t_full.index(s), (t // STAGES) & 1)
    qk_t = warpgroup_mma(k_t, q_ring.index(s).reshape([BLOCK_M, D]).permute((1, 0)), zeros_s, use_acc=False,
                         is_async=True)
    dp_t = warpgroup_mma(v_t, do_ring.index(s).reshape([BLOCK_M, D]).permute((1, 0)), zeros_s, use_acc=False,
                         is_async=True)
    return qk_t, dp_t


@gluon.jit
def _scores0(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
             STAGES: gl.constexpr):
    """The first score warpgroup (the default partition: the kernel's own warps), even tiles."""
    _scores(p, 0, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)


@gluon.jit
def _scores1(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
             STAGES: gl.constexpr):
    """The second score warpgroup (a worker of 4 warps), odd tiles."""
    _scores(p, 1, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)


@gluon.jit
def _grads(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
           STAGES: gl.constexpr):
    """The gradient warpgroup (a worker of 4 warps): ``dV += P^T dO`` and ``dK += dS^T Q`` of every
    tile, its buffers released once both are done; then the store."""
    (q_desc, do_desc, k_desc, v_desc, q_ring, do_ring, k_smem, v_smem, p_ring, ds_ring, kv_bar, t_full, t_empty,
     h_full, h_empty, LSE, DELTA, GK, GV, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh,
     s_vgs, b, kvh, G, n0, m_start, m_full, nm, nf, Tm, T, Sq, Sk, diag, qk_scale, scale) = p
    o_layout: gl.constexpr = _mma_layout(D, 4)  # dK, dV: [BLOCK_N, D]
    dk = gl.zeros([BLOCK_N, D], gl.float32, o_layout)
    dv = gl.zeros([BLOCK_N, D], gl.float32, o_layout)
    for t in range(T):
        s = t % STAGES
        u = t % 2
        mbarrier.wait(t_full.index(s), (t // STAGES) & 1)
        mbarrier.wait(h_full.index(u), (t // 2) & 1)
        dv = warpgroup_mma(p_ring.index(u), do_ring.index(s).reshape([BLOCK_M, D]), dv, is_async=True)
        dk = warpgroup_mma(ds_ring.index(u), q_ring.index(s).reshape([BLOCK_M, D]), dk, is_async=True)
        # released as soon as done (the score warpgroups' products keep the tensor cores busy meanwhile)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(t_empty.index(s), count=1)
        mbarrier.arrive(h_empty.index(u), count=1)
    _store_rows(GK, dk * scale, b, kvh, n0, Sk, s_kgb, s_kgh, s_kgs, o_layout, BLOCK_N, D)
    _store_rows(GV, dv, b, kvh, n0, Sk, s_vgb, s_vgh, s_vgs, o_layout, BLOCK_N, D)


@gluon.jit(do_not_specialize=["Sq", "Sk", "diag", "GH", "s_lb", "s_lh", "s_eb", "s_eh"])
def _attn_bwd_kv_ws(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, GK, GV,
                    s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh, s_vgs,
                    HKV, G, Sq, Sk, diag, qk_scale, scale, GH,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                    STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Grid ``(key blocks, B * HKV)`` in the order of ``GH`` (``attention._program_order``);
    ``num_warps = 4`` (the first score warpgroup), plus the second's 4, the gradient warpgroup's 4
    and the producer's 1. ``q_desc`` and ``do_desc`` read ``BLOCK_M`` rows, ``k_desc`` and
    ``v_desc`` ``BLOCK_N``."""
    pid_n, pid_bh = _program_order(GH)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    n0 = pid_n * BLOCK_N
    dtype: gl.constexpr = q_desc.dtype

    # query blocks [m_start, m_full) cross the diagonal; from m_full on every query sees every key.
    # Tiles (query head, query block): the Tm diagonal ones (nm per head), then the full ones (nf per
    # head), each head-major (_tile_of)
    m_start = 0
    m_full = 0
    if CAUSAL:
        m_start = (gl.maximum(n0 - diag, 0) // BLOCK_M) * BLOCK_M
        m_full = gl.maximum(m_start, gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M)
    nm = gl.maximum(gl.cdiv(gl.minimum(m_full, Sq) - m_start, BLOCK_M), 0)
    nf = gl.maximum(gl.cdiv(Sq - m_full, BLOCK_M), 0)
    Tm = G * nm
    T = Tm + G * nf

    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    # Q, dO: [STAGES, BLOCK_M, D]; K, V: [BLOCK_N, D]; P^T, dS^T: [2, BLOCK_N, BLOCK_M], one buffer per
    # score warpgroup
    h_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    p_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], h_layout)
    ds_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], h_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    t_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    t_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    h_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    h_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(t_full.index(i), count=1)
        mbarrier.init(t_empty.index(i), count=2)  # its score warpgroup and the gradient one
    for i in gl.static_range(2):
        mbarrier.init(h_full.index(i), count=1)
        mbarrier.init(h_empty.index(i), count=1)
    p = (q_desc, do_desc, k_desc, v_desc, q_ring, do_ring, k_smem, v_smem, p_ring, ds_ring, kv_bar, t_full, t_empty,
         h_full, h_empty, LSE, DELTA, GK, GV, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh,
         s_vgs, b, kvh, G, n0, m_start, m_full, nm, nf, Tm, T, Sq, Sk, diag, qk_scale, scale)
    # workers: the second score warpgroup and the gradient one (4 warps each) and the producer (1),
    # given the registers asked for each (setmaxnreg) out of the launch's maxnreg per thread; the
    # first score warpgroup keeps the rest.
    gl.warp_specialize([
        (_scores0, (p, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)),
        (_scores1, (p, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)),
        (_grads, (p, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)),
        (_producer, (p, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)),
    ], [4, 4, 1], [160, 160, 24])
