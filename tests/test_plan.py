"""The planner alone (pure functions): every piece against a dense brute-force visibility."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from splitsoftmax.distributed import plan as pl
from splitsoftmax.distributed import layout as lay
from splitsoftmax.distributed.layout import Seg


def dense(total: int, docs, causal: bool, window) -> torch.Tensor:
    """``[p, j]``: query p sees key j (same document, causal, window), by definition."""
    p = torch.arange(total).view(-1, 1)
    j = torch.arange(total).view(1, -1)
    ok = torch.ones(total, total, dtype=torch.bool)
    if docs is not None:
        doc = torch.bucketize(torch.arange(total), torch.tensor(docs[1:]), right=True)
        ok &= doc.view(-1, 1) == doc.view(1, -1)
    if causal:
        ok &= j <= p
    left, right = window if window is not None else (-1, -1)
    if left >= 0:
        ok &= j >= p - left
    if right >= 0:
        ok &= j <= p + right
    return ok


def pos(segs) -> list:
    return [s.glob + i for s in segs for i in range(s.n)]


def covered(qbuf, kbuf, pieces, docs, b) -> torch.Tensor:
    """How many pieces cover each (local query, local key) pair of the two buffers."""
    nq, nk = sum(s.n for s in qbuf), sum(s.n for s in kbuf)
    cnt = torch.zeros(nq, nk, dtype=torch.int64)
    for pc in pieces:
        a = torch.arange(pc.nq).view(-1, 1)
        c = torch.arange(pc.nk).view(1, -1)
        vis = torch.ones(pc.nq, pc.nk, dtype=torch.bool)
        if pc.rows:
            r = pl.rows(qbuf, kbuf, pc, docs, b)
            assert r.dtype == torch.int32 and r.shape == (2, pc.nq)
            vis = (c >= r[0].view(-1, 1).long()) & (c < r[1].view(-1, 1).long())
        if pc.causal:  # (by rows as well: the kernels apply both)
            vis &= c <= a + pc.diag
        if pc.lo is not None:
            vis &= c >= a + pc.lo
        cnt[pc.q:pc.q + pc.nq, pc.k:pc.k + pc.nk] += vis.long()
    return cnt


def random_docs(rng: random.Random, total: int) -> tuple:
    cuts = sorted(rng.randint(0, total) for _ in range(rng.randint(0, 6)))
    return tuple([0, *cuts, total])


WINDOWS = [None, (0, 0), (1, -1), (3, 0), (-1, 2), (5, 3), (40, -1)]
CASES = [(p, total, layout, causal, w)
         for p in (1, 2, 3, 5) for total in (0, 1, 7, 23) for layout in ("contiguous", "zigzag")
         for causal in (False, True) for w in WINDOWS]


@pytest.mark.parametrize("p,total,layout,causal,window", CASES)
def test_plan_matches_dense(p, total, layout, causal, window):
    """Per rank and step: the keys received are exactly those its queries see, the keys sent are
    exactly those the receiver sees, and the pieces cover every visible pair once and nothing else."""
    rng = random.Random(hash((p, total, layout, causal, window)) & 0xFFFF)
    uneven = [rng.randint(0, 9) for _ in range(p - 1)] + [0]
    for docs in (None, random_docs(rng, total), random_docs(rng, total)):
        lens = lay.shard_lengths(total, p, layout, docs)
        if layout == "contiguous" and total % 2:  # any lengths, one rank empty
            lens = uneven
            docs = None if docs is None else (*(d for d in docs if d < sum(uneven)), sum(uneven))
        vis = dense(sum(lens), docs, causal, window)
        plans = [pl.make_plan(r, lens, lens, layout, causal, docs, window) for r in range(p)]
        segs = [lay.segments(layout, lens, r, docs) for r in range(p)]
        for r, s in itertools.product(range(p), range(p)):
            plan, o = plans[r], (r - s) % p
            qp = pos(plan.q)
            assert qp == pos(segs[r])
            if plan.direct and s:
                want = [j for j in pos(segs[o]) if vis[qp, j].any()] if qp else []
                assert pos(plan.keys[s]) == want, (r, s)
                assert pos(plans[o].send[s]) == want, (r, s)
                own = pos(segs[o])
                assert [own[i] for seg in plans[o].send[s] for i in range(seg.local, seg.local + seg.n)] == want
            else:
                assert pos(plan.keys[s]) == pos(segs[o])
            if plan.direct:
                assert all(seg.n > 0 for seg in plan.send[s] + (plan.keys[s] if s else ())), (r, s)
            kp = pos(plan.keys[s])
            sub = vis[qp][:, kp] if qp and kp else torch.zeros(len(qp), len(kp), dtype=torch.bool)
            cnt = covered(plan.q, plan.keys[s], plan.pieces[s], docs, plan.band)
            assert torch.equal(cnt, sub.long()), (r, s, docs, plan.pieces[s])
            assert bool(plan.pieces[s]) == bool(sub.any())


@pytest.mark.parametrize("p,total,layout", [(p, t, lay_) for p in (1, 2, 3, 5) for t in (1, 23, 1000)
                                             for lay_ in ("contiguous", "zigzag")])
def test_plain_ring_steps_are_one_launch_each(p, total, layout):
    """Without documents or window every ring step is at most one piece (one launch): a rank's own
    step one causal piece over all its rows (its positions rise with the local index), any other
    the full piece that its pairs make once joined; full visibility one full piece."""
    lens = lay.shard_lengths(total, p, layout)
    for r in range(p):
        causal_plan = pl.make_plan(r, lens, lens, layout, True)
        n = lens[r]
        assert causal_plan.pieces[0] == ((pl.Piece(0, n, 0, n, True, 0, None, False),) if n else ())
        for s in range(1, p):
            assert len(causal_plan.pieces[s]) <= 1 and not any(pc.causal for pc in causal_plan.pieces[s])
        full_plan = pl.make_plan(r, lens, lens, layout, False)
        assert all(len(pcs) == (1 if n and lens[(r - s) % p] else 0) for s, pcs in enumerate(full_plan.pieces))


@pytest.mark.parametrize("causal,window", [(True, (40, -1)), (True, (5, 0)), (False, (5, 3)), (False, (0, 7))])
def test_one_rank_window_step_is_one_piece(causal, window):
    """A one-rank zigzag shard's two chunks continue one another (local index and position), so its
    step under a window is one banded piece, as on one device; the pieces still match the rule."""
    plan = pl.make_plan(0, [1000], [1000], "zigzag", causal, None, window)
    piece, = plan.pieces[0]
    assert (piece.q, piece.nq, piece.k, piece.nk, piece.rows) == (0, 1000, 0, 1000, False)
    cnt = covered(plan.q, plan.keys[0], plan.pieces[0], None, plan.band)
    assert torch.equal(cnt, dense(1000, None, causal, window).long())


def test_coalesced_segments():
    """Runs of segments continuing one another in local index and position become one; a gap in
    either, or an empty segment between, does not join."""
    S = Seg
    assert pl.coalesced([S(0, 10, 3), S(3, 13, 2), S(5, 20, 1)]) == [S(0, 10, 5), S(5, 20, 1)]
    assert pl.coalesced([S(0, 10, 3), S(4, 13, 2)]) == [S(0, 10, 3), S(4, 13, 2)]
    assert pl.coalesced([S(0, 10, 3), S(3, 13, 0), S(3, 13, 4)]) == [S(0, 10, 7)]


def test_joined_pieces():
    """Full pieces side by side (same rows, adjacent keys; same keys, adjacent rows) become one; causal
    ones and gaps stay apart."""
    full = lambda q, nq, k, nk: pl.Piece(q, nq, k, nk, False, 0, None, False)  # noqa: E731
    assert pl._joined([full(0, 4, 0, 3), full(0, 4, 3, 5)]) == (full(0, 4, 0, 8),)
    assert pl._joined([full(4, 2, 0, 3), full(0, 4, 0, 3)]) == (full(0, 6, 0, 3),)
    assert pl._joined([full(0, 4, 0, 3), full(0, 4, 4, 5)]) == (full(0, 4, 0, 3), full(0, 4, 4, 5))
    diag = pl.Piece(0, 4, 3, 4, True, 0, None, False)
    assert pl._joined([full(0, 4, 0, 3), diag]) == (full(0, 4, 0, 3), diag)


@pytest.mark.parametrize("max_band", [0, 4, 100])
def test_banded_and_rows_pieces_agree(max_band):
    """Per-document zigzag with several documents: rows pieces (max_band 0) and banded pieces
    (many) both cover exactly the visible pairs."""
    docs, p = (0, 5, 5, 6, 19, 30), 3
    lens = lay.shard_lengths(30, p, "zigzag", docs)
    vis = dense(30, docs, True, (4, 0))
    for r, s in itertools.product(range(p), range(p)):
        plan = pl.make_plan(r, lens, lens, "zigzag", True, docs, (4, 0), max_band=max_band)
        qp, kp = pos(plan.q), pos(plan.keys[s])
        cnt = covered(plan.q, plan.keys[s], plan.pieces[s], docs, plan.band)
        assert torch.equal(cnt, vis[qp][:, kp].long())
        if max_band == 0:  # by rows: one piece a run of rows that see keys, in order, apart
            assert all(pc.rows for pc in plan.pieces[s])
            assert all(a.q + a.nq < b.q for a, b in zip(plan.pieces[s], plan.pieces[s][1:]))
        if max_band == 100:
            assert not any(pc.rows for pc in plan.pieces[s])


def test_row_groups():
    """Runs of rows that see keys (touching in local index: one run), cut where at least ``min_gap``
    rows lie between, then the narrowest gaps joined until at most ``most`` groups remain."""
    S = Seg
    qs = [S(0, 0, 5), S(5, 100, 3), S(10, 8, 2), S(40, 50, 4), S(47, 60, 1), S(100, 70, 2)]
    # runs [0, 8), [10, 12), [40, 44), [47, 48), [100, 102): gaps 2, 28, 3, 52
    starts = lambda groups: [[s.local for s in g] for g in groups]  # noqa: E731
    assert starts(pl.row_groups(qs, 1, 16)) == [[0, 5], [10], [40], [47], [100]]
    assert starts(pl.row_groups(qs, 3, 16)) == [[0, 5, 10], [40], [47], [100]]
    assert starts(pl.row_groups(qs, 4, 16)) == [[0, 5, 10], [40, 47], [100]]
    assert starts(pl.row_groups(qs, 1, 3)) == [[0, 5, 10], [40, 47], [100]]
    assert starts(pl.row_groups(qs, 1, 2)) == [[0, 5, 10, 40, 47], [100]]
    assert starts(pl.row_groups(qs, 1, 1)) == [[0, 5, 10, 40, 47, 100]]
    assert pl.row_groups([], 1, 4) == []


SHORT_LONG = (1500, 300, 200, 1200, 250, 180, 1700, 260, 0, 190, 220, 150)  # three split at P = 4


def balanced_case(lengths: tuple, p: int) -> tuple:
    """``(cu_seqlens, lens, each rank's local rows of whole documents, the dense visibility)``."""
    cu = tuple(itertools.accumulate(lengths, initial=0))
    lens = lay.shard_lengths(cu[-1], p, "balanced", cu)
    owners = lay.balanced_owners(cu, p)
    doc = torch.bucketize(torch.arange(cu[-1]), torch.tensor(cu[1:]), right=True)
    whole = [{i for i, g in enumerate(pos(lay.segments("balanced", lens, r, cu))) if owners[doc[g]] >= 0}
             for r in range(p)]
    return cu, lens, whole, dense(cu[-1], cu, True, None)


def test_balanced_rows_pieces_leave_whole_documents_out():
    """"balanced", short documents whole between the chunks of long ones: after step 0 the whole
    documents see nothing, so the pieces by rows (one per run of rows that see keys, runs a row
    tile or more apart) hold none of their rows and walk at most the split documents' rows a step
    (one span from the first row that sees a key to the last held the whole documents between);
    every visible pair covered once."""
    p, gap = 4, 128
    cu, lens, whole, vis = balanced_case(SHORT_LONG, p)
    several = 0
    for r in range(p):
        plan = pl.make_plan(r, lens, lens, "balanced", True, cu, min_gap=gap)
        split_rows = lens[r] - len(whole[r])
        qp = pos(plan.q)
        for s in range(1, p):
            pcs = plan.pieces[s]
            walked = {a for pc in pcs for a in range(pc.q, pc.q + pc.nq)}
            assert not walked & whole[r], (r, s, pcs)
            assert sum(pc.nq for pc in pcs) <= split_rows, (r, s, pcs)
            several += sum(pc.rows for pc in pcs) > 1
            cnt = covered(plan.q, plan.keys[s], pcs, cu, plan.band)
            assert torch.equal(cnt, vis[qp][:, pos(plan.keys[s])].long()), (r, s)
    assert several >= 6  # the case cuts: steps of three runs and of two


@pytest.mark.parametrize("min_gap,max_rows", [(1, 1), (1, 2), (300, 16)])
def test_rows_pieces_cover_once_when_joined(min_gap, max_rows):
    """Gaps joined (narrower than ``min_gap``, or past ``max_rows`` pieces): still every visible
    pair once, and at most ``max_rows`` pieces by rows a step."""
    p = 4
    cu, lens, _, vis = balanced_case(SHORT_LONG, p)
    for r in range(p):
        plan = pl.make_plan(r, lens, lens, "balanced", True, cu, min_gap=min_gap, max_rows=max_rows)
        qp = pos(plan.q)
        for s in range(p):
            pcs = plan.pieces[s]
            assert sum(pc.rows for pc in pcs) <= max_rows
            cnt = covered(plan.q, plan.keys[s], pcs, cu, plan.band)
            assert torch.equal(cnt, vis[qp][:, pos(plan.keys[s])].long()), (r, s)


def test_window_halo_contiguous():
    """A window shorter than a shard: each rank receives the last ``left`` keys of the previous
    rank and nothing else (a halo to one neighbour); steps 2..P-1 are skipped on every rank."""
    lens, left = [10, 10, 10, 10], 3
    for r in range(4):
        plan = pl.make_plan(r, lens, lens, "contiguous", True, None, (left, 0))
        assert plan.keys[1] == ((Seg(0, 10 * (r - 1) + 7, 3),) if r else ())
        assert plan.send[1] == ((Seg(7, 10 * r + 7, 3),) if r < 3 else ())
        assert all(plan.keys[s] == () and plan.send[s] == () and plan.pieces[s] == () for s in (2, 3))
        own = plan.pieces[0]
        assert len(own) == 1 and own[0].causal and own[0].diag == 0 and own[0].lo == -left


def test_window_halo_zigzag():
    """Zigzag with a window shorter than a chunk: halos from the two neighbours only."""
    p, total, left = 4, 80, 4  # chunks of 10
    lens = lay.shard_lengths(total, p, "zigzag")
    for r in range(p):
        plan = pl.make_plan(r, lens, lens, "zigzag", True, None, (left, 0))
        sizes = [sum(s.n for s in k) for k in plan.keys]
        want = [lens[r]] + [0] * (p - 1)
        if r > 0:
            want[1] += left  # chunk r-1's tail, held by rank r-1
        if r < p - 1:
            want[p - 1] += left  # chunk 2P-2-r's tail, held by rank r+1 (as its second chunk)
        else:
            want[0] += 0  # rank P-1's chunks P-1 and P are adjacent: nothing from another rank
        assert sizes == want, (r, sizes)


def test_window_longer_than_shard():
    """A window of 25 over shards of 10: rank 3 (positions 30..39) needs ranks 2 and 1 whole and
    the last 5 keys of rank 0; rank 2 needs rank 1 and the last 5 of rank 0."""
    lens = [10, 10, 10, 10]
    plan = pl.make_plan(3, lens, lens, "contiguous", True, None, (25, 0))
    assert plan.keys[1:] == ((Seg(0, 20, 10),), (Seg(0, 10, 10),), (Seg(0, 5, 5),))
    plan = pl.make_plan(2, lens, lens, "contiguous", True, None, (25, 0))
    assert plan.keys[1:] == ((Seg(0, 10, 10),), (Seg(0, 0, 10),), ())


def test_documents_skip_ranks():
    """Causal documents: a rank receives only the part of an earlier rank's keys in the document
    its first queries continue; shards that start a document receive nothing."""
    lens = [6, 6, 6]
    want = {(0, 3, 9, 18): [[(), ()], [(Seg(0, 3, 3),), ()], [(Seg(0, 9, 3),), ()]],
            (0, 3, 6, 12, 18): [[(), ()]] * 3}
    for docs, per_rank in want.items():
        for r in range(3):
            plan = pl.make_plan(r, lens, lens, "contiguous", True, docs)
            assert [k for k in plan.keys[1:]] == per_rank[r], (docs, r, plan.keys)
            assert sum(bool(p) for p in plan.pieces) == 1 + sum(bool(k) for k in per_rank[r])


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("window", [None, (40, 0), (40, -1)])
def test_rows_pieces_keep_to_a_diagonal(layout, window):
    """Under causal documents (with or without a window) a piece by rows whose intervals keep to the
    main diagonal (``c <= a``; a rank's own step always) is marked causal (the cover test above
    holds it to the rule), which lets its backward bound the dS buffer; others and, without a band
    that hides later keys, all are not."""
    docs = (0, 30, 31, 200, 333, 600)
    lens = lay.shard_lengths(600, 3, layout, docs)
    for r in range(3):
        plan = pl.make_plan(r, lens, lens, layout, True, docs, window, max_band=0)
        for s, pcs in enumerate(plan.pieces):
            for pc in pcs:
                rows = pl.rows(plan.q, plan.keys[s], pc, docs, plan.band)
                last = max(int(rows[1, a]) - 1 - a for a in range(pc.nq) if rows[1, a] > rows[0, a])
                assert pc.rows and pc.causal == (last <= 0) and pc.diag == 0, (r, s, pc)
        own, = plan.pieces[0]
        assert own.causal
        full = pl.make_plan(r, lens, lens, layout, False, docs, None, max_band=0)
        assert not any(pc.causal for pcs in full.pieces for pc in pcs)


def test_uploaded_rows_note_their_reach():
    """A piece's row bounds, uploaded, carry how far a row lies past its interval's first key (the
    longest document's last row: 266 past its start), for the backward's dS bound."""
    from splitsoftmax.distributed.work import uploaded_rows
    from splitsoftmax.core.mask import row_reach
    docs = (0, 30, 31, 200, 333, 600)
    lens = lay.shard_lengths(600, 1, "zigzag", docs)
    plan = pl.make_plan(0, lens, lens, "zigzag", True, docs, None, max_band=0)
    pc, = plan.pieces[0]
    host = pl.rows(plan.q, plan.keys[0], pc, docs, plan.band)
    assert row_reach(uploaded_rows(host, "cpu")) == max(a - int(host[0, a]) for a in range(pc.nq)) == 266


def test_seen_mirror():
    """seen(k, q, mirror) is the query rows that see a key: a window of 2 over two segments."""
    q = (Seg(0, 10, 5),)
    k = (Seg(0, 4, 3), Seg(3, 20, 2))
    b = pl.band(True, (2, 0))
    assert pl.seen(q, k, None, b) == ()  # keys 4..6 are more than 2 before query 10; 20.. after
    k = (Seg(0, 8, 3),)
    assert pl.seen(q, k, None, b) == (Seg(0, 8, 3),)  # query 10 sees 8, 9, 10
    assert pl.seen(k, q, None, b.mirror()) == (Seg(0, 10, 3),)  # queries 10, 11, 12 see key 10
    assert pl.seen(q, (Seg(0, 6, 4),), None, b) == (Seg(2, 8, 2),)


def test_band():
    assert pl.band(False) == pl.Band(None, None)
    assert pl.band(True) == pl.Band(None, 0)
    assert pl.band(True, (3, 5)) == pl.Band(-3, 0)
    assert pl.band(False, (-1, 2)) == pl.Band(None, 2)
    assert pl.band(False, (4, -1)).mirror() == pl.Band(None, 4)


def test_tree_piece():
    b = pl.band(True, (3, 0))
    assert pl.tree_piece(2, 0, 10, b, 8) == pl.Piece(0, 2, 5, 5, True, 3, 0, False)  # queries 8, 9 see 5..9
    assert pl.tree_piece(2, 10, 5, b, 8) is None
    assert pl.tree_piece(2, 10, 5, b, None) == pl.Piece(0, 2, 0, 5, True, 0, -3, False)


def test_positions_and_doc_zigzag_round_trip():
    """Per-document zigzag: every position once, chunks r and 2P-1-r of each document in order."""
    for p in (1, 2, 3, 5):
        for docs in ((0, 0), (0, 1), (0, 3, 3, 4, 17), (0, 2 * p - 1, 4 * p, 4 * p + 1)):
            lens = lay.shard_lengths(docs[-1], p, "zigzag", docs)
            seen_all = []
            for r in range(p):
                segs = lay.segments("zigzag", lens, r, docs)
                got = pl.positions(segs, 0, lens[r]).tolist()
                want = []
                for a, e in zip(docs[:-1], docs[1:]):
                    ch = torch.tensor_split(torch.arange(a, e), 2 * p)
                    want += ch[r].tolist() + ch[2 * p - 1 - r].tolist()
                assert got == want
                assert got == sorted(got)
                seen_all += got
            assert sorted(seen_all) == list(range(docs[-1]))
