"""The attention variants' keywords (docs/API.md, "Attention variants"): checked once, held as a
small frozen :class:`Variants`, and turned into the local ops' :class:`~splitsoftmax.core.mask.Mask` for
any query segment and key segment of the global sequence (:func:`local_mask`).

Positions are global: query ``i`` of the segment that starts at ``q_start`` sits at key position
``q_offset[b] + q_start + i``; key ``j`` of the segment that starts at ``k_start`` is key
``k_start + j``. An int ``q_offset`` and the segments' starts fold into the band's edges (``diag``
and ``Mask.lo``); a tensor ``q_offset`` travels as ``Mask.q_offset``. Documents become per-row key
intervals (``Mask.rows``), computed on the host from ``cu_seqlens``: a sequence or CPU tensor costs
no synchronisation, a CUDA tensor is read once and its reading kept while the tensor is unmodified
(same object, same ``_version``). Sinks are not part of the mask: the caller merges them once per
row (:func:`splitsoftmax.core.state.add_sinks`).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import checks as _checks
from .mask import NO_MASK, Mask, note_reach

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True, eq=False)
class Variants:
    """The checked keywords of one attention call (defaults: today's full / causal rule).

    causal:   key ``j <= p`` for a query at key position ``p``.
    cu:       document boundaries ``(N+1,)`` as host ints (global positions), or ``None``; inside
              ``torch.compile`` a ``cu_seqlens`` tensor stays an int64 tensor on its device.
    left, right: the window's edges, ``-1`` unbounded.
    softcap:  ``c > 0`` caps scores as ``c * tanh(s / c)``; ``0.0``: none.
    sinks:    ``(H,)`` float tensor or ``None`` (merged by the caller, not in the mask).
    kv_range: ``(B, 2)`` int32 on the queries' device, global key positions, or ``None``.
    q_offset: an int, or a ``(B,)`` int32 tensor on the queries' device.

    Holds tensors, so it compares by identity (``eq=False``).
    """

    causal: bool = False
    cu: Optional[tuple] = None
    left: int = -1
    right: int = -1
    softcap: float = 0.0
    sinks: Optional[Tensor] = None
    kv_range: Optional[Tensor] = None
    q_offset: Union[int, Tensor] = 0

    def plain(self) -> bool:
        """Whether every keyword is at its default (the mask is ``NO_MASK``, no sinks)."""
        return (self.cu is None and self.left == -1 and self.right == -1 and self.softcap == 0.0
                and self.sinks is None and self.kv_range is None and isinstance(self.q_offset, int)
                and self.q_offset == 0)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _int_tensor(name: str, t: Tensor) -> None:
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")


# a CUDA cu_seqlens tensor -> (its _version when read, its values): one host read per tensor while unmodified
_CU_CACHE = WeakIdKeyDictionary()


def _host_values(cu: Tensor) -> tuple:
    return tuple(cu.tolist())


def cached_values(cu: Tensor) -> tuple:
    """``cu``'s values, read to the host once per (tensor, ``_version``)."""
    hit = _CU_CACHE.get(cu)
    if hit is not None and hit[0] == cu._version:
        return hit[1]
    values = _host_values(cu)
    _CU_CACHE[cu] = (cu._version, values)
    return values


def _cu_values(cu) -> tuple:
    """The boundaries as host ints: a CPU tensor or a sequence costs no synchronisation, another
    device's tensor is read once (:func:`cached_values`)."""
    if isinstance(cu, Tensor):
        if cu.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu.shape)}")
        _int_tensor("cu_seqlens", cu)
        return _host_values(cu) if cu.device.type == "cpu" else cached_values(cu)
    if isinstance(cu, (str, bytes)) or not hasattr(cu, "__len__"):
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor or a sequence of ints, got {type(cu).__name__}")
    values = tuple(cu)
    if not all(_is_int(c) for c in values):
        raise ValueError(f"cu_seqlens must hold ints, got {list(values)!r}")
    return tuple(int(c) for c in values)


def _traced_cu(cu: Tensor, sq: int) -> Tensor:
    """A ``cu_seqlens`` tensor inside ``torch.compile``: kept on its device (reading it would break the
    graph), its values checked by device-side assertions."""
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D with at least one entry, got shape {tuple(cu.shape)}")
    _int_tensor("cu_seqlens", cu)
    steps_ok = (cu[1:] >= cu[:-1]).all()
    _device_check(steps_ok & (cu[0] == 0) & (cu[-1] == sq), f"cu_seqlens must rise from 0 to {sq}")
    return cu.to(torch.long)


def documents_need_no_offset(q_offset) -> None:
    """``cu_seqlens`` takes ``q_offset`` 0 only: an int 0 or None (a tensor, whose values only the
    device holds, is refused whatever it holds, on one device and sharded alike)."""
    if q_offset is not None and (isinstance(q_offset, Tensor) or q_offset != 0):
        raise ValueError(f"cu_seqlens needs q_offset == 0 (an int), got {q_offset!r}")


def check_cu_seqlens(cu, sq: int, sk: int, q_offset) -> Optional[Union[tuple, Tensor]]:
    """``cu_seqlens`` as a tuple of host ints, checked against the (global) lengths ``sq``, ``sk``
    (inside ``torch.compile``, a tensor stays a tensor: :func:`_traced_cu`)."""
    if cu is None:
        return None
    if sq != sk:
        raise ValueError(f"cu_seqlens needs self-attention (Sq == Sk), got Sq={sq}, Sk={sk}")
    documents_need_no_offset(q_offset)
    if isinstance(cu, Tensor) and torch.compiler.is_compiling():
        return _traced_cu(cu, sq)
    values = _cu_values(cu)
    if len(values) < 1:
        raise ValueError("cu_seqlens must have at least one entry (cu[0] = 0)")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {list(values)}")
    if values[-1] != sq:
        raise ValueError(f"cu_seqlens[-1] must equal the sequence length {sq}, got {values[-1]}")
    return values


def check_window(window) -> tuple[int, int]:
    """``window_size`` as ``(left, right)``, ``-1`` unbounded."""
    if window is None:
        return -1, -1
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window!r}")
    left, right = window
    if not (_is_int(left) and _is_int(right)):
        raise ValueError(f"window_size entries must be ints, got {window!r}")
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1, got {tuple(window)}")
    # (an edge 2^31 - 1 or more away bounds nothing: positions are below 2^31)
    return tuple(-1 if int(e) >= _UNBOUNDED else int(e) for e in (left, right))


_UNBOUNDED = 2 ** 31 - 1


def check_softcap(softcap) -> float:
    """``softcap`` as a float (0.0: none)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"softcap must be a positive float, got {type(softcap).__name__} {softcap!r}")
    softcap = _checks.as_float("softcap", softcap)
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be finite and > 0, got {softcap}")
    return softcap


def check_sinks(sinks, heads: int, device) -> Optional[Tensor]:
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        raise ValueError(f"sinks must be a float tensor (H,), got {getattr(sinks, 'dtype', type(sinks).__name__)}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape (H,) = ({heads},), got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}")
    return sinks


def _device_check(ok: Tensor, message: str) -> None:
    """``ValueError`` when ``ok`` is false; a device-side assertion where reading it would
    synchronise (CUDA) or break a traced graph (``torch.compile``)."""
    if ok.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)


def check_kv_range(kv_range, batch: int, sk: int, device) -> Optional[Tensor]:
    """``kv_range`` as ``(B, 2)`` int32 on ``device`` (global key positions)."""
    if kv_range is None:
        return None
    if not isinstance(kv_range, Tensor):
        raise ValueError(f"kv_range must be an integer tensor (B, 2), got {type(kv_range).__name__}")
    _int_tensor("kv_range", kv_range)
    if tuple(kv_range.shape) != (batch, 2):
        raise ValueError(f"kv_range must have shape (B, 2) = ({batch}, 2), got {tuple(kv_range.shape)}")
    if kv_range.device != device:
        raise ValueError(f"kv_range is on {kv_range.device} but q is on {device}")
    lo, hi = kv_range[:, 0], kv_range[:, 1]
    _device_check(((lo <= hi) & (lo >= 0) & (hi <= sk)).all(),
                  f"kv_range must satisfy 0 <= kv_range[b, 0] <= kv_range[b, 1] <= Sk = {sk}")
    return kv_range.to(torch.int32)


def check_q_offset(q_offset, batch: int, device) -> Union[int, Tensor]:
    """``q_offset`` as an int (within ``+-2^40``) or a ``(B,)`` int32 tensor on ``device``; a tensor's
    entries beyond ``+-2^30`` (read on the device, so never checked on the host) are clamped there:
    with sequences and windows shorter than ``2^29`` such a query sees the same keys either way (all
    or none)."""
    if _is_int(q_offset):  # (past +-2^40 every key is seen or none, as at +-2^40)
        return min(max(int(q_offset), -(2 ** 40)), 2 ** 40)
    if not isinstance(q_offset, Tensor):
        raise ValueError(f"q_offset must be an int or an integer tensor (B,), got {type(q_offset).__name__}")
    _int_tensor("q_offset", q_offset)
    if tuple(q_offset.shape) != (batch,):
        raise ValueError(f"q_offset must be an int or have shape (B,) = ({batch},), got {tuple(q_offset.shape)}")
    if q_offset.device != device:
        raise ValueError(f"q_offset is on {q_offset.device} but q is on {device}")
    if q_offset.dtype in (torch.int32, torch.int64):  # (the kernels add positions to int32 offsets)
        q_offset = q_offset.clamp(-_OFFSET_BOUND, _OFFSET_BOUND)
    return q_offset.to(torch.int32)


_OFFSET_BOUND = 2 ** 30


def parse(*, batch: int, heads: int, sq: int, sk: int, device, causal: bool, cu_seqlens=None, window_size=None,
          softcap=None, sinks=None, kv_range=None, q_offset=0) -> Variants:
    """Check the keywords for queries ``(batch, heads, sq)`` over ``sk`` keys (global lengths when
    sharded) on ``device``; raises ``ValueError`` naming the argument."""
    if q_offset is None:
        q_offset = 0
    off = check_q_offset(q_offset, batch, device)
    cu = check_cu_seqlens(cu_seqlens, sq, sk, off)
    left, right = check_window(window_size)
    return Variants(causal=bool(causal), cu=cu, left=left, right=right, softcap=check_softcap(softcap),
                    sinks=check_sinks(sinks, heads, device), kv_range=check_kv_range(kv_range, batch, sk, device),
                    q_offset=off)


def _band(spec: Variants, shift: int) -> tuple[bool, int, Optional[int]]:
    """``(causal, diag, lo)`` of the local op for a query/key shift ``q_off + q_start - k_start``:
    key ``j`` in ``[i + shift - left, i + shift + min(0 if causal, right)]``."""
    upper = [e for e, on in ((0, spec.causal), (spec.right, spec.right >= 0)) if on]
    lo = None if spec.left < 0 else shift - spec.left
    return bool(upper), shift + (min(upper) if upper else 0), lo


def _rows_of(bounds: Tensor, q_start: int, q_len: int, k_start: int, k_len: int) -> Tensor:
    """``(2, q_len)`` int32: the key interval of each query row's document (``bounds`` the int64
    boundaries), local to the key segment and clamped to ``[0, k_len]``."""
    if q_len == 0 or bounds.shape[0] < 2:
        return torch.zeros(2, 0, dtype=torch.int32, device=bounds.device)
    pos = torch.arange(q_start, q_start + q_len, dtype=torch.long, device=bounds.device)
    doc = (torch.searchsorted(bounds, pos, right=True) - 1).clamp_(0, bounds.shape[0] - 2)
    rows = torch.stack((bounds[doc], bounds[doc + 1])) - k_start
    return rows.clamp_(0, k_len).to(torch.int32)


@lru_cache(maxsize=64)
def _doc_rows_host(cu: tuple, q_start: int, q_len: int, k_start: int, k_len: int) -> Tensor:
    """:func:`_rows_of` for host boundaries ``cu``."""
    if q_start < 0 or q_start + q_len > cu[-1]:
        raise ValueError(f"query positions [{q_start}, {q_start + q_len}) lie outside cu_seqlens {list(cu)}")
    return _rows_of(torch.tensor(cu, dtype=torch.long), q_start, q_len, k_start, k_len)


_ROWS_CACHE: dict = {}


def doc_rows(cu: tuple, q_start: int, q_len: int, k_start: int, k_len: int, device) -> Tensor:
    """:func:`_doc_rows_host` on ``device`` (the copy kept per device: one upload per plan), its
    reach noted (:func:`splitsoftmax.core.mask.note_reach`: how far a row lies past its document's start)."""
    if torch.compiler.is_compiling():  # a traced constant: no cache to mutate
        return _doc_rows_host.__wrapped__(cu, q_start, q_len, k_start, k_len).to(device)
    key = (cu, q_start, q_len, k_start, k_len, torch.device(device))
    hit = _ROWS_CACHE.get(key)
    if hit is None:
        host = _doc_rows_host(cu, q_start, q_len, k_start, k_len)
        hit = host.to(device)
        note_reach(hit, int((torch.arange(q_len) - host[0]).max()) if q_len else 0)
        if len(_ROWS_CACHE) >= 64:
            _ROWS_CACHE.pop(next(iter(_ROWS_CACHE)))
        _ROWS_CACHE[key] = hit
    return hit


def local_mask(spec: Variants, q_start: int, q_len: int, k_start: int, k_len: int, device) -> tuple[Mask, bool, int]:
    """``(mask, causal, diag)`` for the local op of the queries at global rows ``[q_start, q_start + q_len)``
    over the keys at global positions ``[k_start, k_start + k_len)``.

    Local query ``i`` and key ``j`` see each other iff the contract's rule holds for global query
    ``q_start + i`` and key ``k_start + j`` (see :mod:`splitsoftmax.core.mask` for the local rule).
    """
    tensor_off = isinstance(spec.q_offset, Tensor)
    causal, diag, lo = _band(spec, (0 if tensor_off else spec.q_offset) + q_start - k_start)
    if not tensor_off:  # edges past either end see all keys or none: the kernels' int32 positions stay small
        diag = min(max(diag, -q_len), k_len)
        lo = None if lo is None else min(max(lo, -q_len), k_len)
    if isinstance(spec.cu, Tensor):
        rows = _rows_of(spec.cu, q_start, q_len, k_start, k_len)
    else:
        rows = None if spec.cu is None else doc_rows(spec.cu, q_start, q_len, k_start, k_len, device)
    kv = None
    if spec.kv_range is not None:
        kv = (spec.kv_range - k_start).clamp_(0, k_len)
    mask = Mask(lo=lo, softcap=spec.softcap, kv_range=kv, q_offset=spec.q_offset if tensor_off else None, rows=rows)
    return (NO_MASK if mask.plain() else mask), causal, diag
