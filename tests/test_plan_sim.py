"""The event simulator: the ring's overlap of transfers with compute against closed forms, the bounds
that let the planner skip simulations, bytes and memory accounting."""
from __future__ import annotations

import numpy as np
import pytest

from splitsoftmax.planning.model import load_profile
from splitsoftmax.planning.plan import candidates
from splitsoftmax.planning.sim import Candidate, Problem, Simulator, _ring


def _uniform(p, n, c0, c):
    return np.full(p, c0), list(range(1, n + 1)), (lambda t: np.full(p, c))


@pytest.mark.parametrize("c0, c, x", [(2.0, 3.0, 1.0), (2.0, 1.0, 3.0), (0.5, 3.0, 1.0), (1.0, 1.0, 1.0)])
def test_ring_overlaps_transfer_with_compute(c0, c, x):
    """Alike ranks, ``n`` steps after the own one: the block of step t arrives at ``t * x`` at the
    earliest and no sooner than the step two before has freed its buffer."""
    p, n = 4, 6
    c0s, steps, at = _uniform(p, n, c0, c)
    got = _ring(c0s, steps, at, np.full(p, x))
    # closed form by hand: step t starts at max(end of step t-1, arrival of block t)
    end, arrive, ends = c0, 0.0, [0.0, c0]
    for t in range(1, n + 1):
        arrive = max(arrive, ends[t - 1]) + x
        end = max(end, arrive) + c
        ends.append(end)
    assert np.allclose(got, end)
    assert end >= max(c0 + n * c, n * x + c) - 1e-12


def test_ring_waits_for_the_slowest_neighbour():
    """One slow rank delays the blocks it forwards: its successor finishes later than alone."""
    p, n = 4, 6
    c0 = np.zeros(p)
    slow = np.array([0.0, 5.0, 0.0, 0.0])
    got = _ring(c0, list(range(1, n + 1)), lambda t: slow + 1.0, np.full(p, 0.5))
    alone = _ring(c0, list(range(1, n + 1)), lambda t: np.full(p, 1.0), np.full(p, 0.5))
    assert got[1] == got.max() and got[2] > alone[2]


def test_backward_dkv_follows_compute_and_goes_home():
    p, n = 3, 4
    c0s, steps, at = _uniform(p, n, 1.0, 1.0)
    fwd = _ring(c0s, steps, at, np.full(p, 0.1))
    bwd = _ring(c0s, steps, at, np.full(p, 0.1), np.full(p, 0.2))
    assert np.allclose(fwd, 1.0 + n * 1.0)
    assert np.all(bwd >= fwd + 0.2 - 1e-12)


@pytest.mark.parametrize("docs, causal, world", [((65536,), True, 16), ((65536,), False, 8),
                                                 ((512, 3000, 8192, 700) * 8, True, 16)])
def test_bounds_hold_the_simulated_time(docs, causal, world):
    sim = Simulator(Problem(docs, causal, 32, 8, 128), load_profile("h100"))
    kinds = ["zigzag", "balanced", "contiguous"] if len(docs) > 1 else ["zigzag", "contiguous"]
    for cand in candidates(world, 32, kinds):
        exact, bound = sim.run(cand), sim.run(cand, exact=False)
        assert bound.total_s <= exact.total_s * (1 + 1e-9), cand
        assert exact.total_s <= bound.upper_s * (1 + 1e-9), cand


def test_one_rank_is_one_gpu():
    sim = Simulator(Problem((8192,), True, 16, 16, 128), load_profile("h200"))
    r = sim.run(Candidate("ring", "zigzag", 1, 1))
    assert r.total_s == pytest.approx(sim.one_gpu_s(), rel=1e-9)
    assert r.bytes == {"intra": 0.0, "inter": 0.0}


def test_ring_bytes_and_link_class():
    """A ring of 16 ranks, 8 a host, sends its shard's K/V (bf16) P-1 times forward and K/V plus
    float32 dK/dV backward, plus the dK/dV's way home; it crosses hosts."""
    s, hkv, d = 65536, 8, 128
    sim = Simulator(Problem((s,), True, 32, hkv, d), load_profile("h100"), gpus_per_host=8)
    r = sim.run(Candidate("ring", "zigzag", 1, 16))
    kv = s / 16 * 2 * hkv * d
    assert r.bytes["intra"] == 0.0
    assert r.bytes["inter"] == pytest.approx(kv * (2 + 2 + 4) * 15 + kv * 4)
    inside = Simulator(Problem((s,), True, 32, hkv, d), load_profile("h100"), gpus_per_host=16)
    assert inside.run(Candidate("ring", "zigzag", 1, 16)).bytes["inter"] == 0.0


def test_memory_grows_with_the_gathered_keys():
    sim = Simulator(Problem((1 << 20,), True, 32, 8, 128), load_profile("h100"))
    ring = sim.run(Candidate("ring", "zigzag", 1, 64)).peak_bytes
    gather = sim.run(Candidate("allgather", "zigzag", 1, 64)).peak_bytes
    assert gather > 4 * ring


def test_kernel_share_counts_idle_ranks_and_exposed_transfers():
    sim = Simulator(Problem((1 << 20,), True, 32, 8, 128), load_profile("h100"))
    one = sim.one_gpu_s()
    idle = sim.score(sim.run(Candidate("heads", "contiguous", 64, 1)), one)  # 32 heads on 64 ranks
    assert 0.45 < idle.kernel_share < 0.52
    busy = sim.score(sim.run(Candidate("ring", "zigzag", 1, 8)), one)   # compute-bound, transfers hidden
    assert busy.kernel_share > 0.97 and busy.efficiency > 0.97
    starved = sim.score(sim.run(Candidate("ring", "zigzag", 1, 512)), one)  # 2k tokens a rank over IB
    assert starved.kernel_share < 0.8


@pytest.mark.parametrize("cand", [Candidate("heads+ring", "zigzag", 4, 4), Candidate("ring", "contiguous", 1, 8),
                                  Candidate("heads+allgather", "zigzag", 2, 4), Candidate("heads", "contiguous", 8, 1)])
def test_timeline_is_the_simulated_layer(cand):
    """The slowest rank's events end when the layer does; its compute runs one step at a time; a
    step starts only once its K/V block has arrived."""
    sim = Simulator(Problem((65536,), True, 32, 8, 128), load_profile("h100"))
    events = sim.timeline(cand)
    r = sim.run(cand)
    assert max(e["end_ms"] for e in events) == pytest.approx(r.total_s * 1e3, rel=1e-9)
    compute = [e for e in events if e["event"] == "compute"]
    assert all(a["end_ms"] <= b["start_ms"] + 1e-9 for a, b in zip(compute, compute[1:]))
    arrive = {(e["pass"], e["step"]): e["end_ms"] for e in events if e["event"] == "kv block"}
    for e in compute:
        if (e["pass"], e["step"]) in arrive:
            assert e["start_ms"] >= arrive[(e["pass"], e["step"])] - 1e-9
