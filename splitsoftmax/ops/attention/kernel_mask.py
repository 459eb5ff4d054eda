"""The variants of :class:`splitsoftmax.core.mask.Mask` inside the Triton attention kernels.

Device side: each query row's visible keys are one interval ``[lo_r, hi_r)`` (:func:`row_bounds`,
read from the mask's device tensors, no host synchronisation); a program's key loop covers the
union of its rows' intervals and runs the tiles inside their intersection unmasked
(:func:`band_tiles`). Softcap maps the scores through :func:`capped` (``tanh`` on the natural-scale
scores, the result in the kernels' log2 domain).

Host side: :func:`kernel_mask` turns a ``Mask`` into the kernels' arguments (checked, int32,
contiguous) and :func:`key_range` gives the keys any row may see from the shapes alone (what the
split-KV plan cuts into chunks).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...core.mask import NO_MASK, Mask
from .._triton.algebra import LOG2E

BIG = tl.constexpr(1 << 30)  # beyond any key index a kernel takes (int32 coordinates)


@triton.jit
def tanh(x, APPROX: tl.constexpr):
    """``tanh(x)`` of a float32 tile: the GPU's ``tanh.approx.f32`` (one special-function op, about
    2^-11 relative error) where ``APPROX``, else ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)``
    (exact to float32 rounding); NaN stays NaN, +-inf gives +-1."""
    if APPROX:
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        e = tl.math.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|)
        t = (1.0 - e) / (1.0 + e)
        y = tl.where(x < 0, -t, t)
    return y


@triton.jit
def capped(qk, cap_in, cap_out, APPROX: tl.constexpr):
    """Softcapped scores in the log2 domain: ``c * tanh(scale * qk / c) * log2(e)`` with
    ``cap_in = scale / c`` and ``cap_out = c * log2(e)``; ``qk`` is a tile of raw products."""
    return tanh(qk * cap_in, APPROX) * cap_out


@triton.jit
def row_bounds(pos, row_ok, b, lo, hi, Sq, diag, lo_off, KVR, QOFF, ROWS, CAUSAL: tl.constexpr,
               WINDOW: tl.constexpr, KV_RANGE: tl.constexpr, Q_OFFSET: tl.constexpr, ROW_BOUNDS: tl.constexpr):
    """``(lo_r, hi_r)`` ``[BLOCK_M]``: row ``pos`` (of batch element ``b``) sees keys
    ``lo_r <= j < hi_r``, cut to the program's key range ``[lo, hi)``. The terms are the mask's
    rule (splitsoftmax.core.mask): ``j <= pos + off + diag`` (``CAUSAL``), ``j >= pos + off + lo_off``
    (``WINDOW``), ``kv_range[b]`` (``KV_RANGE``, at ``KVR``), ``rows[:, pos]`` (``ROW_BOUNDS``, at
    ``ROWS``, the ``(2, Sq)`` bounds); ``off = q_offset[b]`` (``Q_OFFSET``, at ``QOFF``) else 0."""
    qpos = pos
    if Q_OFFSET:
        qpos = pos + tl.load(QOFF + b)
    lo_r = tl.zeros_like(pos) + lo
    hi_r = tl.zeros_like(pos) + hi
    if CAUSAL:
        hi_r = tl.minimum(hi_r, qpos + diag + 1)
    if WINDOW:
        lo_r = tl.maximum(lo_r, qpos + lo_off)
    if KV_RANGE:
        lo_r = tl.maximum(lo_r, tl.load(KVR + 2 * b))
        hi_r = tl.minimum(hi_r, tl.load(KVR + 2 * b + 1))
    if ROW_BOUNDS:
        lo_r = tl.maximum(lo_r, tl.load(ROWS + pos, mask=row_ok, other=0))
        hi_r = tl.minimum(hi_r, tl.load(ROWS + Sq + pos, mask=row_ok, other=0))
    return lo_r, hi_r


@triton.jit
def band_tiles(lo_r, hi_r, row_ok, BLOCK_N: tl.constexpr):
    """``(a0, a1, a2, end)``: the key tiles (starting at multiples of ``BLOCK_N``) a program of rows
    ``[lo_r, hi_r)`` (``row_ok`` the real ones) visits. ``[a0, a1)`` and ``[a2, end)`` cross some
    row's interval edge (masked); every real row sees the tiles of ``[a1, a2)`` whole (no mask).
    The union skips rows that see nothing; ``end <= a0`` where no row sees anything."""
    seen = row_ok & (lo_r < hi_r)
    u_lo = tl.min(tl.where(seen, lo_r, BIG), 0)
    end = tl.max(tl.where(seen, hi_r, 0), 0)
    i_lo = tl.max(tl.where(row_ok, lo_r, 0), 0)
    i_hi = tl.min(tl.where(row_ok, hi_r, BIG), 0)
    a0 = (u_lo // BLOCK_N) * BLOCK_N
    a1 = tl.minimum(tl.maximum(tl.cdiv(i_lo, BLOCK_N) * BLOCK_N, a0), tl.maximum(end, a0))
    a2 = a1 + (tl.maximum(tl.minimum(i_hi, end) - a1, 0) // BLOCK_N) * BLOCK_N
    return a0, a1, a2, end


class KernelMask(NamedTuple):
    """The forward kernel's view of a Mask: pointer arguments (``dummy`` where a field is absent),
    the window's edge, the softcap factors and the constexpr flags."""

    kvr: Tensor
    qoff: Tensor
    rows: Tensor
    lo_off: int
    cap_in: float
    cap_out: float
    flags: dict

    @property
    def band(self) -> bool:
        """Whether any field narrows a row's keys (else the causal / full tiling runs as is)."""
        f = self.flags
        return f["WINDOW"] or f["KV_RANGE"] or f["Q_OFFSET"] or f["ROW_BOUNDS"]


_PLAIN_FLAGS = dict(WINDOW=False, KV_RANGE=False, Q_OFFSET=False, ROW_BOUNDS=False, SOFTCAP=False,
                    SOFTCAP_APPROX=False)


def _index_tensor(name: str, t: Tensor, shape: tuple, q: Tensor) -> Tensor:
    """``t`` checked to be an integer tensor of ``shape`` on ``q``'s device, as contiguous int32."""
    if not isinstance(t, Tensor) or t.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"mask.{name} must be an integer tensor, got {t!r:.80}")
    if tuple(t.shape) != shape:
        raise ValueError(f"mask.{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"mask.{name} is on {t.device}, the inputs on {q.device}")
    return t.to(torch.int32).contiguous()


def kernel_mask(mask: Mask, q: Tensor, scale: float, dummy: Tensor, approx: bool) -> KernelMask:
    """The kernel arguments of ``mask`` for queries ``q (B, H, Sq, D)``; ``dummy`` stands in for an
    absent tensor (never read); ``approx``: softcap through the GPU's ``tanh.approx``."""
    if mask is NO_MASK:
        return KernelMask(dummy, dummy, dummy, 0, 1.0, 1.0, _PLAIN_FLAGS)
    b, sq = q.shape[0], q.shape[2]
    cap = float(mask.softcap)
    if not cap >= 0.0 or cap == float("inf"):
        raise ValueError(f"mask.softcap must be finite and >= 0 (0: none), got {mask.softcap}")
    kvr = dummy if mask.kv_range is None else _index_tensor("kv_range", mask.kv_range, (b, 2), q)
    qoff = dummy if mask.q_offset is None else _index_tensor("q_offset", mask.q_offset, (b,), q)
    rows = dummy if mask.rows is None else _index_tensor("rows", mask.rows, (2, sq), q)
    flags = dict(WINDOW=mask.lo is not None, KV_RANGE=mask.kv_range is not None,
                 Q_OFFSET=mask.q_offset is not None, ROW_BOUNDS=mask.rows is not None, SOFTCAP=cap > 0,
                 SOFTCAP_APPROX=cap > 0 and approx)
    lo = 0 if mask.lo is None else int(mask.lo)
    return KernelMask(kvr, qoff, rows, lo, scale / cap if cap else 1.0, cap * LOG2E.value if cap else 1.0, flags)


def key_range(sq: int, sk: int, causal: bool, diag: int, mask: Mask) -> tuple[int, int]:
    """``[k0, k1)``: the keys some row may see, from the shapes and the host-known fields alone
    (``kv_range``, ``rows`` and a ``q_offset`` tensor are read on the device, so they narrow nothing
    here)."""
    shifted = mask.q_offset is not None
    k1 = sk if shifted or not causal else max(0, min(sk, sq + diag))
    k0 = 0 if shifted or mask.lo is None else max(0, min(int(mask.lo), k1))
    return k0, k1
