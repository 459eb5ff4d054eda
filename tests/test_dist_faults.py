"""Faults on real groups (Gloo here; NCCL in test_gpu_dist.py): a peer that exits, a peer that
stalls past SPLITSOFTMAX_TIMEOUT.

The surviving ranks must raise RuntimeError naming the peer rank and the step, within the
timeout (never a hang); the workers assert this themselves and exit 0. Mismatched arguments are
covered by ``case_mismatch`` (loopback, Gloo and MPI).
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from _dist_util import assert_ok, spawn
from test_dist_cases import DEVICE
from splitsoftmax import sharded_attention
from splitsoftmax.distributed import as_comm
from splitsoftmax.ops.attention.schedules import ring

pytestmark = pytest.mark.distributed
TIMEOUT = 10  # SPLITSOFTMAX_TIMEOUT for the stall cases: as short as the checks allow
# Gloo reports a peer that exited at once; an NCCL transfer to it just never completes (its kernel
# waits), so on NCCL (CUDA tensors) the timeout is what ends the wait.
EXIT_WITHIN = TIMEOUT + 4 if DEVICE.type == "cuda" else TIMEOUT
HERE = "tests/test_dist_faults.py"


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 6, 8, generator=g).to(DEVICE) for _ in range(3)]


def _fail_in_ring(action):
    """Make this rank run ``action`` instead of its first ring transfer (after the handshake)."""
    def patched(*args):
        action()
    ring._transfer = patched


def _survive(group, victim: int, within: float, step: str, how: str):
    """Call the ring attention; expect a RuntimeError naming ``step`` and ``victim`` within ``within`` s."""
    c = as_comm(group)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"{step}.*peer rank\(?s?\)? \[?{victim}\]? {how}") as err:
        sharded_attention(*_inputs(), group=group, schedule="ring")
    elapsed = time.monotonic() - start
    assert elapsed < within, f"rank {c.rank} took {elapsed:.1f} s to notice ({err.value})"
    print(f"rank {c.rank}: {err.value} after {elapsed:.1f} s", flush=True)
    os._exit(0)


def _warm_on_nccl(group):
    """On NCCL, one healthy call first, as in any job past its first step. During a process's first
    call Triton still loads its kernels, and the CUDA driver's module load waits behind NCCL's
    kernel, which waits for the lost peer: no host-side timeout can end that (README.md)."""
    if DEVICE.type == "cuda":
        sharded_attention(*_inputs(), group=group, schedule="ring")


def exit_before(group):
    c = as_comm(group)
    if c.rank == c.size - 1:
        os._exit(3)
    _survive(group, c.size - 1, EXIT_WITHIN, "metadata handshake", "(failed|did not answer)")


def exit_in_ring(group):
    c = as_comm(group)
    _warm_on_nccl(group)
    if c.rank == c.size - 1:
        _fail_in_ring(lambda: os._exit(3))
        sharded_attention(*_inputs(), group=group, schedule="ring")
    _survive(group, c.size - 1, EXIT_WITHIN, "ring forward step 0", "(failed|did not answer)")


def stall_before(group):
    c = as_comm(group)
    if c.rank == c.size - 1:
        time.sleep(TIMEOUT + 3)
        os._exit(0)
    _survive(group, c.size - 1, TIMEOUT + 4, "metadata handshake", f"did not answer within {TIMEOUT} s")


def stall_in_ring(group):
    c = as_comm(group)
    _warm_on_nccl(group)
    if c.rank == c.size - 1:
        _fail_in_ring(lambda: (time.sleep(TIMEOUT + 3), os._exit(0)))
        sharded_attention(*_inputs(), group=group, schedule="ring")
    _survive(group, c.size - 1, TIMEOUT + 4, "ring forward step 0", f"did not answer within {TIMEOUT} s")


def run_case(size, case, timeout, backend="gloo"):
    """``case`` on ``size`` ranks: the victim (last rank) ends as planned, every survivor exits 0."""
    results = spawn(size, f"{HERE}:{case}", timeout=timeout, env={"SPLITSOFTMAX_TIMEOUT": str(TIMEOUT)},
                    backend=backend)
    victim_rc = 3 if case.startswith("exit") else 0
    assert results[-1][0] == victim_rc, f"victim rank: rc {results[-1][0]}\n{results[-1][1][-3000:]}"
    assert_ok(results[:-1], f"{case} with {size} ranks")


@pytest.mark.parametrize("case", ["exit_before", "exit_in_ring"])
def test_peer_exits(case):
    """A peer that exits (before the call / in the middle of the ring) -> RuntimeError, no hang."""
    run_case(2, case, timeout=90)


@pytest.mark.parametrize("size,case", [(3, "stall_before"), (2, "stall_in_ring")])
def test_peer_stalls(size, case):
    """A peer that stalls past SPLITSOFTMAX_TIMEOUT=10 -> RuntimeError naming it, within the timeout."""
    run_case(size, case, timeout=120)


def test_failing_early_local_work_completes_the_started_handshake(monkeypatch):
    """A tree call whose local work raises after the handshake started still completes its
    transfers before raising: no message is left undelivered in the world."""
    from splitsoftmax.ops.attention import sharded
    from splitsoftmax.distributed.comm import LoopbackWorld

    def failing(*args, **kwargs):
        raise RuntimeError("local failed")
    monkeypatch.setattr(sharded, "early_local", failing)
    world = LoopbackWorld(3)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)

    def body(comm):
        k, v = torch.randn(1, 2, 5, 8, dtype=torch.float64), torch.randn(1, 2, 5, 8, dtype=torch.float64)
        sharded_attention(q, k, v, group=comm, schedule="tree")
    with pytest.raises(RuntimeError, match="local failed"):
        world.run(body)
    assert world.sends[11] == 3 * 2
    assert not any(world.boxes.values()), {key: len(b) for key, b in world.boxes.items() if b}
