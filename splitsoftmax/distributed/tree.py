"""The tree schedule: a fixed-order all-reduce of packed states (Bruck all-gather + ordered merge).

``bruck_allgather`` takes ``ceil(log2 P)`` rounds: in round ``k`` rank ``r`` sends the blocks it
holds (its own and those of ranks ``r+1 ..``, at most ``2^k``) to ``r - 2^k`` and receives as
many from ``r + 2^k``. Every rank then holds all ``P`` blocks and merges them in rank order with
``splitsoftmax.state``: the result is bit-identical on every rank and from run to run. A state
travels packed, ``(out, lse)`` in one float32 buffer, one message per round. Where the transport
has its own all-gather (NCCL), :func:`allgather` uses that one collective instead of the rounds;
the blocks arrive in the same rank order, so the merge is unchanged.

Used for split-KV attention (q replicated, K/V contiguous shards, causal bottom-right aligned
over the global key sequence) and for the row statistics of the sharded softmax family.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import state
from .._log import LOG, nbytes
from ..local import op
from . import layout
from .comm import Communicator
from .ring import AttnSpec

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


def _tree_block(spec: AttnSpec, sq: int) -> tuple[str, int]:
    """Decision for this rank's keys: the queries are the last ``sq`` global key positions."""
    total, off = sum(spec.k_lens), sum(spec.k_lens[:spec.rank])
    return layout.decide(total - sq, sq, off, spec.k_lens[spec.rank], spec.causal)


def local_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, kind: str, diag: int) -> tuple[Tensor, Tensor]:
    """This rank's partial ``(out (B,H,Sq,Dv), lse (B,H,Sq))`` for the decision ``kind``/``diag``."""
    if kind == layout.SKIP:
        e = state.empty_state(q.shape[:3], v.shape[-1], dtype=state.stat_dtype(q.dtype), device=q.device)
        return state.to_out_lse(e)
    return op("attn_fwd", q)(q, k, v, scale, kind == layout.DIAG, diag)


def early_local(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Optional[tuple[Tensor, Tensor]]:
    """The partial state when it needs nothing from the peers (not causal), else None: started
    before the handshake completes, it hides the handshake's round trip."""
    if causal:
        return None
    with torch.no_grad():
        return local_attention(q, k, v, scale, *layout.decide(0, q.shape[2], 0, k.shape[2], False))


def tree_attention_fwd(comm: Communicator, spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor,
                       local: Optional[tuple[Tensor, Tensor]] = None):
    """``(out (B,H,Sq,Dv) q.dtype, lse (B,H,Sq) accumulation dtype)``, identical on every rank.

    ``local``: this rank's partial state when already computed (:func:`early_local`)."""
    out, lse = local if local is not None else local_attention(q, k, v, spec.scale, *_tree_block(spec, q.shape[2]))
    dt = state.stat_dtype(q.dtype)
    packed = torch.cat((out.to(dt), lse.to(dt).unsqueeze(-1)), dim=-1)  # [B, H, Sq, Dv+1]
    parts = allgather(comm, packed.reshape(-1), "tree forward").view(comm.size, *packed.shape)
    out, lse = op("merge_out_lse", parts)(parts[..., :-1], parts[..., -1])  # fixed order: same on every rank
    return out.to(q.dtype), lse


def tree_attention_bwd(comm: Communicator, spec: AttnSpec, q, k, v, dout, lse, delta):
    """``(dq summed over ranks, dk, dv local)``, float32."""
    kind, diag = _tree_block(spec, q.shape[2])
    dt = state.stat_dtype(q.dtype)
    if kind == layout.SKIP:
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        dk = torch.zeros(k.shape, dtype=dt, device=q.device)
        dv = torch.zeros(v.shape, dtype=dt, device=q.device)
    else:
        dq, dk, dv = op("attn_bwd", q)(q, k, v, dout.contiguous(), lse, delta, spec.scale, kind == layout.DIAG, diag)
    return allreduce_sum(comm, dq.to(dt), "tree backward: sum of dq"), dk, dv
