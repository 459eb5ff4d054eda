"""The loopback cases again under mpirun with 2 and 3 ranks (group = MPI.COMM_WORLD)."""
from __future__ import annotations

import re

import pytest

from _dist_util import assert_ok, mpirun, mpirun_path

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(mpirun_path() is None, reason="mpirun is not installed")]


@pytest.fixture(scope="module", autouse=True)
def _mpi4py():
    pytest.importorskip("mpi4py")


@pytest.mark.parametrize("size", [2, 3])
def test_mpi_all_ops(size):
    """Every sharded op forward and backward vs float64 over mpi4py, mismatches refused everywhere."""
    assert_ok(mpirun(size, "tests/test_dist_cases.py:case_all", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              f"mpirun -n {size}")


def case_mpi_objects(comm):
    """The handshake's sessions live on the MPI communicator itself: a new mpi4py object of it on
    one rank at every call still finds them. A communicator on which a transfer timed out (its
    late messages could be taken for later ones) refuses later calls at once; others still work."""
    import time

    import torch
    from mpi4py import MPI

    import splitsoftmax as ss
    p, r = comm.Get_size(), comm.Get_rank()
    x = torch.randn(3, 4 * p, generator=torch.Generator().manual_seed(0))
    mine, want = (t.tensor_split(p, dim=1)[r] for t in (x, torch.softmax(x, 1)))
    for _ in range(4):
        group = MPI.Intracomm(comm) if r == 1 else comm
        torch.testing.assert_close(ss.sharded_softmax(mine, 1, group=group), want)
    late = comm.Dup()
    if r == 1:
        time.sleep(3)  # (the others give up after SPLITSOFTMAX_TIMEOUT = 1 s)
    for message in ("did not answer within", "timed out .* cannot be used again"):
        try:
            ss.sharded_softmax(mine, 1, group=late)
        except RuntimeError as e:
            assert re.search(message, str(e)), e
        else:
            raise AssertionError("a call on a communicator whose peer stopped answering returned")
    comm.Barrier()
    torch.testing.assert_close(ss.sharded_softmax(mine, 1, group=comm), want)


@pytest.mark.parametrize("size", [2, 3])
def test_mpi_communicator_objects_and_timeouts(size):
    assert_ok(mpirun(size, "tests/test_dist_mpi.py:case_mpi_objects", timeout=120,
                     env={"SPLITSOFTMAX_TIMEOUT": "1"}), f"mpirun -n {size}")
