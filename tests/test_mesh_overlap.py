"""The heads all-to-all overlaps the sequence schedule, as behaviour: an event record of each rank's
posts, waits and local-op launches (loopback worlds) shows the ring's first K/V send posted and the
first compute launched before the last piece of q is waited for (the backward: of dout), and
the chunked path gives every result as q exchanged whole does."""
from __future__ import annotations

import threading
from functools import partial

import pytest
import torch

from splitsoftmax import sharded_attention
from splitsoftmax.distributed import LoopbackWorld, shard
from splitsoftmax.distributed.comm import LoopbackComm
from splitsoftmax.ops.attention.schedules import heads, ring
from splitsoftmax.ops._registry import use_triton
from test_dist_cases import DEVICE, F32
from test_heads_cases import _inputs, sinks_of

TAG_KV, TAG_GATHER = 21, 31


class RecordingComm(LoopbackComm):
    """A loopback rank that records ``("post", tag)`` and ``("wait", step)`` in its world's record."""

    def post(self, sends, recvs, tag):
        self.world.record(("post", tag))
        return super().post(sends, recvs, tag)

    def wait(self, handles, step):
        self.world.record(("wait", step))
        super().wait(handles, step)


class RecordingWorld(LoopbackWorld):
    """Loopback ranks with one event list per world rank (the rank of the thread that records)."""

    def __init__(self, size: int):
        super().__init__(size)
        self.events = {r: [] for r in range(size)}
        self.ranks: dict = {}

    def comm(self, rank, members=None):
        self.ranks[threading.get_ident()] = rank
        return RecordingComm(self, rank, members)

    def record(self, event) -> None:
        self.events[self.ranks[threading.get_ident()]].append(event)


@pytest.fixture
def world_of(monkeypatch):
    """``world_of(size)``: a :class:`RecordingWorld` whose ranks also record ``("compute", heads)``
    for every local-op launch of the sequence schedules."""
    made = []
    launch = ring.masked_op

    def recorded(name, t, mask):
        made[0].record(("compute", t.shape[1]))
        return launch(name, t, mask)
    monkeypatch.setattr(ring, "masked_op", recorded)

    def make(size: int) -> RecordingWorld:
        made[:] = [RecordingWorld(size)]
        return made[0]
    return make


def _first(events: list, pred) -> int:
    return next(i for i, e in enumerate(events) if pred(e))


def _last(events: list, pred) -> int:
    return max(i for i, e in enumerate(events) if pred(e))


def _is_wait(text: str):
    return lambda e: e[0] == "wait" and text in e[1]


@pytest.mark.parametrize("schedule", ["heads+ring", "heads+allgather"])
def test_forward_overlap(world_of, schedule):
    """2 x 2 mesh, 4 query heads over 2 kv heads (two heads a rank, q in two chunks): on every rank
    k and v are waited for first; the sequence schedule's first transfer (the ring's K/V send, the
    all-gather) is posted and the first launch (one chunk's heads) made before q's last chunk is
    waited for."""
    q, k, v, _, _ = _inputs(2, 16, 4, 2)
    world = world_of(4)

    def run(c):
        m = c.mesh(2, 2)
        sharded_attention(*(shard(t, 2, group=m) for t in (q, k, v)), causal=True, group=m, schedule=schedule)
    world.run(run)
    tag = TAG_KV if schedule == "heads+ring" else TAG_GATHER
    for r, ev in world.events.items():
        last_q = _last(ev, _is_wait("q to heads, chunk"))
        assert _first(ev, _is_wait("heads")) == _first(ev, _is_wait("k, v to heads")), (r, ev)
        assert _first(ev, lambda e: e == ("post", tag)) < _first(ev, _is_wait("q to heads, chunk 0")), (r, ev)
        first = _first(ev, lambda e: e[0] == "compute")
        assert first < last_q and ev[first] == ("compute", 1), (r, ev)


def test_backward_overlap(world_of):
    """The backward, 4 heads over 4 kv heads (dout in two chunks of kv groups): the ring's first K/V
    send is posted before dout is waited for, and the first launch (one chunk's heads) made before
    dout's last chunk is."""
    q, k, v, _, _ = _inputs(2, 16, 4, 4)
    world = world_of(4)

    def run(c):
        m = c.mesh(2, 2)
        mine = [shard(t, 2, group=m).clone().requires_grad_() for t in (q, k, v)]
        out = sharded_attention(*mine, causal=True, group=m, schedule="heads+ring")
        del world.events[world.ranks[threading.get_ident()]][:]  # the backward's events alone
        out.sum().backward()
    world.run(run)
    for r, ev in world.events.items():
        assert _first(ev, lambda e: e == ("post", TAG_KV)) < _first(ev, _is_wait("dout to heads")), (r, ev)
        first = _first(ev, lambda e: e[0] == "compute")
        assert first < _last(ev, _is_wait("dout to heads, chunk")) and ev[first] == ("compute", 1), (r, ev)


def _results(shape, schedule, h, hkv, kw) -> list:
    """Every rank's out, lse and gradients of one call on a loopback mesh (1-D: ``schedule="heads"``)."""
    q, k, v, wo, _ = _inputs(5, 19, h, hkv)

    def run(c):
        m = c.mesh(*shape) if shape[0] > 1 else c
        place = partial(shard, dim=2, group=m, layout="zigzag", cu_seqlens=kw.get("cu_seqlens"))
        mine = [place(t).clone().requires_grad_() for t in (q, k, v)]
        sinks = kw.get("sinks")
        sinks = None if sinks is None else sinks.detach().clone().requires_grad_()
        out, lse = sharded_attention(*mine, causal=True, group=m, schedule=schedule, layout="zigzag",
                                     return_lse=True, **{**kw, "sinks": sinks})
        ((out * place(wo)).sum() + lse.sum()).backward()
        return [out, lse] + [t.grad for t in mine] + ([] if sinks is None else [sinks.grad])
    return LoopbackWorld(shape[0] * shape[1]).run(run)


@pytest.mark.parametrize("shape,schedule,h,hkv,kw", [
    ((2, 3), "heads+ring", 7, 7, dict(window_size=(5, 0), softcap=1.5)),
    ((2, 2), "heads+ring", 6, 3, dict(cu_seqlens=(0, 7, 19))),
    ((2, 3), "heads+allgather", 7, 1, dict(sinks=sinks_of(7))),
    ((2, 2), "heads+ring", 8, 4, dict(sinks=sinks_of(8))),
    ((1, 3), "heads", 6, 2, {}),
], ids=["2x3-ring-mha", "2x2-ring-gqa", "2x3-allgather-sinks", "2x2-ring-gqa-sinks", "1d"])
def test_chunks_as_whole(monkeypatch, shape, schedule, h, hkv, kw):
    """q in head chunks gives every result as q in one piece (one chunk: the order of old), to the
    last bits: the same computation per head, the torch path's batched products rounding a little
    differently for another number of heads (1e-14; the oracle's float64 tolerance is 1e-10). The
    Triton kernels may split the keys of fewer heads over more programs: their own float32 bar."""
    tol = F32 if use_triton(torch.zeros(0, device=DEVICE)) else dict(atol=1e-14, rtol=1e-14)
    chunked = _results(shape, schedule, h, hkv, kw)
    monkeypatch.setattr(heads, "CHUNKS", 1)
    heads.q_chunks.cache_clear()
    try:
        whole = _results(shape, schedule, h, hkv, kw)
    finally:
        heads.q_chunks.cache_clear()
    for r, (a, b) in enumerate(zip(chunked, whole)):
        for i, (x, y) in enumerate(zip(a, b)):
            what = (shape, schedule, h, hkv, sorted(kw), r, i)
            torch.testing.assert_close(x, y, **tol, msg=lambda m: f"{what}: {m}")
