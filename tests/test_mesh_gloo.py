"""2-D meshes on real process groups of 4 ranks (one start each): a 2-D ``DeviceMesh`` and a tuple
of ProcessGroups on Gloo (the handshake over the default group, which the mesh covers), and a tuple
of MPI communicators under mpirun (the handshake in two stages); head splits, layouts and keywords
against float64, shard / unshard, refusals on every rank."""
from __future__ import annotations

import pytest
import torch

from _dist_util import assert_ok, mpirun, mpirun_path, spawn
from splitsoftmax import sharded_attention
from test_dist_cases import DEVICE
from test_heads_cases import sinks_of
from test_mesh_cases import case_shard_roundtrip, check


def _qkv(h: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, n, 3, 8, generator=g, dtype=torch.float64).to(DEVICE) for n in (h, 2, 2)]


def case_mesh(mesh, rank: int):
    """A few exact calls (GQA with Hkv below the heads degree, zigzag per document with sinks, a
    window), shard / unshard, and H differing on rank 2 refused on every rank, naming it."""
    docs = (0, 1, 6, 6, 13)
    check(mesh, "heads+ring", "contiguous", True, {}, 3, 1, lens=[2, 0, 3, 4])
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


def case_mpi(comm):
    """A 2 x 2 mesh of MPI communicators split from COMM_WORLD."""
    r = comm.Get_rank()
    case_mesh((comm.Split(r % 2, r), comm.Split(r // 2, r)), r)


@pytest.mark.distributed
def test_gloo_mesh():
    assert_ok(spawn(4, "tests/test_mesh_gloo.py:case_gloo", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              "gloo world of 4")


@pytest.mark.mpi
@pytest.mark.skipif(mpirun_path() is None, reason="mpirun is not installed")
def test_mpi_mesh():
    pytest.importorskip("mpi4py")
    assert_ok(mpirun(4, "tests/test_mesh_gloo.py:case_mpi", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              "mpirun -n 4")
