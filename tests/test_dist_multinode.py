"""A two-node launch on one machine: two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1)."""
from __future__ import annotations

import os

import pytest

from _dist_util import VENV_BIN, assert_ok, torchrun_nodes

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not os.path.exists(os.path.join(VENV_BIN, "torchrun")), reason="no torchrun")]


def test_two_torchrun_agents():
    """4 ranks over 2 'nodes' (2 per agent): ring / allgather / tree / softmax vs float64."""
    results = torchrun_nodes(2, 2, "tests/test_dist_cases.py:case_multinode", timeout=240)
    assert_ok(results, "torchrun --nnodes 2")
