"""The planner's choices as behaviour: free links -> the best kernel shapes; a dear all-to-all -> no
heads; fewer kv heads than ranks -> replicated kv counted; packed documents -> fragmentation weighed.
And ``ss.plan_attention``'s contract: what a plan holds, and its argument errors."""
from __future__ import annotations

import copy
import time

import pytest
import torch

import splitsoftmax as ss
from splitsoftmax.planning import load_profile
from splitsoftmax.planning.sim import Candidate, Problem, Simulator

LLAMA = dict(heads=32, kv_heads=8, head_dim=128)


def _links(gbs=None, alltoall=None, latency=None, overheads=None):
    data = copy.deepcopy(load_profile("h100").data)
    for cls in data["links"].values():
        for kind, e in cls.items():
            if gbs is not None:
                e["gbs"] = gbs
            if alltoall is not None and kind == "alltoall":
                e["gbs"] = alltoall
            if latency is not None:
                e["latency_us"] = latency
    if overheads is not None:
        for what in ("step_us", "call_us"):
            data["kernel"][what].update(fwd=overheads, bwd=overheads)
    return data


def test_free_links_pick_the_best_kernel_shapes():
    """With transfers free, time is compute: the plan is a candidate whose kernels are fastest (one
    launch over every key a rank sees: heads, or all-gather, whose key loops are the longest), not
    the ring, whose steps run shorter pieces."""
    plan = ss.plan_attention(8, seq_len=65536, profile=_links(gbs=1e6, latency=0), **LLAMA)
    fastest = min(plan.candidates, key=lambda r: r.compute_s)
    assert plan.best.compute_s == pytest.approx(fastest.compute_s, rel=1e-9)
    heads = next(r for r in plan.candidates if r.candidate == Candidate("heads", "contiguous", 8, 1))
    ring = next(r for r in plan.candidates if r.candidate == Candidate("ring", "zigzag", 1, 8))
    assert heads.compute_s == pytest.approx(fastest.compute_s, rel=1e-9)
    assert ring.compute_s > 1.05 * plan.best.compute_s and plan.schedule != "ring"


def test_a_dear_all_to_all_is_avoided():
    """Packed documents on 8 GPUs: with the profile's links the plan moves heads; with an all-to-all
    of 0.5 GB/s (everything else alike) it does not."""
    cu = _documents(1 << 18)
    cheap = ss.plan_attention(8, cu_seqlens=cu, **LLAMA)
    dear = ss.plan_attention(8, cu_seqlens=cu, profile=_links(alltoall=0.5), **LLAMA)
    assert cheap.mesh[0] > 1 and dear.mesh[0] == 1, (cheap.mesh, dear.mesh)
    heads = next(r for r in dear.candidates if r.candidate.schedule == "heads")
    assert "all-to-all" in heads.why


def _alltoall_bytes(heads, kv_heads, degree, rows, d=128, e=2):
    """Bytes one heads-rank (rank 0) sends in the forward and backward all-to-alls, from
    ``torch.tensor_split`` of the heads and the kv heads each rank's query heads read."""
    q = [t.tolist() for t in torch.tensor_split(torch.arange(heads), degree)]
    g = heads // kv_heads
    kv = [sorted({h // g for h in qs}) for qs in q]
    readers = {k: sum(k in x for x in kv) for k in range(kv_heads)}
    grad_e = 4 if max(readers.values()) > 1 else e
    n0 = rows / degree
    fwd = sum(n0 * (len(q[j]) + 2 * len(kv[j])) * d * e for j in range(1, degree))
    fwd += (rows - n0) * len(q[0]) * (d * e + 4)
    bwd = sum(n0 * len(q[j]) * (d * e + 8) for j in range(1, degree))  # dout with the rows' lse and delta
    bwd += (rows - n0) * (len(q[0]) * d * e + 2 * len(kv[0]) * d * grad_e)
    return fwd + bwd


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_fewer_kv_heads_than_ranks_send_replicated_kv(kv_heads):
    s, degree = 65536, 8
    sim = Simulator(Problem((s,), True, 32, kv_heads, 128), load_profile("h100"))
    r = sim.run(Candidate("heads", "contiguous", degree, 1))
    want = _alltoall_bytes(32, kv_heads, degree, s)
    assert r.bytes["intra"] + r.bytes["inter"] == pytest.approx(want)
    # each rank receives a whole kv head whatever Hkv: bytes never fall with kv_heads / degree
    naive = _alltoall_bytes(32, 8, degree, s)
    assert r.bytes["intra"] >= naive


@pytest.mark.parametrize("kv_heads, hosts", [(2, 2), (4, 2), (1, 1), (1, 2)])
def test_kv_relay_across_hosts(kv_heads, hosts):
    """A heads group of 8 over ``hosts`` hosts: where each kv head's readers share a host, K/V take
    two hops (fewer bytes across hosts, more inside, a cheaper all-to-all than one copy per reader);
    one host, or readers on several: one hop, as without the relay."""
    pb = Problem((65536,), True, 32, kv_heads, 128)
    cand = Candidate("heads", "contiguous", 8, 1)
    two, one = (Simulator(pb, load_profile("h100"), 8 // hosts, relay=r).run(cand) for r in (True, False))
    if hosts > 1 and 8 // kv_heads <= 8 // hosts:
        assert two.bytes["inter"] < one.bytes["inter"] and two.bytes["intra"] > one.bytes["intra"]
        assert two.alltoall_s < one.alltoall_s
    else:
        assert (two.bytes, two.alltoall_s) == (one.bytes, one.alltoall_s)


def test_replicated_kv_makes_heads_dearer_in_the_ranking():
    args = dict(seq_len=131072, heads=32, head_dim=128, profile=_links(alltoall=20))
    few = ss.plan_attention(8, kv_heads=1, **args)
    many = ss.plan_attention(8, kv_heads=8, **args)

    def heads(plan):
        return next(r for r in plan.candidates if r.candidate.schedule == "heads")
    assert heads(few).alltoall_s > heads(many).alltoall_s


def _documents(total):
    lengths = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    docs = []
    for n in lengths:
        docs += [n] * (total // len(lengths) // n)
    docs.append(total - sum(docs))
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    return cu


def test_packed_documents_weigh_fragmentation():
    """1M tokens of documents from 256 to 32k on 64 GPUs: zigzag cuts the short ones into pieces
    shorter than a tile; whole-document placement or heads must beat the zigzag ring, and the plan
    is one of them."""
    plan = ss.plan_attention(64, cu_seqlens=_documents(1 << 20), **LLAMA)
    by = {(r.candidate.schedule, r.candidate.layout, r.candidate.heads_degree): r for r in plan.candidates}
    ring = by[("ring", "zigzag", 1)]
    best_other = min(r.total_s for r in plan.candidates
                     if r.candidate.layout == "balanced" or r.candidate.heads_degree > 1)
    assert best_other < 0.8 * ring.total_s
    assert plan.layout == "balanced" or plan.mesh[0] > 1
    assert by[("ring", "balanced", 1)].tile_efficiency > ring.tile_efficiency


def test_a_plan_holds_what_the_contract_lists():
    plan = ss.plan_attention(16, seq_len=262144, dtype=torch.bfloat16, **LLAMA)
    assert plan.schedule in ("ring", "allgather", "heads", "heads+ring", "heads+allgather")
    assert plan.mesh[0] * plan.mesh[1] == 16 and plan.layout in ("contiguous", "zigzag")
    assert plan.best.why == "chosen"
    for r in plan.candidates:
        assert r.fwd_s > 0 and r.bwd_s > 0 and r.peak_bytes > 0
        assert set(r.bytes) == {"intra", "inter"} and r.why
    assert plan.candidates == sorted(plan.candidates, key=lambda r: r.total_s)
    assert "prediction" in plan.table() and plan.as_dict()["prediction"] is True


@pytest.mark.parametrize("kwargs, match", [
    (dict(world=0, seq_len=10), "world must be a positive int"),
    (dict(world=4, seq_len=10, heads=6, kv_heads=4), r"heads \(6\) must be a multiple of kv_heads \(4\)"),
    (dict(world=4), "exactly one of seq_len and cu_seqlens"),
    (dict(world=4, seq_len=10, cu_seqlens=[0, 10]), "exactly one of seq_len and cu_seqlens"),
    (dict(world=4, cu_seqlens=[1, 10]), "cu_seqlens must start at 0"),
    (dict(world=4, cu_seqlens=[0, 10, 5]), "cu_seqlens must start at 0, never decrease"),
    (dict(world=4, seq_len=10, window_size=(-2, 0)), "window_size entries must be >= -1"),
    (dict(world=4, seq_len=10, dtype="int8"), "dtype must be a torch floating dtype"),
    (dict(world=4, seq_len=10, gpus_per_host=0), "gpus_per_host must be a positive int"),
    (dict(world=4, seq_len=10, profile="nope"), "profile 'nope'"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    args = dict(heads=8, kv_heads=8, head_dim=64) | kwargs
    world = args.pop("world")
    with pytest.raises(ValueError, match=match):
        ss.plan_attention(world, **args)


def test_windows_and_documents_plan_and_4096_gpus_answer_within_a_second():
    windowed = ss.plan_attention(64, seq_len=1 << 20, window_size=(4095, 0), **LLAMA)
    full = ss.plan_attention(64, seq_len=1 << 20, **LLAMA)
    assert windowed.one_gpu_s < 0.1 * full.one_gpu_s
    start = time.perf_counter()
    big = ss.plan_attention(4096, seq_len=1 << 22, **LLAMA)
    assert time.perf_counter() - start < 1.0
    assert big.mesh[0] * big.mesh[1] == 4096


def test_rank_groups_lay_heads_groups_on_contiguous_ranks():
    plan = ss.plan_attention(64, seq_len=1 << 20, **LLAMA)
    hd, sd = plan.mesh
    seq_groups, heads_groups = plan.rank_groups()
    assert len(heads_groups) == sd and all(g == list(range(g[0], g[0] + hd)) for g in heads_groups)
    assert sorted(r for g in seq_groups for r in g) == list(range(64)) == sorted(r for g in heads_groups for r in g)
    assert all(len(set(g) & set(h)) == 1 for g in seq_groups for h in heads_groups)


def test_layouts_weighed_follow_the_input():
    def kinds(**kw):
        return {r.candidate.layout for r in ss.plan_attention(16, **kw, **LLAMA).candidates}
    assert kinds(seq_len=1 << 18) == {"zigzag", "contiguous"}
    assert kinds(seq_len=1 << 18, causal=False) == {"contiguous"}
    assert kinds(seq_len=1 << 18, window_size=(4095, 0)) == {"contiguous"}
    assert kinds(cu_seqlens=[0, 4096, 1 << 18]) == {"zigzag", "balanced", "contiguous"}
