"""``schedule="heads"`` on NCCL: one rank per GPU, CUDA tensors, Triton kernels, the native
``all_to_all_single``. The same functions as the Gloo and MPI lanes (the transport, refusals, every
head split and keyword against float64) and a peer that exits or stalls inside the all-to-all."""
from __future__ import annotations

import pytest
import torch

import test_heads_faults as faults
from _dist_util import assert_ok, spawn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_nccl_heads(size):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    assert_ok(spawn(size, "tests/test_heads_gloo.py:case_gloo", timeout=300, env={"SPLITSOFTMAX_TIMEOUT": "60"},
                    backend="nccl"), f"nccl world of {size}")


@pytest.mark.parametrize("case,victim_rc", [("exit_in_alltoall", 3), ("stall_in_alltoall", 0)])
def test_nccl_heads_faults(case, victim_rc):
    """A peer that exits or stalls inside NCCL's all-to-all -> RuntimeError naming it, no hang."""
    faults.run_case(case, 2, victim_rc, backend="nccl")


def test_nccl_heads_relay():
    """Four ranks counted as two machines of two (``SPLITSOFTMAX_HOST``): K/V in two hops over
    ``all_to_all_single``, every head split and keyword against float64."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    assert_ok(spawn(4, "tests/test_heads_relay.py:case_two_machines", timeout=300, env={"SPLITSOFTMAX_TIMEOUT": "60"},
                    backend="nccl"), "nccl world of 4 on two machines")
