"""2-D meshes: a sequence group and a heads group, and the small all-gather every rank of one makes.

A mesh is given as a 2-D ``DeviceMesh`` (dimension 0: sequence, dimension 1: heads) or a tuple
``(seq_group, heads_group)`` of groups (ProcessGroups, MPI communicators, loopback communicators).
Its ranks are numbered ``s * heads + h`` (sequence rank ``s``, heads rank ``h``), as a DeviceMesh
numbers its entries: heads groups are contiguous ranks.

The handshake runs over ``Mesh.whole``, a communicator of all the mesh's ranks, where one is known
(the default torch.distributed group when the mesh covers it; the loopback world): there ranks whose
meshes differ (shape, coordinates, groups that are not the mesh's rows and columns) are told apart
and named by their rank in it (:func:`mesh_order`). Elsewhere (MPI communicators, a mesh over part
of the world) the handshake's vectors travel in two stages (:meth:`Mesh.start_gather`): over the
heads group, then every heads group's rows over the sequence group, and ranks are named by mesh rank.
Either way every rank ends with every rank's vector, in mesh rank order, and decides alike.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import torch
from torch import Tensor

from .comm import Communicator, LoopbackComm, TorchComm, as_comm


class Mesh(Communicator):
    """A ``seq x heads`` mesh: ``seq`` and ``heads`` communicators, ``rank = s * heads.size + h``."""

    def __init__(self, seq: Communicator, heads: Communicator):
        self.seq, self.heads = seq, heads
        self.shape = (seq.size, heads.size)
        self.rank = seq.rank * heads.size + heads.rank
        self.size = seq.size * heads.size
        self.meta_device = heads.meta_device
        self.whole, self.members = _whole(seq, heads, self.size)

    @property
    def host(self) -> int:
        return self.heads.host

    def fields(self) -> dict:
        """Per-rank handshake fields of a handshake over :attr:`whole`: coordinates, and a code of
        the groups' members (ranks of ``whole``), for :func:`mesh_order`."""
        return {"mesh coordinates": self.seq.rank << 32 | self.heads.rank, "mesh groups": groups_code(*self.members)}

    def post(self, sends, recvs, tag):
        raise TypeError("a 2-D mesh has no point-to-point transfers of its own: use its seq or heads group")

    def start_gather(self, mine: Tensor, tag: int, step: str) -> Callable[[], list]:
        """Start the all-gather of the small flat ``mine`` (same size on every rank); the returned
        ``finish()`` waits (bounded) and gives every rank's copy in mesh rank order."""
        rows, handles = post_gather(self.heads, mine, tag)

        def finish() -> list:
            self.heads.wait(handles, f"{step} (heads group)")
            block = torch.cat(rows)
            blocks, more = post_gather(self.seq, block, tag)
            self.seq.wait(more, f"{step} (sequence group)")
            return [row for b in blocks for row in b.chunk(self.heads.size)]
        return finish


def _whole(seq: Communicator, heads: Communicator, size: int) -> tuple:
    """``(communicator of all the mesh's ranks, (seq members, heads members) as its ranks)``, or
    ``(None, None)`` where none is known."""
    if isinstance(seq, LoopbackComm) and isinstance(heads, LoopbackComm) and seq.world is heads.world \
            and seq.world.size == size:
        return seq.world.comm(seq.members[seq.rank]), (seq.members, heads.members)
    if isinstance(seq, TorchComm) and isinstance(heads, TorchComm) and seq.dist.get_world_size() == size:
        members = tuple(tuple(seq.dist.get_process_group_ranks(c.group)) for c in (seq, heads))
        return TorchComm(None), members
    return None, None


def value_code(value) -> int:
    """A handshake field (< 2^56) for a value of many parts (lengths, members, a profile): a
    fingerprint of its ``repr``, equal on two ranks where their values are."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little")


def groups_code(seq_members: tuple, heads_members: tuple) -> int:
    """A code (< 2^56) of a rank's groups' members, in group rank order."""
    return value_code((tuple(seq_members), tuple(heads_members)))


def mesh_order(op: str, shape: tuple, coords: list, codes: list) -> list:
    """The ranks of ``whole`` in mesh rank order, from every one's coordinates ``s << 32 | h`` and
    groups code; ``ValueError`` naming the ranks whose mesh is not the one their coordinates make."""
    ps, ph = shape
    at = [(c >> 32) * ph + (c & 0xFFFFFFFF) if c >> 32 < ps and c & 0xFFFFFFFF < ph else -1 for c in coords]
    taken: dict = {}
    for r, i in enumerate(at):
        taken.setdefault(i, []).append(r)
    bad = sorted(r for i, rs in taken.items() for r in rs if i < 0 or len(rs) > 1)
    if bad or len(taken) != len(coords):
        raise ValueError(f"{op}: the mesh differs across ranks: rank(s) {bad} claim coordinates (sequence, heads) "
                         f"{[(coords[r] >> 32, coords[r] & 0xFFFFFFFF) for r in bad]} that other ranks claim or "
                         f"that lie outside the {ps} x {ph} mesh; every rank must pass the same mesh")
    order = [0] * len(at)
    for r, i in enumerate(at):
        order[i] = r
    want = [groups_code(tuple(order[j * ph + i % ph] for j in range(ps)),
                        tuple(order[(i // ph) * ph + j] for j in range(ph))) for i in at]
    bad = [r for r, (c, w) in enumerate(zip(codes, want)) if c != w]
    if bad:
        raise ValueError(f"{op}: the mesh differs across ranks: rank(s) {bad} pass a sequence or heads group "
                         f"that is not the column or row of the mesh at their coordinates; every rank must pass "
                         f"the same mesh")
    return order


def post_gather(comm: Communicator, mine: Tensor, tag: int) -> tuple[list, list]:
    """Start the all-gather of the small flat ``mine`` by direct sends: ``(rows in rank order, handles)``."""
    p, r = comm.size, comm.rank
    rows = [torch.zeros_like(mine) for _ in range(p)]
    rows[r] = mine
    peers = [q for q in range(p) if q != r]
    return rows, comm.post([(mine, q) for q in peers], [(rows[q], q) for q in peers], tag)


def is_mesh(group) -> bool:
    """Whether ``group`` is given as a 2-D mesh: a 2-D DeviceMesh or a tuple (list) of groups."""
    return (type(group).__name__ == "DeviceMesh" and group.ndim == 2) or isinstance(group, (tuple, list))


def as_group(group) -> Communicator:
    """:func:`~splitsoftmax.distributed.comm.as_comm`, or a :class:`Mesh` for a 2-D DeviceMesh or a
    tuple ``(seq_group, heads_group)``."""
    if not is_mesh(group):
        return as_comm(group)
    if type(group).__name__ == "DeviceMesh":
        return Mesh(as_comm(group.get_group(0)), as_comm(group.get_group(1)))
    if len(group) != 2:
        raise ValueError(f"group: a mesh is a tuple (seq_group, heads_group), got {len(group)} groups")
    seq, heads = as_comm(group[0]), as_comm(group[1])
    if isinstance(seq, Mesh) or isinstance(heads, Mesh):
        raise ValueError("group: each group of a (seq_group, heads_group) tuple must be 1-d")
    return Mesh(seq, heads)


def mesh_shape(comm: Communicator) -> int:
    """The handshake field of the mesh shape: 0 for a 1-d group, else ``seq << 32 | heads``."""
    return comm.shape[0] << 32 | comm.shape[1] if isinstance(comm, Mesh) else 0


def seq_lengths(lens: list, shape: tuple) -> list:
    """Every sequence shard's length from every mesh rank's (mesh rank order)."""
    return [sum(lens[s * shape[1]:(s + 1) * shape[1]]) for s in range(shape[0])]
