"""Fused N-way merge of partial attention results ``(out_i, lse_i)`` in one Triton kernel.

The math is ``splitsoftmax.core.state.merge_out_lse``: with ``M = max_i lse_i`` (0 where every part
is empty), ``w_i = exp(lse_i - M)``, ``out = sum_i w_i out_i / sum_i w_i`` and
``lse = M + log(sum_i w_i)``. A part with ``lse_i = -inf`` has ``w_i = 0`` and its ``out_i`` is
never multiplied in (NaN there stays out); a row where every part is empty gives ``(0, -inf)``.

Two kernels, one math. Many rows (a ring's or a gathered merge): a program owns ``BLOCK_R`` rows
and ``BLOCK_D`` columns; it first reads only the ``lse`` column of every part (small) to fix ``M``
and ``sum w``, then streams each part's ``out`` tile once with its final weight, so the partials
are read exactly once and nothing is rescaled. Few rows and few parts (split-KV decode: tens of
rows, tens of splits): one program per row and column block loads every part at once, so the
merge costs one memory round trip instead of two per part. Neither kernel compiles again for a new
length: the part tile is the part count rounded up to a power of two (at least
``configs.MERGE_PARTS_MIN_BLOCK``, masked parts merging as empty ones), and the stride between the
parts' ``lse`` rows, a row count, is not specialised (``splitsoftmax.tools.warmup``).
"""
from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from ...core.runtime import interpreting
from .._triton import configs
from .._triton.algebra import LOG2E, inv_or_zero, lse2_of, ref_max, rescale
from .._triton.device import hopper, sm_count
from .._triton.launch import Launcher


@triton.jit
def _wait_producer(PDL: tl.constexpr):
    """Under programmatic dependent launch (``PDL``) the kernel may start before the one before it
    in the stream has finished: wait here until it has, and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit(do_not_specialize=["N", "R", "s_ln"])
def _merge_fwd_kernel(OUTS, LSES, OUT, LSE, N, R, DV,
                      s_on, s_or, s_od, s_ln, s_lr, s_outr, s_outd, s_lser,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr, PDL: tl.constexpr):
    _wait_producer(PDL)
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    # pass 1: running max and normaliser of the weights, in the log2 domain
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    for i in range(N):
        x = tl.load(LSES + i * s_ln + rows64 * s_lr, mask=rmask, other=float("-inf")).to(tl.float32) * LOG2E
        m_new, _, w_m, w_x = rescale(m, x)
        s = s * w_m + w_x
        m = m_new
    m_use = ref_max(m)
    inv = inv_or_zero(s)  # [BLOCK_R]
    # pass 2: one read of each part's tile with its final weight
    mask2 = rmask[:, None] & (cols[None, :] < DV)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    optr = OUTS + rows64[:, None] * s_or + cols[None, :] * s_od  # [BLOCK_R, BLOCK_D]
    for i in range(N):
        x = tl.load(LSES + i * s_ln + rows64 * s_lr, mask=rmask, other=float("-inf")).to(tl.float32) * LOG2E
        w = tl.math.exp2(x - m_use) * inv  # [BLOCK_R]; 0 for empty parts
        o = tl.load(optr + i * s_on, mask=mask2 & (w > 0)[:, None], other=0.0).to(tl.float32)
        acc += w[:, None] * o
    tl.store(OUT + rows64[:, None] * s_outr + cols[None, :] * s_outd, acc.to(OUT.dtype.element_ty), mask=mask2)
    if WRITE_LSE:
        if pid_d == 0:  # a branch, not a mask: triton 3.9's interpreter mistypes a splatted scalar compare
            tl.store(LSE + rows64 * s_lser, lse2_of(m_use, s) * 0.6931471805599453, mask=rmask)


@triton.jit(do_not_specialize=["N", "R", "s_ln"])
def _merge_parts_kernel(OUTS, LSES, OUT, LSE, N, R, DV,
                        s_on, s_or, s_od, s_ln, s_lr, s_outr, s_outd, s_lser,
                        BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Grid ``(R, cdiv(DV, BLOCK_D))``: one row, every part (``N <= BLOCK_P``) loaded at once; the
    ``lse`` and ``out`` loads are independent, so the merge waits for memory once."""
    _wait_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    parts = tl.arange(0, BLOCK_P)  # [BLOCK_P]
    pmask = parts < N
    x = tl.load(LSES + parts * s_ln + row * s_lr, mask=pmask, other=float("-inf")).to(tl.float32) * LOG2E
    o = tl.load(OUTS + parts[:, None] * s_on + row * s_or + cols[None, :] * s_od,
                mask=pmask[:, None] & (cols < DV)[None, :], other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_D]
    m = tl.max(x, 0)
    m_use = ref_max(m)
    w = tl.math.exp2(x - m_use)  # [BLOCK_P]; 0 for empty parts, NaN for NaN ones
    s = tl.sum(w, 0)
    w = w * inv_or_zero(s)
    # [BLOCK_D]; an empty part (w = 0) is skipped whatever its out holds, a NaN weight is kept
    acc = tl.sum(tl.where((w != 0)[:, None], w[:, None] * o, 0.0), 0)
    tl.store(OUT + row * s_outr + cols * s_outd, acc.to(OUT.dtype.element_ty), mask=cols < DV)
    if pid_d == 0:
        tl.store(LSE + row * s_lser, lse2_of(m_use, s) * 0.6931471805599453)


_MERGE_ROWS, _MERGE_PARTS = Launcher(_merge_fwd_kernel), Launcher(_merge_parts_kernel)
_KERNELS = {"rows": _MERGE_ROWS, "parts": _MERGE_PARTS}
# (N, R, Dv, strides, dtypes, device, configs, 16-byte alignments) -> the bound launch of a merge of that
# geometry, worked out once (cleared when full, like the launch cache)
_PLANS: dict = {}
_MAX_PLANS = 1024
_PLAN_IDS = itertools.count()  # a plan's number: the launch cache's key for its geometry and dtypes


def merge_plan(n: int, r: int, dv: int, sms: int, pdl: bool) -> tuple[str, tuple, dict]:
    """``(kernel, grid, constexprs and launch options)`` of an ``N``-way merge of ``R`` rows of
    ``Dv`` columns on a GPU of ``sms`` multiprocessors (``pdl``: programmatic dependent launch).

    ``"rows"`` (:func:`_merge_fwd_kernel`) tiles the rows; where that runs fewer than
    ``configs.MERGE_PARTS_PROGRAMS_PER_SM`` programs per SM and the parts fit one tile, ``"parts"``
    (:func:`_merge_parts_kernel`) holds every part of a row at once, in ``BLOCK_P = next_pow2(N)``
    tile rows, at least ``configs.MERGE_PARTS_MIN_BLOCK``: so every split-KV prefill (a few splits)
    shares one compiled merge, and decoding compiles one per power of two of its split count.
    """
    block_r, block_d, warps = configs.MERGE_TILE_INTERPRET if interpreting() else configs.MERGE_TILE
    block_d = min(block_d, configs.next_pow2(max(dv, 1)))
    grid = (configs.cdiv(r, block_r), max(1, configs.cdiv(dv, block_d)))
    target = configs.MERGE_PARTS_PROGRAMS_PER_SM * sms
    if grid[0] * grid[1] < target and configs.next_pow2(n) * block_d <= configs.MERGE_PARTS_MAX_ELEMS:
        while block_d > 16 and r * configs.cdiv(dv, block_d) < target:  # narrower columns, more programs
            block_d //= 2
        block_p = max(configs.MERGE_PARTS_MIN_BLOCK, configs.next_pow2(n))
        return "parts", (r, configs.cdiv(dv, block_d)), dict(BLOCK_P=block_p, BLOCK_D=block_d, PDL=pdl,
                                                             launch_pdl=pdl, num_warps=warps)
    return "rows", grid, dict(BLOCK_R=block_r, BLOCK_D=block_d, WRITE_LSE=True, PDL=pdl, launch_pdl=pdl,
                              num_warps=warps)


def _configs() -> tuple:
    """The tunables :func:`merge_plan` reads (part of a cached plan's key: tests change them)."""
    return (configs.MERGE_TILE, configs.MERGE_PARTS_PROGRAMS_PER_SM, configs.MERGE_PARTS_MAX_ELEMS,
            configs.MERGE_PARTS_MIN_BLOCK, configs.MERGE_PDL)


def _new_plan(key: tuple, outs: Tensor, lses: Tensor, out: Tensor, lse: Tensor):
    """Work out, bind and keep the launch of the merge ``key`` (see :data:`_PLANS`)."""
    n, r, dv, strides = key[:4]
    kind, grid, kwargs = merge_plan(n, r, dv, sm_count(outs), configs.MERGE_PDL and hopper(outs))
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    # the launch cache's key: the plan's number (its integers by value, its dtypes) and the tensors'
    # 16-byte alignment
    bound = _PLANS[key] = _KERNELS[kind].bind(grid, (next(_PLAN_IDS), *key[-4:]),
                                              (outs, lses, out, lse, n, r, dv, *strides), kwargs)
    return bound


def _bound(outs: Tensor, lses: Tensor, out: Tensor, lse: Tensor, n: int, r: int, dv: int, strides: tuple):
    """The bound launch of the merge of ``n`` parts of ``r`` rows of ``dv`` columns; ``strides``: the
    kernels' eight (parts, rows and columns of ``outs``; parts and rows of ``lses``; rows and columns of
    ``out``; rows of ``lse``)."""
    key = (n, r, dv, strides, outs.dtype, lses.dtype, out.dtype, lse.dtype, outs.get_device(), _configs(),
           outs.data_ptr() % 16 == 0, lses.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0, lse.data_ptr() % 16 == 0)
    bound = _PLANS.get(key)
    return _new_plan(key, outs, lses, out, lse) if bound is None else bound


def merge_launch(outs: Tensor, lses: Tensor, out: Tensor, lse: Tensor, rows: Optional[tuple] = None):
    """:func:`merge_into` of these operands as a launch ``f(outs, lses, out, lse)`` for any operands of
    the same geometry (a caller that keeps it skips the lookup); None where there are no rows."""
    n, r, dv = outs.shape
    if not r:
        return None
    dst = rows or (*out.stride(), lse.stride(0))
    return _bound(outs, lses, out, lse, n, r, dv, (*outs.stride(), *lses.stride(), *dst))


def merge_into(outs: Tensor, lses: Tensor, out: Tensor, lse: Tensor, rows: Optional[tuple] = None) -> None:
    """Merge ``outs (N, R, Dv)``, ``lses (N, R)`` into ``out (R, Dv)`` (any float dtype), ``lse (R,)`` fp32.

    All four may be strided views. Or ``rows = (row stride, column stride, lse row stride)`` gives
    where ``out`` and ``lse``, of any shape, hold their ``R`` rows. ``out`` and ``lse`` are written,
    not read.
    """
    bound = merge_launch(outs, lses, out, lse, rows)
    if bound is not None:
        bound(outs, lses, out, lse)


@lru_cache(maxsize=1024)
def _flat_rows(shape: tuple, outs_strides: tuple, lses_strides: tuple) -> Optional[tuple]:
    """``(R, strides)`` of ``outs (N, *rows, Dv)`` and ``lses (N, *rows)`` seen as ``(N, R, Dv)`` and
    ``(N, R)`` without a copy, merged into contiguous ``(*rows, Dv)``, ``(*rows)``: the kernels' eight
    strides (see :func:`_launch`); None where some row dims of either are not one evenly strided run."""
    rows, dv = shape[1:-1], shape[-1]
    o_row, l_row = _row_stride(rows, outs_strides[1:-1]), _row_stride(rows, lses_strides[1:])
    if o_row is None or l_row is None:
        return None
    return math.prod(rows), (outs_strides[0], o_row, outs_strides[-1], lses_strides[0], l_row, dv, 1, 1)


def _row_stride(sizes: tuple, strides: tuple) -> Optional[int]:
    """The one stride that walks the flattened dims ``sizes`` (strides ``strides``), else None."""
    dims = [(n, st) for n, st in zip(sizes, strides) if n != 1]
    for (_, outer), (n, inner) in zip(dims, dims[1:]):
        if outer != inner * n:
            return None
    return dims[-1][1] if dims else (strides[-1] if strides else 0)


def merge_out_lse(outs: Tensor, lses: Tensor, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """N-way merge: ``outs (N, *rows, Dv)``, ``lses (N, *rows)`` -> ``(out (*rows, Dv), lse (*rows))``.

    ``out`` is float32 unless ``out_dtype``; ``lse`` float32. Same math as
    ``splitsoftmax.core.state.merge_out_lse``.
    """
    shape, device = outs.shape, outs.device
    out = torch.empty(shape[1:], dtype=out_dtype or torch.float32, device=device)
    lse = torch.empty(shape[1:-1], dtype=torch.float32, device=device)
    n = shape[0]
    if n == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    flat = _flat_rows(shape, outs.stride(), lses.stride())
    if flat is None:  # rows no one stride walks: merge copies of them
        r, dv = lse.numel(), shape[-1]
        merge_into(outs.reshape(n, r, dv), lses.reshape(n, r), out.view(r, dv), lse.view(r))
    elif flat[0]:
        _bound(outs, lses, out, lse, n, flat[0], shape[-1], flat[1])(outs, lses, out, lse)
    return out, lse


def merge_runner(outs: Tensor, lses: Tensor) -> Optional["LeanMerge"]:
    """The merge of these operands' geometry (and of the settings it reads) as one call (a
    :class:`LeanMerge`), for the public ``merge_states`` of float32 ``outs (N, *rows, Dv)``, ``lses
    (N, *rows)``: None for other dtypes, no parts or no rows, or rows no one stride walks."""
    shape = outs.shape
    if outs.dtype != torch.float32 or shape[0] == 0:
        return None
    flat = _flat_rows(shape, outs.stride(), lses.stride())
    if flat is None or not flat[0]:
        return None
    out, lse = outs.new_empty(shape[1:]), outs.new_empty(shape[1:-1])  # (fresh: contiguous, aligned)
    return LeanMerge(_bound(outs, lses, out, lse, shape[0], flat[0], shape[-1], flat[1]), shape[1:], shape[1:-1],
                     _configs())


class LeanMerge:
    """:func:`merge_runner`'s runner: ``run(outs, lses) -> (out, lse)`` as ``merge_out_lse(outs, lses)``
    returns them (the outputs made, the bound launch run), for operands of the geometry it was made
    for while ``run.fresh()`` (no setting it read has changed)."""

    __slots__ = ("bound", "shape", "lse_shape", "settings")

    def __init__(self, bound, shape: tuple, lse_shape: tuple, settings: tuple):
        self.bound, self.shape, self.lse_shape, self.settings = bound, shape, lse_shape, settings

    def fresh(self) -> bool:
        """Whether the settings it read are still those in force."""
        return self.settings == _configs()

    def __call__(self, outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
        out, lse = outs.new_empty(self.shape), outs.new_empty(self.lse_shape)
        self.bound(outs, lses, out, lse)
        return out, lse
