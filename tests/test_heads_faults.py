"""Faults inside the heads schedule's all-to-all on Gloo (the native ``all_to_all_single``): a peer
that exits, a peer that stalls past SPLITSOFTMAX_TIMEOUT. The surviving ranks raise RuntimeError
naming the peer rank and the step within the timeout (never a hang); the workers assert this
themselves and exit 0."""
from __future__ import annotations

import os
import time

import pytest
import torch

from _dist_util import assert_ok, spawn
from splitsoftmax import sharded_attention
from splitsoftmax.distributed import as_comm
from splitsoftmax.ops.attention.schedules import heads
from test_dist_cases import DEVICE

pytestmark = pytest.mark.distributed
TIMEOUT = 6
HERE = "tests/test_heads_faults.py"
STEP = "heads forward: k, v to heads"


def _call(group):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 6, 8, generator=g).to(DEVICE) for h in (4, 2, 2))
    return sharded_attention(q, k, v, group=group, schedule="heads")


def _warm_on_nccl(group):
    """On NCCL one healthy call first (Triton's first kernel loads wait behind NCCL's kernels)."""
    if DEVICE.type == "cuda":
        _call(group)


def _victim(action) -> None:
    """This rank runs ``action`` instead of starting its first all-to-all (after the handshake)."""
    heads.start_exchange = lambda *args: action()


def _survive(group, how: str, within: float):
    c = as_comm(group)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"{STEP}: rank {c.rank}: .*peer rank\(?s?\)? \[?{c.size - 1}\]? {how}"):
        _call(group)
    elapsed = time.monotonic() - start
    assert elapsed < within, f"rank {c.rank} took {elapsed:.1f} s to notice"
    os._exit(0)


def exit_in_alltoall(group):
    c = as_comm(group)
    _warm_on_nccl(group)
    if c.rank == c.size - 1:
        _victim(lambda: os._exit(3))
        _call(group)
    _survive(group, "(failed|did not answer)", TIMEOUT + (3 if DEVICE.type == "cpu" else 6))


def stall_in_alltoall(group):
    c = as_comm(group)
    _warm_on_nccl(group)
    if c.rank == c.size - 1:
        _victim(lambda: (time.sleep(TIMEOUT + 3), os._exit(0)))
        _call(group)
    _survive(group, f"did not answer within {TIMEOUT} s", TIMEOUT + 3)


def stall_in_native_alltoall(group):
    """Gloo's own all_to_all_single (NCCL's path): one collective, bounded alike."""
    from splitsoftmax.distributed import alltoall
    alltoall.NATIVE_BACKENDS.add("gloo")
    stall_in_alltoall(group)


@pytest.mark.parametrize("case,size,victim_rc", [("exit_in_alltoall", 2, 3), ("stall_in_alltoall", 3, 0),
                                                 ("stall_in_native_alltoall", 2, 0)])
def test_peer_fault_in_alltoall(case, size, victim_rc):
    """The survivors raise within SPLITSOFTMAX_TIMEOUT, naming the victim (the pairs name it alone
    among 3 ranks)."""
    run_case(case, size, victim_rc)


def run_case(case: str, size: int, victim_rc: int, backend: str = "gloo") -> None:
    results = spawn(size, f"{HERE}:{case}", timeout=90, env={"SPLITSOFTMAX_TIMEOUT": str(TIMEOUT)}, backend=backend)
    assert results[-1][0] == victim_rc, f"victim rank: rc {results[-1][0]}\n{results[-1][1][-3000:]}"
    assert_ok(results[:-1], f"{case} with {size} ranks")
