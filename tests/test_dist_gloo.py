"""The loopback cases again on real Gloo process groups of 2, 3 and 4 ranks (one start per size)."""
from __future__ import annotations

import pytest

from _dist_util import assert_ok, spawn

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("size", [2, 3, 4])
def test_gloo_all_ops(size):
    """Forward and backward of every sharded op vs float64, uneven/empty shards, zigzag, GQA, tree,
    mismatches refused on every rank with the group usable afterwards."""
    assert_ok(spawn(size, "tests/test_dist_cases.py:case_all", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              f"gloo world of {size}")
