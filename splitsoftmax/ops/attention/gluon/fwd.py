"""The plain forward for Hopper, written in Gluon and warp-specialized: the score product of the
next key block runs while the softmax of this one is taken, and the value product of the last one
runs beside both.

Triton issues a key block's ``S = Q K^T`` only after the previous block's ``O += P V`` (the
tensor cores take products in order), so the softmax of a block waits for both and the tensor
cores idle while it runs. Here each of two consumer warpgroups (``BLOCK_M`` rows each of the
program's ``2 * BLOCK_M``) issues ``S_j`` first and ``O += P_{j-1} V_{j-1}`` right after, waits for
``S_j`` alone and takes its softmax while ``P_{j-1} V_{j-1}`` runs; the rescale of ``O`` by
``alpha_j`` follows that product. One producer warpgroup streams Q, then K and V through rings of
their own by TMA; each consumer releases a buffer (an mbarrier arrival) as soon as its product that
read it is done, and nothing else ties the two consumers together, so that one's softmax runs beside
the other's products. Key blocks that every row of the program's tile sees whole run pipelined like
this; those crossing the diagonal or ``Sk`` run after them, every product in turn, masked. The
producer looks at each masked block's V before handing it on: a NaN/Inf there is replaced by 0 and
its key flagged, and the rows that see a flagged key are made NaN, so such a value reaches only the
rows that see it (as ``attention._guarded_pv``).

The variants' masks (splitsoftmax.core.mask: a window's lower edge, ``kv_range``, ``q_offset``, document
rows; softcapped scores) take the same route: each tile of ``2 * BLOCK_M`` rows walks the key blocks
some of its rows see, those every row of the tile sees whole first (pipelined, no mask), then the
others (``attention_bwd_gluon._q_walk``); a consumer skips the blocks none of its own rows sees.

Same semantics as ``attention._attn_fwd_kernel`` with one key split: ``out (B, H, Sq, D)`` in its
dtype, ``lse`` in the natural log, empty rows ``(0, -inf)``; or, as its ``ACC`` (a ring step),
merged into the running float32 state already held in ``out`` and ``lse``. 2-byte inputs with
``D = Dv``, TMA-addressable ``(B, H, S, D)`` operands.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..._triton import configs
from ..._triton.algebra import LOG2E, inv_or_zero, lse2_of, online_step, ref_max, rescale
from .bwd import (_batch_bounds, _doc_rows, _key_block, _mma_layout, _q_walk, _store_rows, _tanh, _thread_barrier,
                  _tma_load, launch_order)

# the exponent field of a 2-byte float, by dtype: all its bits set marks a NaN or an infinity
EXP_BITS_BF16 = gl.constexpr(0x7F80)
EXP_BITS_FP16 = gl.constexpr(0x7C00)
# scalars read where they are used (configs.ATTN_FWD_GLUON_OWN_SCALARS, by Triton version)
OWN_SCALARS = gl.constexpr(configs.ATTN_FWD_GLUON_OWN_SCALARS)


@gluon.jit
def _tanh_of(x, APPROX: gl.constexpr):
    """``tanh(x)``: the GPU's ``tanh.approx.f32`` where ``APPROX`` (as ``attn_mask.tanh``), else the
    backward's form from one ``exp2``."""
    if APPROX:
        y = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                      pack=1)
    else:
        y = _tanh(x)
    return y


@gluon.jit
def _scaled(qk, qk_scale, cap, SOFTCAP: gl.constexpr, APPROX: gl.constexpr):
    """Scores in the log2 domain from raw products ``qk``: ``qk * qk_scale``, or softcapped
    ``c * tanh(scale * qk / c) * log2(e)`` with ``cap = (scale / c, c * log2(e))``."""
    if SOFTCAP:
        s = _tanh_of(qk * cap[0], APPROX) * cap[1]
    else:
        s = qk * qk_scale
    return s


@gluon.jit
def _online(qk, m_i, l_i, qk_scale, cap, SOFTCAP: gl.constexpr, APPROX: gl.constexpr):
    """One block of the online softmax, unmasked: ``(p, alpha, m, l)`` from raw products ``qk
    [BLOCK_M, BLOCK_N]`` (``qk_scale > 0`` holds log2(e); ``cap``: :func:`_scaled`)."""
    if SOFTCAP:  # the row maximum of tanh, then scaled (c > 0: the same value): s feeds exp2 alone, as an FMA
        t = _tanh_of(qk * cap[0], APPROX)
        m_new = gl.maximum(m_i, gl.max(t, 1) * cap[1])
        s = t * cap[1]
    else:
        s = qk * qk_scale
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    p, alpha, l_i = online_step(l_i, m_i, m_new, s)
    return p, alpha, m_new, l_i


@gluon.jit
def _row_keys(qi, rlo, rhi, dg, lw, kv_lo, kv_hi, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              ROW_BOUNDS: gl.constexpr):
    """``(lo_r, hi_r)``: row ``qi`` sees the keys ``lo_r <= j < hi_r`` (``attention_bwd_gluon._seen``'s
    rule as one interval per row)."""
    lo_r = gl.zeros_like(qi) + kv_lo
    hi_r = gl.zeros_like(qi) + kv_hi
    if CAUSAL:
        hi_r = gl.minimum(hi_r, qi + dg + 1)
    if WINDOW:
        lo_r = gl.maximum(lo_r, qi + lw)
    if ROW_BOUNDS:
        lo_r = gl.maximum(lo_r, rlo)
        hi_r = gl.minimum(hi_r, rhi)
    return lo_r, hi_r


@gluon.jit
def _element_bounds(mk, b, Sk, diag, KV_RANGE: gl.constexpr, Q_OFFSET: gl.constexpr):
    """``(kv_lo, kv_hi, dg, lw)`` of batch element ``b`` (``attention_bwd_gluon._batch_bounds``) from
    the mask's arguments ``mk``."""
    KVR, QOFF, _, s_kvb, s_kvc, s_off, _, lo, _, _ = mk
    return _batch_bounds(KVR, QOFF, s_kvb, s_kvc, s_off, b, Sk, diag, lo, KV_RANGE, Q_OFFSET)


@gluon.jit
def _tile_walk(mk, bounds, m0, Sq, ROWS: gl.constexpr, layout: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ROW_BOUNDS: gl.constexpr):
    """``(walk, T)`` of query rows ``m0 + [0, ROWS)`` (``layout``: a ``[ROWS]`` layout): the ``T`` key
    blocks some of them sees, in the order ``_key_block`` takes them from ``walk``: those every row
    sees whole first, then the others. ``mk``: the mask's arguments (``_attn_fwd_gluon``), ``bounds``
    the batch element's (:func:`_element_bounds`)."""
    _, _, ROWS_T, _, _, _, s_r, _, _, _ = mk
    kv_lo, kv_hi, dg, lw = bounds
    qi = m0 + gl.arange(0, ROWS, layout=layout)
    rlo, rhi = _doc_rows(ROWS_T, s_r, qi, Sq, ROW_BOUNDS)
    first, end, ia, ib = _q_walk(m0, qi, rlo, rhi, Sq, dg, lw, kv_lo, kv_hi, ROWS, BLOCK_N, CAUSAL, WINDOW,
                                 ROW_BOUNDS)
    return (first, ia - first, ib, ia, ib - ia), end - first


@gluon.jit
def _ws_producer(p, mk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                 STAGES: gl.constexpr, WINDOW: gl.constexpr, KV_RANGE: gl.constexpr, Q_OFFSET: gl.constexpr,
                 ROW_BOUNDS: gl.constexpr):
    """Takes the program's tiles from the launch's counter and hands each on (``_post_tile``); for
    each, Q's two halves, each once its consumer is done with the last tile's, then K and V of the
    tile's key blocks in its walk's order (``_tile_walk``), each into its ring's next buffer once
    both consumers have released it (the rings run on across tiles); a masked block's V is handed on
    once ``_guard_v`` has looked at it. The program that takes the counter past the tiles last zeroes
    it."""
    (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, a_smem, f_smem, q_full, q_empty, k_full, k_empty, v_full,
     v_empty, v_land, tile_ids, id_full, id_empty, CTR, O, LSE, s_ob, s_oh, s_os, s_lb, s_lh, s_ls, H, G, NB, NBH,
     GH, Sq, Sk, diag, qk_scale) = p
    rows: gl.constexpr = gl.BlockedLayout([2 * BLOCK_M // 128], [32], [4], [0])  # [2 * BLOCK_M], 4 warps
    GUARD: gl.constexpr = CAUSAL or WINDOW or KV_RANGE or ROW_BOUNDS  # masked blocks may hide keys inside Sk
    it = 0
    base = 0
    n_guarded = 0
    t = gl.atomic_add(CTR, 1)
    _post_tile(tile_ids, id_full, id_empty, t, it)
    while t < NB * NBH:
        b, h, kvh, m0 = _tile_of(t, NB, NBH, H, G, GH, BLOCK_M, CAUSAL)
        bounds = _element_bounds(mk, b, Sk, diag, KV_RANGE, Q_OFFSET)
        walk, T = _tile_walk(mk, bounds, m0, Sq, 2 * BLOCK_M, rows, BLOCK_N, CAUSAL, WINDOW,
                             ROW_BOUNDS)  # both consumers' blocks
        for c in gl.static_range(2):
            mbarrier.wait(q_empty.index(c), (it & 1) ^ 1)  # a fresh barrier counts as released
            mbarrier.expect(q_full.index(c), BLOCK_M * D * 2)
            _tma_load(q_desc, [b, h, m0 + c * BLOCK_M, 0], q_full.index(c), q_smem.index(c))
        for j in range(base, base + T):
            s = j % STAGES
            phase = ((j // STAGES) & 1) ^ 1
            n0 = _key_block(j - base, walk) * BLOCK_N
            mbarrier.wait(k_empty.index(s), phase)
            mbarrier.expect(k_full.index(s), BLOCK_N * D * 2)
            _tma_load(k_desc, [b, kvh, n0, 0], k_full.index(s), k_ring.index(s))
            mbarrier.wait(v_empty.index(s), phase)
            masked = False
            if GUARD:
                masked = j - base >= walk[4]
            if masked:  # a masked block: its V looked at here, not by the consumers
                mbarrier.expect(v_land.index(0), BLOCK_N * D * 2)
                _tma_load(v_desc, [b, kvh, n0, 0], v_land.index(0), v_ring.index(s))
                mbarrier.wait(v_land.index(0), n_guarded & 1)
                n_guarded += 1
                _guard_v(v_ring.index(s).reshape([BLOCK_N, D]), a_smem.index(s), f_smem.index(s), BLOCK_N, D)
                mbarrier.arrive(v_full.index(s), count=1)
            else:
                mbarrier.expect(v_full.index(s), BLOCK_N * D * 2)
                _tma_load(v_desc, [b, kvh, n0, 0], v_full.index(s), v_ring.index(s))
        it += 1
        base += T
        t = gl.atomic_add(CTR, 1)
        _post_tile(tile_ids, id_full, id_empty, t, it)
    if gl.atomic_add(CTR + 1, 1) == gl.num_programs(0) - 1:  # every program is past its last take
        gl.atomic_xchg(CTR, 0)
        gl.atomic_xchg(CTR + 1, 0)


@gluon.jit
def _own(x):
    """The int32 scalar ``x`` read where it is used: where ``OWN_SCALARS``, through an opaque move the
    compiler can neither hoist nor merge, so that nothing computed from ``x`` (a widened stride,
    ``diag + 1``) is held across a tile loop or the warp-specialize split."""
    if OWN_SCALARS:
        x = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)
    return x


@gluon.jit
def _post_tile(tile_ids, id_full, id_empty, t, it):
    """The producer hands tile ``t`` (the program's ``it``-th) to both consumers: slot ``it % 2`` of
    ``tile_ids``, once both have read what it held."""
    s = it % 2
    mbarrier.wait(id_empty.index(s), ((it // 2) & 1) ^ 1)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    tile_ids.index(s).store(gl.full([1], t, gl.int32, one))
    _thread_barrier()  # written before the one arrival
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
def _ws_consumer(p, mk, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                 CAUSAL: gl.constexpr, STAGES: gl.constexpr, WINDOW: gl.constexpr, KV_RANGE: gl.constexpr,
                 Q_OFFSET: gl.constexpr, ROW_BOUNDS: gl.constexpr, SOFTCAP: gl.constexpr,
                 SOFTCAP_APPROX: gl.constexpr, ACC: gl.constexpr):
    """Rows ``C * BLOCK_M + [0, BLOCK_M)`` of each tile the producer hands over, until one past the last."""
    (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, a_smem, f_smem, q_full, q_empty, k_full, k_empty, v_full,
     v_empty, v_land, tile_ids, id_full, id_empty, CTR, O, LSE, s_ob, s_oh, s_os, s_lb, s_lh, s_ls, H, G, NB, NBH,
     GH, Sq, Sk, diag, qk_scale) = p
    rows: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # [2 * BLOCK_M] in the warpgroup
    it = 0
    base = 0
    t = _take_tile(tile_ids, id_full, id_empty, it)
    while t < NB * NBH:
        b, h, kvh, m0 = _tile_of(t, NB, NBH, H, G, GH, BLOCK_M, CAUSAL)
        bounds = _element_bounds(mk, b, _own(Sk), _own(diag), KV_RANGE, Q_OFFSET)
        walk, T = _tile_walk(mk, bounds, m0, Sq, 2 * BLOCK_M, rows, BLOCK_N, CAUSAL, WINDOW,
                             ROW_BOUNDS)  # both consumers' blocks
        _ws_rows(p, mk, bounds, C, b, h, m0 + C * BLOCK_M, walk, T, base, it & 1, BLOCK_M, BLOCK_N, D, CAUSAL,
                 STAGES, WINDOW, KV_RANGE, ROW_BOUNDS, SOFTCAP, SOFTCAP_APPROX, ACC)
        it += 1
        base += T
        t = _take_tile(tile_ids, id_full, id_empty, it)


@gluon.jit
def _ws_rows(p, mk, bounds, C: gl.constexpr, b, h, r0, walk, T, base, q_phase, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
             WINDOW: gl.constexpr, KV_RANGE: gl.constexpr, ROW_BOUNDS: gl.constexpr, SOFTCAP: gl.constexpr,
             SOFTCAP_APPROX: gl.constexpr, ACC: gl.constexpr):
    """Rows ``r0 + [0, BLOCK_M)`` of head ``(b, h)`` over the tile's ``T`` key blocks (``walk``,
    ``_tile_walk``; block ``u`` of the walk is the rings' ``base + u``): those the whole tile sees
    pipelined, then the others masked, those none of these rows sees released unread; ``bounds``:
    the batch element's (:func:`_element_bounds`). ``ACC``: merged into the state held at ``O``,
    ``LSE`` (:func:`_merged`)."""
    (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, a_smem, f_smem, q_full, q_empty, k_full, k_empty, v_full,
     v_empty, v_land, tile_ids, id_full, id_empty, CTR, O, LSE, s_ob, s_oh, s_os, s_lb, s_lh, s_ls, H, G, NB, NBH,
     GH, Sq, Sk, diag, qk_scale) = p
    _, _, ROWS_T, _, _, _, s_r, _, cap_in, cap_out = mk
    cap = (cap_in, cap_out)
    NW: gl.constexpr = 4
    GUARD: gl.constexpr = CAUSAL or WINDOW or KV_RANGE or ROW_BOUNDS  # masked blocks may hide keys inside Sk
    dtype: gl.constexpr = q_smem.dtype
    # S, P: [BLOCK_M queries, BLOCK_N keys]; O: [BLOCK_M, D], P feeds it from registers
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, NW)
    o_layout: gl.constexpr = _mma_layout(D, NW)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)  # [BLOCK_M]
    cols: gl.constexpr = gl.SliceLayout(0, s_layout)  # [BLOCK_N]
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)  # [BLOCK_M]
    n_in = walk[4]
    # these rows' own bounds: the blocks [c_first, c_end) hold every key one of them sees
    kv_lo, kv_hi, dg, lw = bounds
    qi = r0 + gl.arange(0, BLOCK_M, layout=rows)
    rlo, rhi = _doc_rows(ROWS_T, s_r, qi, Sq, ROW_BOUNDS)
    c_first, c_end, _, _ = _q_walk(r0, qi, rlo, rhi, Sq, dg, lw, kv_lo, kv_hi, BLOCK_M, BLOCK_N, CAUSAL, WINDOW,
                                   ROW_BOUNDS)
    lo_r, hi_r = _row_keys(qi, rlo, rhi, dg, lw, kv_lo, kv_hi, CAUSAL, WINDOW, ROW_BOUNDS)

    zeros_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, rows)
    mbarrier.wait(q_full.index(C), q_phase)
    q_t = q_smem.index(C).reshape([BLOCK_M, D])
    if n_in > 0:
        k_t = _ws_take(k_ring, k_full, base, BLOCK_N, D, STAGES)
        qk = warpgroup_mma(q_t, k_t.permute((1, 0)), zeros_s, use_acc=False)
        _ws_release(k_empty, base, STAGES)
        p_j, alpha, m_i, l_i = _online(qk, m_i, l_i, qk_scale, cap, SOFTCAP, SOFTCAP_APPROX)
        for j in range(base + 1, base + n_in):
            k_t = _ws_take(k_ring, k_full, j, BLOCK_N, D, STAGES)
            qk = warpgroup_mma(q_t, k_t.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
            v_t = _ws_take(v_ring, v_full, j - 1, BLOCK_N, D, STAGES)
            acc = warpgroup_mma(gl.convert_layout(p_j.to(dtype), p_layout), v_t, acc, is_async=True)
            qk = warpgroup_mma_wait(1, deps=(qk, ))
            _ws_release(k_empty, j, STAGES)
            p_j, alpha, m_i, l_i = _online(qk, m_i, l_i, qk_scale, cap, SOFTCAP, SOFTCAP_APPROX)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            _ws_release(v_empty, j - 1, STAGES)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        # no masked block read after: the last score product is done, the next tile's Q may land
        # (_last_read is taken here and again below, not held across the loop: held, it spilled)
        if _last_read(walk, T, c_first, c_end) < 0:
            mbarrier.arrive(q_empty.index(C), count=1)
        v_t = _ws_take(v_ring, v_full, base + n_in - 1, BLOCK_N, D, STAGES)
        acc = warpgroup_mma(gl.convert_layout(p_j.to(dtype), p_layout), v_t, acc)
        _ws_release(v_empty, base + n_in - 1, STAGES)
    u_last = _last_read(walk, T, c_first, c_end)  # Q is free once this step's score product is done
    for u in range(n_in, T):
        kb = _key_block(u, walk)
        if (kb >= c_first) & (kb < c_end):
            # a masked block: every product in turn; its V as the producer left it (GUARD: a NaN/Inf
            # replaced by 0 and flagged, ``_guard_v``), the rows that see a flagged key made NaN
            k_t = _ws_take(k_ring, k_full, base + u, BLOCK_N, D, STAGES)
            qk = warpgroup_mma(q_t, k_t.permute((1, 0)), zeros_s, use_acc=False)
            _ws_release(k_empty, base + u, STAGES)
            if u == u_last:
                mbarrier.arrive(q_empty.index(C), count=1)
            kj = kb * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols)
            ok = (kj[None, :] >= lo_r[:, None]) & (kj[None, :] < hi_r[:, None])
            s = gl.where(ok, _scaled(qk, qk_scale, cap, SOFTCAP, SOFTCAP_APPROX), float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = ref_max(m_new)
            p_j, alpha, l_i = online_step(l_i, m_i, m_use, s)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            v_t = _ws_take(v_ring, v_full, base + u, BLOCK_N, D, STAGES)
            acc = warpgroup_mma(gl.convert_layout(p_j.to(dtype), p_layout), v_t, acc)
            if GUARD:
                slot = (base + u) % STAGES
                if _flag(a_smem.index(slot)) != 0:
                    # a NaN/Inf value counts only for the rows that see it (p > 0)
                    bad = f_smem.index(slot).load(cols) != 0
                    hit = gl.sum(gl.where(bad[None, :], p_j, 0.0), 1) > 0
                    acc = gl.where(gl.convert_layout(hit, o_rows)[:, None], float("nan"), acc)
            _ws_release(v_empty, base + u, STAGES)
        else:  # the other consumer's block: released in turn, unread
            _ws_take(k_ring, k_full, base + u, BLOCK_N, D, STAGES)
            _ws_release(k_empty, base + u, STAGES)
            _ws_take(v_ring, v_full, base + u, BLOCK_N, D, STAGES)
            _ws_release(v_empty, base + u, STAGES)
    if (n_in == 0) & (u_last < 0):  # no block read: Q released unread
        mbarrier.arrive(q_empty.index(C), count=1)

    some = l_i != 0
    lse2 = lse2_of(m_i, l_i)
    inv = 1.0 / gl.where(some, l_i, 1.0)
    out = acc * gl.convert_layout(inv, o_rows)[:, None]
    s_ob, s_oh, s_os, s_lb, s_lh = _own(s_ob), _own(s_oh), _own(s_os), _own(s_lb), _own(s_lh)
    l_ptrs = LSE + b.to(gl.int64) * s_lb + h.to(gl.int64) * s_lh + qi * s_ls
    if ACC:
        out, lse2 = _merged(O, l_ptrs, qi < Sq, out, lse2, b, h, r0, Sq, s_ob, s_oh, s_os, o_layout, BLOCK_M, D)
    _store_rows(O, out, b, h, r0, Sq, s_ob, s_oh, s_os, o_layout, BLOCK_M, D)
    gl.store(l_ptrs, lse2 * 0.6931471805599453, mask=qi < Sq)


@gluon.jit
def _merged(O, l_ptrs, ok, out, lse2, b, h, r0, Sq, s_ob, s_oh, s_os, o_layout: gl.constexpr,
            BLOCK_M: gl.constexpr, D: gl.constexpr):
    """``(out, lse2)`` of rows ``r0 + [0, BLOCK_M)`` (``out [BLOCK_M, D]`` in ``o_layout``, ``lse2
    [BLOCK_M]`` in the log2 domain) merged with the running state already held there: ``O`` and
    ``l_ptrs`` (the rows' natural-log ``lse``; ``ok``: the rows below ``Sq``, both in ``lse2``'s
    layout). The Triton kernel's ``ACC`` epilogue (``attention._attn_fwd_kernel``): an empty part
    (``lse = -inf``) is never multiplied in, a NaN stays NaN, a row empty in both is ``(0, -inf)``."""
    rows: gl.constexpr = gl.SliceLayout(1, o_layout)  # [BLOCK_M]
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))  # [D]
    r = r0 + gl.arange(0, BLOCK_M, layout=rows)
    old2 = gl.load(l_ptrs, mask=ok, other=float("-inf")) * LOG2E
    _, m2, w_old, w_new = rescale(old2, lse2)
    tot = w_old + w_new
    inv = inv_or_zero(tot)
    keep = gl.convert_layout(w_old > 0, rows) & (r < Sq)
    o_old = gl.load(O + b.to(gl.int64) * s_ob + h.to(gl.int64) * s_oh + r[:, None].to(gl.int64) * s_os + cols[None, :],
                    mask=keep[:, None] & (cols < D)[None, :], other=0.0)  # [BLOCK_M, D]
    out = o_old * gl.convert_layout(w_old * inv, rows)[:, None] + out * gl.convert_layout(w_new * inv, rows)[:, None]
    return out, lse2_of(m2, tot)


@gluon.jit
def _last_read(walk, T, c_first, c_end):
    """The last step of a tile's walk (``_tile_walk``) past its interior blocks whose key block lies in
    a consumer's ``[c_first, c_end)``, or -1: the walk's ``[first, ia)`` are steps ``n_in ..``, its
    ``[ib, first + T)`` follow them."""
    first, n_pre, ib, ia, n_in = walk
    post = gl.minimum(c_end, first + T) - 1
    pre = gl.minimum(c_end, ia) - 1
    return gl.where(post >= gl.maximum(c_first, ib), n_in + n_pre + post - ib,
                    gl.where(pre >= gl.maximum(c_first, first), n_in + pre - first, -1))


@gluon.jit
def _guard_v(v_t, a_t, f_t, BLOCK_N: gl.constexpr, D: gl.constexpr):
    """The producer's look at a masked block's V, landed in the shared ``[BLOCK_N, D]`` tile
    ``v_t`` (2-byte floats), before any consumer reads it: ``a_t [1]`` says whether it holds a NaN or
    an infinity (all bits of such a value's exponent field are set, the largest any value's field
    holds); if so each is replaced by 0 in place, ready for the tensor cores, and ``f_t [BLOCK_N]``
    marks the keys that held one. A few rows at a time, within the producer's registers."""
    EXP: gl.constexpr = EXP_BITS_BF16 if v_t.dtype == gl.bfloat16 else EXP_BITS_FP16
    NW: gl.constexpr = 4
    TPR: gl.constexpr = 32 if D >= 256 else D // 8  # threads per row, 8 values each
    CH: gl.constexpr = 8  # rows per read: the period of the tile's swizzle
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPR, TPR], [NW, 1], [1, 0])
    top = gl.zeros([CH, D], gl.int16, blocked)
    for c in gl.static_range(BLOCK_N // CH):
        x = v_t.slice(c * CH, CH).load(blocked)  # [CH, D]
        top = gl.maximum(top, x.to(gl.int16, bitcast=True) & EXP)
    bad = gl.max(gl.max(top, 1), 0) == EXP
    one: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    a_t.store(gl.zeros([1], gl.int32, one) + bad.to(gl.int32))
    if bad:
        for c in gl.static_range(BLOCK_N // CH):
            x = v_t.slice(c * CH, CH).load(blocked)  # [CH, D]
            finite = gl.abs(x.to(gl.float32)) < float("inf")
            v_t.slice(c * CH, CH).store(gl.where(finite, x, gl.zeros_like(x)))
            f_t.slice(c * CH, CH).store(gl.max(gl.where(finite, 0, 1), 1))
        fence_async_shared()  # the zeros, before the tensor cores read the tile
    _thread_barrier()  # every warp's part is written before the producer's one arrival


@gluon.jit
def _flag(a_t):
    """The producer's ``[1]`` flag ``a_t`` as one value for every thread of a warpgroup."""
    return gl.max(a_t.load(gl.BlockedLayout([1], [32], [4], [0])), 0)


@gluon.jit
def _ws_consumer0(p, mk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                  STAGES: gl.constexpr, WINDOW: gl.constexpr, KV_RANGE: gl.constexpr, Q_OFFSET: gl.constexpr,
                  ROW_BOUNDS: gl.constexpr, SOFTCAP: gl.constexpr, SOFTCAP_APPROX: gl.constexpr,
                  ACC: gl.constexpr):
    """The first consumer (the default partition: the kernel's own warps)."""
    _ws_consumer(p, mk, 0, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, WINDOW, KV_RANGE, Q_OFFSET, ROW_BOUNDS, SOFTCAP,
                 SOFTCAP_APPROX, ACC)


@gluon.jit
def _ws_consumer1(p, mk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                  STAGES: gl.constexpr, WINDOW: gl.constexpr, KV_RANGE: gl.constexpr, Q_OFFSET: gl.constexpr,
                  ROW_BOUNDS: gl.constexpr, SOFTCAP: gl.constexpr, SOFTCAP_APPROX: gl.constexpr,
                  ACC: gl.constexpr):
    """The second consumer (a worker partition of 4 warps)."""
    _ws_consumer(p, mk, 1, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, WINDOW, KV_RANGE, Q_OFFSET, ROW_BOUNDS, SOFTCAP,
                 SOFTCAP_APPROX, ACC)


@gluon.jit(do_not_specialize=["Sq", "Sk", "diag", "NB", "NBH", "GH", "s_lb", "s_lh", "s_r", "lo"])
def _attn_fwd_gluon(q_desc, k_desc, v_desc, O, LSE, CTR, KVR, QOFF, ROWS, s_ob, s_oh, s_os, s_lb, s_lh, s_ls,
                    s_kvb, s_kvc, s_off, s_r, H, G, NB, NBH, Sq, Sk, diag, lo, qk_scale, cap_in, cap_out, GH,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                    STAGES: gl.constexpr, WINDOW: gl.constexpr, KV_RANGE: gl.constexpr, Q_OFFSET: gl.constexpr,
                    ROW_BOUNDS: gl.constexpr, SOFTCAP: gl.constexpr, SOFTCAP_APPROX: gl.constexpr,
                    ACC: gl.constexpr, num_warps: gl.constexpr):
    """Grid ``(P,)``: the programs take the ``NB * NBH`` tiles (``NB`` blocks of ``2 * BLOCK_M``
    queries by ``NBH = B * H`` heads, in ``_tile_of``'s order) one at a time from the counter
    ``CTR`` (two int32, zero at launch and left zero), each program running on while its next tile's
    Q, K and V stream in; ``P`` up to the number of tiles. ``num_warps = 4`` (the first consumer),
    plus the second consumer's 4 and the producer's 4. ``q_desc`` reads ``BLOCK_M`` rows, ``k_desc``
    and ``v_desc`` ``BLOCK_N``; ``O`` has unit last stride; ``qk_scale`` is the scale times log2(e).
    The mask's fields (``attn_mask.kernel_mask``; read where their flag is set): the window's lower
    edge ``lo`` (``WINDOW``), ``KVR (B, 2)`` (``KV_RANGE``, strides ``s_kvb, s_kvc``), ``QOFF (B,)``
    (``Q_OFFSET``, ``s_off``), the document bounds ``ROWS (2, Sq)`` (``ROW_BOUNDS``, ``s_r``), and
    ``SOFTCAP``'s ``cap_in = scale / c``, ``cap_out = c * log2(e)``."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    a_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    f_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    id_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    id_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_land = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(v_land.index(0), count=1)
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
    p = (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, a_smem, f_smem, q_full, q_empty, k_full, k_empty, v_full,
         v_empty, v_land, tile_ids, id_full, id_empty, CTR, O, LSE, s_ob, s_oh, s_os, s_lb, s_lh, s_ls, H, G, NB, NBH,
         GH, Sq, Sk, diag, qk_scale)
    mk = (KVR, QOFF, ROWS, s_kvb, s_kvc, s_off, s_r, lo, cap_in, cap_out)
    # workers: the second consumer (4 warps) and the producer (4, for its reads of masked blocks' V),
    # given the registers asked for each (setmaxnreg) out of the launch's maxnreg per thread; the first
    # consumer keeps the rest.
    gl.warp_specialize([
        (_ws_consumer0, (p, mk, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, WINDOW, KV_RANGE, Q_OFFSET, ROW_BOUNDS, SOFTCAP,
                         SOFTCAP_APPROX, ACC)),
        (_ws_consumer1, (p, mk, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, WINDOW, KV_RANGE, Q_OFFSET, ROW_BOUNDS, SOFTCAP,
                         SOFTCAP_APPROX, ACC)),
        (_ws_producer, (p, mk, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, WINDOW, KV_RANGE, Q_OFFSET, ROW_BOUNDS)),
    ], [4, 4], [240, 24])
