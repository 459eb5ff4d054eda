"""Which keys a query row sees, as the local attention ops take it.

The public keywords of docs/API.md's "Attention variants" (``cu_seqlens``, ``window_size``,
``kv_range``, ``q_offset``) all reduce to one rule per query row: row ``i`` of batch element ``b``
sees key ``j`` (both in the coordinates of the local op's own ``q`` and ``k``) iff

    max(row_lo[i], kv_lo[b], i + off[b] + lo)  <=  j  <=  min(row_hi[i] - 1, kv_hi[b] - 1, i + off[b] + diag)

where each term is present only when given: ``lo`` is ``Mask.lo`` (``None``: unbounded below),
``diag`` is the local op's ``diag`` argument when ``causal`` is set (unbounded above otherwise),
``off`` is ``Mask.q_offset`` (0 when absent), ``kv_lo/kv_hi`` come from ``Mask.kv_range`` and
``row_lo/row_hi`` from ``Mask.rows`` (packed documents). So every row's visible keys are one
contiguous interval, and a tile of rows has a key range to loop over (the union of its rows'
intervals) and an interior (their intersection) that needs no mask.

``softcap`` (0: none) maps scores ``s -> c * tanh(s / c)`` after the scale and before masking.
Sinks are not here: they are one more partial state, merged once per row by the caller.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary


class Mask(NamedTuple):
    """The variant part of a local attention op's visibility (the band's upper edge stays the ops'
    ``causal, diag`` arguments). Tensors live on ``q``'s device and are read there (no host sync).

    lo:       key ``j >= i + off + lo`` (a window's left edge), ``None``: unbounded.
    softcap:  ``c > 0`` caps the scaled scores as ``c * tanh(s / c)``; ``0.0``: no cap.
    kv_range: ``(B, 2)`` int32, element ``b`` sees ``kv_range[b, 0] <= j < kv_range[b, 1]``.
    q_offset: ``(B,)`` int32, added to the row index ``i`` in both band edges (``lo`` and ``diag``).
    rows:     ``(2, Sq)`` int32, row ``i`` sees ``rows[0, i] <= j < rows[1, i]`` (documents), shared
              by every batch element and head.
    """

    lo: Optional[int] = None
    softcap: float = 0.0
    kv_range: Optional[Tensor] = None
    q_offset: Optional[Tensor] = None
    rows: Optional[Tensor] = None

    def plain(self) -> bool:
        """Whether this is the default (today's full / causal visibility)."""
        return (self.lo is None and self.softcap == 0.0 and self.kv_range is None and self.q_offset is None
                and self.rows is None)


NO_MASK = Mask()

# a Mask.rows tensor -> (its _version when noted, its reach): noted where the host made it
_REACH = WeakIdKeyDictionary()


def note_reach(rows: Tensor, reach: int) -> None:
    """Note that no row ``i`` of ``rows`` (``Mask.rows``) lies more than ``reach`` past its interval's
    first key (``i - rows[0, i] <= reach``), a bound the host knows without reading the tensor back."""
    _REACH[rows] = (rows._version, reach)


def row_reach(rows: Tensor) -> Optional[int]:
    """The bound :func:`note_reach` noted for ``rows`` while it is unmodified, else None."""
    hit = _REACH.get(rows)
    return hit[1] if hit is not None and hit[0] == rows._version else None


def visible(mask: Mask, causal: bool, diag: int, b: int, sq: int, sk: int, device=None) -> Tensor:
    """The rule above as a dense boolean ``(B, Sq, Sk)`` tensor: ``[b, i, j]`` is whether row ``i`` of
    element ``b`` sees key ``j``. The definition the kernels, the CPU path and the oracles agree on
    (small sizes: tests and references)."""
    i = torch.arange(sq, device=device).view(1, sq, 1)
    j = torch.arange(sk, device=device).view(1, 1, sk)
    off = torch.zeros(b, 1, 1, dtype=torch.long, device=device)
    if mask.q_offset is not None:
        off = mask.q_offset.to(device=device, dtype=torch.long).view(b, 1, 1)
    ok = torch.ones(b, sq, sk, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i + off + diag
    if mask.lo is not None:
        ok &= j >= i + off + mask.lo
    if mask.kv_range is not None:
        kv = mask.kv_range.to(device=device, dtype=torch.long)
        ok &= (j >= kv[:, 0].view(b, 1, 1)) & (j < kv[:, 1].view(b, 1, 1))
    if mask.rows is not None:
        rows = mask.rows.to(device=device, dtype=torch.long)
        ok &= (j >= rows[0].view(1, sq, 1)) & (j < rows[1].view(1, sq, 1))
    return ok
