"""The ring loop, and the per-step attention work it is parameterised with.

``ring_loop`` visits every rank's K/V buffer: at step ``s`` rank ``r`` holds the buffer of rank
``(r - s) % P``; the next buffer is already in flight (non-blocking send to ``r+1`` / receive
from ``r-1``) while ``visit`` computes on the current one, so a pass costs ``P-1`` transfers.
With ``carry`` (the backward), each visit's contribution for the buffer's owner (dK/dV, float32)
travels around the ring too, accumulated on the way and arriving home after ``P-1`` more transfers.

The visits (``attn_fwd_visit``, ``attn_bwd_visit``) run the local ops of ``splitsoftmax.local``
on the block pairs that ``layout.block_pairs`` keeps; partial results stay float32 states merged
by ``splitsoftmax.state``. The allgather schedule reuses the same visits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import state
from .._log import LOG, clock, nbytes
from ..local import op
from . import layout
from .comm import Communicator

TAG_KV, TAG_DKV = 21, 22


@dataclass
class AttnSpec:
    """What every rank agreed on in the handshake: shapes, flags and every rank's lengths."""

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

    def kv_numel(self, origin: int) -> int:
        """Elements of the packed K/V (or dK/dV) buffer of rank ``origin``: ``B*Hkv*n*(D+Dv)``."""
        return self.b * self.hkv * self.k_lens[origin] * (self.d + self.dv)

    def pairs(self, origin: int) -> list:
        qs = layout.segments(self.layout, self.q_lens, self.rank)
        return layout.block_pairs(qs, layout.segments(self.layout, self.k_lens, origin), self.causal)


def pack(a: Tensor, b: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``a (B, Hkv, n, D)`` and ``b (B, Hkv, n, Dv)`` as one flat buffer (one message)."""
    return torch.cat((a.reshape(-1), b.reshape(-1))).to(dtype or a.dtype).contiguous()


def unpack(buf: Tensor, spec: AttnSpec, origin: int) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`pack` for rank ``origin``'s lengths: ``(k (B,Hkv,n,D), v (B,Hkv,n,Dv))``."""
    n = spec.k_lens[origin]
    split = spec.b * spec.hkv * n * spec.d
    return buf[:split].view(spec.b, spec.hkv, n, spec.d), buf[split:].view(spec.b, spec.hkv, n, spec.dv)


def _transfer(comm: Communicator, send: Tensor, recv: Tensor, tag: int) -> list:
    """Send to the next rank, receive from the previous one; empty buffers are not sent."""
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    LOG.debug("rank %d: send %d bytes to rank %d, receive %d bytes from rank %d (tag %d)", comm.rank, nbytes(send),
              nxt, nbytes(recv), prv, tag)
    return comm.post([(send, nxt)] if send.numel() else [], [(recv, prv)] if recv.numel() else [], tag)


def ring_loop(comm: Communicator, first: Tensor, numel: Callable[[int], int], visit: Callable,
              carry: Optional[Callable[[int], int]] = None, step: str = "ring") -> Optional[Tensor]:
    """Call ``visit(origin, buf)`` for every rank's buffer, ``first`` being this rank's.

    ``numel(origin)``: size of rank ``origin``'s buffer. With ``carry(origin)`` (its size),
    ``visit`` returns a flat contribution for ``origin``; the sum over all ranks of the
    contributions for this rank's buffer is returned.
    """
    p, r = comm.size, comm.rank
    cur, home, acc, acc_h = first, None, None, []
    for s in range(p):
        origin = (r - s) % p
        nbuf, kv_h = None, []
        if s < p - 1:
            nbuf = first.new_empty(numel((origin - 1) % p))
            kv_h = _transfer(comm, cur, nbuf, TAG_KV)
        t0 = clock()
        contrib = visit(origin, cur)
        LOG.debug("%s step %d/%d: rank %d on the K/V of rank %d, %.3f ms host time", step, s, p, r, origin,
                  1e3 * (clock() - t0))
        if carry is not None and s == 0:
            home = contrib
        elif carry is not None:
            if s >= 2:
                comm.wait(acc_h, f"{step} step {s}: dK/dV from rank {(r - 1) % p}")
                contrib = contrib + acc
            acc = contrib.new_empty(carry((origin - 1) % p))
            acc_h = _transfer(comm, contrib, acc, TAG_DKV)
        if s < p - 1:
            comm.wait(kv_h, f"{step} step {s}: K/V from rank {(r - 1) % p}")
            cur = nbuf
    if carry is None:
        return None
    if p > 1:
        comm.wait(acc_h, f"{step}: dK/dV returning home from rank {(r - 1) % p}")
        return home + acc
    return home


def _sl(t: Tensor, seg) -> Tensor:
    """The rows of segment ``seg`` along the sequence (dim 2), as a view (the kernels take strides)."""
    return t[:, :, seg.local:seg.local + seg.n]


def attn_fwd_visit(spec: AttnSpec, q: Tensor, acc: tuple[Tensor, Tensor]) -> Callable:
    """Visit for the forward: merge each block pair's attention into ``acc = (out, lse)`` in place."""
    fwd_acc = op("attn_fwd_acc", q)
    acc_out, acc_lse = acc

    def visit(origin: int, buf: Tensor) -> None:
        k, v = unpack(buf, spec, origin)
        for _, qs, ks, kind, diag in spec.pairs(origin):
            fwd_acc(_sl(q, qs), _sl(k, ks), _sl(v, ks), spec.scale, kind == layout.DIAG, diag,
                    _sl(acc_out, qs), acc_lse[:, :, qs.local:qs.local + qs.n])
    return visit


def attn_bwd_visit(spec: AttnSpec, q: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, dq: Tensor) -> Callable:
    """Visit for the backward: add to ``dq`` (float32), return the packed dK/dV for ``origin``."""
    bwd = op("attn_bwd", q)

    def visit(origin: int, buf: Tensor) -> Tensor:
        k, v = unpack(buf, spec, origin)
        dk = torch.zeros(k.shape, dtype=dq.dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=dq.dtype, device=q.device)
        for _, qs, ks, kind, diag in spec.pairs(origin):
            sq = slice(qs.local, qs.local + qs.n)
            dqp, dkp, dvp = bwd(_sl(q, qs), _sl(k, ks), _sl(v, ks), _sl(dout, qs), lse[:, :, sq], delta[:, :, sq],
                                spec.scale, kind == layout.DIAG, diag)
            dq[:, :, sq] += dqp
            dk[:, :, ks.local:ks.local + ks.n] += dkp
            dv[:, :, ks.local:ks.local + ks.n] += dvp
        return pack(dk, dv)
    return visit


def empty_acc(spec: AttnSpec, q: Tensor) -> tuple[Tensor, Tensor]:
    """The empty running state ``(out = 0 (B,H,Sq,Dv), lse = -inf (B,H,Sq))`` of this rank's queries,
    in the accumulation dtype (float32; float64 for float64 inputs)."""
    dt = state.stat_dtype(q.dtype)
    out = torch.zeros((spec.b, spec.h, q.shape[2], spec.dv), dtype=dt, device=q.device)
    return out, torch.full((spec.b, spec.h, q.shape[2]), float("-inf"), dtype=dt, device=q.device)


def finish_acc(acc: tuple[Tensor, Tensor], out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(out in out_dtype, lse)`` from the running state."""
    return acc[0].to(out_dtype), acc[1]


def ring_attention_fwd(comm: Communicator, spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor):
    """Forward of the ring schedule: ``(out, lse)`` of this rank's queries over all keys."""
    acc = empty_acc(spec, q)
    ring_loop(comm, pack(k, v), spec.kv_numel, attn_fwd_visit(spec, q, acc), step="ring forward")
    return finish_acc(acc, q.dtype)


def ring_attention_bwd(comm: Communicator, spec: AttnSpec, q, k, v, dout, lse, delta):
    """Backward of the ring schedule: ``(dq, dk, dv)`` float32 of this rank's shards."""
    dq = torch.zeros(q.shape, dtype=state.stat_dtype(q.dtype), device=q.device)
    visit = attn_bwd_visit(spec, q, dout, lse, delta, dq)
    dkv = ring_loop(comm, pack(k, v), spec.kv_numel, visit, carry=spec.kv_numel, step="ring backward")
    dk, dv = unpack(dkv, spec, spec.rank)
    return dq, dk, dv
