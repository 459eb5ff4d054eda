"""The backward's dK/dV kernel for Hopper, in Gluon and warp-specialized: two warpgroups take the
scores of alternate query tiles, a third takes the gradients of all.

A program holds a key block (``BLOCK_N`` keys of one kv head) and walks the query tiles of the ``G``
query heads that read it: the masked ones (a row of the tile misses some key of the block: across
the causal diagonal, a window's edge, a document's ends, the key range) first, then the interior
ones that every pair sees, each head-major; tiles no pair sees are not visited. Triton waits for
each score-shaped product right after issuing it and one warpgroup holding both the dK/dV
accumulators and the score tiles spills or idles, so the work is split by role:

- score warpgroup ``C`` (of two; tiles ``C, C + 2, ..``) issues ``S^T = K Q^T`` and ``dP^T = V dO^T``,
  takes ``P^T`` while ``dP^T`` runs, then ``dS^T``, and hands both over through its shared buffer;
- the gradient warpgroup issues ``dV += P^T dO`` and ``dK += dS^T Q`` of every tile in turn, all
  operands in shared memory, and holds the two ``[BLOCK_N, D]`` float32 accumulators (with
  ``DS_OUT`` it also copies each ``dS^T`` to global memory by TMA, for the dQ kernel);
- one producer warp loads K and V once, then streams the Q and dO tiles by TMA through ``STAGES``
  buffers, each released when its score warpgroup and the gradient warpgroup have arrived on it.

Tile ``t`` lands in buffer ``t % STAGES`` and signals barrier ``t % (2 * STAGES)``, two barriers per
buffer: a wait names a barrier's phase by its parity alone, so a waiter must see every phase of the
barriers it waits on (one two phases behind passes at once). A score warpgroup takes every other
tile; with one barrier per buffer and an odd ``STAGES`` it would see every other phase only, and
its products could read a buffer still holding (or taking) the tile before (seen as dK/dV that
differed between calls). With ``2 * STAGES`` barriers each holds the tiles of one warpgroup.

The two score warpgroups run out of step, so one's exponentials run beside the other's products and
the gradient products. Masked tiles run in turn: ``S^T`` reads Q as it is, then the score warpgroup
zeroes every NaN/Inf of the Q and dO tiles in place before ``dP^T`` and the hand-over, so hidden
pairs give exact zeros (never ``0 * NaN``). Visibility is ``attention_bwd``'s rule (``causal, diag``,
a window edge ``lo``, ``q_offset``, ``kv_range``, document rows) and the scores may be softcapped;
plain masks take the same math, order of sums and guard as the Triton kernel of
``attention_bwd_plain``. bfloat16 ``(B, H, S, D)`` operands that TMA can address.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..._triton.algebra import LOG2E
from .bwd import (_batch_bounds, _doc_rows, _finite_or_zero_smem, _mma_layout, _probs, _program_order, _row_stats,
                  _score_grad, _seen, _store_rows, _thread_barrier, _tma_load, _tma_store)


@gluon.jit
def _tile_of(t, tiles, BLOCK_M: gl.constexpr):
    """``(query head within the group, first query row)`` of tile ``t`` of a program's walk
    ``tiles``: the ``Tm`` masked ones (``nmk`` per head: ``n_pre`` blocks from ``first``, then the
    rest after the interior ones), then the interior ones (``n_in`` per head after the first
    ``n_pre``), each head-major."""
    b, kvh, G, first, n_pre, n_in, nmk, Tm, T = tiles
    u = t - Tm
    if t < Tm:
        gi = t // nmk
        j = t - gi * nmk
        blk = first + j + gl.where(j < n_pre, 0, n_in)
    else:
        gi = u // gl.maximum(n_in, 1)
        blk = first + n_pre + u - gi * n_in
    return gi, blk * BLOCK_M


@gluon.jit
def _wait_tile(t_full, t, STAGES: gl.constexpr):
    """Wait until tile ``t``'s Q and dO have landed in buffer ``t % STAGES`` (its barrier:
    ``t % (2 * STAGES)``, which the waiting warpgroups see every phase of)."""
    mbarrier.wait(t_full.index(t % (2 * STAGES)), (t // (2 * STAGES)) & 1)


@gluon.jit
def _tile_stats(stats, t, tiles, layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """:func:`_row_stats` of tile ``t``, clamped to ``[0, T)`` (nothing is read when ``T == 0``)."""
    LSE, DELTA, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, Sq = stats
    b, kvh, G, first, n_pre, n_in, nmk, Tm, T = tiles
    gi, m0 = _tile_of(gl.maximum(gl.minimum(t, T - 1), 0), tiles, BLOCK_M)
    h = kvh * G + gi
    return _row_stats(LSE, DELTA, b * s_lb + h * s_lh, b * s_eb + h * s_eh, m0, Sq, s_ls, s_es, layout, BLOCK_M)


@gluon.jit
def _kv_walk(RB, pid_n, n0, n1, Sq, dg, lw, kv_lo, kv_hi, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr,
             HAS_LO: gl.constexpr, HAS_KV: gl.constexpr, HAS_ROWS: gl.constexpr):
    """Query blocks of key block ``[n0, n1)``: ``(first, end, ia, ib)``, blocks ``[first, end)`` hold
    a row that sees one of its keys, ``[ia, ib)`` only rows that see all of them
    (``attention_bwd._kv_rows``; keys past ``Sk`` need no mask here: their rows are not stored)."""
    r_lo = 0
    r_hi = Sq
    f_lo = 0
    f_hi = Sq
    if CAUSAL:
        r_lo = gl.maximum(r_lo, n0 - dg)
        f_lo = gl.maximum(f_lo, n1 - 1 - dg)
    if HAS_LO:
        r_hi = gl.minimum(r_hi, n1 - lw)
        f_hi = gl.minimum(f_hi, n0 - lw + 1)
    if HAS_ROWS:
        r_lo = gl.maximum(r_lo, gl.load(RB + pid_n * 4))
        r_hi = gl.minimum(r_hi, gl.load(RB + pid_n * 4 + 1))
        f_lo = gl.maximum(f_lo, gl.load(RB + pid_n * 4 + 2))
        f_hi = gl.minimum(f_hi, gl.load(RB + pid_n * 4 + 3))
    if HAS_KV:
        r_hi = gl.where((kv_hi <= n0) | (kv_lo >= n1) | (kv_lo >= kv_hi), 0, gl.maximum(r_hi, 0))
        f_hi = gl.where((n0 < kv_lo) | (n1 > kv_hi), 0, f_hi)  # some keys out of range: every tile masked
    first = gl.maximum(gl.minimum(r_lo, r_hi), 0) // BLOCK_M
    end = gl.where(r_lo >= r_hi, first, gl.maximum(gl.cdiv(r_hi, BLOCK_M), first))  # no row sees a key: none
    ia = gl.minimum(gl.maximum(gl.cdiv(f_lo, BLOCK_M), first), end)
    ib = gl.where(f_hi >= Sq, end, gl.maximum(f_hi, 0) // BLOCK_M)  # rows past Sq have p = 0
    ib = gl.minimum(gl.maximum(ib, ia), end)
    return first, end, ia, ib


@gluon.jit
def _key_block(RB, KVR, QOFF, s_kvb, s_kvc, s_off, HKV, G, Sq, Sk, diag, lo, qk_scale, scale, cap2, GH,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, HAS_LO: gl.constexpr,
               HAS_KV: gl.constexpr, HAS_OFF: gl.constexpr, HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr):
    """This program's key block (grid ``(key blocks, B * HKV)`` in the order of ``GH``) and the tiles it
    walks: ``(b, kv head, n0, kv_lo, kv_hi, dg, lw, cs, tiles)`` (``cs`` the scores' scale: ``qk_scale``,
    or ``scale / softcap`` in log2 units with a softcap). ``tiles = (b, kv head, G, first, n_pre, n_in,
    nmk, Tm, T)``: the ``Tm`` masked tiles (query blocks ``[first, ia)`` and ``[ib, end)`` of each of
    the ``G`` query heads), then the interior ones (``[ia, ib)``), each head-major (:func:`_tile_of`)."""
    pid_n, pid_bh = _program_order(GH)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    n0 = pid_n * BLOCK_N
    kv_lo, kv_hi, dg, lw = _batch_bounds(KVR, QOFF, s_kvb, s_kvc, s_off, b, Sk, diag, lo, HAS_KV, HAS_OFF)
    first, end, ia, ib = _kv_walk(RB, pid_n, n0, n0 + BLOCK_N, Sq, dg, lw, kv_lo, kv_hi, BLOCK_M, CAUSAL, HAS_LO,
                                  HAS_KV, HAS_ROWS)
    n_pre = ia - first
    nmk = n_pre + end - ib
    n_in = ib - ia
    Tm = G * nmk
    cs = qk_scale
    if SOFTCAP:
        cs = scale / cap2 * LOG2E  # s / c
    return b, kvh, n0, kv_lo, kv_hi, dg, lw, cs, (b, kvh, G, first, n_pre, n_in, nmk, Tm, Tm + G * n_in)


@gluon.jit
def _producer(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
              STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr):
    """K and V once, then tiles ``[0, T)``' Q and dO, each into the ring's next buffer once its score
    warpgroup and the gradient warpgroup have released it (the constexprs but the tile's unused:
    the partitions share one signature)."""
    (q_desc, do_desc, k_desc, v_desc, q_ring, do_ring, k_smem, v_smem, kv_bar, t_full, t_empty, n0, tiles) = p
    b, kvh, G, first, n_pre, n_in, nmk, Tm, T = tiles
    mbarrier.expect(kv_bar, 2 * BLOCK_N * D * 2)
    _tma_load(k_desc, [b, kvh, n0, 0], kv_bar, k_smem)
    _tma_load(v_desc, [b, kvh, n0, 0], kv_bar, v_smem)
    for t in range(T):
        s = t % STAGES
        mbarrier.wait(t_empty.index(s), ((t // STAGES) & 1) ^ 1)  # a fresh barrier counts as released
        gi, m0 = _tile_of(t, tiles, BLOCK_M)
        full = t_full.index(t % (2 * STAGES))
        mbarrier.expect(full, 2 * BLOCK_M * D * 2)
        _tma_load(q_desc, [b, kvh * G + gi, m0, 0], full, q_ring.index(s))
        _tma_load(do_desc, [b, kvh * G + gi, m0, 0], full, do_ring.index(s))


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
def _sink_keys(pdp_t, lse2, sink):
    """``bwd_common._sink_keys``: ``[keys]``, ``sum_rows exp(sink - lse) * pdp_t`` of a ``[keys, rows]``
    tile ``pdp_t`` of ``P * dP`` (0 at hidden pairs) from the rows' ``lse2 = lse * log2(e)`` (``+inf``:
    ``p_sink = 0``)."""
    p_sink = gl.exp2(sink * LOG2E - lse2)
    return gl.sum(pdp_t * p_sink[None, :], 1)


@gluon.jit
def _sink_flush(ptrs, acc, gi, nxt):
    """Store the per-key sums ``acc`` of head ``gi`` (within the group) at ``ptrs`` where the
    warpgroup's next tile in this part of its walk is of another head ``nxt`` (-1: none), and restart
    them from 0 there; else keep them."""
    last = nxt != gi
    gl.store(ptrs, acc, mask=last)
    return gl.where(last, 0.0, acc)


@gluon.jit
def _scores(p, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
            CAUSAL: gl.constexpr, STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_ROWS: gl.constexpr,
            SOFTCAP: gl.constexpr, SINK: gl.constexpr):
    """Score warpgroup ``C`` of two (4 warps): ``P^T`` and ``dS^T`` of tiles ``C, C + 2, ..``, the
    masked ones first, guarded, then the interior ones with ``dP^T`` running while ``P^T`` is taken.
    Each hands over through buffer ``C``; the two run out of step, one's products beside the other's
    exponentials. ``SINK``: each query head's ``sum_rows p_sink P dP`` per key over this warpgroup's
    masked tiles, then over its interior ones, go to parts ``2 C`` and ``2 C + 1`` of the sinks'
    buffer (``sk``: ``(SNK, PDP, s_wp, s_wh)``, both pointers at query head ``kvh * G``, the buffer's
    at the program's batch element)."""
    (k_smem, v_smem, q_ring, do_ring, p_ring, ds_ring, kv_bar, t_full, t_empty, h_full, h_empty, stats, tiles,
     ROWS, s_r, n0, dg, lw, kv_lo, kv_hi, cs, cap2, sk) = p
    Sq = stats[8]
    Tm = tiles[7]
    T = tiles[8]
    NW: gl.constexpr = 4
    # S^T, dP^T, P^T, dS^T: [BLOCK_N keys, BLOCK_M queries]
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, NW)
    q_cols: gl.constexpr = gl.SliceLayout(0, s_layout)  # [BLOCK_M]
    k_rows: gl.constexpr = gl.SliceLayout(1, s_layout)  # [BLOCK_N]
    kj = n0 + gl.arange(0, BLOCK_N, layout=k_rows)
    zeros_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    lse2, delta = _tile_stats(stats, C, tiles, q_cols, BLOCK_M)
    mbarrier.wait(kv_bar, 0)
    k_t = k_smem.reshape([BLOCK_N, D])
    v_t = v_smem.reshape([BLOCK_N, D])
    if SINK:
        acc = gl.zeros([BLOCK_N], gl.float32, k_rows)
        pdp = sk[1] + 2 * C * sk[2] + kj  # this warpgroup's part of its masked tiles, per key
        nmk = tiles[6]
    for t in range(C, Tm, 2):
        s = t % STAGES
        q_t = q_ring.index(s).reshape([BLOCK_M, D])
        do_t = do_ring.index(s).reshape([BLOCK_M, D])
        _wait_tile(t_full, t, STAGES)
        qk_t = warpgroup_mma(k_t, q_t.permute((1, 0)), zeros_s, use_acc=False)
        _finite_or_zero_smem(q_t, BLOCK_M, D, NW)
        _finite_or_zero_smem(do_t, BLOCK_M, D, NW)
        fence_async_shared()
        _thread_barrier()
        dp_t = warpgroup_mma(v_t, do_t.permute((1, 0)), zeros_s, use_acc=False)
        mbarrier.arrive(t_empty.index(s), count=1)
        gi, m0 = _tile_of(t, tiles, BLOCK_M)
        qi = m0 + gl.arange(0, BLOCK_M, layout=q_cols)
        rlo, rhi = _doc_rows(ROWS, s_r, qi, Sq, HAS_ROWS)
        seen = _seen(kj[:, None], qi[None, :], rlo[None, :], rhi[None, :], dg, lw, kv_lo, kv_hi, CAUSAL, HAS_LO,
                     HAS_ROWS)
        p_t, c_t = _probs(qk_t, lse2[None, :], cs, cap2, SOFTCAP)
        p_t = gl.where(seen, p_t, 0.0)
        if SINK:  # (dO is guarded: hidden pairs give 0)
            acc = _sink_flush(pdp + gi * sk[3], acc + _sink_keys(p_t * dp_t, lse2, gl.load(sk[0] + gi)), gi,
                              gl.where(t + 2 < Tm, (t + 2) // nmk, -1))
        _hand_over(p_ring, ds_ring, h_full, h_empty, t, p_t,
                   gl.where(seen, _score_grad(p_t, c_t, dp_t, delta[None, :], SOFTCAP), 0.0))
        lse2, delta = _tile_stats(stats, t + 2, tiles, q_cols, BLOCK_M)
    t0 = Tm + (Tm + C) % 2  # this warpgroup's first interior tile
    lse2, delta = _tile_stats(stats, t0, tiles, q_cols, BLOCK_M)
    for t in range(t0, T, 2):
        qk_t, dp_t = _issue_scores(k_t, v_t, q_ring, do_ring, t_full, t, zeros_s, BLOCK_M, D, STAGES)
        qk_t = warpgroup_mma_wait(1, deps=(qk_t, ))  # dP^T runs on while P^T is taken
        p_t, c_t = _probs(qk_t, lse2[None, :], cs, cap2, SOFTCAP)
        dp_t = warpgroup_mma_wait(0, deps=(dp_t, ))
        mbarrier.arrive(t_empty.index(t % STAGES), count=1)
        if SINK:
            n_in = tiles[5]
            gi = (t - Tm) // n_in
            acc = _sink_flush(pdp + sk[2] + gi * sk[3], acc + _sink_keys(p_t * dp_t, lse2, gl.load(sk[0] + gi)),
                              gi, gl.where(t + 2 < T, (t + 2 - Tm) // n_in, -1))
        _hand_over(p_ring, ds_ring, h_full, h_empty, t, p_t, _score_grad(p_t, c_t, dp_t, delta[None, :], SOFTCAP))
        lse2, delta = _tile_stats(stats, t + 2, tiles, q_cols, BLOCK_M)


@gluon.jit
def _issue_scores(k_t, v_t, q_ring, do_ring, t_full, t, zeros_s, BLOCK_M: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr):
    """Issue tile ``t``'s ``S^T = K Q^T`` and ``dP^T = V dO^T`` (``[BLOCK_N, BLOCK_M]``, asynchronous)
    once its Q and dO have landed."""
    s = t % STAGES
    _wait_tile(t_full, t, STAGES)
    qk_t = warpgroup_mma(k_t, q_ring.index(s).reshape([BLOCK_M, D]).permute((1, 0)), zeros_s, use_acc=False,
                         is_async=True)
    dp_t = warpgroup_mma(v_t, do_ring.index(s).reshape([BLOCK_M, D]).permute((1, 0)), zeros_s, use_acc=False,
                         is_async=True)
    return qk_t, dp_t


@gluon.jit
def _scores0(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
             STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr,
             SINK: gl.constexpr):
    """The first score warpgroup (the default partition: the kernel's own warps), even tiles."""
    _scores(p, 0, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP, SINK)


@gluon.jit
def _scores1(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
             STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr,
             SINK: gl.constexpr):
    """The second score warpgroup (a worker of 4 warps), odd tiles."""
    _scores(p, 1, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP, SINK)


@gluon.jit
def _grads(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
           STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr,
           DS_OUT: gl.constexpr):
    """The gradient warpgroup (a worker of 4 warps): ``dV += P^T dO`` and ``dK += dS^T Q`` of every
    tile, its buffers released once both are done; then the store. ``DS_OUT``: each tile's ``dS^T``
    also goes by TMA from its hand-over buffer to ``ds_desc`` (rows ``((b, h) * NKB + key block) *
    BLOCK_N``, columns the tile's query rows less ``ds_col0``; ``ds_row0``: query head ``kvh * G``'s
    row of this key block), for the dQ kernel to read."""
    (q_ring, do_ring, p_ring, ds_ring, t_full, t_empty, h_full, h_empty, T, GK, GV, s_kgb, s_kgh, s_kgs, s_vgb,
     s_vgh, s_vgs, b, kvh, n0, Sk, scale, tiles, ds_desc, NKB, ds_row0, ds_col0) = p
    o_layout: gl.constexpr = _mma_layout(D, 4)  # dK, dV: [BLOCK_N, D]
    dk = gl.zeros([BLOCK_N, D], gl.float32, o_layout)
    dv = gl.zeros([BLOCK_N, D], gl.float32, o_layout)
    for t in range(T):
        s = t % STAGES
        u = t % 2
        _wait_tile(t_full, t, STAGES)
        mbarrier.wait(h_full.index(u), (t // 2) & 1)
        dv = warpgroup_mma(p_ring.index(u), do_ring.index(s).reshape([BLOCK_M, D]), dv, is_async=True)
        dk = warpgroup_mma(ds_ring.index(u), q_ring.index(s).reshape([BLOCK_M, D]), dk, is_async=True)
        if DS_OUT:
            gi, m0 = _tile_of(t, tiles, BLOCK_M)
            _tma_store(ds_desc, [ds_row0 + gi * NKB * BLOCK_N, m0 - ds_col0], ds_ring.index(u))
        # released as soon as done (the score warpgroups' products keep the tensor cores busy meanwhile)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        if DS_OUT:
            tma.store_wait(0)  # (the copy has read the buffer)
        mbarrier.arrive(t_empty.index(s), count=1)
        mbarrier.arrive(h_empty.index(u), count=1)
    _store_rows(GK, dk * scale, b, kvh, n0, Sk, s_kgb, s_kgh, s_kgs, o_layout, BLOCK_N, D)
    _store_rows(GV, dv, b, kvh, n0, Sk, s_vgb, s_vgh, s_vgs, o_layout, BLOCK_N, D)


@gluon.jit(do_not_specialize=["Sq", "Sk", "diag", "lo", "GH", "s_lb", "s_lh", "s_eb", "s_eh"])
def _attn_bwd_kv_ws(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, GK, GV, KVR, QOFF, ROWS, RB, ds_desc,
                    s_lb, s_lh, s_ls, s_eb, s_eh, s_es, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh, s_vgs,
                    s_kvb, s_kvc, s_off, s_r,
                    HKV, G, Sq, Sk, diag, lo, qk_scale, scale, cap2, GH, SNK, PDP, s_wp, s_wb, s_wh,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                    STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_KV: gl.constexpr, HAS_OFF: gl.constexpr,
                    HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr, DS_OUT: gl.constexpr,
                    DS_ALIGN: gl.constexpr, num_warps: gl.constexpr, SINK: gl.constexpr = False):
    """Grid ``(key blocks, B * HKV)`` in the order of ``GH`` (``attention._program_order``);
    ``num_warps = 4`` (the first score warpgroup), plus the second's 4, the gradient warpgroup's 4
    and the producer's 1. ``q_desc`` and ``do_desc`` read ``BLOCK_M`` rows, ``k_desc`` and
    ``v_desc`` ``BLOCK_N``. The mask's tensors and strides (``KVR, QOFF, ROWS``, ``RB`` its
    :func:`attention_bwd.row_blocks`) are those of ``attention_bwd._attn_bwd_kv_kernel``, read where
    their flag is set; ``cap2 = softcap * log2(e)``. ``DS_OUT``: every tile's ``dS^T`` (bfloat16,
    ``[BLOCK_N, BLOCK_M]``) is also written through ``ds_desc``, a 2-D ``(B * H * key blocks * BLOCK_N,
    query columns)`` descriptor (:func:`_grads`), a causal key block's query rows from its first in
    the band (``n0 - diag - off``) rounded down to ``BLOCK_M``, then to ``DS_ALIGN`` (the dQ kernel's
    query tile; that kernel finds it likewise); otherwise ``ds_desc`` is not read. ``SINK``: the
    score warpgroups store each query head's ``sum_rows p_sink P dP`` per key (:func:`_scores`) into
    ``PDP (4, B, H, key blocks * BLOCK_N)`` (strides ``s_wp, s_wb, s_wh``), the sinks ``SNK (H,)``
    float32; without it ``SNK, PDP`` and their strides are None (constexprs)."""
    b, kvh, n0, kv_lo, kv_hi, dg, lw, cs, tiles = _key_block(
        RB, KVR, QOFF, s_kvb, s_kvc, s_off, HKV, G, Sq, Sk, diag, lo, qk_scale, scale, cap2, GH, BLOCK_M, BLOCK_N,
        CAUSAL, HAS_LO, HAS_KV, HAS_OFF, HAS_ROWS, SOFTCAP)
    Tm = tiles[7]
    T = tiles[8]
    dtype: gl.constexpr = q_desc.dtype
    ds_col0 = 0  # DS_OUT: this key block's first row in the causal band, rounded down to DS_ALIGN
    if CAUSAL:
        ds_col0 = gl.maximum(n0 - dg, 0) // BLOCK_M * BLOCK_M // DS_ALIGN * DS_ALIGN

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
    t_full = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    t_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    h_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    h_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(t_full.index(i), count=1)
        mbarrier.init(t_full.index(STAGES + i), count=1)
        mbarrier.init(t_empty.index(i), count=2)  # its score warpgroup and the gradient one
    for i in gl.static_range(2):
        mbarrier.init(h_full.index(i), count=1)
        mbarrier.init(h_empty.index(i), count=1)
    # each partition's operands: buffers, barriers, row statistics, the tile walk, visibility and scores,
    # the gradients
    stats = (LSE, DELTA, s_lb, s_lh, s_ls, s_eb, s_eh, s_es, Sq)
    sk = ()  # the sinks' operands, only where read
    if SINK:
        sk = (SNK + kvh * G, PDP + b * s_wb + kvh * G * s_wh, s_wp, s_wh)
    ps = (k_smem, v_smem, q_ring, do_ring, p_ring, ds_ring, kv_bar, t_full, t_empty, h_full, h_empty, stats, tiles,
          ROWS, s_r, n0, dg, lw, kv_lo, kv_hi, cs, cap2, sk)
    pg = (q_ring, do_ring, p_ring, ds_ring, t_full, t_empty, h_full, h_empty, T, GK, GV, s_kgb, s_kgh, s_kgs, s_vgb,
          s_vgh, s_vgs, b, kvh, n0, Sk, scale, tiles, ds_desc, gl.num_programs(0),
          (b * HKV + kvh) * G * gl.num_programs(0) * BLOCK_N + n0, ds_col0)
    pp = (q_desc, do_desc, k_desc, v_desc, q_ring, do_ring, k_smem, v_smem, kv_bar, t_full, t_empty, n0, tiles)
    # workers: the second score warpgroup and the gradient one (4 warps each) and the producer (1),
    # given the registers asked for each (setmaxnreg) out of the launch's maxnreg per thread; the
    # first score warpgroup keeps the rest.
    gl.warp_specialize([
        (_scores0, (ps, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP, SINK)),
        (_scores1, (ps, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP, SINK)),
        (_grads, (pg, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP, DS_OUT)),
        (_producer, (pp, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP)),
    ], [4, 4, 1], [160, 160, 24])
