"""The allgather schedule: K/V gathered once, dK/dV reduce-scattered back to their owners.

Both collectives are direct exchanges (every rank posts its ``P-1`` sends and receives at once,
empty buffers skipped, any per-rank sizes) and the reduction sums in rank order, so every
transport gives the same, reproducible result. The visits are the ring's (``ring.py``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .._log import LOG, nbytes
from .comm import Communicator
from .ring import AttnSpec, attn_bwd_visit, attn_fwd_visit, empty_acc, finish_acc, pack, unpack
from .. import state

TAG_GATHER, TAG_SCATTER = 31, 32


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


def allgather_attention_fwd(comm: Communicator, spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor):
    """Forward: gather every rank's packed K/V, then visit them in rank order."""
    bufs = allgather_var(comm, pack(k, v), spec.kv_numel, "allgather forward: gathering K/V")
    acc = empty_acc(spec, q)
    visit = attn_fwd_visit(spec, q, acc)
    for origin, buf in enumerate(bufs):
        visit(origin, buf)
    return finish_acc(acc, q.dtype)


def allgather_attention_bwd(comm: Communicator, spec: AttnSpec, q, k, v, dout, lse, delta):
    """Backward: gather K/V again, compute every owner's dK/dV, reduce-scatter them home."""
    bufs = allgather_var(comm, pack(k, v), spec.kv_numel, "allgather backward: gathering K/V")
    dq = torch.zeros(q.shape, dtype=state.stat_dtype(q.dtype), device=q.device)
    visit = attn_bwd_visit(spec, q, dout, lse, delta, dq)
    parts = [visit(origin, buf) for origin, buf in enumerate(bufs)]
    dk, dv = unpack(reduce_scatter_var(comm, parts, "allgather backward: reduce-scatter of dK/dV"), spec, spec.rank)
    return dq, dk, dv
