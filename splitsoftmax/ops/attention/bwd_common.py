"""What the two attention backwards share (``bwd.py``: every mask, atomic or deterministic;
``bwd_plain.py``: the plain pair): the tile loads and visibility tests of their kernels, and the
host's descriptors, mask arguments and row blocks; the sums of the sinks' gradient that their dK/dV
kernels write with sinks (:func:`sink_buffers`).

With sinks the gradient ``dsinks[h] = -sum_rows p_sink (rowsum(dout * out) - dlse)`` needs
``rowsum(dout * out) = sum_j P_ij dP_ij`` (``dP_ij = dout_i . v_j``): taken from the rounded
``out`` it carries ``out``'s rounding (bfloat16: several times the error of a same-precision
reference). The dK/dV kernels hold ``P`` and ``dP`` of every visible pair once, so with ``SINK`` they
sum ``p_sink P dP`` over each tile's rows per key in float32 (:func:`_sink_keys`), add the tiles of
one query head in registers and store the per-key sums once per head and part of their walk (a slot
no other program or warpgroup writes: no atomics); the host sums the buffer per head
(:func:`sink_sums`), the same order on every call. Without sinks the kernels compile as before
(their operands are None constexprs).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .._triton.algebra import LOG2E
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
def _sink_keys(pdp_t, lse2, sink):
    """``[keys]``: ``sum_rows p_sink * pdp_t`` of a ``[keys, rows]`` tile ``pdp_t`` of ``P * dP``
    (float32, 0 at hidden pairs), ``p_sink = exp(sink - lse)`` from the rows' ``lse2 = lse * log2(e)``
    (``+inf`` in empty rows and past the end: there ``p_sink = 0``)."""
    p_sink = tl.math.exp2(sink * LOG2E - lse2)  # [rows]
    return tl.sum(pdp_t * p_sink[None, :], 1)


@triton.jit
def _sink_flush(ptrs, acc, last):
    """Store the per-key sums ``acc`` at ``ptrs`` where ``last`` (a head's last tile in this part of a
    program's walk) and restart them from 0 there; else keep them."""
    keep = tl.where(last, 1, 0)  # (the interpreter takes no mask made of a loop's scalar comparison)
    tl.store(ptrs, acc, mask=tl.zeros(acc.shape, tl.int32) < keep)
    return tl.where(last, 0.0, acc)


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


def sink_buffers(sinks: Optional[Tensor], q: Tensor, parts: int, keys: int) -> Optional[tuple[Tensor, Tensor]]:
    """None without ``sinks``; else ``(sinks (H,) float32, zeros (parts, B, H, keys) float32)``: the
    buffer where the dK/dV kernel's programs store, per part of their walk, query head and key
    (``keys``: the key blocks' keys, padded), ``sum_rows p_sink P dP`` (each slot stored once)."""
    if sinks is None:
        return None
    b, h = q.shape[:2]
    return (sinks.to(torch.float32).contiguous(),
            torch.zeros((parts, b, h, keys), dtype=torch.float32, device=q.device))


def sink_args(sink: Optional[tuple]) -> tuple:
    """The dK/dV kernels' last five operands ``(SNK, PDP, s_wp, s_wb, s_wh)``: the sinks (read at
    ``SNK + h``) and the buffer of :func:`sink_buffers` with its strides (a piece's views of them keep
    the whole's), or five ``None`` without sinks (constexprs: the kernels compile as if they took
    none)."""
    if sink is None:
        return (None,) * 5
    snk, pdp = sink
    return (snk, pdp, *pdp.stride()[:3])


def sink_sums(grads: tuple, sink: Optional[tuple]) -> tuple:
    """``grads``, and with ``sink`` (of :func:`sink_buffers`) its buffer summed per query head ``(H,)``
    float32: ``sum over rows and keys of p_sink P dP``."""
    return grads if sink is None else (*grads, sink[1].sum((0, 1, 3)))
