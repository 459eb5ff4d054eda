"""The tree schedule: a fixed-order all-reduce of packed states (Bruck all-gather + ordered merge).

``bruck_allgather`` takes ``ceil(log2 P)`` rounds: in round ``k`` rank ``r`` sends the blocks it
holds (its own and those of ranks ``r+1 ..``, at most ``2^k``) to ``r - 2^k`` and receives as
many from ``r + 2^k``. Every rank then holds all ``P`` blocks and merges them in rank order with
``splitsoftmax.core.state``: the result is bit-identical on every rank and from run to run. A state
travels packed, ``(out, lse)`` in one float32 buffer, one message per round. Where the transport
has its own all-gather (NCCL), :func:`allgather` uses that one collective instead of the rounds;
the blocks arrive in the same rank order, so the merge is unchanged.

Used by split-KV attention (``ops/attention/schedules/tree.py``), the row statistics of the
sharded softmax family, cross-entropy and vocabulary statistics. Beside it, the all-gather and
reduce-scatter of blocks of any lengths (:func:`allgather_var`, :func:`reduce_scatter_var`).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..core import state
from ..core.log import LOG, nbytes
from .comm import Communicator

TAG_TREE = 41
TAG_GATHER, TAG_SCATTER = 31, 32


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


def allgather_var(comm: Communicator, mine: Tensor, numel: Callable[[int], int], step: str) -> list:
    """Every rank's flat buffer (sizes ``numel(rank)``), in rank order."""
    r = comm.rank
    bufs = [mine if q == r else mine.new_empty(numel(q)) for q in range(comm.size)]
    peers = [q for q in range(comm.size) if q != r]
    sends = [(mine, q) for q in peers if mine.numel()]
    LOG.debug("%s: rank %d sends %d bytes to each of %d peer(s), receives %d bytes", step, r, nbytes(mine),
              len(sends), sum(nbytes(bufs[q]) for q in peers))
    handles = comm.post(sends, [(bufs[q], q) for q in peers if bufs[q].numel()], TAG_GATHER)
    comm.wait(handles, step)
    return bufs


def reduce_scatter_var(comm: Communicator, parts: list, step: str) -> Tensor:
    """Sum over ranks of ``parts[rank]`` (this rank's contribution to each owner), summed in rank order."""
    r = comm.rank
    got = [parts[r] if q == r else parts[r].new_empty(parts[r].numel()) for q in range(comm.size)]
    peers = [q for q in range(comm.size) if q != r]
    LOG.debug("%s: rank %d sends %d bytes, receives %d bytes", step, r, sum(nbytes(parts[q]) for q in peers),
              sum(nbytes(got[q]) for q in peers))
    handles = comm.post([(parts[q], q) for q in peers if parts[q].numel()],
                        [(got[q], q) for q in peers if got[q].numel()], TAG_SCATTER)
    comm.wait(handles, step)
    return torch.stack(got).sum(dim=0)
