"""``python -m splitsoftmax bench placement`` on CPU at toy sizes: the harness and its accounting, not
the speed."""
import json

import pytest

from splitsoftmax.distributed.layout import causal_work, shard_lengths
from splitsoftmax.tools.bench import placement as bp


@pytest.mark.parametrize("layout", bp.LAYOUTS)
@pytest.mark.parametrize("p", [3, 16, 64])
def test_rank_pairs_add_up_to_the_pack(layout, p):
    """Every document's causal pairs counted once over the ranks, segments crossing documents included."""
    docs = bp.boundaries(bp.uniform_pack(1 << 18, seed=3))
    lens = shard_lengths(docs[-1], p, layout, docs)
    pairs = bp.rank_pairs(layout, lens, docs, p)
    assert sum(pairs) == sum(causal_work(b - a) for a, b in zip(docs[:-1], docs[1:]))
    assert max(pairs) <= 1.1 * sum(pairs) / p


def test_uniform_pack():
    lens = bp.uniform_pack(100_000, lo=256, hi=32768, seed=0)
    assert sum(lens) == 100_000 and all(256 <= n <= 32768 for n in lens[:-1]) and 0 < lens[-1] <= 32768
    assert bp.uniform_pack(100_000) == lens


def test_chosen_ranks():
    assert bp.chosen_ranks([5, 1, 3]) == [0, 1, 2]
    # the least loaded (rank 5), the most (rank 4) and the one at sorted position P // 2 (rank 3)
    assert bp.chosen_ranks([10, 40, 20, 30, 50, 0]) == [3, 4, 5]


@pytest.mark.once
def test_end_to_end_on_cpu(tmp_path, capsys):
    """The uniform pack (the published one is drawn from a distribution of ~14M documents: slow at toy
    pack sizes, where every long document is cut into many quarters)."""
    assert bp.main(["--device", "cpu", "--tokens", "512", "--ranks", "2", "5", "--heads", "2", "--kv-heads", "1",
                    "--dim", "16", "--packs", "uniform", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "placement.json") as f:
        data = json.load(f)
    rows, lines = data["rows"], data["summary"]
    assert data["complete"] is True
    assert data["meta"]["plan"] == {"min_gap": bp.configs.ATTN_PLAN_MIN_GAP, "max_row_pieces": bp.pl.MAX_ROW_PIECES}
    assert [(r["pack"], r["P"]) for r in rows if r["P"] == 1] == [("uniform", 1)]
    packs = {"uniform": bp.uniform_pack(512)}
    for pack, lengths in packs.items():
        docs = bp.boundaries(lengths)
        for p in (2, 5):
            for layout in bp.LAYOUTS:
                pairs = bp.rank_pairs(layout, shard_lengths(512, p, layout, docs), docs, p)
                mine = {r["rank"]: r for r in rows if (r["pack"], r["P"], r["layout"]) == (pack, p, layout)}
                assert sorted(mine) == bp.chosen_ranks(pairs)
                for rank, r in mine.items():
                    assert r["pairs"] == pairs[rank] and r["rows"] > 0 and r["launches_fwd"] >= 1
                    assert r["piece_rows"] >= r["rows"]  # the own step walks every row (each sees itself)
                    assert r["fwd"] > 0 and r["fwd+bwd"] > 0
    assert {(ln["pack"], ln["P"], ln["layout"]) for ln in lines} == \
        {("uniform", p, lay) for p in (2, 5) for lay in bp.LAYOUTS}
    for ln in lines:
        assert ln["fwd_efficiency"] > 0 and ln["fwd+bwd_efficiency"] > 0 and ln["max_pairs_vs_mean"] >= 1
    table = capsys.readouterr().out
    assert "f+b eff" in table and table.count("\n") == 1 + len(lines)
