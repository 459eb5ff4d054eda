"""The allgather schedule: K/V gathered once, dK/dV reduce-scattered back to their owners.

Both collectives are direct exchanges (every rank posts its ``P-1`` sends and receives at once,
empty buffers skipped, any per-rank sizes) and the reduction sums in rank order, so every
transport gives the same, reproducible result. The visits are the ring's (``ring.py``).

With documents or a window (a plan with ``direct``) each rank gathers from each owner only the key
rows its queries see (nothing: no transfer), and returns only those rows' dK/dV.
"""
from __future__ import annotations


import torch
from torch import Tensor

from ....distributed.comm import Communicator
from ....distributed.tree import TAG_GATHER, TAG_SCATTER, allgather_var, reduce_scatter_var
from .ring import attn_bwd_visit, attn_fwd_visit, by_origin, dq_of, state_of
from ....distributed.work import AttnSpec, Packer, add_rows, nrows, pack, unpack, unpack_rows
from ....core import state



def gather_seen(comm: Communicator, spec: AttnSpec, k: Tensor, v: Tensor, step: str) -> list:
    """Per step ``s``, the key rows of rank ``r - s`` this rank's queries see, ``(k, v)`` or None
    (step 0: this rank's own), all exchanged at once."""
    plan, p, r, own = spec.plan, comm.size, comm.rank, Packer(k, v)
    outs = {s: own.rows(plan.send[s]) for s in range(1, p) if plan.send[s]}
    bufs = {s: k.new_empty(spec.rows_numel(nrows(plan.keys[s]))) for s in range(1, p) if plan.keys[s]}
    hs = comm.post([(b, (r + s) % p) for s, b in outs.items()], [(b, (r - s) % p) for s, b in bufs.items()],
                   TAG_GATHER)
    comm.wait(hs, step)
    return [(k, v)] + [unpack_rows(bufs[s], spec, nrows(plan.keys[s])) if s in bufs else None for s in range(1, p)]


def _in_rank_order(spec: AttnSpec) -> list:
    """Steps ``s`` ordered by their owner rank ``(rank - s) % P``."""
    p = len(spec.k_lens)
    return sorted(range(p), key=lambda s: (spec.rank - s) % p)


def allgather_attention_fwd(comm: Communicator, spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor):
    """Forward: gather every rank's packed K/V (or the rows this rank sees), then visit them in
    rank order. ``(out, lse)`` in the accumulation dtype."""
    acc = [None]
    visit = attn_fwd_visit(spec, q, acc)
    if spec.plan.direct:
        got = gather_seen(comm, spec, k, v, "allgather forward: gathering K/V")
        for s in _in_rank_order(spec):
            if got[s] is not None:
                visit(s, *got[s])
        return state_of(acc, spec, q)
    bufs = allgather_var(comm, pack(k, v), spec.kv_numel, "allgather forward: gathering K/V")
    run = by_origin(spec, visit)
    for origin, buf in enumerate(bufs):
        run(origin, buf)
    return state_of(acc, spec, q)


def _scatter_seen(comm: Communicator, spec: AttnSpec, parts: list, k: Tensor, dt) -> tuple[Tensor, Tensor]:
    """Send each step's dK/dV rows to their owner; sum this rank's own in rank order of the senders."""
    plan, p, r = spec.plan, comm.size, comm.rank
    mine = {s: parts[s] for s in range(1, p) if parts[s] is not None}
    got = {s: torch.empty(spec.rows_numel(nrows(plan.send[s])), dtype=dt, device=k.device)
           for s in range(1, p) if plan.send[s]}
    hs = comm.post([(b, (r - s) % p) for s, b in mine.items()], [(b, (r + s) % p) for s, b in got.items()],
                   TAG_SCATTER)
    comm.wait(hs, "allgather backward: returning dK/dV")
    dk = torch.zeros(k.shape, dtype=dt, device=k.device)
    dv = torch.zeros(k.shape[:3] + (spec.dv,), dtype=dt, device=k.device)
    for t in range(p):  # the sender's rank order, this rank's own part in its place
        s = (t - r) % p
        if s == 0:
            pk, pv = unpack(parts[0], spec, r)
            dk += pk
            dv += pv
        elif s in got:
            add_rows(dk, dv, got[s], spec, plan.send[s])
    return dk, dv


def allgather_attention_bwd(comm: Communicator, spec: AttnSpec, q, k, v, dout, lse, delta, sink=None):
    """Backward: gather K/V again, compute every owner's dK/dV, reduce-scatter them home (``sink``:
    the sums for the sinks' gradient of this rank's rows, ``op.bwd_call``)."""
    dt = state.stat_dtype(q.dtype)
    dq = [None]
    visit = attn_bwd_visit(spec, q, dout, lse, delta, dq, sink)
    if spec.plan.direct:
        got = gather_seen(comm, spec, k, v, "allgather backward: gathering K/V")
        parts = [None] * len(got)
        for s in _in_rank_order(spec):
            if got[s] is not None:
                parts[s] = visit(s, *got[s])
        dk, dv = _scatter_seen(comm, spec, parts, k, dt)
        return dq_of(dq, q), dk, dv
    bufs = allgather_var(comm, pack(k, v), spec.kv_numel, "allgather backward: gathering K/V")
    run = by_origin(spec, visit)
    parts = [run(origin, buf) for origin, buf in enumerate(bufs)]
    dk, dv = unpack(reduce_scatter_var(comm, parts, "allgather backward: reduce-scatter of dK/dV"), spec, spec.rank)
    return dq_of(dq, q), dk, dv
