"""2-D meshes: a sequence group and a heads group, and the small all-gather every rank of one makes.

A mesh is given as a 2-D ``DeviceMesh`` (dimension 0: sequence, dimension 1: heads) or a tuple
``(seq_group, heads_group)`` of groups (ProcessGroups, MPI communicators, loopback communicators).
Its ranks are numbered ``s * heads + h`` (sequence rank ``s``, heads rank ``h``), as a DeviceMesh
numbers its entries: heads groups are contiguous ranks.

The mesh has no communicator of its own over all its ranks, so the handshake's vectors travel in
two stages (:meth:`Mesh.start_gather`): over the heads group, then every heads group's rows over
the sequence group. Every rank then holds every rank's vector, in mesh rank order, and decides alike.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .comm import Communicator, as_comm


class Mesh(Communicator):
    """A ``seq x heads`` mesh: ``seq`` and ``heads`` communicators, ``rank = s * heads.size + h``."""

    def __init__(self, seq: Communicator, heads: Communicator):
        self.seq, self.heads = seq, heads
        self.shape = (seq.size, heads.size)
        self.rank = seq.rank * heads.size + heads.rank
        self.size = seq.size * heads.size
        self.meta_device = heads.meta_device

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


def post_gather(comm: Communicator, mine: Tensor, tag: int) -> tuple[list, list]:
    """Start the all-gather of the small flat ``mine`` by direct sends: ``(rows in rank order, handles)``."""
    p, r = comm.size, comm.rank
    rows = [torch.zeros_like(mine) for _ in range(p)]
    rows[r] = mine
    peers = [q for q in range(p) if q != r]
    return rows, comm.post([(mine, q) for q in peers], [(rows[q], q) for q in peers], tag)


def as_group(group) -> Communicator:
    """:func:`~splitsoftmax.distributed.comm.as_comm`, or a :class:`Mesh` for a 2-D DeviceMesh or a
    tuple ``(seq_group, heads_group)``."""
    if type(group).__name__ == "DeviceMesh" and group.ndim == 2:
        return Mesh(as_comm(group.get_group(0)), as_comm(group.get_group(1)))
    if isinstance(group, (tuple, list)):
        if len(group) != 2:
            raise ValueError(f"group: a mesh is a tuple (seq_group, heads_group), got {len(group)} groups")
        seq, heads = as_comm(group[0]), as_comm(group[1])
        if isinstance(seq, Mesh) or isinstance(heads, Mesh):
            raise ValueError("group: each group of a (seq_group, heads_group) tuple must be 1-d")
        return Mesh(seq, heads)
    return as_comm(group)


def mesh_shape(comm: Communicator) -> int:
    """The handshake field of the mesh shape: 0 for a 1-d group, else ``seq << 32 | heads``."""
    return comm.shape[0] << 32 | comm.shape[1] if isinstance(comm, Mesh) else 0


def seq_lengths(lens: list, shape: tuple) -> list:
    """Every sequence shard's length from every mesh rank's (mesh rank order)."""
    return [sum(lens[s * shape[1]:(s + 1) * shape[1]]) for s in range(shape[0])]
