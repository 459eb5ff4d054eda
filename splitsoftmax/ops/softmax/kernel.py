"""Triton kernels of the softmax family: one-pass, online two-pass and split-row.

Every launcher takes a 2-D view ``x (R, N)`` with unit column stride (any row stride) and has the
signature of its torch twin in ``torch.py``. Paths (chosen by ``configs.softmax_plan``):

- one pass: a ``[BLOCK_R, BLOCK_N]`` tile holds whole rows; read once, write once (2N traffic);
- coop: a row too long for one program but short enough for ``C`` co-resident programs: each
  holds one chunk on chip, publishes its partial ``(m, l)``, waits (bounded) for its siblings',
  merges them and normalises the chunk it holds (2N traffic, like one pass);
- two pass: one program per row, online ``(m, l)`` over tiles, then the normalising pass walks the
  tiles backwards so the most recently read ones come from L2 (3N, less what L2 keeps);
- split: few very long rows; ``S`` programs per row each write a partial ``(m, l)``, the
  normalising launch merges a row's partials (``m' = max m_i``, ``l' = sum exp(m_i - m') l_i``,
  reference 0 where ``m' = -inf``) and normalises its chunk, last chunk first.

Statistics are float32; ``exp(d)`` is ``exp2(d * log2(e))`` with ``d = x - m`` formed first (folding
``log2(e)`` into ``x`` and ``m`` separately rounds ``m * log2(e)`` and costs ~1e-6 relative in every
term); ``lse`` is natural log. A row of all ``-inf`` has ``l = 0``: ``lse = -inf``, softmax 0, log-softmax ``-inf``.
NaN in a row makes that row's ``l`` NaN and stays there.
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Hashable, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .._triton import configs
from .._triton.algebra import LOG2E, ref_max
from .._triton.launch import Launcher



@triton.jit
def _lse(m, l):
    """Natural ``lse`` from ``(m, l)`` ([BLOCK_R] each); ``-inf`` where ``l = 0``, NaN stays NaN."""
    return tl.where(l == 0.0, float("-inf"), ref_max(m) + tl.log(l))


@triton.jit
def _online(m, l, x):
    """Fold tile ``x [BLOCK_R, BLOCK_N]`` (float32) into the running ``(m, l)`` ([BLOCK_R])."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    ref = ref_max(m_new)
    p = tl.math.exp2((x - ref[:, None]) * LOG2E)  # [BLOCK_R, BLOCK_N]
    l = l * tl.math.exp2((m - ref) * LOG2E) + tl.sum(p, axis=1)
    return m_new, l


@triton.jit
def _stats(xb, rmask, start, end, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, SUM: tl.constexpr = False):
    """Online ``(m, l)`` of columns ``[start, end)`` of the rows at ``xb [BLOCK_R, 1]``, and with
    ``SUM`` their plain sum (else 0), each ``[BLOCK_R]``.

    Full tiles load without a column mask (vector loads), ``STAGES`` deep in flight; a masked
    tail tile follows if the range has one. The sum accumulates per lane, reduced once at the end.
    """
    cols = tl.arange(0, BLOCK_N)
    m = tl.full([xb.shape[0]], float("-inf"), tl.float32)
    l = tl.zeros([xb.shape[0]], tl.float32)
    if SUM:  # (a per-lane accumulator costs registers: only when asked; H200, 8192-wide bf16 tiles: -13%)
        total = tl.zeros([xb.shape[0], BLOCK_N], tl.float32)
    n_full = (end - start) // BLOCK_N
    for i in tl.range(n_full, num_stages=STAGES):
        c0 = tl.multiple_of(start + i * BLOCK_N, BLOCK_N)
        x = tl.load(xb + (c0 + cols)[None, :], mask=rmask[:, None], other=float("-inf"),
                    eviction_policy="evict_last").to(tl.float32)  # [BLOCK_R, BLOCK_N]
        m, l = _online(m, l, x)
        if SUM:
            total += x
    if start + n_full * BLOCK_N < end:
        c = start + n_full * BLOCK_N + cols
        cmask = rmask[:, None] & (c < end)[None, :]
        x = tl.load(xb + c[None, :], mask=cmask, other=float("-inf")).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        m, l = _online(m, l, x)
        if SUM:
            total += tl.where(cmask, x, 0.0)
    if SUM:
        row_sum = tl.sum(total, axis=1)
    else:
        row_sum = tl.zeros([xb.shape[0]], tl.float32)
    return m, l, row_sum


@triton.jit
def _norm_tile(x, lse, m, c, LOG: tl.constexpr):
    """``c * exp(x - m)`` or ``x - lse`` of ``x [BLOCK_R, BLOCK_N]``; empty rows 0 / -inf.

    With the row's state at hand ``m`` is its max and ``c = g / l`` (as exact as torch's
    two-pass); from ``lse`` alone ``m = lse``, ``c = g`` (one rounding of ``lse`` more).
    """
    empty = (lse == float("-inf"))[:, None]
    if LOG:
        y = tl.where(empty, float("-inf"), x - lse[:, None])
    else:
        y = tl.where(empty, 0.0, tl.math.exp2((x - m[:, None]) * LOG2E) * c[:, None])
    return y


@triton.jit
def _scale(m, l, g):
    """``(m, g / l)`` for :func:`_norm_tile` from a row state ``(m, l)``; 0 in empty rows."""
    return ref_max(m), tl.where(l == 0.0, 0.0, g / l)


@triton.jit
def _tile_state(x, LOG: tl.constexpr):
    """The state ``(m, l)`` ([BLOCK_R] each) of a tile ``x [BLOCK_R, BLOCK_N]`` (float32) that is
    held on chip, and what its output is made from (:func:`_tile_out`): ``exp(x - m)`` for softmax,
    so one exp per element, or ``x`` for log-softmax."""
    m = tl.max(x, axis=1)
    p = tl.math.exp2((x - ref_max(m)[:, None]) * LOG2E)  # [BLOCK_R, BLOCK_N]
    return (x if LOG else p), m, tl.sum(p, axis=1)


@triton.jit
def _tile_out(t, m_tile, lse, m, inv, LOG: tl.constexpr):
    """The output of a held tile from :func:`_tile_state`'s ``t`` and ``m_tile`` and its rows' state
    (``lse``, and ``m, inv`` from :func:`_scale`): ``exp(x - m_tile) * exp(m_tile - m) / l``, or
    ``x - lse``; empty rows 0 / -inf."""
    if LOG:
        y = _norm_tile(t, lse, m, inv, True)
    else:
        y = t * (tl.math.exp2((m_tile - m) * LOG2E) * inv)[:, None]
    return y


@triton.jit
def _normalize_range(xb, yb, rmask, lse, m, c, start, end, LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write the normalised columns ``[start, end)`` of the rows at ``xb``/``yb``, last tile first."""
    cols = tl.arange(0, BLOCK_N)
    n_full = (end - start) // BLOCK_N
    tail = start + n_full * BLOCK_N
    cc = tail + cols
    cmask = rmask[:, None] & (cc < end)[None, :]
    x = tl.load(xb + cc[None, :], mask=cmask, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
    tl.store(yb + cc[None, :], _norm_tile(x, lse, m, c, LOG).to(yb.dtype.element_ty), mask=cmask)
    for i in range(n_full):
        c0 = tl.multiple_of(tail - (i + 1) * BLOCK_N, BLOCK_N)
        x = tl.load(xb + (c0 + cols)[None, :], mask=rmask[:, None], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)  # [BLOCK_R, BLOCK_N]
        y = _norm_tile(x, lse, m, c, LOG).to(yb.dtype.element_ty)
        tl.store(yb + (c0 + cols)[None, :], y, mask=rmask[:, None])


@triton.jit
def _merge_states(pm, pl):
    """Merged ``(m, l)`` [BLOCK_R] of the partial states ``pm, pl [BLOCK_R, BLOCK_S]`` (absent ones
    ``(-inf, 0)``)."""
    m = tl.max(pm, axis=1)
    l = tl.sum(pl * tl.math.exp2((pm - ref_max(m)[:, None]) * LOG2E), axis=1)
    return m, l


@triton.jit
def _merge_partials(pm_ptr, pl_ptr, rows, rmask, S, BLOCK_S: tl.constexpr):
    """Merged ``(m, l)`` [BLOCK_R] of the ``S`` partial ``(m, l)`` of each row (row-major ``(R, S)``)."""
    s = tl.arange(0, BLOCK_S)
    mask = rmask[:, None] & (s < S)[None, :]
    off = rows[:, None].to(tl.int64) * S + s[None, :]
    pm = tl.load(pm_ptr + off, mask=mask, other=float("-inf"))  # [BLOCK_R, BLOCK_S]
    pl = tl.load(pl_ptr + off, mask=mask, other=0.0)  # [BLOCK_R, BLOCK_S]
    return _merge_states(pm, pl)


@triton.jit(do_not_specialize=["R", "chunk"])
def _lse_fwd_kernel(x_ptr, lse_ptr, pm_ptr, pl_ptr, R, N, stride_x, chunk,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr, STAGES: tl.constexpr):
    """Grid ``(cdiv(R, BLOCK_R), S)``: ``(m, l)`` of a ``chunk`` of columns; ``lse`` if ``S == 1``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rmask = rows < R
    s = tl.program_id(1)
    start = s * chunk
    end = tl.minimum(start + chunk, N)
    m, l, _ = _stats(x_ptr + rows[:, None].to(tl.int64) * stride_x, rmask, start, end, BLOCK_N, STAGES)
    if PARTIAL:
        off = rows.to(tl.int64) * tl.num_programs(1) + s
        tl.store(pm_ptr + off, m, mask=rmask)
        tl.store(pl_ptr + off, l, mask=rmask)
    else:
        tl.store(lse_ptr + rows, _lse(m, l), mask=rmask)


@triton.jit(do_not_specialize=["R", "S"])
def _lse_merge_fwd_kernel(pm_ptr, pl_ptr, lse_ptr, R, S, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid ``cdiv(R, BLOCK_R)``: the ``lse`` of each row from its ``S`` partial states."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    m, l = _merge_partials(pm_ptr, pl_ptr, rows, rmask, S, BLOCK_S)
    tl.store(lse_ptr + rows, _lse(m, l), mask=rmask)


@triton.jit(do_not_specialize=["R"])
def _softmax_fwd_kernel(x_ptr, y_ptr, lse_ptr, R, N, stride_x, stride_y, LOG: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr, STAGES: tl.constexpr,
                        LSE: tl.constexpr = True):
    """Grid ``cdiv(R, BLOCK_R)``: whole rows; one pass if ``BLOCK_N >= N``, else online two-pass;
    ``lse`` written where ``LSE`` (else ``lse_ptr`` is not read)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rmask = rows < R
    xb = x_ptr + rows[:, None].to(tl.int64) * stride_x
    yb = y_ptr + rows[:, None].to(tl.int64) * stride_y
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_N)
        mask = rmask[:, None] & (cols < N)[None, :]
        x = tl.load(xb + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        t, m, l = _tile_state(x, LOG)
        lse = _lse(m, l)
        mr, inv = _scale(m, l, 1.0)
        tl.store(yb + cols[None, :], _tile_out(t, m, lse, mr, inv, LOG).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        m, l, _ = _stats(xb, rmask, 0, N, BLOCK_N, STAGES)
        lse = _lse(m, l)
        mr, c = _scale(m, l, 1.0)
        _normalize_range(xb, yb, rmask, lse, mr, c, 0, N, LOG, BLOCK_N)
    if LSE:
        tl.store(lse_ptr + rows, lse, mask=rmask)


@triton.jit
def _row_chunk(x_ptr, row, R, N, stride_x, cols):
    """Columns ``cols [BLOCK_N]`` of ``row`` as a ``[1, BLOCK_N]`` tile in x's dtype; ``-inf`` past
    ``N``, and no load at all for ``row >= R``."""
    rows = row + tl.arange(0, 1)  # [1]
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    return tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=float("-inf"))


@triton.jit
def _publish(m, l, row, R, c, C, st_ptr):
    """Publish ``(m, l)`` ([1] each) as state ``c`` of ``row``: both float32 bit patterns in one
    int64 (``m`` high, ``l`` low), swapped in with a relaxed atomic, so the word is its own arrival
    flag and no fence waits for the program's outstanding stores."""
    word = (m.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (l.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    rows = row + tl.arange(0, 1)  # [1]
    tl.atomic_xchg(st_ptr + rows.to(tl.int64) * C + c, word, mask=rows < R, sem="relaxed")


@triton.jit
def _gather_states(st_ptr, rows, C, spin, BLOCK_C: tl.constexpr):
    """Poll (at most ``spin`` times) for the ``C`` published states of ``rows [1]``. Returns
    ``(pm, pl [1, BLOCK_C], complete)``; an unpublished word is all ones (an ``l`` computed by the
    kernels is never that NaN pattern)."""
    s = tl.arange(0, BLOCK_C)[None, :]
    ptrs = st_ptr + rows[:, None].to(tl.int64) * C + s  # [1, BLOCK_C]
    word = tl.load(ptrs, mask=s < C, other=0, volatile=True)
    polls = 0
    while (tl.sum((word == -1).to(tl.int32)) > 0) & (polls < spin):
        word = tl.load(ptrs, mask=s < C, other=0, volatile=True)
        polls += 1
    pm = tl.where(s < C, (word >> 32).to(tl.int32).to(tl.float32, bitcast=True), float("-inf"))
    pl = tl.where(s < C, word.to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    return pm, pl, tl.sum((word == -1).to(tl.int32)) == 0


@triton.jit
def _row_state(st_ptr, x_ptr, rows, rmask, N, C, stride_x, spin, BLOCK_C: tl.constexpr, LOOP_N: tl.constexpr):
    """``(lse, m, 1 / l)`` of ``rows [1]`` (see :func:`_scale`) merged from the ``C`` states its
    siblings publish, or computed from ``x`` itself if they are not all there after ``spin`` polls."""
    pm, pl, complete = _gather_states(st_ptr, rows, C, spin, BLOCK_C)
    if complete:
        m, l = _merge_states(pm, pl)
    else:
        m, l, _ = _stats(x_ptr + rows[:, None].to(tl.int64) * stride_x, rmask, 0, N, LOOP_N, 1)
    mr, inv = _scale(m, l, 1.0)
    return _lse(m, l), mr, inv


@triton.jit(do_not_specialize=["R", "C", "spin"])
def _softmax_coop_kernel(x_ptr, y_ptr, lse_ptr, st_ptr, R, N, C, stride_x, stride_y, spin,
                         LOG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, LOOP_N: tl.constexpr):
    """Grid ``G * C`` (co-resident): ``G`` groups of ``C`` siblings; program ``g * C + c`` holds
    columns ``[c * BLOCK_N, (c + 1) * BLOCK_N)`` of rows ``g, g + G, ...`` on chip (for softmax as
    ``exp(x - m_chunk)``, so one exp per element).

    Software-pipelined over its rows: it publishes the state of row ``r + G``'s chunk (into
    ``st (R, C)``, all ones until published) and has row ``r + 2G``'s chunk in flight before it
    waits for row ``r``'s siblings, whose states went out an iteration earlier; then it merges the
    ``C`` states of row ``r`` and normalises the chunk it holds (one read, one write: 2N). A program
    still short of siblings after ``spin`` polls (not co-resident) computes the row's state from
    ``x`` itself: slower, never stuck, the same result.
    """
    pid = tl.program_id(0)
    c = pid % C
    G = tl.num_programs(0) // C
    cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
    row0 = pid // C
    cur, cur_m, l = _tile_state(_row_chunk(x_ptr, row0, R, N, stride_x, cols).to(tl.float32), LOG)  # [1, BLOCK_N]
    _publish(cur_m, l, row0, R, c, C, st_ptr)
    nxt = _row_chunk(x_ptr, row0 + G, R, N, stride_x, cols)  # [1, BLOCK_N], x.dtype
    for row in range(row0, R, G):
        held, held_m, l = _tile_state(nxt.to(tl.float32), LOG)
        _publish(held_m, l, row + G, R, c, C, st_ptr)
        after = _row_chunk(x_ptr, row + 2 * G, R, N, stride_x, cols)
        rows = row + tl.arange(0, 1)  # [1]
        rmask = rows < R
        lse, mr, inv = _row_state(st_ptr, x_ptr, rows, rmask, N, C, stride_x, spin, BLOCK_C, LOOP_N)
        y = _tile_out(cur, cur_m, lse, mr, inv, LOG)  # [1, BLOCK_N]
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (cols < N)[None, :])
        if c == 0:  # a branch, not a mask: triton 3.9's interpreter mistypes a splatted scalar compare
            tl.store(lse_ptr + rows, lse, mask=rmask)
        cur, cur_m = held, held_m
        nxt = after


@triton.jit(do_not_specialize=["R", "chunk", "S"])
def _normalize_fwd_kernel(x_ptr, y_ptr, lse_ptr, g_ptr, pm_ptr, pl_ptr, R, N, stride_x, stride_y,
                          chunk, S, LOG: tl.constexpr, HAS_G: tl.constexpr, MERGE: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid ``(cdiv(R, BLOCK_R), S)``, chunks in reverse launch order (the last read is in L2).

    ``MERGE``: ``lse`` is merged from ``S`` partials, and the chunk-0 program writes it out.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rmask = rows < R
    s = tl.num_programs(1) - 1 - tl.program_id(1)
    if HAS_G:
        g = tl.load(g_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    else:
        g = tl.full([BLOCK_R], 1.0, tl.float32)
    if MERGE:
        m, l = _merge_partials(pm_ptr, pl_ptr, rows, rmask, S, BLOCK_S)
        lse = _lse(m, l)
        if s == 0:  # a branch, not a mask (as above)
            tl.store(lse_ptr + rows, lse, mask=rmask)
        m, c = _scale(m, l, g)
    else:
        lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        m, c = ref_max(lse), g
    start = s * chunk
    _normalize_range(x_ptr + rows[:, None].to(tl.int64) * stride_x,
                     y_ptr + rows[:, None].to(tl.int64) * stride_y,
                     rmask, lse, m, c, start, tl.minimum(start + chunk, N), LOG, BLOCK_N)


@triton.jit
def _grad_terms(y, dy, LOG: tl.constexpr):
    """The per-element term of the row sum: ``dy`` (log) or ``dy * y``."""
    return dy if LOG else dy * y


@triton.jit
def _dx(y, dy, s, empty, LOG: tl.constexpr):
    """``dx [BLOCK_R, BLOCK_N]`` from ``y, dy`` and the row sum ``s [BLOCK_R]``; 0 in empty rows."""
    if LOG:
        dx = dy - tl.math.exp2(y * LOG2E) * s[:, None]
    else:
        dx = y * (dy - s[:, None])
    return tl.where(empty[:, None], 0.0, dx)


@triton.jit(do_not_specialize=["R", "chunk"])
def _rowsum_bwd_kernel(y_ptr, dy_ptr, out_ptr, R, N, stride_y, stride_dy, chunk, LOG: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid ``(cdiv(R, BLOCK_R), S)``: partial row sums of ``dy * y`` (or ``dy``) into ``out (R, S)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    s = tl.program_id(1)
    start = s * chunk
    end = tl.minimum(start + chunk, N)
    yb = y_ptr + rows[:, None].to(tl.int64) * stride_y
    db = dy_ptr + rows[:, None].to(tl.int64) * stride_dy
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    for c0 in range(start, end, BLOCK_N):
        c = c0 + cols
        mask = rmask[:, None] & (c < end)[None, :]
        y = tl.load(yb + c[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        dy = tl.load(db + c[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += _grad_terms(y, dy, LOG)
    tl.store(out_ptr + rows.to(tl.int64) * tl.num_programs(1) + s, tl.sum(acc, axis=1), mask=rmask)


@triton.jit(do_not_specialize=["R", "chunk"])
def _softmax_bwd_kernel(y_ptr, dy_ptr, dx_ptr, lse_ptr, rs_ptr, R, N, stride_y, stride_dy, stride_dx,
                        chunk, LOG: tl.constexpr, FUSED_SUM: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid ``(cdiv(R, BLOCK_R), S)``. ``FUSED_SUM``: the tile holds whole rows and sums them itself."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    empty = tl.load(lse_ptr + rows, mask=rmask, other=0.0) == float("-inf")  # [BLOCK_R]
    yb = y_ptr + rows[:, None].to(tl.int64) * stride_y
    db = dy_ptr + rows[:, None].to(tl.int64) * stride_dy
    xb = dx_ptr + rows[:, None].to(tl.int64) * stride_dx
    cols = tl.arange(0, BLOCK_N)
    if FUSED_SUM:
        mask = rmask[:, None] & (cols < N)[None, :]
        y = tl.load(yb + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        dy = tl.load(db + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(_grad_terms(y, dy, LOG), axis=1)
        tl.store(xb + cols[None, :], _dx(y, dy, s, empty, LOG).to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        s = tl.load(rs_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        start = tl.program_id(1) * chunk
        end = tl.minimum(start + chunk, N)
        for c0 in range(start, end, BLOCK_N):
            c = c0 + cols
            mask = rmask[:, None] & (c < end)[None, :]
            y = tl.load(yb + c[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(db + c[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(xb + c[None, :], _dx(y, dy, s, empty, LOG).to(dx_ptr.dtype.element_ty), mask=mask)


_L_lse_fwd = Launcher(_lse_fwd_kernel)
_L_lse_merge_fwd = Launcher(_lse_merge_fwd_kernel)
_L_normalize_fwd = Launcher(_normalize_fwd_kernel)
_L_rowsum_bwd = Launcher(_rowsum_bwd_kernel)
_L_softmax_bwd = Launcher(_softmax_bwd_kernel)
_L_softmax_coop = Launcher(_softmax_coop_kernel)
_L_softmax_fwd = Launcher(_softmax_fwd_kernel)

# The launches of the short-row paths build their launcher keys by hand (see ``ops._triton.launch``):
# each pointer's dtype and 16-byte alignment, each integer by value, the ``do_not_specialize``
# ones by whether they are below this (typed i32). Outputs are fresh contiguous torch.empty
# tensors (which the tests fill with NaN), so their row stride is the column count. Plans and
# launch arguments are worked out once per shape.
_INT32 = 2 ** 31
_MEMO_MAX = 4096


@lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(t: Tensor) -> int:
    """Streaming multiprocessors of ``t``'s device (the configured count, or a small one on CPU)."""
    if configs.SOFTMAX.sm_count:
        return configs.SOFTMAX.sm_count
    return _device_sms(t.device.index or 0) if t.is_cuda else configs.SOFTMAX_INTERPRET_SMS


def _memo(key: tuple, make, *args):
    """``make(*args)``, once per ``key`` while ``configs.SOFTMAX`` stays as it is (its ``memo``)."""
    hit = configs.SOFTMAX.memo.get(key)
    return _keep(key, make(*args)) if hit is None else hit


def _keep(key: Hashable, value):
    """Keep ``value`` in ``configs.SOFTMAX.memo`` under ``key`` (the memo emptied when full); return it."""
    memo = configs.SOFTMAX.memo
    if len(memo) >= _MEMO_MAX:
        memo.clear()
    memo[key] = value
    return value


def _plan(x: Tensor, stats_only: bool = False) -> configs.SoftmaxPlan:
    """The launch plan for ``x (R, N)``."""
    return _memo(("plan", *x.shape, x.dtype, x.get_device(), stats_only), _new_plan, x, stats_only)


def _new_plan(x: Tensor, stats_only: bool) -> configs.SoftmaxPlan:
    return configs.softmax_plan(x.shape[0], x.shape[1], x.element_size(), _sms(x), configs.SOFTMAX, stats_only)


def _unit_cols(x: Tensor) -> Tensor:
    """``x`` itself when its columns are contiguous (any row stride), else a contiguous copy."""
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _grid(x: Tensor, p: configs.SoftmaxPlan) -> tuple[int, int]:
    return configs.cdiv(x.shape[0], p.block_r), p.splits


def _partials(x: Tensor, p: configs.SoftmaxPlan) -> tuple[Tensor, Tensor]:
    """Partial states ``(m, l)``, each ``(R, S)`` float32, of the ``S`` chunks of each row."""
    pm = torch.empty((x.shape[0], p.splits), dtype=torch.float32, device=x.device)
    pl = torch.empty_like(pm)
    _L_lse_fwd.auto(_grid(x, p), (x, pm, pm, pl, x.shape[0], x.shape[1], x.stride(0), p.chunk),
                    BLOCK_R=p.block_r, BLOCK_N=p.block_n, PARTIAL=True, STAGES=p.stages, num_warps=p.num_warps)
    return pm, pl


def _lse_launch(x: Tensor) -> tuple:
    """``(plan, grid, kwargs)`` of :func:`lse_rows` over ``x (R, N)`` (the kwargs of one split)."""
    p = _plan(x, stats_only=True)
    return p, _grid(x, p), dict(BLOCK_R=p.block_r, BLOCK_N=p.block_n, PARTIAL=False, STAGES=p.stages,
                                num_warps=p.num_warps)


def lse_rows(x: Tensor) -> Tensor:
    """Natural-log logsumexp of each row of ``x (R, N)``: ``(R,)`` float32."""
    x = _unit_cols(x)
    R, N = x.shape
    lse = torch.empty(R, dtype=torch.float32, device=x.device)
    if R == 0 or N == 0:
        return lse.fill_(float("-inf"))
    p, grid, kwargs = _memo(("lse", R, N, x.dtype, x.get_device()), _lse_launch, x)
    if p.splits == 1:
        sx = x.stride(0)
        key = (x.dtype, x.data_ptr() % 16 == 0, lse.data_ptr() % 16 == 0, R < _INT32, N, sx, p.chunk < _INT32)
        _L_lse_fwd(grid, key, (x, lse, lse, lse, R, N, sx, p.chunk), kwargs)
        return lse
    pm, pl = _partials(x, p)
    bs = configs.next_pow2(p.splits)
    br = max(1, min(configs.next_pow2(R), 4096 // bs))
    _L_lse_merge_fwd.auto((configs.cdiv(R, br),), (pm, pl, lse, R, p.splits), BLOCK_R=br, BLOCK_S=bs)
    return lse


def _normalize_launch(x: Tensor, log: bool, has_g: bool, merge: bool) -> tuple:
    """``(plan, grid, kwargs)`` of :func:`_normalize` (merging: the split plan of the forward)."""
    p = _plan(x, stats_only=not merge)
    return p, _grid(x, p), dict(LOG=log, HAS_G=has_g, MERGE=merge, BLOCK_R=p.block_r, BLOCK_N=p.block_n,
                                BLOCK_S=configs.next_pow2(p.splits) if merge else 1, num_warps=p.num_warps)


def _normalize(x: Tensor, lse: Tensor, g: Optional[Tensor], log: bool,
               partials: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
    """Launch the normalising pass; with ``partials``, merge them into (and write) ``lse``."""
    R, N = x.shape
    y = torch.empty((R, N), dtype=x.dtype, device=x.device)
    p, grid, kwargs = _memo(("normalize", R, N, x.dtype, x.get_device(), log, g is not None, partials is not None),
                            _normalize_launch, x, log, g is not None, partials is not None)
    pm, pl = partials if partials is not None else (y, y)
    g = y if g is None else g
    sx = x.stride(0)
    key = (x.dtype, lse.dtype, g.dtype, pm.dtype, x.data_ptr() % 16 == 0, y.data_ptr() % 16 == 0,
           lse.data_ptr() % 16 == 0, g.data_ptr() % 16 == 0, pm.data_ptr() % 16 == 0, pl.data_ptr() % 16 == 0,
           R < _INT32, N, sx, p.chunk < _INT32, p.splits < _INT32)
    _L_normalize_fwd(grid, key, (x, y, lse, g, pm, pl, R, N, sx, N, p.chunk, p.splits), kwargs)
    return y


def normalize(x: Tensor, lse: Tensor, log: bool) -> Tensor:
    """``exp(x - lse)`` (softmax) or ``x - lse`` (log-softmax) in ``x.dtype``; empty rows give 0 / -inf."""
    x = _unit_cols(x)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _normalize(x, lse.contiguous(), None, log)


def _fwd_launch(x: Tensor, log: bool, write_lse: bool) -> list:
    """``[plan, grid, kwargs, bound launch]`` of :func:`softmax_fwd` (``write_lse``) or
    :func:`softmax_out` over ``x (R, N)`` (the kwargs of whole rows; the launch bound at its first use)."""
    p = _plan(x)
    return [p, _grid(x, p), dict(LOG=log, BLOCK_R=p.block_r, BLOCK_N=p.block_n, ONE_PASS=p.path == "one_pass",
                                 STAGES=p.stages, LSE=write_lse, num_warps=p.num_warps), None]


def _like_rows(x: Tensor) -> Tensor:
    """A fresh contiguous ``(R, N)`` tensor of ``x``'s dtype (``empty_like`` where ``x`` is contiguous:
    it parses no device argument, about half the host time of ``torch.empty`` on a GPU host)."""
    return torch.empty_like(x) if x.is_contiguous() else x.new_empty(x.shape)


def _whole_rows(run: list, x: Tensor, y: Tensor, lse: Tensor) -> None:
    """Launch ``run`` (of :func:`_fwd_launch`; a one-pass or two-pass plan) on ``x``, ``y`` and ``lse``
    (``y`` itself where the launch writes no ``lse``), bound at its first use."""
    bound = run[3]
    if bound is None:  # (fresh outputs: 16-byte aligned)
        R, N = x.shape
        sx = x.stride(0)
        key = (x.dtype, x.data_ptr() % 16 == 0, True, True, R < _INT32, N, sx)
        bound = run[3] = _L_softmax_fwd.bind(run[1], key, (x, y, lse, R, N, sx, N), run[2])
    bound(x, y, lse)


def softmax_fwd(x: Tensor, log: bool) -> tuple[Tensor, Tensor]:
    """Softmax or log-softmax of each row of ``x (R, N)``: ``(y (R, N) x.dtype, lse (R,) float32)``."""
    x = _unit_cols(x)
    R, N = x.shape
    if R == 0 or N == 0:
        return torch.empty((R, N), dtype=x.dtype, device=x.device), lse_rows(x)
    run = _memo(("fwd", R, N, x.dtype, x.get_device(), log, x.stride(0), x.data_ptr() % 16 == 0), _fwd_launch, x,
                log, True)
    p = run[0]
    lse = x.new_empty(R, dtype=torch.float32)
    if p.path == "split":
        return _normalize(x, lse, None, log, _partials(x, p)), lse
    y = _like_rows(x)
    if p.path == "coop":
        _coop(x, y, lse, log, p)
    else:
        _whole_rows(run, x, y, lse)
    return y, lse


def softmax_out(x: Tensor, log: bool, along: Optional[Hashable] = None) -> Tensor:
    """:func:`softmax_fwd`'s ``y`` alone (no ``lse`` made or written where the rows fit one or two
    passes of one program: a call that records no gradient).

    ``along``: the caller's key of an input whose contiguous rows ``x`` is; where they run whole,
    the memo keeps under it what runs a later input of that key (``run(input)``: a fresh output like
    the input, the bound launch)."""
    x = _unit_cols(x)
    R, N = x.shape
    if R and N:
        run = _memo(("out", R, N, x.dtype, x.get_device(), log, x.stride(0), x.data_ptr() % 16 == 0), _fwd_launch,
                    x, log, False)
        if run[0].path in ("one_pass", "two_pass"):
            y = _like_rows(x)
            _whole_rows(run, x, y, y)
            if along is not None:
                _keep(along, partial(_out_like, run[3]))
            return y
    return softmax_fwd(x, log)[0]


def _out_like(bound, x: Tensor) -> Tensor:
    """The whole-row launch ``bound`` on contiguous ``x``, into a fresh tensor like it."""
    y = torch.empty_like(x)
    bound(x, y, y)
    return y


def _coop(x: Tensor, y: Tensor, lse: Tensor, log: bool, p: configs.SoftmaxPlan) -> None:
    """Launch the coop path (``p.splits`` programs per row) into ``y (R, N)``, ``lse (R,)``."""
    R, N = x.shape
    states = torch.full((R, p.splits), -1, dtype=torch.int64, device=x.device)  # all ones: unpublished
    # under the interpreter programs run one after another: a sibling never arrives while one waits
    spin = configs.SOFTMAX.coop_spin if x.is_cuda else min(configs.SOFTMAX.coop_spin, 2)
    groups = max(1, min(R, p.resident // p.splits))
    _L_softmax_coop.auto((groups * p.splits,), (x, y, lse, states, R, N, p.splits, x.stride(0), y.stride(0), spin),
                         LOG=log, BLOCK_N=p.block_n, BLOCK_C=configs.next_pow2(p.splits),
                         LOOP_N=_plan(x, stats_only=True).block_n, num_warps=p.num_warps)


def _rowsum_launch(y: Tensor, log: bool) -> tuple:
    """``(plan, grid, kwargs)`` of :func:`softmax_rowsum` over ``y (R, N)``."""
    p = _plan(y, stats_only=True)
    return p, _grid(y, p), dict(LOG=log, BLOCK_R=p.block_r, BLOCK_N=p.block_n, num_warps=p.num_warps)


def softmax_rowsum(y: Tensor, dy: Tensor, log: bool) -> Tensor:
    """The row sum the backward needs: ``sum(dy * y)`` (softmax) or ``sum(dy)`` (log): ``(R,)`` float32."""
    y, dy = _unit_cols(y), _unit_cols(dy)
    R, N = y.shape
    if R == 0 or N == 0:
        return torch.zeros(R, dtype=torch.float32, device=y.device)
    p, grid, kwargs = _memo(("rowsum", R, N, y.dtype, y.get_device(), log), _rowsum_launch, y, log)
    out = torch.empty((R, p.splits), dtype=torch.float32, device=y.device)
    sy, sd = y.stride(0), dy.stride(0)
    key = (y.dtype, dy.dtype, y.data_ptr() % 16 == 0, dy.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0,
           R < _INT32, N, sy, sd, p.chunk < _INT32)
    _L_rowsum_bwd(grid, key, (y, dy, out, R, N, sy, sd, p.chunk), kwargs)
    return out[:, 0] if p.splits == 1 else out.sum(1)


def _bwd_launch(y: Tensor, log: bool, local_sum: bool) -> list:
    """``[plan, fused, grid, kwargs, bound launches]`` of :func:`softmax_bwd`: ``fused`` where the
    tile holds whole rows and the row sum is the local one; the launches bound at their first use,
    by the 16-byte alignment of ``lse`` and the row sums."""
    p = _plan(y)
    fused = local_sum and p.path == "one_pass"
    if not fused:
        p = _plan(y, stats_only=True)
    return [p, fused, _grid(y, p), dict(LOG=log, FUSED_SUM=fused, BLOCK_R=p.block_r, BLOCK_N=p.block_n,
                                        num_warps=p.num_warps), {}]


def softmax_bwd(y: Tensor, dy: Tensor, lse: Tensor, log: bool, rowsum: Optional[Tensor] = None) -> Tensor:
    """``dx`` of (log-)softmax from its output ``y (R, N)``; ``rowsum`` (global, for shards) defaults
    to the local one. Rows with ``lse = -inf`` get ``dx = 0``."""
    y, dy = _unit_cols(y), _unit_cols(dy)
    R, N = y.shape
    dx = torch.empty((R, N), dtype=y.dtype, device=y.device)
    if R == 0 or N == 0:
        return dx
    sy, sd = y.stride(0), dy.stride(0)
    p, fused, grid, kwargs, bound = _memo(("bwd", R, N, y.dtype, dy.dtype, y.get_device(), log, rowsum is None, sy,
                                           sd, y.data_ptr() % 16 == 0, dy.data_ptr() % 16 == 0), _bwd_launch, y, log,
                                          rowsum is None)
    lse = lse.contiguous()
    if fused:
        rs = lse
    else:
        rs = (softmax_rowsum(y, dy, log) if rowsum is None else rowsum).contiguous()
    geo = (lse.dtype, rs.dtype, lse.data_ptr() % 16 == 0, rs.data_ptr() % 16 == 0)
    run = bound.get(geo)
    if run is None:  # (dx: fresh, 16-byte aligned)
        key = (y.dtype, dy.dtype, *geo[:2], y.data_ptr() % 16 == 0, dy.data_ptr() % 16 == 0, True, *geo[2:],
               R < _INT32, N, sy, sd, p.chunk < _INT32)
        run = bound[geo] = _L_softmax_bwd.bind(grid, key, (y, dy, dx, lse, rs, R, N, sy, sd, N, p.chunk), kwargs)
    run(y, dy, dx, lse, rs)
    return dx


def logsumexp_bwd(x: Tensor, lse: Tensor, g: Tensor) -> Tensor:
    """``dx = g * exp(x - lse)`` for ``x (R, N)``, ``lse, g (R,)``; 0 in empty rows."""
    x = _unit_cols(x)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _normalize(x, lse.contiguous(), g.contiguous(), log=False)
