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
    # 2k tokens a rank over IB, 8 heads each with its kv head: 4 KB of K/V a row for a quarter of the
    # compute (with 32:8 heads a step's host time and running state would hide the transfers)
    thin = Simulator(Problem((1 << 20,), True, 8, 8, 128), load_profile("h100"))
    starved = thin.score(thin.run(Candidate("ring", "zigzag", 1, 512)), thin.one_gpu_s())
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


def _free(prof):
    from splitsoftmax.planning.validation import free_links
    return free_links(prof)


@pytest.mark.parametrize("docs", [(65536,), (512, 3000, 8192, 700) * 8])
def test_allgather_runs_the_ring_steps_after_its_gather(docs):
    """With links free the allgather's compute is the ring's steps back to back (the schedule visits
    the gathered keys as the ring does); with real links every gather and reduce-scatter adds in
    full: nothing overlaps, and the backward gathers K/V again."""
    pb = Problem(docs, True, 32, 8, 128)
    prof = load_profile("h100")
    ring, gather = Candidate("ring", "zigzag", 1, 8), Candidate("allgather", "zigzag", 1, 8)
    free = Simulator(pb, _free(prof))
    assert free.run(gather).fwd_s == pytest.approx(free.run(ring).fwd_s, rel=1e-9)
    sim = Simulator(pb, prof)
    (move, scatter), _ = sim._gather_s(gather, sim.split("zigzag", 8), 2 * 8 * 128)
    assert move > 0 and scatter > move
    got, alone = sim.run(gather), free.run(gather)
    assert got.fwd_s == pytest.approx(alone.fwd_s + move, rel=1e-9)
    assert got.bwd_s == pytest.approx(alone.bwd_s + move + scatter, rel=1e-9)
    events = [e["event"] for e in sim.timeline(gather) if e["pass"] == "bwd"]
    assert events.index("gather") < events.index("compute") < events.index("reduce-scatter")


def test_step_rate_slows_ring_steps_only():
    """A slower step kernel lengthens every ring step, not one GPU's call nor a heads group's one call."""
    pb = Problem((65536,), True, 32, 8, 128)
    base = load_profile("h100").with_step_rate(fwd=1.0, fwd_bwd=1.0)
    slow = base.with_step_rate(fwd=0.5, fwd_bwd=0.5)
    a, b = Simulator(pb, _free(base)), Simulator(pb, _free(slow))
    assert a.one_gpu_parts() == b.one_gpu_parts()
    heads = Candidate("heads", "contiguous", 8, 1)
    assert a.run(heads).total_s == b.run(heads).total_s
    ring = Candidate("ring", "zigzag", 1, 8)
    ra, rb = a.run(ring), b.run(ring)
    assert rb.fwd_s > 1.8 * ra.fwd_s and rb.bwd_s > 1.8 * ra.bwd_s  # all but the host overheads doubled
    with pytest.raises(ValueError, match="unknown pass"):
        base.with_step_rate(bwd=1.0)


def test_step_bytes_cost_each_active_step_at_hbm_rate():
    """Merge passes outside the kernel: ``rows x heads x bytes / hbm`` on each step a rank computes,
    so a ring pays them once a step and a heads group (one call) not at all."""
    import copy
    from splitsoftmax.planning.model import Profile
    pb = Problem((65536,), True, 32, 8, 128)
    base = _free(load_profile("h100"))
    data = copy.deepcopy(base.data)
    data["kernel"]["step_bytes"] = {"fwd": 1000.0, "bwd": 3000.0}
    dear = Profile(data)
    for p in (4, 8):
        ring = Candidate("ring", "zigzag", 1, p)
        a, b = Simulator(pb, base).run(ring), Simulator(pb, dear).run(ring)
        per_step = (65536 / p) * 32 * np.array([1000.0, 3000.0]) / (dear.data["hbm_gbs"] * 1e9)
        assert b.fwd_s - a.fwd_s == pytest.approx(p * per_step[0], rel=1e-6)
        assert b.bwd_s - a.bwd_s == pytest.approx(p * per_step[1], rel=1e-6)
    heads = Candidate("heads", "contiguous", 8, 1)
    assert Simulator(pb, base).run(heads).total_s == Simulator(pb, dear).run(heads).total_s
    data["kernel"]["step_bytes"] = {"fwd": -1.0}
    with pytest.raises(ValueError, match="step_bytes"):
        Profile(data)


def test_grad_bytes_set_the_dkv_transfers():
    """dK/dV sums in the inputs' dtype halve what follows each block backward; the forward is unchanged."""
    import copy
    from splitsoftmax.planning.model import Profile
    pb = Problem((65536,), True, 32, 8, 128)
    wide = load_profile("h100")
    data = copy.deepcopy(wide.data)
    data["kernel"]["grad_bytes"] = 2
    narrow = Profile(data)
    ring = Candidate("ring", "zigzag", 1, 16)  # two hosts: the hop across them is slow
    a, b = Simulator(pb, wide).run(ring), Simulator(pb, narrow).run(ring)
    assert a.fwd_s == b.fwd_s and b.bwd_s < a.bwd_s
    assert b.bytes["inter"] / a.bytes["inter"] == pytest.approx(((2 * 2 + 2) * 15 + 2) / ((2 * 2 + 4) * 15 + 4), rel=1e-6)
