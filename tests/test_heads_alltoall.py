"""The all-to-all transport (op-agnostic) and the heads schedule's refusals, on any group.

``case_exchange`` sends every peer its own list of tensors (mixed dtypes, uneven and empty sizes,
non-contiguous sources) and checks every byte received; on torch.distributed it runs over the
native ``all_to_all_single`` and again over the point-to-point fallback. ``case_agreement``: heads
calls whose arguments differ across ranks raise ``ValueError`` on every rank before any bulk
transfer, and the group stays usable. Here on the loopback world; test_heads_gloo.py and
test_heads_mpi.py run the same functions in worker processes.
"""
from __future__ import annotations

import time

import pytest
import torch

from splitsoftmax import sharded_attention
from splitsoftmax.distributed import LoopbackWorld, as_comm, shard
from splitsoftmax.distributed import alltoall
from splitsoftmax.distributed.alltoall import exchange
from test_dist_cases import DEVICE
from test_heads_cases import check, sinks_of

DTYPES = (torch.float16, torch.float64, torch.int32, torch.bfloat16, torch.bool)


def _payload(src: int, dst: int) -> list:
    """What rank ``src`` sends rank ``dst``: sizes and dtypes depend on both, some empty, the
    first a non-contiguous (transposed) view."""
    g = torch.Generator().manual_seed(100 * src + dst)
    n = (3 * src + 5 * dst) % 4
    out = [torch.randn(3, n + 1, generator=g).to(DEVICE, torch.float16).t()]
    for i, dt in enumerate(DTYPES[1:]):
        shape = (n * (i + 1) % 5, 2) if (src + dst + i) % 3 else (0,)
        out.append((torch.randn(shape, generator=g) * 50).to(DEVICE, dt))
    return out


def _exchange_once(group, step: str):
    c = as_comm(group)
    sends = [_payload(c.rank, q) for q in range(c.size)]
    specs = [[(t.shape, t.dtype) for t in _payload(q, c.rank)] for q in range(c.size)]
    got = exchange(c, sends, specs, step, 77, DEVICE)
    for q in range(c.size):
        for i, (a, b) in enumerate(zip(got[q], _payload(q, c.rank))):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {c.rank}: piece {i} from rank {q} ({step})"


def case_exchange(group):
    """Every rank's pieces arrive intact; on torch.distributed over the point-to-point pairs (Gloo's
    default) and by one ``all_to_all_single`` (NCCL's; here forced on Gloo)."""
    c = as_comm(group)
    if type(c).__name__ == "MpiComm":  # Ialltoallv: no point-to-point pair
        pairs, alltoall._pairs = alltoall._pairs, None
        try:
            _exchange_once(group, "Ialltoallv")
        finally:
            alltoall._pairs = pairs
    if type(c).__name__ != "TorchComm":
        _exchange_once(group, "all-to-all")
        return
    native, calls = c.dist.all_to_all_single, []
    c.dist.all_to_all_single = lambda *a, **kw: (calls.append(a[2:4]), native(*a, **kw))[1]
    backend = c.dist.get_backend(c.group)
    try:
        _exchange_once(group, "pairs")
        assert calls == [] or backend in alltoall.NATIVE_BACKENDS, calls
        alltoall.NATIVE_BACKENDS.add(backend)
        _exchange_once(group, "native all-to-all")
        assert len(calls) == 1 + (backend == "nccl"), calls
    finally:
        if backend != "nccl":
            alltoall.NATIVE_BACKENDS.discard(backend)
        c.dist.all_to_all_single = native


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_loopback_exchange(size):
    """One message per pair with bytes to carry, on the caller's tag."""
    world = LoopbackWorld(size)
    world.run(case_exchange)
    nonempty = sum(1 for r in range(size) for q in range(size)
                   if q != r and any(t.numel() for t in _payload(r, q)))
    assert world.sends.get(77, 0) == nonempty and set(world.sends) <= {77}, dict(world.sends)


def test_exchange_peer_that_never_answers(monkeypatch):
    """A peer that does not join the all-to-all: RuntimeError naming it and the step, within
    SPLITSOFTMAX_TIMEOUT (the receive is bounded)."""
    monkeypatch.setenv("SPLITSOFTMAX_TIMEOUT", "0.5")

    def run(c):
        if c.rank == 1:
            time.sleep(1.0)
            return
        t0 = time.monotonic()
        try:
            _exchange_once(c, "step x")
        finally:
            assert time.monotonic() - t0 < 3.0
    with pytest.raises(RuntimeError, match=r"step x: rank 0: peer rank\(s\) \[1\] did not answer within 0.5 s"):
        LoopbackWorld(2).run(run)


def _raises(fn, pattern):
    with pytest.raises(ValueError, match=pattern):
        fn()


def case_agreement(group):
    """Heads calls with arguments that differ across ranks (or fail a global check) raise ValueError
    on every rank, naming the field and the ranks; afterwards the group works."""
    c = as_comm(group)
    if c.size == 1:
        return
    last, other = c.size - 1, c.rank == c.size - 1
    s = 3 * c.size + 1
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, s, 8, generator=g, dtype=torch.float64).to(DEVICE) for h in (6, 2, 2))
    ql, kl, vl = (shard(t, 2, group=group, layout="zigzag") for t in (q, k, v))

    def attn(ql=ql, kl=kl, vl=vl, **kw):
        kw = {"causal": True, "schedule": "heads", "layout": "zigzag", **kw}
        return lambda: sharded_attention(ql, kl, vl, group=group, **kw)
    _raises(attn(ql=ql[:, :4] if other else ql), rf"H differs across ranks \(.*rank\(s\) \[{last}\]: 4")
    _raises(attn(kl=kl[:, :1] if other else kl, vl=vl[:, :1] if other else vl), r"Hkv differs across ranks")
    _raises(attn(schedule="ring" if other else "heads"), rf"schedule differs .*rank\(s\) \[{last}\]: 'ring'")
    _raises(attn(window_size=(3, 0) if other else (2, 0)), rf"window_size differs across ranks \(.*\[{last}\]")
    _raises(attn(sinks=sinks_of(6) if other else None), rf"sinks differs across ranks \(.*\[{last}\]")
    _raises(attn(cu_seqlens=(0, 1, s)), r"not of a per-document zigzag split of cu_seqlens")
    _raises(attn(layout="contiguous", q_offset=1 if other else 0),
            rf"q_offset must be 0|rank\(s\) \[{last}\] rejected their arguments")
    _raises(attn(kv_range=torch.tensor([[0, s + 1], [0, s]], device=DEVICE)), rf"kv_range must satisfy .*Sk = {s}")
    check(group, "zigzag", True, dict(window_size=(2, 0), sinks=sinks_of(6)), 6, 2, s=s)


@pytest.mark.parametrize("size", [2, 3])
def test_agreement_before_bulk_transfer(size):
    """Only the handshake's messages (tag 11, and the refusal reasons' 12) before a refusal."""
    world = LoopbackWorld(size)
    world.run(case_agreement)
    bulk = {t: n for t, n in world.sends.items() if t not in (11, 12)}
    assert set(bulk) == {51, 52, 53, 54}, bulk  # the closing check's one call, not the refused ones
    world2 = LoopbackWorld(size)
    world2.run(lambda g: check(g, "zigzag", True, dict(window_size=(2, 0), sinks=sinks_of(6)), 6, 2, s=3 * size + 1))
    per_call = {t: n for t, n in world2.sends.items() if t not in (11, 12)}
    assert bulk == per_call, (bulk, per_call)
