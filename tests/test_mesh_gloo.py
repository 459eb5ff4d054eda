"""2-D meshes on real process groups (one start per world): on Gloo worlds of 4 a 2-D ``DeviceMesh``
and a tuple of ProcessGroups (the handshake over the default group, which the mesh covers), of 6 and
8 every mesh shape of that size (2x3, 3x2; 2x4, 4x2, 8x1, 1x8) and the 1-D heads schedule over the
world; a tuple of MPI communicators under mpirun (the handshake in two stages); head splits, layouts
and keywords against float64, shard / unshard, refusals on every rank."""
from __future__ import annotations

import pytest
import torch

from _dist_util import assert_ok, mpirun, mpirun_path, spawn
from splitsoftmax import sharded_attention
from splitsoftmax.distributed.mesh import as_group
from test_dist_cases import DEVICE
from test_heads_cases import check as check_heads, sinks_of
from test_mesh_cases import case_shard_roundtrip, check, mesh_lengths

# the mesh shapes (sequence degree first) run on a Gloo world of each size beyond 4
WIDE = {6: [(2, 3), (3, 2)], 8: [(2, 4), (4, 2), (8, 1), (1, 8)]}


def _qkv(h: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, n, 3, 8, generator=g, dtype=torch.float64).to(DEVICE) for n in (h, 2, 2)]


def case_mesh(mesh, rank: int):
    """A few exact calls (GQA with Hkv below the heads degree, zigzag per document with sinks, a
    window), shard / unshard, and H differing on rank 2 refused on every rank, naming it."""
    docs = (0, 1, 6, 6, 13)
    check(mesh, "heads+ring", "contiguous", True, {}, 3, 1, lens=mesh_lengths(as_group(mesh).shape, 9, 1))
    check(mesh, "heads+allgather", "zigzag", True, dict(cu_seqlens=docs, sinks=sinks_of(5)), 5, 5, s=13)
    check(mesh, "heads+ring", "zigzag", False, dict(window_size=(2, 1), softcap=1.5), 6, 2, s=13)
    case_shard_roundtrip(mesh)
    with pytest.raises(ValueError, match=r"H differs across ranks .*rank\(s\) \[2\]: 6"):
        sharded_attention(*_qkv(6 if rank == 2 else 4), group=mesh, schedule="heads+ring")


def case_gloo(group):
    """A 2 x 2 DeviceMesh, then a tuple of the same groups made with new_group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    rank = dist.get_rank()
    case_mesh(init_device_mesh(DEVICE.type, (2, 2), mesh_dim_names=("seq", "heads")), rank)
    cols = [dist.new_group([h, h + 2]) for h in range(2)]
    rows = [dist.new_group([2 * s, 2 * s + 1]) for s in range(2)]
    case_mesh((cols[rank % 2], rows[rank // 2]), rank)


def case_gloo_wide(group):
    """Each mesh shape of :data:`WIDE` for this world's size as a 2-D DeviceMesh (the first also as a
    tuple of groups made with new_group), then ``schedule="heads"`` over the world: H not a multiple
    of the degree, fewer kv heads than ranks, a window."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    rank, size = dist.get_rank(), dist.get_world_size()
    for i, (ps, ph) in enumerate(WIDE[size]):
        case_mesh(init_device_mesh(DEVICE.type, (ps, ph), mesh_dim_names=("seq", "heads")), rank)
        if i == 0:
            cols = [dist.new_group(list(range(h, size, ph))) for h in range(ph)]
            rows = [dist.new_group(list(range(s * ph, (s + 1) * ph))) for s in range(ps)]
            case_mesh((cols[rank % ph], rows[rank // ph]), rank)
    check_heads(group, "zigzag", True, dict(window_size=(3, 0)), 2 * size + 2, 2, s=2 * size + 3)


def case_mpi(comm):
    """A 2 x 2 mesh of MPI communicators split from COMM_WORLD."""
    r = comm.Get_rank()
    case_mesh((comm.Split(r % 2, r), comm.Split(r // 2, r)), r)


@pytest.mark.distributed
def test_gloo_mesh():
    assert_ok(spawn(4, "tests/test_mesh_gloo.py:case_gloo", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              "gloo world of 4")


@pytest.mark.distributed
@pytest.mark.parametrize("size", sorted(WIDE))
def test_gloo_mesh_shapes(size):
    assert_ok(spawn(size, "tests/test_mesh_gloo.py:case_gloo_wide", timeout=300, env={"SPLITSOFTMAX_TIMEOUT": "90"}),
              f"gloo world of {size}")


@pytest.mark.mpi
@pytest.mark.skipif(mpirun_path() is None, reason="mpirun is not installed")
def test_mpi_mesh():
    pytest.importorskip("mpi4py")
    assert_ok(mpirun(4, "tests/test_mesh_gloo.py:case_mpi", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              "mpirun -n 4")
