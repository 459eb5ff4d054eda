"""What the two attention backwards share (``bwd.py``: every mask, atomic or deterministic;
``bwd_plain.py``: the plain pair): the tile loads and visibility tests of their kernels, and the
host's descriptors, mask arguments and row blocks."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from ...core.mask import Mask
from .decode import pad_dim
from .fwd import _load_rows as _load


@triton.jit
def _tile(src, b, h, r0, rows, offs, rmask, cmask, s_rows, ROWS: tl.constexpr, COLS: tl.constexpr,
          EVEN: tl.constexpr, TMA: tl.constexpr):
    """Tile ``[ROWS, COLS]`` of rows ``r0 ..`` of head ``(b, h)``: with ``TMA`` through the
    ``(B, H, S, D)`` descriptor ``src`` (zeros past S), else through the head's base pointer ``src``
    (``rows = r0 + arange``, ``offs`` the column offsets, zeros outside ``rmask``/``cmask``)."""
    if TMA:
        x = src.load([b, h, r0, 0]).reshape(ROWS, COLS)
    else:
        x = _load(src + rows[:, None] * s_rows + offs[None, :], rmask, cmask, True, not EVEN)
    return x


@triton.jit
def _finite_or_zero(x):
    """Tile ``x`` with every NaN/Inf element replaced by 0."""
    return tl.where(tl.abs(x.to(tl.float32)) < float("inf"), x, 0.0).to(x.dtype)


@triton.jit
def _seen(kk, ii, rlo, rhi, dg, lw, kv_lo, kv_hi, CAUSAL: tl.constexpr, HAS_LO: tl.constexpr,
          HAS_ROWS: tl.constexpr):
    """Whether key ``kk`` is visible to row ``ii`` (broadcastable int tiles; ``rlo, rhi`` the rows'
    document bounds, ``dg``/``lw`` the band edges with the row's offset folded in)."""
    ok = (kk >= kv_lo) & (kk < kv_hi)
    if CAUSAL:
        ok = ok & (kk <= ii + dg)
    if HAS_LO:
        ok = ok & (kk >= ii + lw)
    if HAS_ROWS:
        ok = ok & (kk >= rlo) & (kk < rhi)
    return ok


@triton.jit
def _batch_bounds(KVR, QOFF, s_kvb, s_kvc, s_off, b, Sk, diag, lo, HAS_KV: tl.constexpr,
                  HAS_OFF: tl.constexpr):
    """``(kv_lo, kv_hi, dg, lw)`` of batch element ``b``: its key range (clipped to ``[0, Sk]``) and
    the band edges ``diag + off``, ``lo + off``."""
    kv_lo = 0
    kv_hi = Sk
    if HAS_KV:
        kv_lo = tl.maximum(tl.load(KVR + b * s_kvb), 0)
        kv_hi = tl.minimum(tl.load(KVR + b * s_kvb + s_kvc), Sk)
    off = 0
    if HAS_OFF:
        off = tl.load(QOFF + b * s_off)
    return kv_lo, kv_hi, diag + off, lo + off


@triton.jit
def q_walk(ROWS, s_r, m0, Sq, Sk, dg, lw, kv_lo, kv_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           CAUSAL: tl.constexpr, HAS_LO: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Key blocks of query rows ``qi = m0 + [0, BLOCK_M)``: ``(rlo, rhi, first, end, ia, ib)``, the
    rows' document bounds ``rlo, rhi`` (``qi`` twice without ``HAS_ROWS``), blocks ``[first, end)``
    holding a key one of the rows sees, ``[ia, ib)`` only keys every row sees."""
    qi = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    qmask = qi < Sq
    last = tl.minimum(m0 + BLOCK_M, Sq) - 1
    k_lo = kv_lo
    k_hi = kv_hi
    f_lo = kv_lo
    f_hi = kv_hi
    if CAUSAL:
        k_hi = tl.minimum(k_hi, last + dg + 1)
        f_hi = tl.minimum(f_hi, m0 + dg + 1)
    if HAS_LO:
        k_lo = tl.maximum(k_lo, m0 + lw)
        f_lo = tl.maximum(f_lo, last + lw)
    rlo = qi
    rhi = qi
    if HAS_ROWS:
        rlo = tl.load(ROWS + qi, mask=qmask, other=0)
        rhi = tl.load(ROWS + s_r + qi, mask=qmask, other=0)
        k_lo = tl.maximum(k_lo, tl.min(tl.where(qmask, rlo, Sk), 0))
        k_hi = tl.minimum(k_hi, tl.max(tl.where(qmask, rhi, 0), 0))
        f_lo = tl.maximum(f_lo, tl.max(tl.where(qmask, rlo, 0), 0))
        f_hi = tl.minimum(f_hi, tl.min(tl.where(qmask, rhi, Sk), 0))
    k_hi = tl.maximum(k_hi, k_lo)
    first = k_lo // BLOCK_N
    end = tl.where(k_hi == k_lo, first, tl.cdiv(k_hi, BLOCK_N))
    ia = tl.minimum(tl.maximum(tl.cdiv(f_lo, BLOCK_N), first), end)
    ib = tl.minimum(tl.maximum(tl.maximum(f_hi, 0) // BLOCK_N, ia), end)
    return rlo, rhi, first, end, ia, ib


def _tma_ok(t: Tensor) -> bool:
    """Whether a TMA descriptor can address ``t``: unit last stride, unpadded last dim, 16-byte base
    and strides (positive where the dim has more than one element)."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.shape[-1] == pad_dim(t.shape[-1]) and t.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 and (st > 0 or n == 1) for st, n in zip(t.stride()[:-1], t.shape[:-1])))


def _descriptor(t: Tensor, rows: int) -> TensorDescriptor:
    """The ``(B, H, S, D)`` descriptor of ``t`` reading ``[1, 1, rows, D]`` tiles (zeros past S); a
    dim of one element gets a valid stride whatever ``t`` has there. ``__post_init__`` is skipped:
    :func:`_tma_ok` has checked (and it costs host time on every call)."""
    strides = list(t.stride())
    for i in (2, 1, 0):
        if t.shape[i] == 1:
            strides[i] = strides[i + 1] * t.shape[i + 1]
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.padding = t, list(t.shape), strides, "zero"
    desc.block_shape = [1, 1, rows, t.shape[-1]]
    return desc


def row_blocks(rows: Tensor, sk: int, bn: int) -> Tensor:
    """``(key blocks, 4)`` int32 from document rows ``rows (2, Sq)`` (intervals nondecreasing in the
    row): for key block ``[n0, n0 + bn)`` the rows ``[r0, r1)`` that see one of its keys and the rows
    ``[f0, f1)`` that see all of them, as ``(r0, r1, f0, f1)``."""
    lo, hi = rows[0].contiguous(), rows[1].contiguous()
    n0 = torch.arange(0, sk, bn, device=rows.device, dtype=torch.int32)
    last = n0 + (bn - 1)
    a = torch.searchsorted(hi, torch.stack((n0, last), 1), right=True, out_int32=True)
    c = torch.searchsorted(lo, torch.stack((last, n0), 1), right=True, out_int32=True)
    return torch.stack((a[:, 0], c[:, 0], a[:, 1], c[:, 1]), 1).contiguous()


def _mask_args(mask: Mask, q: Tensor, lse: Tensor) -> tuple:
    """``(KVR, QOFF, ROWS, strides, flags)`` of ``mask`` (``lse`` stands in for absent tensors)."""
    kvr = mask.kv_range.to(torch.int32) if mask.kv_range is not None else None
    off = mask.q_offset.to(torch.int32) if mask.q_offset is not None else None
    rows = mask.rows.to(torch.int32).contiguous() if mask.rows is not None else None
    strides = (*(kvr.stride() if kvr is not None else (0, 0)), off.stride(0) if off is not None else 0,
               rows.stride(0) if rows is not None else 0)
    flags = dict(HAS_LO=mask.lo is not None, HAS_KV=kvr is not None, HAS_OFF=off is not None,
                 HAS_ROWS=rows is not None, SOFTCAP=mask.softcap > 0)
    return (kvr if kvr is not None else lse, off if off is not None else lse, rows if rows is not None else lse,
            strides, flags)
