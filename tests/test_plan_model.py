"""The planner's cost model: tile counting, the rate table, transfers, profiles, and the work each
layout gives each rank (conserved against a brute-force count of visible pairs)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from splitsoftmax.planning.model import Tiles, Work, load_profile, piece, shipped
from splitsoftmax.planning.sim import head_split
from splitsoftmax.planning.work import full_sequence, split

T = Tiles(128)


def test_piece_counts_tiles_and_pairs():
    w = piece(1000, 1000, True, T)
    nt = math.ceil(1000 / 128)
    assert (w.visible, w.touched, w.rowtiles, w.chain) == (1000 * 1001 / 2, nt * (nt + 1) / 2, nt, nt)
    w = piece(300, 700, False, T, count=3)
    assert (w.visible, w.touched, w.rowtiles) == (3 * 300 * 700, 3 * 3 * 6, 9)
    # pieces shorter than a tile share it when packed; unpacked, each takes whole tiles
    packed, alone = piece(32, 32, False, T, count=8), piece(32, 32, False, Tiles(128, packed=False), count=8)
    assert packed.touched == 2 and alone.touched == 8
    assert packed.visible == alone.visible == 8 * 32 * 32


def test_pieces_of_one_launch_add_rows_and_keep_one_launch():
    w = piece(256, 256, True, T) + piece(512, 128, False, T)
    assert w.rowtiles == 2 + 4 and w.launches == 1 and w.chain == 2
    assert piece(0, 10, False, T).launches == 0


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_tile_model_reproduces_the_causal_tables(name):
    """The model is fed only the full (non-causal) rates; the causal rates it predicts for the table's
    runs (H=16, B*S=32768) must come within 10% of the measured causal table at every length."""
    prof = load_profile(name)
    for pas in ("fwd", "fwd_bwd"):
        for s, measured in prof.data["kernel"][pas]["causal"]:
            b = 32768 // s
            w = piece(s, s, True, prof.tiles, count=b)
            t = prof.kernel_s(w, 16, 128, "fwd")
            if pas == "fwd_bwd":
                t = t + prof.kernel_s(w, 16, 128, "bwd")
            flops = 4.0 * 128 * 16 * s * s / 2 * b * (3.5 if pas == "fwd_bwd" else 1.0)
            predicted = flops / float(t) / 1e12
            assert abs(predicted / measured - 1) < 0.10, (name, pas, s, predicted, measured)


def test_rate_interpolates_and_falls_below_the_table():
    prof = load_profile("h200")
    table = prof.data["kernel"]["fwd"]["full"]
    for s, r in table:
        assert float(prof.rate("fwd", s)) == pytest.approx(r)
    r1 = table[0][1]
    low = prof.rate("fwd", np.array([128.0, 512.0]))
    assert 0 < low[0] < low[1] < r1


def test_transfer_and_links():
    prof = load_profile("h100")
    bw, lat = prof.link("inter", "p2p")
    assert float(prof.transfer_s(1e9, "inter", "p2p")) == pytest.approx(lat + 1e9 / bw)
    assert float(prof.transfer_s(0, "inter", "p2p")) == 0.0
    for cls in ("intra", "inter"):
        for kind in ("p2p", "alltoall", "allgather"):
            assert prof.data["links"][cls][kind]["source"].split(":")[0] in ("measured", "vendor", "estimate"), (cls, kind)


def test_profiles_load_by_name_path_and_dict(tmp_path):
    assert set(shipped()) >= {"h100", "h200"}
    data = load_profile("h200").data
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert load_profile(str(path)).name == "h200" and load_profile(data).name == "h200"
    with pytest.raises(ValueError, match="profile 'nope'"):
        load_profile("nope")
    with pytest.raises(TypeError, match="profile must be"):
        load_profile(3)
    bad = json.loads(json.dumps(data))
    bad["kernel"]["fwd"]["full"] = [[1024, 0]]
    with pytest.raises(ValueError, match="kernel table 'fwd'"):
        load_profile(bad)
    bad = json.loads(json.dumps(data))
    del bad["links"]["inter"]["alltoall"]
    with pytest.raises(ValueError, match="links.inter.alltoall needs gbs > 0"):
        load_profile(bad)


def test_scaled_profile_scales_the_kernel_time():
    prof = load_profile("h100")
    w = piece(4096, 4096, False, prof.tiles)
    base = float(prof.kernel_s(w, 8, 128, "fwd"))
    launch = prof.data["kernel"]["launch_us"]["fwd"] * 1e-6
    half = float(prof.with_kernel_scale(fwd=0.5).kernel_s(w, 8, 128, "fwd"))
    assert half - launch == pytest.approx(2 * (base - launch))
    with pytest.raises(ValueError, match="unknown pass"):
        prof.with_kernel_scale(bwd=1.0)


def _brute_pairs(docs, layout, p, causal):
    """Visible pairs per rank by enumerating the layout's positions (the contract's definitions)."""
    starts = np.concatenate([[0], np.cumsum(docs)])
    owner = np.empty(starts[-1], dtype=int)
    if layout == "contiguous":
        n = starts[-1]
        cuts = [n * r // p for r in range(p + 1)]
        sizes = [n // p + (1 if r < n % p else 0) for r in range(p)]
        cuts = np.concatenate([[0], np.cumsum(sizes)])
        for r in range(p):
            owner[cuts[r]:cuts[r + 1]] = r
    else:
        for a, b in zip(starts[:-1], starts[1:]):
            chunks = np.array_split(np.arange(a, b), 2 * p)
            for i, c in enumerate(chunks):
                owner[c] = min(i, 2 * p - 1 - i)
    out = np.zeros(p)
    for a, b in zip(starts[:-1], starts[1:]):
        for i in range(a, b):
            out[owner[i]] += (i - a + 1) if causal else (b - a)
    return out


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("docs, p", [((1000,), 4), ((300, 17, 900, 64, 2000), 3), ((128,) * 10 + (4096,), 8)])
def test_every_layout_conserves_the_visible_pairs(layout, causal, docs, p):
    """Each rank's pairs over all steps (and the all-gather's one launch) sum to the global pairs;
    contiguous and zigzag also match the brute-force count per rank (zigzag up to a row a chunk)."""
    sp = split(layout, p, docs, causal, T)
    per_rank = sp.own.visible + sum(np.asarray(sp.at(t).visible) for t in sp.active)
    total = sum(d * (d + 1) / 2 if causal else d * d for d in docs)
    assert float(np.sum(per_rank)) == pytest.approx(total)
    assert np.allclose(sp.all_keys().visible, per_rank)
    if layout != "balanced":
        brute = _brute_pairs(docs, layout, p, causal)
        tol = 0 if layout == "contiguous" else 2 * max(docs) / (2 * p) * len(docs) + 2
        assert np.all(np.abs(per_rank - brute) <= tol + 1e-6 * brute), (per_rank, brute)


@pytest.mark.parametrize("layout, docs", [("zigzag", (65536,)), ("zigzag", (512, 4096, 300) * 5),
                                          ("contiguous", (65536,)), ("balanced", (512, 4096, 300, 20000) * 3)])
def test_rank_class_shortcuts_equal_the_per_step_sums(layout, docs):
    """The closed forms (zigzag: two kinds of step; one document in slices: one kind) give exactly
    what summing every step of every rank gives."""
    prof = load_profile("h100")
    sp = split(layout, 16, docs, True, prof.tiles)

    def cost(w):
        return prof.kernel_s(w, 4, 128, "fwd")
    fast, slow = sp.costed(cost), sp.walk([cost])[0]
    assert fast.steps == slow.steps
    assert np.allclose(fast.c0, slow.c0) and np.allclose(fast.total, slow.total)
    assert np.allclose(fast.step_max, slow.step_max)
    for t in fast.steps[:5]:
        assert np.allclose(fast.at(t), slow.at(t))


def test_balanced_keeps_short_documents_whole_and_even():
    docs = tuple([512] * 64 + [2048] * 32 + [8192] * 8 + [65536])
    p = 16
    sp = split("balanced", p, docs, True, T)
    work = sp.own.visible + sum(np.asarray(sp.at(t).visible) for t in sp.active)
    assert work.max() <= 1.10 * work.mean()
    # only the one document longer than a rank's share travels
    assert np.allclose(sp.send_rows, 65536 / p)
    # short documents whole walk fewer tiles, with longer key loops, than cut in 2P chunks: the
    # slowest rank's kernel time (launches included) falls several times
    prof = load_profile("h100")
    short = tuple([512] * 64 + [1024] * 64)
    whole, cut = split("balanced", p, short, True, prof.tiles), split("zigzag", p, short, True, prof.tiles)
    assert whole.active == [] and len(cut.active) == p - 1
    assert float(np.sum(whole.all_keys().touched)) < 0.5 * float(np.sum(cut.all_keys().touched))

    def slowest(sp):
        c = sp.costed(lambda w: prof.kernel_s(w, 8, 128, "fwd"))
        return float((c.c0 + c.total).max())
    assert slowest(whole) < 0.25 * slowest(cut)


def test_head_split_follows_tensor_split_and_counts_kv_readers():
    sizes, kv, rep = head_split(32, 8, 8)
    assert sizes.tolist() == [4] * 8 and kv.tolist() == [1] * 8 and not rep
    sizes, kv, rep = head_split(32, 2, 8)
    assert kv.tolist() == [1] * 8 and rep
    sizes, kv, rep = head_split(10, 5, 4)   # uneven: 3, 3, 2, 2 query heads
    assert sizes.tolist() == [3, 3, 2, 2] and kv.tolist() == [2, 2, 1, 1] and rep
    sizes, kv, rep = head_split(2, 1, 4)    # ranks with no heads
    assert sizes.tolist() == [1, 1, 0, 0] and kv.tolist() == [1, 1, 0, 0]


def test_full_sequence_is_one_launch():
    w = full_sequence((100, 200, 5000), True, T)
    assert w.launches == 1 and w.visible == pytest.approx(100 * 101 / 2 + 200 * 201 / 2 + 5000 * 5001 / 2)
    assert isinstance(w, Work)


def _dense_tiles(docs, p, r, u, causal, tile=128):
    """Tile pairs a kernel with per-row key bounds walks, from the dense mask of rank ``r``'s rows
    against the keys of rank ``u`` they see (per-document zigzag, ``torch.tensor_split`` chunks; the
    ring brings only those, ``distributed.plan.make_plan``)."""
    def layout(rank):
        pos, doc, start = [], [], 0
        for d, n in enumerate(docs):
            chunks = torch.tensor_split(torch.arange(start, start + n), 2 * p)
            for i in (rank, 2 * p - 1 - rank):
                pos += chunks[i].tolist()
                doc += [d] * len(chunks[i])
            start += n
        return np.array(pos), np.array(doc)
    qp, qd = layout(r)
    kp, kd = layout(u)
    seen = (qd[:, None] == kd[None, :]) & ((kp[None, :] <= qp[:, None]) if causal else True)
    seen = seen[:, seen.any(0)]  # the key buffer the ring brings: the keys some row sees, in order
    touched = 0
    for i in range(0, len(qp), tile):
        cols = np.nonzero(seen[i:i + tile].any(0))[0]
        if len(cols):
            lo = min(np.nonzero(row)[0][0] for row in seen[i:i + tile] if row.any())
            touched += (cols[-1]) // tile - lo // tile + 1
    return int(seen.sum()), touched


@pytest.mark.parametrize("docs", [(300, 1000, 64, 4096, 700), (96,) * 40, (512,) * 8, (1000, 17, 3000)])
@pytest.mark.parametrize("r, u", [(1, 1), (2, 0), (0, 2), (3, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_tile_walk_equals_the_dense_mask(docs, r, u, causal):
    from splitsoftmax.planning.tiles import walk
    from splitsoftmax.planning.work import zigzag_segments
    w = walk(*zigzag_segments(docs, 4, r, u, causal), 128)
    pairs, touched = _dense_tiles(docs, 4, r, u, causal)
    assert (w.visible, w.touched) == (pairs, touched)


@pytest.mark.parametrize("docs", [(96,) * 40, (300, 1000, 64, 4096, 700), (40,) * 100, (1000,) * 4, (5000,)])
def test_one_launch_over_packed_documents_walks_the_dense_tiles(docs):
    w = full_sequence(docs, True, T)
    pairs, touched = _dense_tiles(docs, 1, 0, 0, True)
    assert (w.visible, w.touched) == (pairs, touched)


@pytest.mark.parametrize("causal", [True, False])
def test_contiguous_slices_walk_the_dense_tiles(causal):
    docs, p, tile = (300, 1000, 64, 4096, 700), 4, 128
    sp = split("contiguous", p, docs, causal, T)
    doc = np.repeat(np.arange(len(docs)), docs)
    pos = np.arange(sum(docs))
    cuts = np.cumsum([0] + [sum(docs) // p + (r < sum(docs) % p) for r in range(p)])
    for t in [0] + sp.active:
        w = sp.own if t == 0 else sp.at(t)
        for r in range(p):
            u = (r - t) % p
            q, k = slice(cuts[r], cuts[r + 1]), slice(cuts[u], cuts[u + 1])
            seen = (doc[q][:, None] == doc[k][None, :]) & ((pos[k][None, :] <= pos[q][:, None]) if causal else True)
            touched = sum(np.nonzero(seen[i:i + tile].any(0))[0][-1] // tile
                          - min(np.nonzero(row)[0][0] for row in seen[i:i + tile] if row.any()) // tile + 1
                          for i in range(0, seen.shape[0], tile) if seen[i:i + tile].any())
            assert (w.visible[r], w.touched[r]) == (seen.sum(), touched), (t, r)


def test_shipped_profiles_hold_the_package_row_piece_rule():
    """The one home of the rule is the package (configs.ATTN_PLAN_MIN_GAP, plan.MAX_ROW_PIECES); the
    shipped profiles carry its values for the planner, which imports no setting or plan of the package."""
    from splitsoftmax.distributed.plan import MAX_ROW_PIECES
    from splitsoftmax.ops._triton import configs
    from splitsoftmax.planning.model import load_profile, shipped
    for name in shipped():
        t = load_profile(name).tiles
        assert (t.min_gap, t.most) == (configs.ATTN_PLAN_MIN_GAP, MAX_ROW_PIECES), name


@pytest.mark.parametrize("docs", [(300, 1000, 64, 4096, 700), (96,) * 40, (5000, 17, 3000, 9000, 40, 2500)])
@pytest.mark.parametrize("most, gap", [(1, 1), (3, 128), (16, 128), (16, 1)])
def test_row_cover_is_the_plans_pieces(docs, most, gap):
    """The rows a step's launches cover and their count, as the model cuts them from the rows that see
    keys, are those of the package's plan (distributed.plan.make_plan) for the same rank and step,
    and the key buffer is the one the plan brings."""
    from splitsoftmax.distributed import plan as pl
    from splitsoftmax.distributed.layout import shard_lengths
    from splitsoftmax.distributed.work import nrows
    from splitsoftmax.planning.model import Tiles
    from splitsoftmax.planning.work import row_cover, zigzag_segments
    p, cu = 4, tuple(np.cumsum((0,) + docs).tolist())
    lens = shard_lengths(cu[-1], p, "zigzag", cu)
    for r in range(p):
        plan = pl.make_plan(r, lens, lens, "zigzag", True, cu, min_gap=gap, max_rows=most)
        for s in range(1, p):
            u = (r - s) % p
            segs = zigzag_segments(docs, p, r, u, True)
            span, launches = row_cover(np.zeros(segs[0].size), segs[0], segs[1], 1, Tiles(128, True, gap, most))
            pieces = plan.pieces[s]
            assert (span[0], launches[0]) == (sum(pc.nq for pc in pieces), len(pieces)), (r, s)
            assert np.max(segs[3], initial=0) == (nrows(plan.keys[s]) if pieces else 0), (r, s)
