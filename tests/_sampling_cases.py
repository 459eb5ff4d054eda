"""Sharded sampling cases run on every rank of a group (loopback threads, Gloo processes, mpirun).

Each case builds the same full logits on every rank, takes this rank's slice and checks the
sharded result against the single-device one on the full logits: every check is an assertion.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import splitsoftmax as ss  # noqa: E402
from _sampling_util import edge_rows  # noqa: E402
from splitsoftmax.distributed.comm import as_comm  # noqa: E402

CONFIGS = [dict(temperature=0.0), dict(), dict(temperature=0.6), dict(top_k=3), dict(top_k=40, top_p=0.9),
           dict(top_p=0.7), dict(top_p=0.95, temperature=2.0), dict(min_p=0.1), dict(top_k=20, top_p=0.8, min_p=0.02),
           dict(top_k=90)]


def split_widths(v: int, size: int, rank_zero_empty: bool) -> list:
    """Uneven widths summing to ``v``; the first rank empty when asked."""
    if size == 1:
        return [v]
    cuts = sorted(min(v, (v * i) // size + i % 2) for i in range(1, size))
    widths = [b - a for a, b in zip([0] + cuts, cuts + [v])]
    return [0, widths[0] + widths[1], *widths[2:]] if rank_zero_empty else widths


def rows_and_seeds(v: int = 97):
    x = torch.cat((edge_rows(v), torch.randn(4, v, generator=torch.Generator().manual_seed(5)) * 3))
    return x, torch.arange(x.shape[0], dtype=torch.int64) * 1_000_003 - 7, 11


def twin_rows(v: int = 97) -> torch.Tensor:
    """Rows that repeat (the first eight four times over, a random row eight times): under an int
    seed each draws on its own, so the sharded draw must key every row as the one-device draw does."""
    x, _, _ = rows_and_seeds(v)
    return torch.cat((x[:8].repeat(4, 1), x[8:9].expand(8, -1)))


def check_all(group, rank_zero_empty: bool = False) -> None:
    """Every configuration and top-k: the sharded tokens equal ``ss.sample`` / ``ss.topk`` on the full
    rows, with per-row seeds and, on repeating rows, with an int seed and offset."""
    comm = as_comm(group)
    x, seeds, offset = rows_and_seeds()
    widths = split_widths(x.shape[1], comm.size, rank_zero_empty)
    mine = torch.split(x, widths, dim=1)[comm.rank]
    twins = twin_rows()
    my_twins = torch.split(twins, widths, dim=1)[comm.rank]
    for kw in CONFIGS:
        want = ss.sample(x, seed=seeds, offset=offset, **kw)
        got = ss.sharded_sample(mine, seed=seeds, offset=offset, group=group, **kw)
        assert torch.equal(got, want), (kw, widths, got, want)
        want = ss.sample(twins, seed=-(2 ** 40) - 3, offset=offset, **kw)
        got = ss.sharded_sample(my_twins, seed=-(2 ** 40) - 3, offset=offset, group=group, **kw)
        assert torch.equal(got, want), (kw, widths, got, want)
    for k in (1, 7, 97):
        wv, wi = ss.topk(x, k)
        gv, gi = ss.sharded_topk(mine, k, group=group)
        assert torch.equal(gi, wi) and torch.equal(gv.nan_to_num(7.0), wv.nan_to_num(7.0)), (k, widths)


def check_disagreement(group) -> None:
    """Ranks that disagree on a filter, N or an integer seed raise ValueError on every rank, on a
    fresh configuration and on one already handshaken; bad arguments on one rank too."""
    comm = as_comm(group)
    x, seeds, offset = rows_and_seeds()
    mine = torch.tensor_split(x, comm.size, dim=1)[comm.rank]
    last = comm.rank == comm.size - 1
    ss.sharded_sample(mine, seed=1, offset=2, top_p=0.5, group=group)
    cases = [(dict(top_p=0.6 if last else 0.5), "top_p"), (dict(top_p=0.5, top_k=5 if last else 6), "top_k"),
             (dict(top_p=0.5, temperature=0.9 if last else 1.0), "temperature"),
             (dict(top_p=0.5, min_p=0.1 if last else 0.0), "min_p")]
    for kw, name in cases:
        _expect(lambda: ss.sharded_sample(mine, seed=1, offset=2, group=group, **kw), name)
    _expect(lambda: ss.sharded_sample(mine, seed=3 if last else 1, offset=2, top_p=0.5, group=group), "configuration")
    _expect(lambda: ss.sharded_sample(mine[:5] if last else mine[:6], seed=1, offset=2, group=group), "N")
    _expect(lambda: ss.sharded_sample(mine, seed=1, offset=2, top_p=1.5 if last else 0.5, group=group), "top_p")
    _expect(lambda: ss.sharded_topk(mine[:, :0] if last else mine, x.shape[1] + 1, group=group), "k=")
    ss.sharded_topk(mine, 4, group=group)
    _expect(lambda: ss.sharded_topk(mine, 3 if last else 4, group=group), "k differs")
    _expect(lambda: ss.sharded_topk(mine.double() if last else mine, 4, group=group), "dtype differs")
    assert torch.equal(ss.sharded_sample(mine, seed=1, offset=2, top_p=0.5, group=group),
                       ss.sample(x, seed=1, offset=2, top_p=0.5))


def _expect(fn, name: str) -> None:
    try:
        fn()
    except ValueError as e:
        assert name in str(e), (name, str(e))
        return
    raise AssertionError(f"no ValueError naming {name!r}")


def case_all(group) -> None:
    check_all(group)
    check_all(group, rank_zero_empty=True)
    check_disagreement(group)
