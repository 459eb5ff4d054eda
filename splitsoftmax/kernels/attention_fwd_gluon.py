"""The plain forward for Hopper, written in Gluon and warp-specialized: the score product of the
next key block runs while the softmax of this one is taken, and the value product of the last one
runs beside both.

Triton issues a key block's ``S = Q K^T`` only after the previous block's ``O += P V`` (the
tensor cores take products in order), so the softmax of a block waits for both and the tensor
cores idle while it runs. Here each of two consumer warpgroups (``BLOCK_M`` rows each of the
program's ``2 * BLOCK_M``) issues ``S_j`` first and ``O += P_{j-1} V_{j-1}`` right after, waits for
``S_j`` alone and takes its softmax while ``P_{j-1} V_{j-1}`` runs; the rescale of ``O`` by
``alpha_j`` follows that product. One producer warp streams Q, then K and V through rings of their
own by TMA; each consumer releases a buffer (an mbarrier arrival) as soon as its product that read
it is done, and nothing else ties the two consumers together, so that one's softmax runs beside the
other's products. Key blocks that every row of a consumer sees whole run pipelined like this;
those crossing the diagonal or ``Sk`` run after them, every product in turn, masked; a V block
there that holds a NaN/Inf is read through the consumer's own guarded copy: such a value reaches
only the rows that see it (as ``attention._guarded_pv``).

Same semantics as ``attention._attn_fwd_kernel`` on the plain (causal or full) mask, one key
split: ``out (B, H, Sq, D)`` in its dtype, ``lse`` in the natural log, empty rows ``(0, -inf)``.
2-byte inputs with ``D = Dv``, TMA-addressable ``(B, H, S, D)`` operands.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .attention_bwd_gluon import _mma_layout, _store_rows, _thread_barrier, _tma_load, key_blocks, launch_order


@gluon.jit
def _online(qk, m_i, l_i, qk_scale):
    """One block of the online softmax, unmasked: ``(p, alpha, m, l)`` from scores ``qk
    [BLOCK_M, BLOCK_N]`` (unscaled; ``qk_scale > 0`` holds log2(e))."""
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    p = gl.exp2(qk * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _ws_producer(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                 STAGES: gl.constexpr):
    """Takes the program's tiles from the launch's counter and hands each on (``_post_tile``); for
    each, Q's two halves, each once its consumer is done with the last tile's, then K and V of key
    blocks ``[0, T)``, each into its ring's next buffer once both consumers have released it (the
    rings run on across tiles). The program that takes the counter past the tiles last zeroes it."""
    (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, g_smem, f_smem, q_full, q_empty, k_full, k_empty, v_full,
     v_empty, tile_ids, id_full, id_empty, CTR, O, LSE, s_ob, s_oh, s_os, s_lb, s_lh, s_ls, H, G, NB, NBH, GH, Sq, Sk,
     diag, qk_scale) = p
    it = 0
    base = 0
    t = gl.atomic_add(CTR, 1)
    _post_tile(tile_ids, id_full, id_empty, t, it)
    while t < NB * NBH:
        b, h, kvh, m0 = _tile_of(t, NB, NBH, H, G, GH, BLOCK_M, CAUSAL)
        _, T = key_blocks(m0, Sq, Sk, diag, 2 * BLOCK_M, BLOCK_N, CAUSAL)  # both consumers' blocks
        for c in gl.static_range(2):
            mbarrier.wait(q_empty.index(c), (it & 1) ^ 1)  # a fresh barrier counts as released
            mbarrier.expect(q_full.index(c), BLOCK_M * D * 2)
            _tma_load(q_desc, [b, h, m0 + c * BLOCK_M, 0], q_full.index(c), q_smem.index(c))
        for j in range(base, base + T):
            s = j % STAGES
            phase = ((j // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(s), phase)
            mbarrier.expect(k_full.index(s), BLOCK_N * D * 2)
            _tma_load(k_desc, [b, kvh, (j - base) * BLOCK_N, 0], k_full.index(s), k_ring.index(s))
            mbarrier.wait(v_empty.index(s), phase)
            mbarrier.expect(v_full.index(s), BLOCK_N * D * 2)
            _tma_load(v_desc, [b, kvh, (j - base) * BLOCK_N, 0], v_full.index(s), v_ring.index(s))
        it += 1
        base += T
        t = gl.atomic_add(CTR, 1)
        _post_tile(tile_ids, id_full, id_empty, t, it)
    if gl.atomic_add(CTR + 1, 1) == gl.num_programs(0) - 1:  # every program is past its last take
        gl.atomic_xchg(CTR, 0)
        gl.atomic_xchg(CTR + 1, 0)


@gluon.jit
def _post_tile(tile_ids, id_full, id_empty, t, it):
    """The producer hands tile ``t`` (the program's ``it``-th) to both consumers: slot ``it % 2`` of
    ``tile_ids``, once both have read what it held."""
    s = it % 2
    mbarrier.wait(id_empty.index(s), ((it // 2) & 1) ^ 1)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile_ids.index(s).store(gl.full([1], t, gl.int32, one))
    mbarrier.arrive(id_full.index(s), count=1)


@gluon.jit
def _take_tile(tile_ids, id_full, id_empty, it):
    """A consumer's ``it``-th tile, as the producer handed it over (``_post_tile``)."""
    s = it % 2
    mbarrier.wait(id_full.index(s), (it // 2) & 1)
    t = gl.max(tile_ids.index(s).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
    mbarrier.arrive(id_empty.index(s), count=1)
    return t


@gluon.jit
def _tile_of(t, NB, NBH, H, G, GH, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """``(b, h, kvh, m0)`` of tile ``t`` of the launch order (``launch_order``) over ``NB`` query
    blocks of ``2 * BLOCK_M`` rows by ``NBH`` heads, causal longest first."""
    blk, bh = launch_order(t, NB, NBH, GH)
    if CAUSAL:
        blk = NB - 1 - blk
    h = bh % H
    return bh // H, h, h // G, blk * (2 * BLOCK_M)


@gluon.jit
def _ws_take(ring, full, j, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """Key block ``j``'s ``[BLOCK_N, D]`` tile of a ring, once landed."""
    s = j % STAGES
    mbarrier.wait(full.index(s), (j // STAGES) & 1)
    return ring.index(s).reshape([BLOCK_N, D])


@gluon.jit
def _ws_release(empty, j, STAGES: gl.constexpr):
    """This consumer is done with key block ``j``'s buffer of a ring."""
    mbarrier.arrive(empty.index(j % STAGES), count=1)


@gluon.jit
def _ws_consumer(p, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                 CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """Rows ``C * BLOCK_M + [0, BLOCK_M)`` of each tile the producer hands over, until one past the last."""
    (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, g_smem, f_smem, q_full, q_empty, k_full, k_empty, v_full,
     v_empty, tile_ids, id_full, id_empty, CTR, O, LSE, s_ob, s_oh, s_os, s_lb, s_lh, s_ls, H, G, NB, NBH, GH, Sq, Sk,
     diag, qk_scale) = p
    it = 0
    base = 0
    t = _take_tile(tile_ids, id_full, id_empty, it)
    while t < NB * NBH:
        b, h, kvh, m0 = _tile_of(t, NB, NBH, H, G, GH, BLOCK_M, CAUSAL)
        _, T = key_blocks(m0, Sq, Sk, diag, 2 * BLOCK_M, BLOCK_N, CAUSAL)  # both consumers' blocks
        _ws_rows(p, C, b, h, m0 + C * BLOCK_M, T, base, it & 1, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)
        it += 1
        base += T
        t = _take_tile(tile_ids, id_full, id_empty, it)


@gluon.jit
def _ws_rows(p, C: gl.constexpr, b, h, r0, T, base, q_phase, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             D: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """Rows ``r0 + [0, BLOCK_M)`` of head ``(b, h)``: their key blocks (those every row sees whole
    pipelined, then the masked ones), then the tile's remaining ones (of ``T``) released unread; the
    tile's key block ``j`` is the rings' ``base + j``."""
    (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, g_smem, f_smem, q_full, q_empty, k_full, k_empty, v_full,
     v_empty, tile_ids, id_full, id_empty, CTR, O, LSE, s_ob, s_oh, s_os, s_lb, s_lh, s_ls, H, G, NB, NBH, GH, Sq, Sk,
     diag, qk_scale) = p
    NW: gl.constexpr = 4
    dtype: gl.constexpr = q_smem.dtype
    # S, P: [BLOCK_M queries, BLOCK_N keys]; O: [BLOCK_M, D], P feeds it from registers
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, NW)
    o_layout: gl.constexpr = _mma_layout(D, NW)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)  # [BLOCK_M]
    cols: gl.constexpr = gl.SliceLayout(0, s_layout)  # [BLOCK_N]
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)  # [BLOCK_M]
    nf, Tc = key_blocks(r0, Sq, Sk, diag, BLOCK_M, BLOCK_N, CAUSAL)

    zeros_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, rows)
    mbarrier.wait(q_full.index(C), q_phase)
    q_t = q_smem.index(C).reshape([BLOCK_M, D])
    if nf > 0:
        k_t = _ws_take(k_ring, k_full, base, BLOCK_N, D, STAGES)
        qk = warpgroup_mma(q_t, k_t.permute((1, 0)), zeros_s, use_acc=False)
        _ws_release(k_empty, base, STAGES)
        p_j, alpha, m_i, l_i = _online(qk, m_i, l_i, qk_scale)
        for j in range(base + 1, base + nf):
            k_t = _ws_take(k_ring, k_full, j, BLOCK_N, D, STAGES)
            qk = warpgroup_mma(q_t, k_t.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
            v_t = _ws_take(v_ring, v_full, j - 1, BLOCK_N, D, STAGES)
            acc = warpgroup_mma(gl.convert_layout(p_j.to(dtype), p_layout), v_t, acc, is_async=True)
            qk = warpgroup_mma_wait(1, deps=(qk, ))
            _ws_release(k_empty, j, STAGES)
            p_j, alpha, m_i, l_i = _online(qk, m_i, l_i, qk_scale)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            _ws_release(v_empty, j - 1, STAGES)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        v_t = _ws_take(v_ring, v_full, base + nf - 1, BLOCK_N, D, STAGES)
        acc = warpgroup_mma(gl.convert_layout(p_j.to(dtype), p_layout), v_t, acc)
        _ws_release(v_empty, base + nf - 1, STAGES)
    qi = r0 + gl.arange(0, BLOCK_M, layout=rows)
    g_t = g_smem.index(C)
    for j in range(nf, Tc):
        # a masked block: every product in turn; V through this consumer's guarded copy if it holds a
        # NaN/Inf (CAUSAL)
        k_t = _ws_take(k_ring, k_full, base + j, BLOCK_N, D, STAGES)
        qk = warpgroup_mma(q_t, k_t.permute((1, 0)), zeros_s, use_acc=False)
        _ws_release(k_empty, base + j, STAGES)
        kj = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols)
        ok = (kj < Sk)[None, :]
        if CAUSAL:
            ok = ok & (kj[None, :] <= qi[:, None] + diag)
        s = gl.where(ok, qk * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p_j = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p_j, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        v_t = _ws_take(v_ring, v_full, base + j, BLOCK_N, D, STAGES)
        if CAUSAL and _has_nonfinite(v_t, BLOCK_N, D, NW):
            # a NaN/Inf value counts only for the rows that see it (p > 0)
            bad = _guarded_copy(v_t, g_t, f_smem.index(C), BLOCK_N, D, NW, cols)
            _ws_release(v_empty, base + j, STAGES)
            hit = gl.sum(gl.where(bad[None, :], p_j, 0.0), 1) > 0
            acc = warpgroup_mma(gl.convert_layout(p_j.to(dtype), p_layout), g_t, acc)
            acc = gl.where(gl.convert_layout(hit, o_rows)[:, None], float("nan"), acc)
        else:
            acc = warpgroup_mma(gl.convert_layout(p_j.to(dtype), p_layout), v_t, acc)
            _ws_release(v_empty, base + j, STAGES)
    mbarrier.arrive(q_empty.index(C), count=1)  # every product that reads Q is done
    for j in range(base + Tc, base + T):  # the other consumer's blocks: released in turn, unread
        mbarrier.wait(k_full.index(j % STAGES), (j // STAGES) & 1)
        _ws_release(k_empty, j, STAGES)
        mbarrier.wait(v_full.index(j % STAGES), (j // STAGES) & 1)
        _ws_release(v_empty, j, STAGES)

    some = l_i != 0
    lse2 = gl.where(some, m_i + gl.log2(gl.where(some, l_i, 1.0)), float("-inf"))
    inv = 1.0 / gl.where(some, l_i, 1.0)
    _store_rows(O, acc * gl.convert_layout(inv, o_rows)[:, None], b, h, r0, Sq, s_ob, s_oh, s_os, o_layout,
                BLOCK_M, D)
    gl.store(LSE + b.to(gl.int64) * s_lb + h.to(gl.int64) * s_lh + qi * s_ls, lse2 * 0.6931471805599453,
             mask=qi < Sq)


@gluon.jit
def _has_nonfinite(v_t, BLOCK_N: gl.constexpr, D: gl.constexpr, NW: gl.constexpr):
    """Whether the shared ``[BLOCK_N, D]`` tile ``v_t`` holds a NaN or an infinity (one answer for
    every thread), read 32 rows at a time."""
    CH: gl.constexpr = 32
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    worst = gl.zeros([CH], gl.int32, gl.SliceLayout(1, blocked))
    for c in gl.static_range(BLOCK_N // CH):
        x = v_t.slice(c * CH, CH).load(blocked)  # [CH, D]
        worst = gl.maximum(worst, gl.max(gl.where(gl.abs(x.to(gl.float32)) < float("inf"), 0, 1), 1))
    return gl.max(worst, 0) > 0


@gluon.jit
def _guarded_copy(v_t, g_t, f_t, BLOCK_N: gl.constexpr, D: gl.constexpr, NW: gl.constexpr, cols: gl.constexpr):
    """``g_t = v_t`` with every NaN/Inf replaced by 0 (``[BLOCK_N, D]`` shared tiles, 32 rows at a
    time), ready for the tensor cores in every warp; returns which keys held one (``[BLOCK_N]`` in
    layout ``cols``, through the shared ``f_t [BLOCK_N]``)."""
    CH: gl.constexpr = 32
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    for c in gl.static_range(BLOCK_N // CH):
        x = v_t.slice(c * CH, CH).load(blocked)  # [CH, D]
        finite = gl.abs(x.to(gl.float32)) < float("inf")
        g_t.slice(c * CH, CH).store(gl.where(finite, x, gl.zeros_like(x)))
        f_t.slice(c * CH, CH).store(gl.max(gl.where(finite, 0, 1), 1))
    fence_async_shared()
    _thread_barrier()
    return f_t.load(cols) > 0


@gluon.jit
def _ws_consumer0(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                  STAGES: gl.constexpr):
    """The first consumer (the default partition: the kernel's own warps)."""
    _ws_consumer(p, 0, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)


@gluon.jit
def _ws_consumer1(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                  STAGES: gl.constexpr):
    """The second consumer (a worker partition of 4 warps)."""
    _ws_consumer(p, 1, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)


@gluon.jit(do_not_specialize=["Sq", "Sk", "diag", "NB", "NBH", "GH", "s_lb", "s_lh"])
def _attn_fwd_gluon(q_desc, k_desc, v_desc, O, LSE, CTR, s_ob, s_oh, s_os, s_lb, s_lh, s_ls,
                    H, G, NB, NBH, Sq, Sk, diag, qk_scale, GH,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                    STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Grid ``(P,)``: the programs take the ``NB * NBH`` tiles (``NB`` blocks of ``2 * BLOCK_M``
    queries by ``NBH = B * H`` heads, in ``_tile_of``'s order) one at a time from the counter
    ``CTR`` (two int32, zero at launch and left zero), each program running on while its next tile's
    Q, K and V stream in; ``P`` up to the number of tiles. ``num_warps = 4`` (the first consumer),
    plus the second consumer's 4 and the producer's 1. ``q_desc`` reads ``BLOCK_M`` rows, ``k_desc``
    and ``v_desc`` ``BLOCK_N``; ``O`` has unit last stride; ``qk_scale`` is the scale times log2(e)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    g_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    g_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D], g_layout)
    f_smem = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    id_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    id_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_full.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
        mbarrier.init(id_full.index(c), count=1)
        mbarrier.init(id_empty.index(c), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    p = (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, g_smem, f_smem, q_full, q_empty, k_full, k_empty, v_full,
         v_empty, tile_ids, id_full, id_empty, CTR, O, LSE, s_ob, s_oh, s_os, s_lb, s_lh, s_ls, H, G, NB, NBH, GH, Sq,
         Sk, diag, qk_scale)
    # workers: the second consumer (4 warps) and the producer (1), given the registers asked for each
    # (setmaxnreg) out of the launch's maxnreg per thread; the first consumer keeps the rest.
    gl.warp_specialize([
        (_ws_consumer0, (p, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)),
        (_ws_consumer1, (p, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)),
        (_ws_producer, (p, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES)),
    ], [4, 1], [240, 24])
