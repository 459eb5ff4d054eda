"""2-D meshes refused and bounded: schedules of the wrong dimension, meshes that differ across ranks
(shape, coordinates, groups), arguments that differ across a mesh, a zigzag of the wrong lengths,
a peer that never calls. Every rank raises (ValueError naming the field and the ranks, or
RuntimeError naming the peer), before any bulk transfer; and a mesh over part of a world, whose
handshake travels in two stages, computes and refuses alike."""
from __future__ import annotations

import pytest
import torch

from splitsoftmax import sharded_attention
from splitsoftmax.distributed import LoopbackWorld, shard, unshard
from splitsoftmax.distributed.mesh import as_group
from test_dist_cases import DEVICE
from test_mesh_cases import check

BULK = (21, 22, 31, 32, 41, 51, 52, 53, 54)  # the tags of the ring, all-gather, tree and all-to-all


def _qkv(h: int = 4, s: int = 3):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, n, s, 8, generator=g, dtype=torch.float64).to(DEVICE) for n in (h, 2, 2)]


def refused(world: LoopbackWorld, fn, *must: str, error=ValueError) -> list:
    """Run ``fn(comm)`` on every rank; every rank must raise ``error`` whose message holds ``must``,
    and no bulk transfer may have started."""
    def body(c):
        with pytest.raises(error) as e:
            fn(c)
        return str(e.value)
    msgs = world.run(body)
    for r, msg in enumerate(msgs):
        for word in must:
            assert word in msg, (r, word, msg)
    assert not any(world.sends.get(t) for t in BULK), dict(world.sends)
    return msgs


def test_schedule_of_the_wrong_dimension():
    """A mesh takes only the 2-D schedules, a 1-d group only the others; a rank whose group is 1-d
    among ranks on a mesh makes every rank raise, naming it."""
    for schedule in ("ring", "allgather", "heads", "tree"):
        refused(LoopbackWorld(4), lambda c: sharded_attention(*_qkv(), group=c.mesh(2, 2), schedule=schedule),
                f"schedule={schedule!r} runs over a 1-d group", "2 x 2 mesh")
    refused(LoopbackWorld(2), lambda c: sharded_attention(*_qkv(), group=c, schedule="heads+ring"),
            "schedule='heads+ring' needs a 2-D group")
    msgs = refused(LoopbackWorld(4), lambda c: sharded_attention(
        *_qkv(), group=c if c.rank == 3 else c.mesh(2, 2), schedule="heads+allgather"), "schedule")
    assert all("rank(s) [3]" in m for m in msgs[:3]), msgs
    for bad, what in (((1, 2, 3), "a tuple (seq_group, heads_group)"), ((object(), object()), "group must be")):
        with pytest.raises((ValueError, TypeError), match=what.replace("(", r"\(").replace(")", r"\)")):
            sharded_attention(*_qkv(), group=bad, schedule="heads+ring")


def test_mesh_differs():
    """Ranks on meshes of different shapes, or one rank with its groups swapped: ValueError on every
    rank naming the mesh and the ranks, before any bulk transfer."""
    msgs = refused(LoopbackWorld(6), lambda c: sharded_attention(
        *_qkv(), group=c.mesh(3, 2) if c.rank == 5 else c.mesh(2, 3), schedule="heads+ring"), "mesh shape differs")
    assert all("rank(s) [5]: (3, 2)" in m and "rank(s) [0, 1, 2, 3, 4]: (2, 3)" in m for m in msgs), msgs
    for x in (1, 3):  # rank 1: coordinates that rank 2 claims; rank 3: its groups swapped, same coordinates
        def swapped(c, x=x):
            seq, heads = c.mesh(2, 2)
            return sharded_attention(*_qkv(), group=(heads, seq) if c.rank == x else (seq, heads),
                                     schedule="heads+ring")
        msgs = refused(LoopbackWorld(4), swapped, "the mesh differs across ranks")
        assert all(f"{x}" in m.split("rank(s) ")[1].split("]")[0] for m in msgs), msgs


def test_arguments_differ_on_a_mesh():
    """H on one rank, a zigzag of the wrong lengths: every rank raises, naming the field and the
    ranks (as world ranks: the loopback world is the mesh's whole)."""
    msgs = refused(LoopbackWorld(6), lambda c: sharded_attention(
        *_qkv(h=6 if c.rank == 4 else 4), group=c.mesh(2, 3), schedule="heads+ring"), "H differs across ranks")
    assert all("rank(s) [4]: 6" in m for m in msgs), msgs
    refused(LoopbackWorld(4), lambda c: sharded_attention(
        *_qkv(s=3 if c.rank == 0 else 1), group=c.mesh(2, 2), schedule="heads+ring", layout="zigzag"),
        "layout='zigzag' but sequence shard(s) [0, 1]")


def test_peer_never_calls(monkeypatch):
    """A rank of the mesh that never calls: the others raise RuntimeError naming it, within the timeout."""
    monkeypatch.setenv("SPLITSOFTMAX_TIMEOUT", "5")

    def body(c):
        if c.rank == 2:
            return "absent"
        with pytest.raises(RuntimeError, match="peer rank.*2"):
            sharded_attention(*_qkv(), group=c.mesh(2, 2), schedule="heads+ring")
        return "raised"
    assert LoopbackWorld(4).run(body, timeout=30) == ["raised", "raised", "absent", "raised"]


def test_mesh_over_part_of_a_world():
    """A 2 x 2 mesh over ranks 0..3 of a world of 5 (no communicator of all its ranks: the
    handshake travels in two stages): exact results, shard / unshard, and a refusal on every rank
    of the mesh naming the mesh rank."""
    def sub(c):
        if c.rank == 4:
            return None
        seq, heads = c.world.comm(c.rank, [c.rank % 2, c.rank % 2 + 2]), c.world.comm(c.rank, [c.rank // 2 * 2,
                                                                                              c.rank // 2 * 2 + 1])
        m = as_group((seq, heads))
        assert m.whole is None and m.shape == (2, 2) and m.rank == c.rank
        return seq, heads

    def body(c):
        mesh = sub(c)
        if mesh is None:
            return None
        check(mesh, "heads+ring", "zigzag", True, dict(window_size=(3, 0)), 3, 1, s=9)
        x = torch.arange(10.0, device=DEVICE).view(1, 1, 10)
        assert torch.equal(unshard(shard(x, 2, group=mesh), 2, group=mesh), x)
        with pytest.raises(ValueError) as e:
            sharded_attention(*_qkv(h=6 if c.rank == 2 else 4), group=mesh, schedule="heads+allgather")
        return str(e.value)
    msgs = LoopbackWorld(5).run(body)
    assert msgs[4] is None and all("H differs across ranks" in m and "rank(s) [2]: 6" in m for m in msgs[:4]), msgs
