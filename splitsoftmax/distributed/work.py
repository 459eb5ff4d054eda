"""The local-op calls of one sharded attention: the agreed spec, each step's calls with their
masks, and K/V buffers packed by rows.

A plan (``splitsoftmax.distributed.plan``) is pure host integers; :class:`Planned` keeps one with the small
device tensors it needs (per-row key intervals of the pieces by rows, the global positions of a
key buffer), built once and shared by every call with the same lengths, documents and window
(the layers of a step, forward and backward). Per call, only what depends on the call's tensors
is made: ``kv_range`` in each buffer's local indices (a search on the device, no synchronisation).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import plan as pl
from ..core.mask import NO_MASK, Mask, note_reach
from .attn_meta import Keywords


class Call(NamedTuple):
    """One local-op call: query rows ``[q, q + nq)`` against buffer keys ``[k, k + nk)``."""

    q: int
    nq: int
    k: int
    nk: int
    causal: bool
    diag: int
    mask: Mask


class Planned:
    """A :class:`~splitsoftmax.distributed.plan.Plan` and its device tensors, each built on first use."""

    def __init__(self, plan: pl.Plan):
        self.plan = plan
        self._dev: dict = {}

    def tensor(self, key: tuple, device, build) -> Tensor:
        k = (key, str(device))
        if k not in self._dev:
            self._dev[k] = build()
        return self._dev[k]

    def key_positions(self, s: int, device) -> Tensor:
        """Global positions ``(n,)`` int64 of the key buffer of step ``s`` (increasing)."""
        keys = self.plan.keys[s]
        return self.tensor(("kpos", s), device, lambda: pl.positions(keys, 0, nrows(keys), device))

    def rows(self, s: int, i: int, device) -> Tensor:
        """``Mask.rows`` of piece ``i`` of step ``s`` (a piece by rows), made on the host and uploaded
        once, its reach noted (:func:`uploaded_rows`)."""
        p = self.plan
        return self.tensor(("rows", s, i), device,
                           lambda: uploaded_rows(pl.rows(p.q, p.keys[s], p.pieces[s][i], p.docs, p.band), device))


def uploaded_rows(rows: Tensor, device) -> Tensor:
    """Host ``Mask.rows`` ``(2, n)`` on ``device``, with how far a row lies past its interval's first
    key noted (:func:`splitsoftmax.core.mask.note_reach`: the backward bounds its dS buffer by it)."""
    out = rows.to(device)
    note_reach(out, int((torch.arange(rows.shape[1]) - rows[0].long()).max()) if rows.shape[1] else 0)
    return out


@lru_cache(maxsize=8)
def planned(rank: int, q_lens: tuple, k_lens: tuple, layout: str, causal: bool, docs: Optional[tuple],
            window: Optional[tuple], min_gap: int = 1) -> Planned:
    """The plan of these arguments (``min_gap``: :func:`~splitsoftmax.distributed.plan.pieces`'),
    kept for the next calls with the same ones."""
    return Planned(pl.make_plan(rank, q_lens, k_lens, layout, causal, docs, window, min_gap=min_gap))


@dataclass
class AttnSpec:
    """What every rank agreed on in the handshake: shapes, flags, every rank's lengths, the
    variant keywords (``kw``) and, for ring / allgather, the plan."""

    b: int
    h: int
    hkv: int
    d: int
    dv: int
    scale: float
    causal: bool
    layout: str
    q_lens: list
    k_lens: list
    rank: int
    kw: Keywords = Keywords()
    planned: Optional[Planned] = None
    _calls: dict = field(default_factory=dict, repr=False)

    @property
    def plan(self) -> pl.Plan:
        return self.planned.plan

    def rows_numel(self, n: int) -> int:
        """Elements of ``n`` packed K/V (or dK/dV) rows: ``B*Hkv*n*(D+Dv)``."""
        return self.b * self.hkv * n * (self.d + self.dv)

    def kv_numel(self, origin: int) -> int:
        """Elements of the whole packed K/V buffer of rank ``origin``."""
        return self.rows_numel(self.k_lens[origin])

    def calls(self, s: int, device) -> tuple:
        """The calls of step ``s`` (made once per sharded call: the backward reuses the forward's)."""
        if s not in self._calls:
            self._calls[s] = step_calls(self, s, device)
        return self._calls[s]


def nrows(segs) -> int:
    return sum(s.n for s in segs)


def make_mask(softcap: float, lo=None, kv_range=None, q_offset=None, rows=None) -> Mask:
    m = Mask(lo=lo, softcap=softcap, kv_range=kv_range, q_offset=q_offset, rows=rows)
    return NO_MASK if m.plain() else m


def step_calls(spec: AttnSpec, s: int, device) -> tuple:
    """Step ``s``'s pieces as calls, with ``kv_range`` mapped to the buffer's local indices."""
    pieces, kw = spec.plan.pieces[s], spec.kw
    kvl = None
    if kw.kv_range is not None and pieces:
        kvl = torch.searchsorted(spec.planned.key_positions(s, device), kw.kv_range.long(), out_int32=True)  # [B, 2]
    out = []
    for i, pc in enumerate(pieces):
        rows = spec.planned.rows(s, i, device) if pc.rows else None
        mask = make_mask(kw.softcap, pc.lo, None if kvl is None else kvl - pc.k, None, rows)
        out.append(Call(pc.q, pc.nq, pc.k, pc.nk, pc.causal, pc.diag, mask))
    return tuple(out)


def pack(a: Tensor, b: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``a (B, Hkv, n, D)`` and ``b (B, Hkv, n, Dv)`` as one flat buffer (one message)."""
    return torch.cat((a.reshape(-1), b.reshape(-1))).to(dtype or a.dtype).contiguous()


def unpack_rows(buf: Tensor, spec: AttnSpec, n: int) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`pack` for ``n`` rows: ``(k (B,Hkv,n,D), v (B,Hkv,n,Dv))`` views."""
    split = spec.b * spec.hkv * n * spec.d
    return buf[:split].view(spec.b, spec.hkv, n, spec.d), buf[split:].view(spec.b, spec.hkv, n, spec.dv)


def unpack(buf: Tensor, spec: AttnSpec, origin: int) -> tuple[Tensor, Tensor]:
    """The whole K/V buffer of rank ``origin``."""
    return unpack_rows(buf, spec, spec.k_lens[origin])


class Packer:
    """Rows of this rank's ``k``, ``v`` packed for sending; the whole buffer is packed once."""

    def __init__(self, k: Tensor, v: Tensor):
        self.k, self.v, self._whole = k, v, None

    def rows(self, segs) -> Tensor:
        if len(segs) == 1 and segs[0].local == 0 and segs[0].n == self.k.shape[2]:
            if self._whole is None:
                self._whole = pack(self.k, self.v)
            return self._whole
        return pack_rows(self.k, self.v, segs)


def pack_rows(k: Tensor, v: Tensor, segs) -> Tensor:
    """The rows of ``segs`` (local indices along dim 2) of ``k`` and ``v``, packed in order."""
    if len(segs) == 1 and segs[0].local == 0 and segs[0].n == k.shape[2]:
        return pack(k, v)
    return pack(torch.cat([k[:, :, s.local:s.local + s.n] for s in segs], 2),
                torch.cat([v[:, :, s.local:s.local + s.n] for s in segs], 2))


def add_rows(dk: Tensor, dv: Tensor, buf: Tensor, spec: AttnSpec, segs) -> None:
    """Add packed rows ``buf`` (the rows of ``segs``, in order) into ``dk``, ``dv`` in place."""
    pk, pv = unpack_rows(buf, spec, nrows(segs))
    at = 0
    for s in segs:
        dk[:, :, s.local:s.local + s.n] += pk[:, :, at:at + s.n]
        dv[:, :, s.local:s.local + s.n] += pv[:, :, at:at + s.n]
        at += s.n
