"""The heads cases under mpirun with 2 and 3 ranks (group = MPI.COMM_WORLD): ``Ialltoallv``."""
from __future__ import annotations

import pytest

from _dist_util import assert_ok, mpirun, mpirun_path

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(mpirun_path() is None, reason="mpirun is not installed")]


@pytest.fixture(scope="module", autouse=True)
def _mpi4py():
    pytest.importorskip("mpi4py")


def case_mpi(comm):
    """The transport, the refusals and every heads case over one MPI communicator."""
    from test_heads_alltoall import case_agreement, case_exchange
    from test_heads_cases import case_all
    for case in (case_exchange, case_agreement, case_all):
        case(comm)


@pytest.mark.parametrize("size", [2, 3])
def test_mpi_heads(size):
    assert_ok(mpirun(size, "tests/test_heads_mpi.py:case_mpi", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              f"mpirun -n {size}")
