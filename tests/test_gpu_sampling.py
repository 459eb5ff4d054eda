"""ss.sample / ss.topk on CUDA: the same tokens as the CPU path bit for bit (dtypes, batch 1 and
many rows, every path of the one-device draw), CUDA-graph capture, sharded over CUDA tensors, top-k.

Compiles dominate this file's time, so its shapes keep the kernels' specialisations few: every
filter in float32 at an aligned vocabulary, the kernel variants once more at an odd one and in
the half types, and the paths of the draw forced through kernel arguments (the list's capacity,
the float slack), not sizes. Int seeds (each row keyed in the kernels with its index) against the
CPU path and the tensor of their row keys."""
import pytest
import torch

import splitsoftmax as ss
from _sampling_cases import CONFIGS, rows_and_seeds, split_widths
from _sampling_util import chi_square, chi_square_limit, filtered_probs
from splitsoftmax.distributed import LoopbackWorld
from splitsoftmax.ops.sampling import config as sc
from splitsoftmax.ops.sampling import device as sampling_device
from splitsoftmax.ops.sampling import numerics as sm

pytestmark = pytest.mark.gpu
# per dtype and vocabulary class (V and the row stride divisible by 16 or not compile apart), the
# filters that reach every kernel variant of the class: records (greedy, plain, top-p, k = 90), the
# pivot rounds and the draw (with and without exact rows)
SHAPES = {(torch.float32, 128256): CONFIGS,
          (torch.float32, 5003): [dict(), dict(top_k=3), dict(top_p=0.7), dict(top_k=20, top_p=0.8, min_p=0.02)],
          (torch.bfloat16, 128256): [dict(), dict(top_p=0.7), dict(min_p=0.1)],
          (torch.float16, 128256): [dict(top_p=0.95, temperature=2.0)],
          (torch.float64, 97): CONFIGS}
SHARDED_CONFIGS = [dict(top_k=40, top_p=0.9), dict(min_p=0.1)]


def _rows(v: int, dtype=torch.float32):
    x, seeds, offset = rows_and_seeds(v)
    return x.to(dtype), seeds, offset


@pytest.mark.parametrize("dtype,v", list(SHAPES), ids=lambda p: str(p))
def test_cuda_tokens_equal_cpu_tokens(dtype, v):
    x, seeds, offset = _rows(v, dtype)
    for kw in SHAPES[(dtype, v)]:
        cpu = ss.sample(x, seed=seeds, offset=offset, **kw)
        cuda = ss.sample(x.cuda(), seed=seeds.cuda(), offset=offset, **kw)
        assert torch.equal(cuda.cpu(), cpu), (kw, dtype, v)


def _flat_rows(n: int = 6, v: int = 5003):
    """Rows whose top-p sets overflow the records (flat and spread logits, rounded ties)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(n, v, generator=g) * torch.linspace(0.3, 3.0, n).unsqueeze(1)
    x[1] = torch.round(x[1] * 3)
    return x, torch.arange(n) * 31 + 2


@pytest.mark.parametrize("case", ["listed", "refuted", "overflowing"])
def test_every_path_on_cuda(monkeypatch, case):
    """Top-p brackets listed by the draw, refuted by the exact masses (a negative slack), and too
    full for the list (a capacity of 3): each finished by its path, as on the CPU; the per-row
    counters are back at zero after every draw (top-p alone too takes these passes here)."""
    monkeypatch.setattr(sc, "NUCLEUS_MISS", 0.0)
    if case == "refuted":
        monkeypatch.setattr(sc, "SLACK", -0.2)
    if case == "overflowing":
        monkeypatch.setattr(sc, "CAP", 3)
    x, seeds = _flat_rows()
    xc = x.cuda()
    for kw in (dict(top_p=0.9), dict(top_p=0.5, min_p=0.01), dict(top_p=0.99, temperature=1.3)):
        want = ss.sample(x, seed=seeds, offset=4, **kw)
        assert torch.equal(ss.sample(xc, seed=seeds.cuda(), offset=4, **kw).cpu(), want), (case, kw)
        # a refuted or overflowing bracket leaves the row an exact range [RLO, RHI) short of everything
        exact = [bool(torch.isfinite(w.planf[:, 5:7]).any()) for w in sampling_device._CACHE.values()
                 if w.planf.is_cuda and w.planf.shape[0] == x.shape[0]]
        assert any(exact) == (case != "listed"), (case, kw)
        for w in sampling_device._CACHE.values():
            assert int(w.cnt.abs().sum()) == 0 and int(w.ccount.abs().sum()) == 0


def test_top_p_alone_on_cuda(monkeypatch):
    """Top-p alone by candidates on CUDA: the CPU tokens at several top-p and temperatures (rows
    with ties, NaN, masked and infinite logits; flat rows), decided by the approximate masses and
    by exact ones everywhere (an error bound above 1), and rows none of whose four candidates is
    kept (a miss bound of 1 allows four at top_p 0.3), which the exact rounds finish."""
    x, seeds, offset = _rows(128256)
    flat, flat_seeds = _flat_rows()
    for slack in (1.0, 1e7):
        monkeypatch.setattr(sc, "NUCLEUS_SLACK", slack)
        for rows, s in ((x, seeds), (flat, flat_seeds)):
            for kw in (dict(top_p=0.9), dict(top_p=0.6, temperature=0.8), dict(top_p=0.999, temperature=2.0)):
                want = ss.sample(rows, seed=s, offset=offset, **kw)
                assert torch.equal(ss.sample(rows.cuda(), seed=s.cuda(), offset=offset, **kw).cpu(), want), (kw, slack)
    assert sampling_device.nucleus_slack(5003, sc.NUCLEUS_TILE) > 1
    monkeypatch.setattr(sc, "NUCLEUS_MISS", 1.0)
    assert sampling_device.nucleus_candidates(0.3) == 4
    want = ss.sample(flat, seed=flat_seeds, offset=offset, top_p=0.3)
    assert torch.equal(ss.sample(flat.cuda(), seed=flat_seeds.cuda(), offset=offset, top_p=0.3).cpu(), want)
    for w in sampling_device._CACHE.values():
        assert int(w.cnt.abs().sum()) == 0 and int(w.ccount.abs().sum()) == 0


def test_batch_of_one_and_non_contiguous():
    """A row drawn alone with its own seed is its token in the batch; an int seed (the batch's,
    each row keyed in the kernels with its index) gives the CPU path's tokens and draws as the
    tensor of its row keys, alone too."""
    x, seeds, offset = _rows(128256)
    xc = x.cuda()
    wide = torch.zeros(x.shape[0], 2 * x.shape[1], device="cuda")[:, ::2]
    wide.copy_(xc)
    keys = sm.row_seeds(-(2 ** 40) - 3, torch.arange(x.shape[0])).cuda()
    for kw in CONFIGS:
        full = ss.sample(xc, seed=seeds.cuda(), offset=offset, **kw)
        assert torch.equal(ss.sample(wide, seed=seeds.cuda(), offset=offset, **kw), full), kw
        batch = ss.sample(xc, seed=-(2 ** 40) - 3, offset=offset, **kw)
        assert torch.equal(batch.cpu(), ss.sample(x, seed=-(2 ** 40) - 3, offset=offset, **kw)), kw
        assert torch.equal(ss.sample(wide, seed=keys, offset=offset, **kw), batch), kw
        for r in (0, 6):
            one = ss.sample(xc[r:r + 1], seed=seeds[r:r + 1].cuda(), offset=offset, **kw)
            assert int(one) == int(full[r]), (kw, r)
            one = ss.sample(xc[r:r + 1], seed=keys[r:r + 1], offset=offset, **kw)
            assert int(one) == int(batch[r]), (kw, r)


def test_identical_rows_under_an_int_seed_on_cuda():
    """Identical rows under one int seed and offset draw independently on CUDA, as on the CPU: the
    tokens follow the softmax (chi-square, one in a million) and pairs agree ``sum p^2`` of the time
    within 5 standard deviations (5.7e-7); equal seed tensors give one token to every row."""
    row = torch.randn(16, generator=torch.Generator().manual_seed(3)) * 1.5
    n = 20_000
    p = filtered_probs(row)
    tokens = ss.sample(row.cuda().expand(n, -1), seed=2024, offset=7)
    assert torch.equal(tokens.cpu(), ss.sample(row.expand(n, -1), seed=2024, offset=7))
    stat, df, outside = chi_square(tokens.cpu(), p)
    assert outside == 0 and stat < chi_square_limit(df), (stat, df)
    s = float((p * p).sum())
    agree = int((tokens[0::2] == tokens[1::2]).sum())
    assert abs(agree - n // 2 * s) < 5.0 * (n // 2 * s * (1 - s)) ** 0.5, (agree, s)
    same = ss.sample(row.cuda().expand(n, -1), seed=torch.full((n,), 2024, device="cuda"), offset=7)
    assert len(set(same.tolist())) == 1


def test_distribution_on_cuda():
    row = torch.randn(16, generator=torch.Generator().manual_seed(3)) * 1.5
    draws = 20_000
    for kw in (dict(), dict(top_p=0.8), dict(top_k=5, min_p=0.1)):
        tokens = ss.sample(row.cuda().expand(draws, -1), seed=1234, offset=torch.arange(draws, device="cuda"), **kw)
        stat, df, outside = chi_square(tokens.cpu(), filtered_probs(row, **kw))
        assert outside == 0 and stat < chi_square_limit(df), (kw, stat, df)


def test_cuda_graph_capture():
    """A decode step captured with device seeds and offsets replays to the eager tokens."""
    x, seeds, _ = _rows(128256)
    x, seeds = x.cuda(), seeds.cuda()
    offsets = torch.zeros_like(seeds)
    for kw in (dict(), dict(top_k=50, top_p=0.9), dict(top_p=0.9), dict(min_p=0.1), dict(temperature=0.0)):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ss.sample(x, seed=seeds, offset=offsets, **kw)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ss.sample(x, seed=seeds, offset=offsets, **kw)
        for step in (3, 4):
            offsets.fill_(step)
            graph.replay()
            assert torch.equal(out, ss.sample(x, seed=seeds, offset=step, **kw)), (kw, step)


def test_sharded_cuda_tensors():
    x, seeds, offset = _rows(5003)
    x, seeds = x.cuda(), seeds.cuda()
    parts = torch.split(x, split_widths(x.shape[1], 3, True), dim=1)
    for kw in SHARDED_CONFIGS:
        want = ss.sample(x, seed=seeds, offset=offset, **kw)
        for got in LoopbackWorld(3).run(lambda c: ss.sharded_sample(parts[c.rank], seed=seeds, offset=offset,
                                                                    group=c, **kw)):
            assert torch.equal(got, want), kw


def test_topk_on_cuda():
    x, _, _ = _rows(128256)
    x = x.cuda()
    x[4, 100:200] = 9.0
    for k in (1, 50, 1000):
        vals, idx = ss.topk(x, k)
        sv, si = torch.sort(x, dim=1, descending=True, stable=True)
        assert torch.equal(idx, si[:, :k]) and torch.equal(vals.nan_to_num(7.0), sv[:, :k].nan_to_num(7.0)), k


def test_near_ties_of_the_keys_on_cuda():
    """Logits that cancel each token's noise (every key within 1e-5): the draw kernel's bound keeps
    every lane, the exact keys and the lower id decide, as on the CPU; top-p alone too (every
    position's bounded key within the margin of the cut: exact keys for all)."""
    n, v = 4, 5003
    seeds, offsets = torch.arange(n) + 5, torch.arange(n) + 1
    noise = sm.gumbel_key(torch.zeros(n, v), sm.words(seeds[:, None], offsets[:, None], 0, v))
    x = (-noise / sm.temperature_scale(1.0)).float()
    for kw in (dict(), dict(top_p=0.9)):
        want = ss.sample(x, seed=seeds, offset=offsets, **kw)
        assert torch.equal(ss.sample(x.cuda(), seed=seeds.cuda(), offset=offsets.cuda(), **kw).cpu(), want), kw
