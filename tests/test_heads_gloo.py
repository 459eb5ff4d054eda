"""The heads cases on real Gloo process groups of 2, 3 and 4 ranks (one start per size): the native
``all_to_all_single`` and the point-to-point fallback, every head split and keyword vs float64,
refusals on every rank."""
from __future__ import annotations

import pytest

from _dist_util import assert_ok, spawn
from test_heads_alltoall import case_agreement, case_exchange
from test_heads_cases import case_all

pytestmark = pytest.mark.distributed


def case_gloo(group):
    """Every heads case, in one worker start (process groups are slow to start)."""
    for case in (case_exchange, case_agreement, case_all):
        case(group)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_gloo_heads(size):
    assert_ok(spawn(size, "tests/test_heads_gloo.py:case_gloo", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              f"gloo world of {size}")
