"""The distributed cases and fault cases on NCCL: one rank per GPU, CUDA tensors, Triton kernels.

The same functions as the Gloo and MPI lanes (``test_dist_cases.case_all``: every sharded op
forward and backward against float64, uneven / empty / zigzag shards, tree decode, mismatches
refused on every rank, subgroups and a DeviceMesh) and ``test_dist_faults``' peer that exits or
stalls past ``SPLITSOFTMAX_TIMEOUT`` -- here in NCCL workers. Needs two GPUs.
"""
from __future__ import annotations

import pytest
import torch

import test_dist_faults as faults
from _dist_util import assert_ok, spawn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]


def test_nccl_all_ops():
    assert_ok(spawn(2, "tests/test_dist_cases.py:case_all", timeout=300, env={"SPLITSOFTMAX_TIMEOUT": "60"},
                    backend="nccl"), "nccl world of 2")


def test_nccl_variants():
    """The attention variants (test_dist_variants.case_all: documents, windows, softcap, sinks,
    kv_range, tree offsets, per-document shards, agreement) on NCCL with CUDA tensors."""
    assert_ok(spawn(2, "tests/test_dist_variants.py:case_all", timeout=300, env={"SPLITSOFTMAX_TIMEOUT": "60"},
                    backend="nccl"), "nccl world of 2, variants")


def test_nccl_balanced():
    """layout="balanced" (test_balanced_layout.case_all: shard / unshard, ring, allgather and heads
    against float64, refusals) on NCCL with CUDA tensors."""
    assert_ok(spawn(2, "tests/test_balanced_layout.py:case_all", timeout=300, env={"SPLITSOFTMAX_TIMEOUT": "60"},
                    backend="nccl"), "nccl world of 2, balanced")


@pytest.mark.parametrize("case", ["exit_before", "exit_in_ring", "stall_before", "stall_in_ring"])
def test_nccl_faults(case):
    """A peer that exits or stalls (before the call / inside the ring) -> RuntimeError naming it, no hang."""
    faults.run_case(2, case, timeout=60, backend="nccl")
