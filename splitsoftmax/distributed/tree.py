"""The tree schedule: a fixed-order all-reduce of packed states (Bruck all-gather + ordered merge).

``bruck_allgather`` takes ``ceil(log2 P)`` rounds: in round ``k`` rank ``r`` sends the blocks it
holds (its own and those of ranks ``r+1 ..``, at most ``2^k``) to ``r - 2^k`` and receives as
many from ``r + 2^k``. Every rank then holds all ``P`` blocks and merges them in rank order with
``splitsoftmax.core.state``: the result is bit-identical on every rank and from run to run. A state
travels packed, ``(out, lse)`` in one float32 buffer, one message per round. Where the transport
has its own all-gather (NCCL), :func:`allgather` uses that one collective instead of the rounds;
the blocks arrive in the same rank order, so the merge is unchanged.

Used for split-KV attention (q replicated, K/V contiguous shards, causal bottom-right aligned
over the global key sequence) and for the row statistics of the sharded softmax family. Under the
variant keywords (all but ``cu_seqlens``) the queries sit at key positions ``q_offset + i``
(default ``Sk - Sq``); with an int offset a rank whose keys no query sees launches nothing (its
partial is the empty state), with a device tensor the offset travels in the local op's mask.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import plan as pl
from ..core import state
from ..core.log import LOG, nbytes
from ..ops._registry import masked_op, op
from .comm import Communicator
from .work import AttnSpec, Call, make_mask

TAG_TREE = 41


def allgather(comm: Communicator, mine: Tensor, step: str) -> Tensor:
    """Equal-sized flat buffers of every rank, ``(P, n)`` in rank order: the transport's own
    all-gather where it has one (NCCL's), else :func:`bruck_allgather`."""
    native = comm.allgather(mine, step) if comm.size > 1 and mine.numel() else None
    return native if native is not None else bruck_allgather(comm, mine, step)


def bruck_allgather(comm: Communicator, mine: Tensor, step: str) -> Tensor:
    """Equal-sized flat buffers of every rank, ``(P, n)`` in rank order, in ``ceil(log2 P)`` rounds."""
    p, r = comm.size, comm.rank
    held = mine.reshape(1, -1)  # held[i] is the block of rank (r + i) % P
    k = 1
    while k < p:
        n = min(k, p - k)
        got = held.new_empty((n, held.shape[1]))
        if held.shape[1]:
            send = held[:n].contiguous().reshape(-1)
            LOG.debug("%s: tree round %d, rank %d sends %d bytes to rank %d, receives from rank %d", step,
                      k.bit_length(), r, nbytes(send), (r - k) % p, (r + k) % p)
            hs = comm.post([(send, (r - k) % p)], [(got.view(-1), (r + k) % p)], TAG_TREE)
            comm.wait(hs, f"{step}: tree round {k.bit_length()} with ranks {(r - k) % p} and {(r + k) % p}")
        held = torch.cat((held, got))
        k *= 2
    return held.roll(r, dims=0)


def allreduce_sum(comm: Communicator, t: Tensor, step: str) -> Tensor:
    """Sum of ``t`` over ranks, added in rank order (identical on every rank)."""
    return allgather(comm, t.reshape(-1).contiguous(), step).sum(dim=0).view(t.shape)


def merge_lse(comm: Communicator, lse: Tensor, step: str) -> Tensor:
    """logsumexp over ranks of per-rank row statistics ``lse (R,)``: the merged ``(R,)``."""
    lses = allgather(comm, lse.contiguous(), step)  # (P, R)
    none = lses.new_zeros((*lses.shape, 0))
    return state.lse_of(state.merge_stack(state.from_out_lse(none, lses)))


def tree_call(spec: AttnSpec, sq: int) -> Optional[Call]:
    """This rank's call over its keys (None: no query sees them); the queries sit at key positions
    ``q_offset + i`` (default ``Sk - Sq``: bottom-right)."""
    kw, off, n = spec.kw, sum(spec.k_lens[:spec.rank]), spec.k_lens[spec.rank]
    qoff = sum(spec.k_lens) - sq if kw.q_offset is None else kw.q_offset
    b = pl.band(spec.causal, kw.window)
    on_device = isinstance(qoff, Tensor)
    piece = pl.tree_piece(sq, off, n, b, None if on_device else qoff)
    if piece is None:
        return None
    kv = None if kw.kv_range is None else kw.kv_range - (off + piece.k)
    banded = b.lo is not None or b.hi is not None
    mask = make_mask(kw.softcap, piece.lo, kv, (qoff - off) if on_device and banded else None)
    return Call(piece.q, piece.nq, piece.k, piece.nk, piece.causal, piece.diag, mask)


def _empty(q: Tensor, dv: int) -> tuple[Tensor, Tensor]:
    return state.to_out_lse(state.empty_state(q.shape[:3], dv, dtype=state.stat_dtype(q.dtype), device=q.device))


def local_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, call: Optional[Call]) -> tuple[Tensor, Tensor]:
    """This rank's partial ``(out (B,H,Sq,Dv), lse (B,H,Sq))`` of ``call`` (None: the empty state)."""
    if call is None:
        return _empty(q, v.shape[-1])
    ks = slice(call.k, call.k + call.nk)
    if call.q == 0 and call.nq == q.shape[2]:
        return masked_op("attn_fwd", q, call.mask)(q, k[:, :, ks], v[:, :, ks], scale, call.causal, call.diag)
    out, lse = _empty(q, v.shape[-1])
    qs = slice(call.q, call.q + call.nq)
    masked_op("attn_fwd_acc", q, call.mask)(q[:, :, qs], k[:, :, ks], v[:, :, ks], scale, call.causal, call.diag,
                                            out[:, :, qs], lse[:, :, qs])
    return out, lse


def early_local(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, kw) -> Optional[tuple[Tensor, Tensor]]:
    """The partial state when it needs nothing from the peers (no band, no kv_range), else None:
    started before the handshake completes, it hides the handshake's round trip."""
    if causal or kw.window is not None or kw.kv_range is not None:
        return None
    with torch.no_grad():
        mask = make_mask(kw.softcap)
        return local_attention(q, k, v, scale, Call(0, q.shape[2], 0, k.shape[2], False, 0, mask))


def tree_attention_fwd(comm: Communicator, spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor,
                       local: Optional[tuple[Tensor, Tensor]] = None):
    """``(out (B,H,Sq,Dv), lse (B,H,Sq))`` in the accumulation dtype, identical on every rank.

    ``local``: this rank's partial state when already computed (:func:`early_local`)."""
    out, lse = local if local is not None else local_attention(q, k, v, spec.scale, tree_call(spec, q.shape[2]))
    dt = state.stat_dtype(q.dtype)
    packed = torch.cat((out.to(dt), lse.to(dt).unsqueeze(-1)), dim=-1)  # [B, H, Sq, Dv+1]
    parts = allgather(comm, packed.reshape(-1), "tree forward").view(comm.size, *packed.shape)
    return op("merge_out_lse", parts)(parts[..., :-1], parts[..., -1])  # fixed order: same on every rank


def tree_attention_bwd(comm: Communicator, spec: AttnSpec, q, k, v, dout, lse, delta):
    """``(dq summed over ranks, dk, dv local)``, float32."""
    call = tree_call(spec, q.shape[2])
    dt = state.stat_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    dk = torch.zeros(k.shape, dtype=dt, device=q.device)
    dv = torch.zeros(v.shape, dtype=dt, device=q.device)
    if call is not None:
        qs, ks = slice(call.q, call.q + call.nq), slice(call.k, call.k + call.nk)
        dqp, dkp, dvp = masked_op("attn_bwd", q, call.mask)(q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                                            dout[:, :, qs].contiguous(), lse[:, :, qs],
                                                            delta[:, :, qs], spec.scale, call.causal, call.diag)
        dq[:, :, qs], dk[:, :, ks], dv[:, :, ks] = dqp, dkp, dvp
    return allreduce_sum(comm, dq, "tree backward: sum of dq"), dk, dv
