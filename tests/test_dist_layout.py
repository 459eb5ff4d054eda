"""Pure-function tables: layouts (contiguous / zigzag index maps) and the per-step causal decision."""
from __future__ import annotations

import pytest
import torch

from splitsoftmax.distributed import layout as lay
from splitsoftmax.distributed.layout import DIAG, FULL, SKIP, Seg

# (q_start, q_len, k_start, k_len, causal) -> decision
DECISIONS = [
    ((0, 4, 0, 4, False), (FULL, 0)),
    ((0, 4, 0, 4, True), (DIAG, 0)),       # the diagonal block
    ((4, 4, 0, 4, True), (FULL, 0)),       # keys all before the queries
    ((0, 4, 4, 4, True), (SKIP, 0)),       # keys all after the queries
    ((3, 4, 0, 4, True), (FULL, 0)),       # last key 3 <= first query 3
    ((2, 4, 0, 4, True), (DIAG, 2)),       # overlap: query a sees key b iff b <= a + 2
    ((0, 4, 2, 4, True), (DIAG, -2)),      # keys start later: query a sees key b iff b <= a - 2
    ((0, 3, 3, 4, True), (SKIP, 0)),       # first key 3 > last query 2
    ((0, 4, 3, 4, True), (DIAG, -3)),      # only the last query sees the first key
    ((0, 0, 0, 4, True), (SKIP, 0)),       # empty query block
    ((0, 4, 0, 0, False), (SKIP, 0)),      # empty key block
    ((10, 1, 0, 11, True), (FULL, 0)),     # a decode query at position 10 sees keys 0..10
    ((10, 2, 0, 12, True), (DIAG, 10)),    # key 11 only for query 11
    ((-3, 5, 0, 2, True), (DIAG, -3)),     # more queries than keys (bottom-right aligned)
]


@pytest.mark.parametrize("args,want", DECISIONS)
def test_decide(args, want):
    assert lay.decide(*args) == want


@pytest.mark.parametrize("qs,qn,ks,kn", [(0, 5, 0, 5), (3, 4, 0, 9), (0, 3, 2, 6), (7, 2, 1, 3), (-2, 4, 0, 3)])
def test_decide_matches_mask(qs, qn, ks, kn):
    """The decision reproduces the dense causal mask of the block (query i sees key j iff j <= i)."""
    dense = (torch.arange(ks, ks + kn)[None, :] <= torch.arange(qs, qs + qn)[:, None])
    kind, diag = lay.decide(qs, qn, ks, kn, True)
    by_diag = torch.arange(kn)[None, :] <= torch.arange(qn)[:, None] + diag
    expect = {SKIP: torch.zeros_like(dense), FULL: torch.ones_like(dense), DIAG: by_diag}[kind]
    assert torch.equal(dense, expect), (kind, diag)
    if kind == DIAG:
        assert dense.any() and not dense.all()


@pytest.mark.parametrize("total,size", [(0, 1), (1, 3), (13, 2), (13, 3), (16, 4), (7, 8), (100, 5)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_segments_cover_sequence(total, size, layout):
    """Shard lengths and segments match torch.tensor_split, and cover every position exactly once."""
    x = torch.arange(total)
    lengths = lay.shard_lengths(total, size, layout)
    chunks = torch.tensor_split(x, 2 * size)
    seen = []
    for r in range(size):
        segs = lay.segments(layout, lengths, r)
        held = torch.cat([x[s.glob:s.glob + s.n] for s in segs]) if segs else x[:0]
        want = (torch.tensor_split(x, size)[r] if layout == "contiguous"
                else torch.cat((chunks[r], chunks[2 * size - 1 - r])))
        assert torch.equal(held, want)
        assert [s.local for s in segs] == [sum(t.n for t in segs[:i]) for i in range(len(segs))]
        seen += held.tolist()
    assert sorted(seen) == list(range(total))
    pieces = lay.global_pieces(layout, lengths)
    assert sum(n for _, _, n in pieces) == total
    assert lay.zigzag_mismatch(lengths) == [] or layout == "contiguous"


def test_contiguous_any_lengths():
    assert lay.segments("contiguous", [0, 5, 2], 0) == [Seg(0, 0, 0)]
    assert lay.segments("contiguous", [0, 5, 2], 2) == [Seg(0, 5, 2)]
    assert lay.zigzag_mismatch([3, 3]) == [] and lay.zigzag_mismatch([2, 4]) == [0, 1]


def test_block_pairs_zigzag():
    """Zigzag rank 0 of 2 (chunks 0 and 3 of 8 positions) against rank 1's keys (chunks 1 and 2)."""
    q = lay.segments("zigzag", [4, 4], 0)
    k = lay.segments("zigzag", [4, 4], 1)
    assert q == [Seg(0, 0, 2), Seg(2, 6, 2)] and k == [Seg(0, 2, 2), Seg(2, 4, 2)]
    pairs = lay.block_pairs(q, k, causal=True)
    assert [(i, kind) for i, _, _, kind, _ in pairs] == [(1, FULL), (1, FULL)]
    assert len(lay.block_pairs(q, k, causal=False)) == 1
