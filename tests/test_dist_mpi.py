"""The loopback cases again under mpirun with 2 and 3 ranks (group = MPI.COMM_WORLD)."""
from __future__ import annotations

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
