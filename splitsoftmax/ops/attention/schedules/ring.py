"""The ring schedule: its two transports, and the per-step attention work they are parameterised with.

At step ``s`` rank ``r`` computes on the keys of rank ``(r - s) % P`` while the next step's keys
are already in flight, so the transfers overlap the compute.

- ``ring_loop`` (full and causal visibility, no documents or window): every K/V buffer travels
  around the ring whole (non-blocking send to ``r+1`` / receive from ``r-1``), ``P-1`` transfers
  a pass. With ``carry`` (the backward), each visit's dK/dV for the buffer's owner travels around
  the ring too, accumulated on the way and arriving home after ``P-1`` more transfers.
- ``direct_loop`` (documents or a window, a plan with ``direct``): at step ``s`` rank ``r`` sends
  rank ``r+s`` the rows of its keys that rank's queries see and receives from ``r-s`` the rows its
  own queries see. A step with nothing visible sends nothing and launches nothing, on every rank
  alike (the plan is a function of agreed metadata); under a window only the halo travels, to one
  neighbour (contiguous) or two (zigzag). In the backward each step's dK/dV rows go straight home.

The visits (``attn_fwd_visit``, ``attn_bwd_visit``) run the local ops of ``splitsoftmax.ops._registry`` (``masked_op``)
on the calls of ``work.step_calls``; partial results stay float32 states merged by
``splitsoftmax.core.state``. The allgather schedule reuses the same visits. Under the heads
schedules the queries (the backward: ``dout``) may still be arriving by heads when a schedule
starts: both loops post their first transfers before the first visit, which runs chunk by chunk as
they land (``Arriving``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch
from torch import Tensor

from ....core import state
from ....core.log import LOG, clock, nbytes
from ..._registry import masked_op
from ..op import bwd_call
from ....distributed.alltoall import Arriving
from ....distributed.comm import Communicator
from ....distributed.work import AttnSpec, Packer, Planned, add_rows, nrows, pack, planned, unpack, unpack_rows
from ..._triton import configs

TAG_KV, TAG_DKV = 21, 22


def plan_of(rank: int, q_lens: tuple, k_lens: tuple, layout: str, causal: bool, docs: Optional[tuple],
            window: Optional[tuple]) -> Planned:
    """This rank's plan for the ring and the all-gather (``work.planned``), its pieces by rows cut
    where at least ``configs.ATTN_PLAN_MIN_GAP`` rows see no key of a step."""
    return planned(rank, tuple(q_lens), tuple(k_lens), layout, causal, docs, window, configs.ATTN_PLAN_MIN_GAP)


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


def post_keys(comm: Communicator, spec: AttnSpec, own: Packer, s: int) -> tuple:
    """Start step ``s``'s direct transfers: ``(receive buffer or None, handles, send buffer)``."""
    plan, p, r = spec.plan, comm.size, comm.rank
    out = own.rows(plan.send[s]) if plan.send[s] else None
    n = nrows(plan.keys[s])
    buf = own.k.new_empty(spec.rows_numel(n)) if n else None
    hs = comm.post([(out, (r + s) % p)] if out is not None else [], [(buf, (r - s) % p)] if buf is not None else [],
                   TAG_KV)
    return buf, hs, out


def direct_loop(comm: Communicator, spec: AttnSpec, k: Tensor, v: Tensor, visit: Callable,
                done: Optional[Callable] = None, step: str = "ring") -> None:
    """``visit(s, k_s, v_s)`` for every step with keys (step 0: this rank's own); ``done(s, result)``
    after every step (``result`` None where nothing was received), in step order."""
    p, r, own = comm.size, comm.rank, Packer(k, v)
    nxt = post_keys(comm, spec, own, 1) if p > 1 else None
    res = visit(0, k, v)
    if done is not None:
        done(0, res)
    for s in range(1, p):
        (buf, hs, _), nxt = nxt, (post_keys(comm, spec, own, s + 1) if s + 1 < p else None)
        comm.wait(hs, f"{step} step {s}: keys with ranks {(r - s) % p} and {(r + s) % p}")
        res = visit(s, *unpack_rows(buf, spec, nrows(spec.plan.keys[s]))) if buf is not None else None
        if done is not None:
            done(s, res)


def attn_fwd_visit(spec: AttnSpec, q, acc: list) -> Callable:
    """Visit for the forward: merge each call's attention into the running state ``acc[0] = (out,
    lse)`` in place (None until a call writes it: the first call covering every row writes its own
    state, as merging it into the empty one would, with no empty state made first).

    ``q``: the queries, or the queries still arriving by heads (:class:`Arriving` of ``(q,)``): the
    first visit then runs chunk by chunk as each arrives (each chunk's heads against the kv heads
    they read: per head the computation of the whole call), later visits on the whole."""
    cur = [q]

    def visit(s: int, k: Tensor, v: Tensor) -> None:
        if isinstance(cur[0], Tensor):
            return fwd_calls(spec, s, cur[0], k, v, acc)
        parts = []
        for lo, hi, (qc,) in cur[0].chunks():
            part, (k0, k1) = [None], kv_heads(spec, lo, hi)
            fwd_calls(spec, s, qc, k[:, k0:k1], v[:, k0:k1], part)
            parts.append(part[0])
        cur[0] = cur[0].whole()[0]
        if parts[0] is not None:  # (each chunk runs the same calls: all written or none)
            acc[0] = tuple(torch.cat(x, 1) for x in zip(*parts))
    return visit


def kv_heads(spec: AttnSpec, lo: int, hi: int) -> tuple:
    """The kv heads ``(k0, k1)`` that query heads ``[lo, hi)`` read (whole groups, or within one)."""
    g = spec.h // spec.hkv
    return lo // g, (hi - 1) // g + 1


def fwd_calls(spec: AttnSpec, s: int, q: Tensor, k: Tensor, v: Tensor, acc: list) -> None:
    """Step ``s``'s calls on ``q`` (any number of heads, ``k``, ``v`` those they read), merged into ``acc``."""
    for c in spec.calls(s, q.device):
        qs, ks = slice(c.q, c.q + c.nq), slice(c.k, c.k + c.nk)
        if acc[0] is None and (c.q, c.nq) == (0, q.shape[2]):
            acc[0] = masked_op("attn_fwd", q, c.mask)(q, k[:, :, ks], v[:, :, ks], spec.scale, c.causal, c.diag)
            continue
        out, lse = acc[0] = state_of(acc, spec, q)
        masked_op("attn_fwd_acc", q, c.mask)(q[:, :, qs], k[:, :, ks], v[:, :, ks], spec.scale, c.causal, c.diag,
                                             out[:, :, qs], lse[:, :, qs])


def state_of(acc: list, spec: AttnSpec, q) -> tuple[Tensor, Tensor]:
    """The forward's running state ``acc[0]``, the empty one (:func:`empty_acc`) where no call wrote it."""
    return acc[0] if acc[0] is not None else empty_acc(spec, arrived(q))


def arrived(x):
    """``x``, or where it is still arriving (:class:`Arriving`), its whole first tensor."""
    return x.whole()[0] if isinstance(x, Arriving) else x


def attn_bwd_visit(spec: AttnSpec, q: Tensor, dout, lse: Optional[Tensor], delta: Optional[Tensor], dq: list,
                   sink: Optional[list] = None) -> Callable:
    """Visit for the backward: add to ``dq[0]`` (float32; None until a call adds to it), return the
    buffer's ``(dk, dv)`` (float32) packed as one flat buffer (:func:`work.pack`'s layout). The first
    call's gradients are taken as they are where they cover every row (the queries' for ``dq``, the
    buffer's for dK/dV), not added to zeros. ``sink``: the sums for the sinks' gradient, as
    ``op.bwd_call`` adds them.

    ``dout`` may be still arriving by heads (:class:`Arriving` of ``(dout, lse, delta)``, ``lse`` and
    ``delta`` None; its chunks whole kv groups): the first visit then runs chunk by chunk as each
    arrives, after its schedule has posted its first transfers; later visits on the whole."""
    rows = [dout, lse, delta]

    def visit(s: int, k: Tensor, v: Tensor) -> Tensor:
        if not isinstance(rows[0], Arriving):
            return bwd_calls(spec, s, q, k, v, *rows, dq, sink)
        parts, grads = [], []
        for lo, hi, got in rows[0].chunks():
            (k0, k1), part = kv_heads(spec, lo, hi), [None]
            sub = replace(spec, h=hi - lo, hkv=k1 - k0, _calls=spec._calls)
            buf = bwd_calls(sub, s, q[:, lo:hi], k[:, k0:k1], v[:, k0:k1], *got, part, sink)
            grads.append(unpack_rows(buf, sub, k.shape[2]))
            parts.append(part[0])
        rows[:] = rows[0].whole()
        dq[0] = None if parts[0] is None else torch.cat(parts, 1)  # (each chunk runs the same calls)
        return pack(*(torch.cat(x, 1) for x in zip(*grads)))
    return visit


def bwd_calls(spec: AttnSpec, s: int, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor,
              dq: list, sink: Optional[list]) -> Tensor:
    """Step ``s``'s calls on ``q`` (``spec.h`` heads; ``k``, ``v`` the ``spec.hkv`` they read): ``dq``
    added to, the buffer's packed ``(dk, dv)`` returned (:func:`attn_bwd_visit`)."""
    n, buf = k.shape[2], None
    for c in spec.calls(s, q.device):
        qs, ks = slice(c.q, c.q + c.nq), slice(c.k, c.k + c.nk)
        dqp, dkp, dvp = bwd_call(masked_op("attn_bwd", q, c.mask),
                                 (q[:, :, qs], k[:, :, ks], v[:, :, ks], dout[:, :, qs], lse[:, :, qs],
                                  delta[:, :, qs], spec.scale, c.causal, c.diag), sink)
        dq[0] = added(dq[0], dqp, qs, q.shape[2])
        whole = buf is None and (c.k, c.nk) == (0, n)
        if buf is None:
            buf = (torch.empty if whole else torch.zeros)(spec.rows_numel(n), dtype=dkp.dtype, device=q.device)
        dk, dv = unpack_rows(buf, spec, n)
        if whole:
            dk.copy_(dkp)
            dv.copy_(dvp)
        else:
            dk[:, :, ks] += dkp
            dv[:, :, ks] += dvp
    if buf is None:
        buf = torch.zeros(spec.rows_numel(n), dtype=state.stat_dtype(q.dtype), device=q.device)
    return buf


def added(total: Optional[Tensor], part: Tensor, rows: slice, n: int) -> Tensor:
    """``total (B, H, n, D)`` (None: zeros) with ``part`` added at ``rows`` of dim 2: ``part`` itself
    where it is the first and covers every row."""
    if total is None:
        if (rows.start, rows.stop) == (0, n):
            return part
        total = part.new_zeros((*part.shape[:2], n, part.shape[3]))
    total[:, :, rows] += part
    return total


def dq_of(dq: list, q: Tensor) -> Tensor:
    """The backward's ``dq`` (float32) once every visit has added to ``dq[0]``: zeros where none did."""
    return dq[0] if dq[0] is not None else torch.zeros(q.shape, dtype=state.stat_dtype(q.dtype), device=q.device)


def empty_acc(spec: AttnSpec, q: Tensor) -> tuple[Tensor, Tensor]:
    """The empty running state ``(out = 0 (B,H,Sq,Dv), lse = -inf (B,H,Sq))`` of this rank's queries,
    in the accumulation dtype (float32; float64 for float64 inputs)."""
    dt = state.stat_dtype(q.dtype)
    out = torch.zeros((*q.shape[:3], spec.dv), dtype=dt, device=q.device)
    return out, torch.full(q.shape[:3], float("-inf"), dtype=dt, device=q.device)


def by_origin(spec: AttnSpec, visit: Callable) -> Callable:
    """``visit(s, k, v)`` as the ``visit(origin, buf)`` of a whole-buffer transport."""
    def run(origin: int, buf: Tensor):
        return visit((spec.rank - origin) % len(spec.k_lens), *unpack(buf, spec, origin))
    return run


def ring_attention_fwd(comm: Communicator, spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor):
    """Forward of the ring schedule: ``(out, lse)`` of this rank's queries over all keys, in the
    accumulation dtype."""
    acc = [None]
    visit = attn_fwd_visit(spec, q, acc)
    if spec.plan.direct:
        direct_loop(comm, spec, k, v, visit, step="ring forward")
    else:
        ring_loop(comm, pack(k, v), spec.kv_numel, by_origin(spec, visit), step="ring forward")
    return state_of(acc, spec, q)


def direct_bwd(comm: Communicator, spec: AttnSpec, k: Tensor, v: Tensor, visit: Callable, dt: torch.dtype):
    """The direct transport's backward: every step's dK/dV rows sent to their owner at once, the
    rows of this rank's keys that each peer computed added in step order to its own step's:
    ``(dk, dv)``."""
    plan, p, r = spec.plan, comm.size, comm.rank
    own, homes = [], []

    def done(s: int, res) -> None:
        if s == 0:
            own.append(res)
            return
        n = nrows(plan.send[s])
        got = torch.empty(spec.rows_numel(n), dtype=dt, device=k.device) if n else None
        hs = comm.post([(res, (r - s) % p)] if res is not None else [], [(got, (r + s) % p)] if n else [], TAG_DKV)
        homes.append((s, got, hs, res))
    direct_loop(comm, spec, k, v, visit, done, step="ring backward")
    dk, dv = unpack(own[0], spec, r)
    for s, got, hs, _ in homes:
        comm.wait(hs, f"ring backward step {s}: dK/dV with ranks {(r - s) % p} and {(r + s) % p}")
        if got is not None:
            add_rows(dk, dv, got, spec, plan.send[s])
    return dk, dv


def ring_attention_bwd(comm: Communicator, spec: AttnSpec, q, k, v, dout, lse, delta, sink: Optional[list] = None):
    """Backward of the ring schedule: ``(dq, dk, dv)`` float32 of this rank's shards (``sink``: the
    sums for the sinks' gradient of this rank's rows, ``op.bwd_call``)."""
    dt = state.stat_dtype(q.dtype)
    dq = [None]
    visit = attn_bwd_visit(spec, q, dout, lse, delta, dq, sink)
    if spec.plan.direct:
        dk, dv = direct_bwd(comm, spec, k, v, visit, dt)
    else:
        dkv = ring_loop(comm, pack(k, v), spec.kv_numel, by_origin(spec, visit), carry=spec.kv_numel,
                        step="ring backward")
        dk, dv = unpack(dkv, spec, spec.rank)
    return dq_of(dq, q), dk, dv
