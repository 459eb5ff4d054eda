"""``layout="balanced"``: short packed documents whole on one rank each, long ones zigzagged.

The placement (pure in ``cu_seqlens`` and ``P``) is checked against its definition: every position
once, whole documents whole, split documents cut like ``torch.tensor_split(doc, 2P)``, the split ones
the largest, and the causal work per rank (counted here from the positions: a query at offset ``t``
of its document sees ``t + 1`` keys) within ``1 + 1/10`` of the mean, or no worse than per-document
zigzag where that bound is out of reach. Then shard / unshard and ``sharded_attention`` (ring,
allgather, heads) on the loopback world against the float64 single-device oracle, and the refusals.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from splitsoftmax import sharded_attention
from splitsoftmax.distributed import LoopbackWorld, as_comm, shard, unshard
from splitsoftmax.distributed import layout as lay
from _dist_util import assert_ok, spawn
from test_dist_cases import DEVICE, F32
from test_dist_variants import check, rank_positions, sinks_of

SLACK = 10  # the stated bound: the busiest rank's causal work <= (1 + 1/SLACK) * mean


def cu_of(lengths) -> tuple:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def positions(cu: tuple, p: int) -> list:
    """Each rank's global positions under "balanced", in its local order."""
    return [[g for s in lay.segments("balanced", [0] * p, r, cu) for g in range(s.glob, s.glob + s.n)]
            for r in range(p)]


def doc_of(cu: tuple) -> list:
    """The document of every position."""
    return [d for d in range(len(cu) - 1) for _ in range(cu[d + 1] - cu[d])]


def work(pos: list, cu: tuple) -> list:
    """Each rank's causal work: the keys its queries see (a query at offset t of its document: t + 1)."""
    doc = doc_of(cu)
    return [sum(g - cu[doc[g]] + 1 for g in mine) for mine in pos]


def random_documents(r: random.Random, big: bool) -> tuple:
    """Document lengths drawn log-normally (empty ones too); ``big``: many documents, long next to 2P."""
    n = r.randint(20, 200) if big else r.randint(1, 12)
    mu = r.uniform(3, 7) if big else r.uniform(0, 3)
    return cu_of([0 if r.random() < 0.05 else int(r.lognormvariate(mu, 1.3)) for _ in range(n)])


def check_placement(cu: tuple, p: int) -> tuple[list, set]:
    """The definition of the placement; returns ``(each rank's positions, the split documents)``."""
    pos = positions(cu, p)
    assert sorted(g for mine in pos for g in mine) == list(range(cu[-1])), f"not a permutation: cu={cu} P={p}"
    assert all(mine == sorted(mine) for mine in pos), f"a rank's positions out of global order: cu={cu} P={p}"
    assert [len(m) for m in pos] == lay.shard_lengths(cu[-1], p, "balanced", cu)
    zig = rank_positions("zigzag", None, p, cu)
    where = {g: r for r, mine in enumerate(pos) for g in mine}
    split = set()
    for d, (a, e) in enumerate(zip(cu[:-1], cu[1:])):
        owners = {where[g] for g in range(a, e)}
        if len(owners) > 1:  # split: exactly the per-document zigzag chunks of this document
            split.add(d)
            for r in range(p):
                assert [g for g in pos[r] if a <= g < e] == [g for g in zig[r] if a <= g < e], (cu, p, d, r)
    return pos, split


@pytest.mark.parametrize("seed", range(60))
def test_placement_random_mixes(seed):
    """A permutation, whole or zigzag per document, the split ones the largest, the work bound
    (or no worse than per-document zigzag); on the mixes of many documents the bound outright."""
    r = random.Random(seed)
    p = r.choice([1, 2, 3, 4, 5, 8, 16, 64])
    cu = random_documents(r, big=seed % 2 == 0)
    pos, split = check_placement(cu, p)
    n = [b - a for a, b in zip(cu[:-1], cu[1:])]
    size = [m * (m + 1) // 2 for m in n]
    whole = [d for d in range(len(n)) if d not in split and n[d]]
    if split and whole:
        smallest = min(split, key=lambda d: (size[d], -d))
        assert all((size[d], -d) <= (size[smallest], -smallest) for d in whole), "a whole one above a split one"
    loads, total = work(pos, cu), sum(size)
    zig = max(work(rank_positions("zigzag", None, p, cu), cu))
    assert max(loads) * p * SLACK <= total * (SLACK + 1) or max(loads) <= zig, (cu, p, loads, zig)
    if seed % 2 == 0:  # many documents: the bound outright, and nothing at or below mean / 8 split
        assert max(loads) * p * SLACK <= total * (SLACK + 1), (cu, p, loads)
        assert all(size[d] * p * SLACK > total for d in split), "a document at or below mean / 8 split"


@pytest.mark.parametrize("seed", range(3))
def test_realistic_packings_within_ten_percent(seed):
    """1M tokens packed from documents of 256 to 32k tokens (log-uniform), 64 ranks: the busiest
    rank's causal work within 10% of the mean, the documents split the largest ones, every other
    document one piece on one rank."""
    r, lengths = random.Random(seed), []
    while sum(lengths) < 1 << 20:
        lengths.append(min(int(math.exp(r.uniform(math.log(256), math.log(32768)))), (1 << 20) - sum(lengths)))
    cu, p = cu_of(lengths), 64
    start = np.repeat(np.asarray(cu[:-1]), lengths)
    cost = np.arange(cu[-1]) - start + 1  # a query's causal keys
    segs = [lay.segments("balanced", [0] * p, rank, cu) for rank in range(p)]
    loads = [sum(int(cost[s.glob:s.glob + s.n].sum()) for s in mine) for mine in segs]
    assert max(loads) * p <= 1.10 * sum(loads), (seed, max(loads) * p / sum(loads))
    owners = lay.balanced_owners(cu, p)
    split = [n for n, o in zip(lengths, owners) if o < 0]
    assert split and min(split) >= max(n for n, o in zip(lengths, owners) if o >= 0), seed
    rank_of = np.empty(cu[-1], dtype=np.int64)
    for rank, mine in enumerate(segs):
        for s in mine:
            rank_of[s.glob:s.glob + s.n] = rank
    held = [len(np.unique(rank_of[a:b])) for a, b in zip(cu[:-1], cu[1:])]
    assert held == [p if o < 0 else 1 for o in owners], seed


def test_deterministic():
    """A pure function of (cu_seqlens, P): the same with the caches cleared, and given as a list."""
    cu = cu_of([7, 300, 2, 0, 90, 45, 45, 1000, 3])
    first = [lay.segments("balanced", [0] * 5, r, cu) for r in range(5)]
    lay._balanced_all.cache_clear()
    lay.balanced_owners.cache_clear()
    assert [lay.segments("balanced", [0] * 5, r, list(cu)) for r in range(5)] == first


def test_short_documents_stay_whole():
    """128 documents of 4096 at 64 ranks: two whole documents a rank (per-document zigzag would cut
    each into 128 pieces of 32 rows), and every rank's work equal."""
    cu = cu_of([4096] * 128)
    pos, split = check_placement(cu, 64)
    assert not split and all(len(m) == 2 * 4096 for m in pos)
    assert len(set(work(pos, cu))) == 1
    assert all(len(lay.segments("balanced", [0] * 64, r, cu)) <= 2 for r in range(64))


def test_long_document_split_short_ones_whole():
    """One document longer than a rank's share of the work is zigzagged; the short ones fill in."""
    cu = cu_of([5, 9, 3000, 200, 150, 150, 64, 1, 0, 300, 250, 220, 180])
    pos, split = check_placement(cu, 4)
    assert split == {2}
    loads = work(pos, cu)
    assert max(loads) * 4 * SLACK <= sum(loads) * (SLACK + 1), loads


def test_bound_out_of_reach():
    """Documents of 1, 3, 4 at 2 ranks (work 1, 6, 10; the bound 1.125 * 8.5): the 4 must split (busiest
    11), splitting the 3 too gives 10, as does splitting all (per-document zigzag): out of reach, so
    the least busiest with the fewest splits is taken; and two documents of 10 at 4 ranks, each alone
    above the bound, both split."""
    cu = cu_of([1, 3, 4])
    pos, split = check_placement(cu, 2)
    assert split == {1, 2} and max(work(pos, cu)) == max(work(rank_positions("zigzag", None, 2, cu), cu)) == 10
    cu = cu_of([10, 10])
    pos, split = check_placement(cu, 4)
    assert split == {0, 1} and work(pos, cu) == [26, 32, 26, 26]


def test_ties_and_order():
    """Equal documents go to the ranks in turn (ties: the lowest rank), larger documents first."""
    cu = cu_of([4, 10, 10, 10, 10, 4, 4, 4, 0])
    # the 10s first (work 55 each: ranks 0, 1, then the tie at 55 to rank 0), then the 4s (10 each)
    assert lay.balanced_owners(cu, 2) == (0, 0, 1, 0, 1, 1, 0, 1, -1)


@pytest.mark.parametrize("seed", range(4))
def test_zigzag_loads_are_the_zigzag_ranks_work(seed):
    """The closed form of the split documents' work per rank (what the placement adds the whole ones
    to) equals the work counted from the per-document zigzag's positions, remainders of every kind
    (documents shorter than 2P, empty, one more or less than a multiple of 2P) included."""
    r = random.Random(seed)
    for p in (1, 2, 3, 8, 33):
        lengths = [r.choice([0, 1, 2 * p - 1, 2 * p, 2 * p + 1, r.randrange(p), r.randrange(40 * p)])
                   for _ in range(r.randint(1, 6))]
        cu = cu_of(lengths)
        assert lay.zigzag_loads(lengths, p) == work(rank_positions("zigzag", None, p, cu), cu), (p, lengths)


def test_empty_and_one_rank():
    assert positions((0,), 3) == [[], [], []]
    assert positions((0, 0, 0), 2) == [[], []]
    assert positions(cu_of([3, 0, 4]), 1) == [list(range(7))]
    assert lay.segments("balanced", [0], 0, cu_of([3, 0, 4])) == [lay.Seg(0, 0, 7)]


def case_shard_roundtrip(group):
    """shard is the placement's rows, unshard inverts it, and each is the other's backward."""
    c = as_comm(group)
    for cu in (cu_of([0, 1, 3, 17, 5, 0, 2, 9, 4]), cu_of([2 * c.size - 1]), cu_of([40, 3, 3, 3]), (0,)):
        s = cu[-1]
        x = torch.randn(2, 3, s, 4, generator=torch.Generator().manual_seed(s), dtype=torch.float64).to(DEVICE)
        xl = x.clone().requires_grad_()
        mine = shard(xl, 2, group=group, layout="balanced", cu_seqlens=torch.tensor(cu))
        assert torch.equal(mine, x[:, :, positions(cu, c.size)[c.rank]]), f"shard cu={cu} rank {c.rank}"
        full = unshard(mine * 2.0, 2, group=group, layout="balanced", cu_seqlens=cu)
        assert torch.equal(full, 2.0 * x), f"unshard cu={cu} rank {c.rank}"
        (full * x).sum().backward()
        assert torch.equal(xl.grad, 2.0 * x), f"shard / unshard gradient cu={cu}"
        back = shard(unshard(mine.detach().clone().requires_grad_(), 2, group=group, layout="balanced", cu_seqlens=cu),
                     2, group=group, layout="balanced", cu_seqlens=cu)
        assert torch.equal(back, mine)


DOCS = (0, 1, 3, 17, 5, 0, 2, 9, 4)  # whole documents on several ranks, the 17 (and at P = 4 the 9) split


def case_attention(group):
    """ring, allgather, heads under "balanced" against the float64 oracle: out, lse, dq, dk, dv (and
    the sinks' share), causal and not, with a window, softcap and sinks."""
    p = as_comm(group).size
    cu = cu_of(DOCS)
    pos, split = check_placement(cu, p)
    homes = {r for r, mine in enumerate(pos) for g in mine if doc_of(cu)[g] not in split}
    assert 3 in split and len(split) < 3 and len(homes) > 1, f"the cases should split the long documents only: {split}"
    s = cu[-1]
    cases = [(True, dict(cu_seqlens=cu)), (False, dict(cu_seqlens=torch.tensor(cu))),
             (True, dict(cu_seqlens=cu, window_size=(3, 0), softcap=1.5, sinks=sinks_of())),
             (False, dict(cu_seqlens=cu, window_size=(2, 1), softcap=0.8))]
    for schedule in ("ring", "allgather", "heads"):
        for causal, kw in cases:
            check(group, schedule, "balanced", causal, kw, s=s)
    check(group, "ring", "balanced", True, cases[2][1], s=s, dtype=torch.float32, tol=F32)


def case_refusals(group):
    """Without cu_seqlens, with the tree, and with lengths not of the placement: ValueError on every rank."""
    c = as_comm(group)
    x = torch.zeros(1, 2, 8, 4, device=DEVICE)
    for call in (lambda: shard(x, 2, group=group, layout="balanced"),
                 lambda: unshard(x, 2, group=group, layout="balanced"),
                 lambda: sharded_attention(x, x, x, group=group, layout="balanced"),
                 lambda: sharded_attention(x, x, x, group=group, layout="balanced", schedule="heads")):
        with pytest.raises(ValueError, match="layout='balanced'.*cu_seqlens"):
            call()
    with pytest.raises(ValueError, match="tree"):
        sharded_attention(x, x, x, group=group, layout="balanced", schedule="tree", cu_seqlens=(0, 8 * c.size))
    cu = cu_of([5, 9, 30, 7])
    lens = lay.shard_lengths(cu[-1], c.size, "balanced", cu)
    lens[0], lens[1] = lens[0] + 1, lens[1] - 1  # ranks 0 and 1 hold lengths not of the placement
    y = torch.zeros(1, 2, lens[c.rank], 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"layout='balanced' but rank\(s\) \[0, 1\] hold Sq_local"):
        sharded_attention(y, y, y, group=group, layout="balanced", cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"unshard: layout='balanced' but rank\(s\) \[0, 1\]"):
        unshard(y, 2, group=group, layout="balanced", cu_seqlens=cu)


@pytest.mark.parametrize("layout,moved", [("balanced", False), ("zigzag", True)])
def test_whole_documents_need_no_transfer(layout, moved):
    """Eight documents of 6 over 4 ranks: two whole ones a rank, so the ring sends no K/V forward
    and no dK/dV backward (per-document zigzag sends both)."""
    from splitsoftmax.ops.attention.schedules.ring import TAG_DKV, TAG_KV
    cu = cu_of([6] * 8)
    world = LoopbackWorld(4)

    def run(c):
        x = torch.randn(1, 2, cu[-1], 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        q, k, v = (shard(x, 2, group=c, layout=layout, cu_seqlens=cu).requires_grad_() for _ in range(3))
        sharded_attention(q, k, v, causal=True, group=c, layout=layout, cu_seqlens=cu).sum().backward()
    world.run(run)
    assert (world.sends.get(TAG_KV, 0) > 0, world.sends.get(TAG_DKV, 0) > 0) == (moved, moved), dict(world.sends)


def case_all(group):
    """Every distributed case, for the Gloo lane here and the NCCL one (test_gpu_dist.py)."""
    for case in (case_shard_roundtrip, case_attention, case_refusals):
        case(group)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("case", [case_shard_roundtrip, case_attention, case_refusals], ids=lambda f: f.__name__)
def test_loopback(size, case):
    LoopbackWorld(size).run(case)


def test_loopback_one_rank():
    """One rank holds everything, in global order."""
    LoopbackWorld(1).run(case_shard_roundtrip)


def test_gloo():
    """The same cases in Gloo processes: each rank computes the placement alone, and they agree."""
    assert_ok(spawn(3, "tests/test_balanced_layout.py:case_all", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              "gloo world of 3, balanced")


def test_context_parallel_refuses_balanced():
    import splitsoftmax as ss

    def case(c):
        with pytest.raises(ValueError, match="layout='balanced'"):
            with ss.context_parallel(c, layout="balanced"):
                pass
    LoopbackWorld(2).run(case)


ROW_DOCS = (60, 12, 10, 50, 11, 9, 70, 12, 0, 10, 13)  # at P = 3 three split, whole ones between their chunks


@pytest.mark.parametrize("min_gap", [1, 8, 20])
def test_rows_pieces_exact(monkeypatch, min_gap):
    """Steps of several pieces by rows (whole documents between the split ones' chunks left out; at
    a ``min_gap`` of 20 some gaps walked inside a piece): ring and allgather, causal and not, and the
    2-D mesh's heads+ring, forward and backward against the float64 oracle."""
    from splitsoftmax.ops._triton import configs
    from splitsoftmax.ops.attention.schedules.ring import plan_of
    from test_mesh_cases import check as mesh_check
    monkeypatch.setattr(configs, "ATTN_PLAN_MIN_GAP", min_gap)
    cu, p = cu_of(ROW_DOCS), 3
    lens = lay.shard_lengths(cu[-1], p, "balanced", cu)
    plans = [plan_of(r, lens, lens, "balanced", True, cu, None).plan for r in range(p)]
    assert sum(sum(pc.rows for pc in pcs) > 1 for plan in plans for pcs in plan.pieces) == 2
    cases = [(True, dict(cu_seqlens=cu)), (False, dict(cu_seqlens=cu)),
             (True, dict(cu_seqlens=cu, window_size=(40, 0), softcap=1.5, sinks=sinks_of()))]
    LoopbackWorld(p).run(lambda g: [check(g, schedule, "balanced", causal, kw, s=cu[-1])
                                    for schedule in ("ring", "allgather") for causal, kw in cases]
                         + [check(g, "ring", "balanced", True, cases[2][1], s=cu[-1], dtype=torch.float32, tol=F32)])
    LoopbackWorld(2 * p).run(lambda c: mesh_check(c.mesh(p, 2), "heads+ring", "balanced", True, dict(cu_seqlens=cu),
                                                 4, 2, s=cu[-1]))


@pytest.mark.interpreter
def test_interpreter_rows_pieces(monkeypatch):
    """Steps of several pieces by rows over the Triton kernels (TRITON_INTERPRET=1), float32."""
    from splitsoftmax.ops._triton import configs
    monkeypatch.setattr(configs, "ATTN_PLAN_MIN_GAP", 8)
    cu = cu_of(ROW_DOCS)
    LoopbackWorld(3).run(lambda g: check(g, "ring", "balanced", True, dict(cu_seqlens=cu), s=cu[-1],
                                         dtype=torch.float32, tol=F32))


@pytest.mark.interpreter
@pytest.mark.parametrize("schedule", ["ring", "heads"])
def test_interpreter(schedule):
    """Over the Triton kernels (TRITON_INTERPRET=1): whole documents and a zigzagged one, windowed,
    capped, with sinks, float32."""
    kw = dict(cu_seqlens=cu_of(DOCS), window_size=(3, 0), softcap=1.5, sinks=sinks_of())
    LoopbackWorld(2).run(lambda g: check(g, schedule, "balanced", True, kw, s=cu_of(DOCS)[-1],
                                         dtype=torch.float32, tol=F32))
