"""The attention backward in one Gluon kernel for Hopper: all five products of a tile pair in one
program, dQ reduce-added in float32 (``configs.ATTN_BWD_FUSED``).

A program holds a key block of ``BLOCK_N = 128`` keys of one kv head and walks the ``BLOCK_M = 64``
query tiles of the ``G`` query heads that read it (``bwd_kv._key_block``: the masked tiles first, then
the interior ones, each head-major), so dK and dV sum over the group in registers. Three partitions:

- two MMA warpgroups (240 registers each): warpgroup ``W`` owns keys ``n0 + 64 W ..`` and their dK,
  dV (``[64, D]`` float32 each), and per tile issues ``S^T = K_W Q^T`` and ``dP^T = V_W dO^T``
  (accumulated onto ``-delta``), takes ``P^T`` while ``dP^T`` runs, then ``dS^T``; it writes ``dS^T``
  into its half of the tile's stage of a two-stage ``[BLOCK_N, BLOCK_M]`` ring and issues
  ``dV += P^T dO`` and ``dK += dS^T Q`` with ``P^T``, ``dS^T`` as register operands. Once both
  halves of the stage are written it issues its half of the tile's dQ, ``dS K[:, 64 W ..]``
  (``[64, D / 2]``: the whole key block, half of the columns), and adds it through its staging
  buffer into the float32 ``dQ`` by a TMA reduction;
- one producer warp (24 registers) loads K and V once, then each tile's Q, dO and the rows'
  ``(lse * log2(e), delta)`` (with documents also their bounds) by TMA through two stages, and writes
  the tile's (batch element, query head, first row) into a small table beside them (the MMA
  warpgroups hold no tile walk).

Barriers: ``q_full[s]`` (the tile's Q, dO and statistics landed), ``q_empty[s]`` (both warpgroups'
products read them: count 2), ``ds_full[s]`` (both halves of the stage written: count 2), ``ds_empty[s]``
(both dQ products read it: count 2); both warpgroups take every tile, so each sees every phase.

Masked tiles (a pair some row does not see) keep NaN/Inf of hidden pairs out as the pair's kernels do,
and each warpgroup takes such a tile as the pair's dK/dV kernel takes it for the same 64 keys
(``bwd_kv._kv_walk`` over them): ``S^T`` reads Q as it is; a warpgroup whose keys every row of the
tile sees then takes ``dP^T``, ``dV`` and ``dK`` from Q and dO as they are; then both meet (``meet``,
count 2), each zeroes the NaN/Inf of its half of the Q and dO rows in place, and they meet again; a
warpgroup with a hidden pair takes ``dP^T``, ``dV`` and ``dK`` after that, from the guarded rows. The
dQ product reads a copy of its columns of K with NaN/Inf zeroed, which each warpgroup writes into its
staging buffer (16 KB either way) before the tile. Keys past ``Sk`` and rows past ``Sq`` read zeros
(TMA) and their rows are not stored. Visibility is ``attention_bwd``'s rule (``causal, diag``, a window
edge ``lo``, ``q_offset``, ``kv_range``, document rows), the scores optionally softcapped.

dQ depends on the order of the reductions: never under deterministic algorithms (the pair runs).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..._triton import configs
from ..._triton.algebra import LOG2E
from ..._triton.launch import Launcher, auto_key
from ..bwd_common import _mask_args, row_blocks
from ..decode import head_group
from .bwd import _DEFAULTS, _mma_layout, _probs, _seen, _store_rows, _thread_barrier, _tma_load, descriptor
from .bwd_kv import _key_block, _kv_walk, _tile_of

if hasattr(tma, "async_atomic_add"):
    _tma_add = tma.async_atomic_add
else:  # (older releases: the builder's reduction, which the Gluon function wraps in newer ones)
    @builtin
    def _tma_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared tile ``src`` into ``tensor_desc`` at ``coord`` by a TMA reduction."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        from triton._C.libtriton import ir
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


@gluon.jit
def _producer(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
              STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr):
    """K and V once, then every tile's Q and dO into the ring's next stage once both warpgroups have
    released it (the constexprs but the tile's unused: the partitions share one signature)."""
    (q_desc, do_desc, k_desc, v_desc, st_desc, q_ring, do_ring, st_ring, k_smem, v_smem, kv_bar, q_full, q_empty,
     info, n0, tiles) = p
    b, kvh, G, first, n_pre, n_in, nmk, Tm, T = tiles
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    mbarrier.expect(kv_bar, 2 * BLOCK_N * D * 2)
    _tma_load(k_desc, [b, kvh, n0, 0], kv_bar, k_smem)
    _tma_load(v_desc, [b, kvh, n0, 0], kv_bar, v_smem)
    for t in range(T):
        s = t % STAGES
        mbarrier.wait(q_empty.index(s), ((t // STAGES) & 1) ^ 1)  # a fresh barrier counts as released
        gi, m0 = _tile_of(t, tiles, BLOCK_M)
        h = kvh * G + gi
        # the tile's (batch element, query head, first row), read before the release
        info.index(s).slice(0, 1).store(gl.full([1], b, gl.int32, one))
        info.index(s).slice(1, 1).store(gl.full([1], h, gl.int32, one))
        info.index(s).slice(2, 1).store(gl.full([1], m0, gl.int32, one))
        _thread_barrier()  # written before the arrival that the TMA loads complete
        full = q_full.index(s)
        mbarrier.expect(full, 2 * BLOCK_M * D * 2 + st_desc.block_type.shape[2] * BLOCK_M * 4)
        _tma_load(q_desc, [b, h, m0, 0], full, q_ring.index(s))
        _tma_load(do_desc, [b, h, m0, 0], full, do_ring.index(s))
        _tma_load(st_desc, [b, h, 0, m0], full, st_ring.index(s))


@builtin
def _reinterpret(buf, dtype, shape, layout, _semantic=None):
    """``buf`` (a shared buffer) viewed as a ``shape`` tile of ``dtype`` in ``layout`` (the method's
    name changed across the Triton versions this package takes)."""
    fn = buf.reinterpret if hasattr(buf, "reinterpret") else buf._reinterpret
    return fn(dtype, shape, layout, _semantic=_semantic)


@gluon.jit
def _field(slot, i: gl.constexpr):
    """Field ``i`` of a tile's slot of the table the producer writes (4 warps read it)."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(slot.slice(i, 1).load(one), 0)


@gluon.jit
def _meet(meet, k):
    """Both MMA warpgroups' ``k``-th meeting (from 0): each arrives once its warps are here, then waits
    for the other."""
    _thread_barrier()
    mbarrier.arrive(meet, count=1)
    mbarrier.wait(meet, k & 1)


@gluon.jit
def _finite_copy(src, dst, ROWS: gl.constexpr, COLS: gl.constexpr, CH: gl.constexpr):
    """``dst = src`` (``[ROWS, COLS]`` shared tiles, possibly the same) with every NaN/Inf replaced by
    0, ``CH`` rows at a time (4 warps)."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for c in gl.static_range(ROWS // CH):
        x = src.slice(c * CH, CH).load(blocked)
        dst.slice(c * CH, CH).store(gl.where(gl.abs(x.to(gl.float32)) < float("inf"), x, gl.zeros_like(x)))


@gluon.jit
def _guard(q_t, do_t, meet, t, W: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """Masked tile ``t``'s Q and dO with every NaN/Inf replaced by 0 in place, half of the rows by each
    MMA warpgroup, between their two meetings of the tile: once neither reads them as they are any
    more, and before either reads them guarded."""
    _meet(meet, 2 * t)
    q_h = q_t.slice(W * (BLOCK_M // 2), BLOCK_M // 2)
    do_h = do_t.slice(W * (BLOCK_M // 2), BLOCK_M // 2)
    _finite_copy(q_h, q_h, BLOCK_M // 2, D, 16)
    _finite_copy(do_h, do_h, BLOCK_M // 2, D, 16)
    fence_async_shared()
    _meet(meet, 2 * t + 1)


@gluon.jit
def _score_grads(qk_t, dp_t, lse2, seen, cs, cap2, dtype: gl.constexpr, MASK: gl.constexpr,
                 SOFTCAP: gl.constexpr):
    """``(P^T, dS^T)`` in ``dtype`` from the completed ``S^T`` and ``dP^T - delta``; ``MASK``: the pairs
    not ``seen`` give exact zeros, whatever the products hold there."""
    p_t, c_t = _probs(qk_t, lse2[None, :], cs, cap2, SOFTCAP)
    if MASK:
        p_t = gl.where(seen, p_t, 0.0)  # (all masked at once: the mask is not held across the tile)
        dp_t = gl.where(seen, dp_t, 0.0)
    if SOFTCAP:  # dS^T = P^T (dP^T - delta) (1 - tanh^2)
        g_t = p_t * (1.0 - c_t * c_t)
        if MASK:
            g_t = gl.where(seen, g_t, 0.0)
        ds_h = (g_t * dp_t).to(dtype)
    else:
        ds_h = (p_t * dp_t).to(dtype)
    return p_t.to(dtype), ds_h


@gluon.jit
def _kv_products(dk, dv, p_h, ds_h, q_t, do_t, a_layout: gl.constexpr):
    """``dV += P^T dO`` and ``dK += dS^T Q`` (``P^T``, ``dS^T`` from registers), completed."""
    dv = warpgroup_mma(gl.convert_layout(p_h, a_layout), do_t, dv, is_async=True)
    dk = warpgroup_mma(gl.convert_layout(ds_h, a_layout), q_t, dk, is_async=True)
    return warpgroup_mma_wait(0, deps=(dk, dv))


@gluon.jit
def _tile(dk, dv, t, p, W: gl.constexpr, MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          D: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr, HAS_LO: gl.constexpr,
          HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr):
    """Tile ``t`` of warpgroup ``W``: ``(dk, dv)`` after its products, its dQ half reduce-added.
    ``MASKED`` (a tile masked for the key block): dQ reads the guarded copy of K's columns that this
    warpgroup writes into its staging buffer, and each warpgroup takes the tile as the pair's dK/dV
    kernel takes it for its 64 keys: where every pair of them is seen, all four products read Q and
    dO as they are, before the guard; else ``dP^T``, ``dV`` and ``dK`` read them guarded and each pair
    is checked against the visibility rule."""
    (k_w, v_w, k_q, k_g, q_ring, do_ring, st_ring, ds_ring, stage_w, q_full, q_empty, ds_full, ds_empty, meet,
     dq_desc, info, cols, prog, vis, zeros_s, zeros_q) = p
    n0, dg, lw, kv_lo, kv_hi, cs, cap2, scale = vis
    HALF: gl.constexpr = BLOCK_N // 2
    DH: gl.constexpr = D // 2
    dtype: gl.constexpr = q_ring.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, 4)  # S^T, dP^T, P^T, dS^T: [HALF keys, BLOCK_M queries]
    o_layout: gl.constexpr = _mma_layout(D, 4)  # dK, dV: [HALF, D]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_cols: gl.constexpr = gl.SliceLayout(0, s_layout)  # [BLOCK_M]
    k_rows: gl.constexpr = gl.SliceLayout(1, s_layout)  # [HALF]
    s = t % STAGES
    ph = (t // STAGES) & 1
    q_t = q_ring.index(s).reshape([BLOCK_M, D])
    do_t = do_ring.index(s).reshape([BLOCK_M, D])
    mbarrier.wait(q_full.index(s), ph)
    b = _field(info.index(s), 0)
    h = _field(info.index(s), 1)
    m0 = _field(info.index(s), 2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    NST: gl.constexpr = st_ring.shape[3]  # the rows' lse2, delta (then with documents their bounds)
    st = _reinterpret(st_ring.index(s), gl.float32, [NST * BLOCK_M], flat)
    if MASKED:
        qk_t = warpgroup_mma(k_w, q_t.permute((1, 0)), zeros_s, use_acc=False)
        tma.store_wait(0)
        _thread_barrier()  # (the last reduction, which some of its warps issued, has read the staging buffer)
        _finite_copy(k_q, k_g, BLOCK_N, DH, 32)
        lse2 = st.slice(0, BLOCK_M).load(q_cols)
        j = m0 // BLOCK_M
        inner = (j >= _field(prog, 4 + 2 * W)) & (j < _field(prog, 5 + 2 * W))  # an interior tile of these keys
        if not inner:  # hidden pairs give exact zeros, never 0 * NaN
            _guard(q_t, do_t, meet, t, W, BLOCK_M, D)
        dp_t = warpgroup_mma(v_w, do_t.permute((1, 0)), zeros_s - st.slice(BLOCK_M, BLOCK_M).load(q_cols)[None, :])
        kj = n0 + W * HALF + gl.arange(0, HALF, layout=k_rows)
        qi = m0 + cols.load(q_cols)  # (read, not held across tiles: its 16 values per thread would spill)
        rlo = qi
        rhi = qi
        if HAS_ROWS:  # (int32 in the statistics' tile: from shared memory, no pointers held)
            sti = _reinterpret(st_ring.index(s), gl.int32, [NST * BLOCK_M], flat)
            rlo = sti.slice(2 * BLOCK_M, BLOCK_M).load(q_cols)
            rhi = sti.slice(3 * BLOCK_M, BLOCK_M).load(q_cols)
        seen = _seen(kj[:, None], qi[None, :], rlo[None, :], rhi[None, :], dg, lw, kv_lo, kv_hi, CAUSAL, HAS_LO,
                     HAS_ROWS)
        p_h, ds_h = _score_grads(qk_t, dp_t, lse2, seen | inner, cs, cap2, dtype, True, SOFTCAP)
        dk, dv = _kv_products(dk, dv, p_h, ds_h, q_t, do_t, a_layout)
        if inner:  # (the products above read Q and dO as they are)
            _guard(q_t, do_t, meet, t, W, BLOCK_M, D)
    else:
        qk_t = warpgroup_mma(k_w, q_t.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        # dP^T - delta: the product added to -delta
        dp_t = warpgroup_mma(v_w, do_t.permute((1, 0)), zeros_s - st.slice(BLOCK_M, BLOCK_M).load(q_cols)[None, :],
                             is_async=True)
        lse2 = st.slice(0, BLOCK_M).load(q_cols)
        qk_t = warpgroup_mma_wait(1, deps=(qk_t, ))  # dP^T runs on while P^T is taken
        p_t, c_t = _probs(qk_t, lse2[None, :], cs, cap2, SOFTCAP)
        if SOFTCAP:  # P^T (1 - tanh^2), taken now: tanh's values are not held beside dP^T
            g_t = p_t * (1.0 - c_t * c_t)
            p_h = p_t.to(dtype)
        dp_t = warpgroup_mma_wait(0, deps=(dp_t, ))
        if SOFTCAP:
            ds_h = (g_t * dp_t).to(dtype)  # dS^T = P^T (dP^T - delta) (1 - tanh^2)
        else:
            ds_h = (p_t * dp_t).to(dtype)  # dS^T = P^T (dP^T - delta)
            p_h = p_t.to(dtype)
    # this warpgroup's half of the stage, once both dQ products of tile t - STAGES have read it
    ds_s = ds_ring.index(s)
    mbarrier.wait(ds_empty.index(s), ph ^ 1)
    ds_s.slice(W * HALF, HALF).store(ds_h)
    fence_async_shared()
    _thread_barrier()
    mbarrier.arrive(ds_full.index(s), count=1)
    if MASKED:  # (dK and dV done)
        mbarrier.wait(ds_full.index(s), ph)
        dq = warpgroup_mma(ds_s.permute((1, 0)), k_g, zeros_q, use_acc=False)
    else:
        dv = warpgroup_mma(gl.convert_layout(p_h, a_layout), do_t, dv, is_async=True)
        ds_a = gl.convert_layout(ds_h, a_layout)
        mbarrier.wait(ds_full.index(s), ph)
        dq = warpgroup_mma(ds_s.permute((1, 0)), k_q, zeros_q, use_acc=False, is_async=True)
        dk = warpgroup_mma(ds_a, q_t, dk, is_async=True)
        dv, dq = warpgroup_mma_wait(1, deps=(dv, dq))  # dK runs on while dQ is staged
    mbarrier.arrive(ds_empty.index(s), count=1)
    tma.store_wait(0)
    _thread_barrier()
    stage_w.reshape([BLOCK_M, DH]).store(dq * scale)
    fence_async_shared()
    _thread_barrier()
    _tma_add(dq_desc, [b, h, m0, W * DH], stage_w)
    if not MASKED:
        dk = warpgroup_mma_wait(0, deps=(dk, ))
    mbarrier.arrive(q_empty.index(s), count=1)
    return dk, dv


@gluon.jit
def _mma(p, W: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
         STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr):
    """MMA warpgroup ``W`` (of two, 4 warps): keys ``n0 + W * BLOCK_N / 2 ..``' dK and dV over every
    tile, the masked ones first; then their store (dK times the scale)."""
    (k_smem, v_smem, q_ring, do_ring, st_ring, ds_ring, stage, kv_bar, q_full, q_empty, ds_full, ds_empty, meet,
     dq_desc, info, cols, Tm, T, vis, out) = p
    HALF: gl.constexpr = BLOCK_N // 2
    DH: gl.constexpr = D // 2
    dtype: gl.constexpr = q_ring.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, 4)
    o_layout: gl.constexpr = _mma_layout(D, 4)
    g_layout: gl.constexpr = _mma_layout(DH, 4)  # the dQ half: [BLOCK_M, DH]
    kg_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DH], dtype)
    zeros_s = gl.zeros([HALF, BLOCK_M], gl.float32, s_layout)
    zeros_q = gl.zeros([BLOCK_M, DH], gl.float32, g_layout)
    dk = gl.zeros([HALF, D], gl.float32, o_layout)
    dv = gl.zeros([HALF, D], gl.float32, o_layout)
    stage_w = stage.index(W)
    k_all = k_smem.reshape([BLOCK_N, D])
    k_w = k_all.slice(W * HALF, HALF)
    v_w = v_smem.reshape([BLOCK_N, D]).slice(W * HALF, HALF)
    k_q = k_all.slice(W * DH, DH, dim=1)  # [BLOCK_N, DH]: this warpgroup's columns of K, for dQ
    k_g = _reinterpret(stage_w, dtype, [BLOCK_N, DH], kg_layout)  # their guarded copy (masked tiles)
    prog = out[8]
    pt = (k_w, v_w, k_q, k_g, q_ring, do_ring, st_ring, ds_ring, stage_w, q_full, q_empty, ds_full, ds_empty, meet,
          dq_desc, info, cols, prog, vis, zeros_s, zeros_q)
    mbarrier.wait(kv_bar, 0)
    for t in range(Tm):
        dk, dv = _tile(dk, dv, t, pt, W, True, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP)
    for t in range(Tm, T):
        dk, dv = _tile(dk, dv, t, pt, W, False, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP)
    tma.store_wait(0)
    GK, GV, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh, s_vgs, prog = out
    b = _field(prog, 0)  # (read here, not held across the tiles)
    kvh = _field(prog, 1)
    n0 = _field(prog, 2)
    Sk = _field(prog, 3)
    scale = vis[7]
    _store_rows(GK, dk * scale, b, kvh, n0 + W * HALF, Sk, s_kgb, s_kgh, s_kgs, o_layout, HALF, D)
    _store_rows(GV, dv, b, kvh, n0 + W * HALF, Sk, s_vgb, s_vgh, s_vgs, o_layout, HALF, D)


@gluon.jit
def _mma0(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
          STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr):
    """The first MMA warpgroup (the default partition: the kernel's own warps), the block's first keys."""
    _mma(p, 0, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP)


@gluon.jit
def _mma1(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
          STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr):
    """The second MMA warpgroup (a worker of 4 warps), the block's last keys."""
    _mma(p, 1, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP)


@gluon.jit(do_not_specialize=["Sq", "Sk", "diag", "lo", "GH"])
def _attn_bwd_fused(q_desc, do_desc, k_desc, v_desc, dq_desc, st_desc, GK, GV, KVR, QOFF, RB, RB2,
                    s_kgb, s_kgh, s_kgs, s_vgb, s_vgh, s_vgs, s_kvb, s_kvc, s_off,
                    HKV, G, Sq, Sk, diag, lo, qk_scale, scale, cap2, GH,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                    STAGES: gl.constexpr, HAS_LO: gl.constexpr, HAS_KV: gl.constexpr, HAS_OFF: gl.constexpr,
                    HAS_ROWS: gl.constexpr, SOFTCAP: gl.constexpr, num_warps: gl.constexpr):
    """Grid ``(key blocks, B * HKV)`` in the order of ``GH`` (``attention._program_order``);
    ``num_warps = 4`` (the first MMA warpgroup), plus the second's 4 and the producer's 1, launched at
    ``maxnreg`` 168. ``q_desc``, ``do_desc`` read ``[1, 1, BLOCK_M, D]`` tiles, ``k_desc``, ``v_desc``
    ``[1, 1, BLOCK_N, D]``; ``dq_desc`` is the float32 ``(B, H, Sq, D)`` dQ (zeroed) that each tile's
    ``[1, 1, BLOCK_M, D / 2]`` halves are added into, times ``scale``. ``GK``, ``GV``: the gradients'
    pointers (unit last stride). The mask's tensors and strides (``KVR, QOFF``, ``RB`` the documents'
    ``row_blocks`` of ``BLOCK_N`` keys, ``RB2`` of ``BLOCK_N / 2``) are ``bwd_kv._attn_bwd_kv_ws``'s, read
    where their flag is set; a tile's rows' document bounds come with their statistics (``st_desc``,
    :func:`_row_stats`). ``qk_scale`` is the scale times log2(e), ``cap2 = softcap * log2(e)``."""
    b, kvh, n0, kv_lo, kv_hi, dg, lw, cs, tiles = _key_block(
        RB, KVR, QOFF, s_kvb, s_kvc, s_off, HKV, G, Sq, Sk, diag, lo, qk_scale, scale, cap2, GH, BLOCK_M, BLOCK_N,
        CAUSAL, HAS_LO, HAS_KV, HAS_OFF, HAS_ROWS, SOFTCAP)
    Tm = tiles[7]
    T = tiles[8]
    dtype: gl.constexpr = q_desc.dtype

    # Q, dO: [STAGES, 1, 1, BLOCK_M, D]; K, V: [1, 1, BLOCK_N, D]; dS^T: [STAGES, BLOCK_N, BLOCK_M];
    # the dQ halves' staging: [2, 1, 1, BLOCK_M, D / 2] float32, one per MMA warpgroup
    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    st_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + st_desc.block_type.shape, st_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_M], ds_layout)
    stage = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    meet = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    info = gl.allocate_shared_memory(gl.int32, [STAGES, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    cols = gl.allocate_shared_memory(gl.int32, [BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    cols.store(gl.arange(0, BLOCK_M, layout=flat))  # a tile's columns
    # for the stores: (b, kv head, n0, Sk); for the masked tiles: the interior query blocks [ia, ib) of
    # each half of the key block (bwd_kv._kv_walk over its 64 keys, as the pair's dK/dV kernel walks them)
    _, _, ia0, ib0 = _kv_walk(RB2, 2 * (n0 // BLOCK_N), n0, n0 + BLOCK_N // 2, Sq, dg, lw, kv_lo, kv_hi, BLOCK_M,
                              CAUSAL, HAS_LO, HAS_KV, HAS_ROWS)
    _, _, ia1, ib1 = _kv_walk(RB2, 2 * (n0 // BLOCK_N) + 1, n0 + BLOCK_N // 2, n0 + BLOCK_N, Sq, dg, lw, kv_lo,
                              kv_hi, BLOCK_M, CAUSAL, HAS_LO, HAS_KV, HAS_ROWS)
    prog = gl.allocate_shared_memory(gl.int32, [8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    f = gl.arange(0, 8, layout=flat)
    prog.store(gl.where(f == 0, b, gl.where(f == 1, kvh, gl.where(f == 2, n0, gl.where(f == 3, Sk, gl.where(
        f == 4, ia0, gl.where(f == 5, ib0, gl.where(f == 6, ia1, ib1))))))))
    q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(meet, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(ds_full.index(i), count=2)
        mbarrier.init(ds_empty.index(i), count=2)
    vis = (n0, dg, lw, kv_lo, kv_hi, cs, cap2, scale)
    out = (GK, GV, s_kgb, s_kgh, s_kgs, s_vgb, s_vgh, s_vgs, prog)
    pm = (k_smem, v_smem, q_ring, do_ring, st_ring, ds_ring, stage, kv_bar, q_full, q_empty, ds_full, ds_empty, meet,
          dq_desc, info, cols, Tm, T, vis, out)
    pp = (q_desc, do_desc, k_desc, v_desc, st_desc, q_ring, do_ring, st_ring, k_smem, v_smem, kv_bar, q_full, q_empty,
          info, n0, tiles)
    # workers: the second MMA warpgroup (4 warps) and the producer (1), given the registers asked for
    # each (setmaxnreg) out of the launch's maxnreg per thread; the first MMA warpgroup keeps the rest
    gl.warp_specialize([
        (_mma0, (pm, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP)),
        (_mma1, (pm, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP)),
        (_producer, (pp, BLOCK_M, BLOCK_N, D, CAUSAL, STAGES, HAS_LO, HAS_ROWS, SOFTCAP)),
    ], [4, 1], [240, 24])


def stats_descriptor(stats: torch.Tensor, rows: int):
    """The Gluon descriptor of the rows' statistics (:func:`_row_stats`) reading ``[1, 1, F, rows]``
    tiles (a tile's ``F`` fields: ``lse2``, ``delta`` and with documents their bounds)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(_DEFAULTS)
    desc.base, desc.shape, desc.strides = stats, list(stats.shape), list(stats.stride())
    desc.block_shape = [1, 1, stats.shape[2], rows]
    desc.layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)
    return desc


def dq_descriptor(acc: torch.Tensor, rows: int, cols: int):
    """The Gluon descriptor of the float32 ``(B, H, Sq, D)`` dQ accumulator ``acc`` (unit last stride,
    16-byte strides) taking ``[1, 1, rows, cols]`` reductions; a dim of one element gets a valid
    stride."""
    desc = descriptor(acc, rows)
    desc.block_shape = [1, 1, rows, cols]
    desc.layout = gl.NVMMASharedLayout.get_default_for(desc.block_shape, gl.float32)
    return desc


_FUSED = Launcher(_attn_bwd_fused)


def _row_stats(lse: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor | None, bm: int) -> torch.Tensor:
    """``stats (B, H, F, SQP)`` float32: each row's ``lse * log2(e)`` (``+inf`` where ``lse =
    -inf``: its ``p`` is 0), then its ``delta``, and where ``rows`` (document bounds ``(2, Sq)``
    int32) is given the row's two bounds as int32 bits (``F`` 4, else 2); ``SQP`` = ``Sq`` rounded up
    to ``bm`` (padding: ``+inf``, 0, bounds 0: no key seen), so that a tile's fields load without a
    mask."""
    b, h, sq = lse.shape
    sqp = configs.cdiv(sq, bm) * bm
    stats = torch.empty((b, h, 2 if rows is None else 4, sqp), dtype=torch.float32, device=lse.device)
    stats[:, :, 0, sq:] = float("inf")
    stats[:, :, 1, sq:] = 0.0
    if rows is not None:
        bounds = stats.view(torch.int32)[:, :, 2:]
        bounds[..., :sq] = rows
        bounds[..., sq:] = 0
    lse2 = stats[:, :, 0, :sq]
    torch.mul(lse, LOG2E.value, out=lse2)
    lse2.masked_fill_(lse == float("-inf"), float("inf"))
    stats[:, :, 1, :sq].copy_(delta)
    return stats


def attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor, scale: float, causal: bool, diag: int, od: torch.dtype, mask) -> tuple:
    """Gradients ``(dq (B,H,Sq,D), dk (B,Hkv,Sk,D), dv (B,Hkv,Sk,D))`` in ``od``, each with its input's
    strides where dense, by one launch of :func:`_attn_bwd_fused` (dQ reduce-added into a zeroed
    float32 buffer, then cast). The operands are 2-byte, TMA-addressable, non-empty, of the head dim
    of ``configs.ATTN_TILES[("bwd_fused", 2, D)]``; ``lse``, ``delta`` ``(B, H, Sq)`` and ``mask`` as
    ``bwd.attn_bwd`` takes them (``bwd_plain.fused`` has checked)."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bm, bn, warps, stages, maxnreg = configs.ATTN_TILES[("bwd_fused", 2, d)]
    acc = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.empty_like(k, dtype=od), torch.empty_like(v, dtype=od)
    kvr, off, rows, mstrides, flags = _mask_args(mask, q, lse)
    stats = _row_stats(lse, delta, rows if flags["HAS_ROWS"] else None, bm)
    rb, rb2 = (row_blocks(rows, sk, bn), row_blocks(rows, sk, bn // 2)) if flags["HAS_ROWS"] else (lse, lse)
    nkb = configs.cdiv(sk, bn)
    lo = mask.lo if mask.lo is not None else 0
    # (three warpgroups' registers in an SM: one program per SM, as two warpgroups of 4 warps each)
    scalars = (*dk.stride()[:3], *dv.stride()[:3], *mstrides[:3], hkv, h // hkv, sq, sk, diag, lo, scale * LOG2E.value,
               scale, mask.softcap * LOG2E.value, head_group(nkb, b * hkv, q, causal, 8))
    tensors = (dk, dv, kvr, off, rb, rb2)
    ops = (descriptor(q, bm), descriptor(dout, bm), descriptor(k, bn), descriptor(v, bn),
           dq_descriptor(acc, bm, d // 2), stats_descriptor(stats, bm))
    _FUSED((nkb, b * hkv), (auto_key((*tensors, *scalars)), q.dtype), (*ops, *tensors, *scalars),
           dict(BLOCK_M=bm, BLOCK_N=bn, D=d, CAUSAL=causal, STAGES=stages, num_warps=warps, maxnreg=maxnreg, **flags))
    return acc.to(od), dk, dv
