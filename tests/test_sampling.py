"""ss.sample / ss.topk on the torch path: the noise, the exact filtered distribution, ties, bad arguments.

The distribution tests draw 20,000 tokens of one row of 16 logits (one call, 20,000 offsets) and
compare the counts with the float64 filtered softmax by a chi-square test at a one-in-a-million
limit. They have the power to see a wrong filter or a biased noise: the top-p draws tested against
top-p without the crossing token (``filtered_probs(..., drop_crossing=True)``) fail with 1,409 of
the 20,000 tokens outside its support (statistic 106 on the rest, limit 37), and the plain draws
tested against the softmax at temperature 1.1 instead of 1.0 fail with 168 against a limit of 57,
while the right distributions give 20 (limit 57) and below. Both failures are asserted below.

The rows of one batch under one int seed draw independently (the row index is part of the key):
30,000 rows of two logit vectors under one seed and offset follow their softmax and agree pairwise
as often as independent draws do, and the same batch under equal per-row seeds (equal noise, the
correlated draws) fails both checks by far.
"""
import math

import pytest
import torch

import splitsoftmax as ss
from _sampling_util import NEG_INF, chi_square, chi_square_limit, edge_rows, filtered_probs
from splitsoftmax.ops.sampling import numerics as sm

DRAWS = 20_000
CONFIGS = [dict(), dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8), dict(min_p=0.2),
           dict(top_k=8, top_p=0.9, min_p=0.05), dict(temperature=2.0, top_p=0.6)]


def test_philox_known_answers():
    """Random123's known-answer vectors of Philox 4x32-10."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, (k0, k1), want in cases:
        seed = torch.tensor([k0 | (k1 << 32)]).to(torch.int64) if k1 < 2 ** 31 else \
            torch.tensor([k0 | (k1 << 32) - 2 ** 64])
        got = sm.philox(seed, *(torch.tensor([c]) for c in ctr))
        assert [int(g) for g in got] == list(want)


def test_polynomials_against_float64():
    y = torch.logspace(-12, 2, 20001, dtype=torch.float64).float()
    rel = (sm.log2_pos(y).double() - torch.log2(y.double())).abs() / torch.log2(y.double()).abs().clamp_min(1)
    assert rel.max() < 3e-7
    v = torch.cat((torch.logspace(-10, -0.5, 5000, dtype=torch.float64), torch.linspace(0.3, 0.9999, 5000,
                                                                                        dtype=torch.float64))).float()
    want = torch.log1p(-v.double()) / math.log(2)
    assert ((sm.log2_1m(v).double() - want).abs() / want.abs()).max() < 3e-7
    d = -torch.linspace(0, 40, 40001).float()
    shift = 45
    q = sm.qmass(d, shift).double()
    exact = torch.exp2(d.double() + shift)
    assert ((q - torch.floor(exact)).abs() <= exact * 3e-7 + 1).all()
    assert int(sm.qmass(torch.zeros(1), shift)) == 2 ** shift


def test_order_keys_and_packing():
    x = torch.tensor([NEG_INF, -3.5, -0.0, 0.0, 1e-30, 2.0, float("inf"), float("nan")])
    o = sm.ord32(x)
    assert o[2] == o[3] and bool((o[1:] >= o[:-1]).all()) and bool((o[4:] > o[3:-1]).all())
    assert torch.equal(sm.unord32(o[:-1]), x[:-1].abs().where(x[:-1] == 0, x[:-1]))
    p = sm.pack(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([7, 3, 9]))
    assert int(p.argmax()) == 2 and int(p[:2].argmax()) == 1 and sm.packed_gid(p).tolist() == [7, 3, 9]


def _draws(x: torch.Tensor, **kw) -> torch.Tensor:
    """``DRAWS`` tokens of the single row ``x (V,)``, one per offset."""
    rows = x.unsqueeze(0).expand(DRAWS, -1)
    return ss.sample(rows, seed=1234, offset=torch.arange(DRAWS), **kw)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the many small integer ops of the noise run faster than on two shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def row16():
    return torch.randn(16, generator=torch.Generator().manual_seed(3), dtype=torch.float64).mul(1.5).float()


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_distribution_chi_square(row16, kw):
    probs = filtered_probs(row16, **kw)
    stat, df, outside = chi_square(_draws(row16, **kw), probs)
    assert outside == 0, f"{outside} draws outside the support of the filtered softmax"
    assert stat < chi_square_limit(df), (stat, df, chi_square_limit(df))


def test_chi_square_sees_a_wrong_filter_and_a_wrong_temperature(row16):
    tokens = _draws(row16, top_p=0.8)
    stat, df, outside = chi_square(tokens, filtered_probs(row16, top_p=0.8, drop_crossing=True))
    assert outside > 1000 and stat > 2 * chi_square_limit(df), (outside, stat)
    stat, df, _ = chi_square(_draws(row16), filtered_probs(row16, temperature=1.1))
    assert stat > 2 * chi_square_limit(df), stat


GROUPS = 10_000
AGREE_Z = 5.0      # a two-sided normal tail of 5.7e-7


def _agreement_limit(n: int, s: float) -> float:
    """Half-width of the agreements of ``n`` independent pairs that agree with probability ``s``
    (Binomial(n, s), normal approximation: exceeded with probability about 5.7e-7)."""
    return AGREE_Z * math.sqrt(n * s * (1 - s))


def _batch_statistics(tokens: torch.Tensor, a: torch.Tensor, b: torch.Tensor, kw: dict) -> list:
    """Of a batch of rows ``[a, a, b] * GROUPS`` drawn under one key rule: per check ``(name, value,
    limit)`` (a check passes when value < limit): the chi-square of the ``a`` rows' and the ``b``
    rows' tokens against their filtered softmax, and how far the agreements of the pairs (first
    ``a``, second ``a``) and (second ``a``, ``b``) are from ``GROUPS sum p q``, what independent draws
    give."""
    pa, pb = filtered_probs(a, **kw), filtered_probs(b, **kw)
    t0, t1, t2 = tokens[0::3], tokens[1::3], tokens[2::3]
    out = []
    for name, t, p in (("a rows", torch.cat((t0, t1)), pa), ("b rows", t2, pb)):
        stat, df, outside = chi_square(t, p)
        out.append((name, stat + (math.inf if outside else 0.0), chi_square_limit(df)))
    for name, u, w, s in (("a with a", t0, t1, float((pa * pa).sum())), ("a with b", t1, t2, float((pa * pb).sum()))):
        out.append((name, abs(int((u == w).sum()) - GROUPS * s), _agreement_limit(GROUPS, s)))
    return out


@pytest.fixture(scope="module")
def rows_ab(row16):
    b = torch.randn(16, generator=torch.Generator().manual_seed(4), dtype=torch.float64).mul(1.5).float()
    return row16, b, torch.stack((row16, row16, b)).repeat(GROUPS, 1)


@pytest.mark.parametrize("kw", [dict(), dict(top_p=0.8)], ids=["plain", "top_p"])
def test_rows_of_an_int_seed_draw_independently(rows_ab, kw):
    """One call, one int seed and one int offset (a decode step's ``seed=step_seed``) over 30,000
    rows ``[a, a, b] * 10,000``: each row's token follows its filtered softmax (chi-square, one in a
    million each) and pairs of rows agree as often as independent draws do: identical rows with
    probability ``sum p_a^2`` (0.148 plain), different ones ``sum p_a p_b`` (0.047), within 5 standard
    deviations (5.7e-7 each): a false failure has probability below 4e-6. An int offset and a tensor
    of it key the rows alike."""
    a, b, x = rows_ab
    tokens = ss.sample(x, seed=2024, offset=7, **kw)
    for name, value, limit in _batch_statistics(tokens, a, b, kw):
        assert value < limit, (name, value, limit)
    assert torch.equal(ss.sample(x[:30], seed=2024, offset=torch.full((30,), 7), **kw), tokens[:30])


@pytest.mark.parametrize("kw", [dict(), dict(top_p=0.8)], ids=["plain", "top_p"])
def test_equal_seed_tensors_give_equal_noise(rows_ab, kw):
    """Rows with equal seeds and offsets in tensors draw with the same noise: identical rows draw
    the same token, and the statistics above fail (the correlated draws they exist to catch)."""
    a, b, x = rows_ab
    n = x.shape[0]
    tokens = ss.sample(x, seed=torch.full((n,), 2024), offset=7, **kw)
    assert torch.equal(tokens[0::3], tokens[1::3]) and len(set(tokens[0::3].tolist())) == 1
    assert len(set(tokens[2::3].tolist())) == 1
    stats = _batch_statistics(tokens, a, b, kw)
    assert all(value > 2 * limit for _, value, limit in stats), stats


def test_an_int_seed_is_its_row_keys():
    """An int seed draws as the tensor of its row keys ``row_seeds(seed, row)``: what reproduces a row
    of the batch in another batch or slot; the keys of distinct rows and seeds differ."""
    x = edge_rows()
    for seed, offset in ((3, 4), (-(2 ** 63), torch.arange(8) * 2 ** 33), (2 ** 64 - 1, 0)):
        keys = sm.row_seeds(seed - 2 ** 64 if seed >= 2 ** 63 else seed, torch.arange(8))
        want = ss.sample(x, seed=seed, offset=offset)
        assert torch.equal(ss.sample(x, seed=keys, offset=offset), want)
        off = offset[[5, 2]] if isinstance(offset, torch.Tensor) else offset
        assert torch.equal(ss.sample(x[[5, 2]], seed=keys[[5, 2]], offset=off), want[[5, 2]])
    keys = torch.stack([sm.row_seeds(s, torch.arange(64)) for s in (0, 1, 2, -1)])
    assert keys.unique().numel() == keys.numel()


def test_greedy_is_argmax_with_lowest_index():
    x = edge_rows()
    got = ss.sample(x, seed=0, offset=0, temperature=0.0)
    want = torch.argmax(torch.nan_to_num(x.double(), nan=NEG_INF), dim=1)  # first maximum
    valid = ~torch.isnan(x).any(dim=1) & (x > NEG_INF).any(dim=1)
    assert torch.equal(got, torch.where(valid, want, -1))
    assert int(ss.sample(torch.tensor([[1.0, 3.0, 3.0, 3.0]]), seed=0, offset=0, temperature=0)) == 1


def test_invalid_rows_give_minus_one_and_support_is_respected():
    x = edge_rows()
    for kw in CONFIGS + [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6)]:
        tok = ss.sample(x, seed=torch.arange(8) + 5, offset=3, **kw)
        assert tok[2] == -1 and tok[3] == -1, kw
        assert tok[5] == x.shape[1] - 1, kw
        for r in (0, 1, 4, 6, 7):
            assert filtered_probs(x[r], **kw)[tok[r]] > 0, (kw, r, int(tok[r]))


def _support(x, n=4000, **kw):
    return set(ss.sample(x.expand(n, -1), seed=9, offset=torch.arange(n), **kw).tolist())


def test_ties_at_the_cut_offs_are_kept():
    x = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    assert _support(x, top_k=2) == {0, 1, 2, 3}
    assert _support(x, top_k=1) == {0}
    # top-p: token 0 holds 0.437 of the mass, the three tied 2.0's 0.482 more, token 4 0.059
    assert _support(x, top_p=0.43) == {0}
    assert _support(x, top_p=0.44) == {0, 1, 2, 3}
    assert _support(x, top_p=0.92) == {0, 1, 2, 3, 4}
    assert _support(x, top_k=4, top_p=0.99) == {0, 1, 2, 3}
    # min-p with an exact boundary: T = log2(e) makes d = x - max, and min_p = 0.5 keeps d >= -1
    y = torch.tensor([[0.0, -1.0, -1.0, -1.5, -0.5]])
    assert _support(y, temperature=math.log2(math.e), min_p=0.5) == {0, 1, 2, 4}
    assert _support(y, min_p=1.0) == {0}
    assert _support(y, top_p=1.0) == {0, 1, 2, 3, 4}


def test_top_p_keeps_the_crossing_token():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    x = torch.log(p).float().unsqueeze(0)
    assert _support(x, top_p=0.6) == {0, 1}
    assert _support(x, top_p=0.49) == {0}
    assert _support(x, top_p=0.81) == {0, 1, 2}
    assert _support(x, top_k=3, top_p=0.9) == {0, 1, 2}   # 0.8 of 0.95: the third crosses 0.9


@pytest.mark.parametrize("probs,top_p,kept", [([0.5, 0.3, 0.2], 0.8, {0, 1}), ([0.4, 0.3, 0.2, 0.1], 0.7, {0, 1}),
                                              ([0.4, 0.3, 0.2, 0.1], 0.9, {0, 1, 2}), ([0.25] * 4, 0.5, {0, 1, 2, 3}),
                                              ([0.5, 0.25, 0.125, 0.125], 0.75, {0, 1})])
def test_top_p_mass_that_reaches_it_exactly(probs, top_p, kept):
    """A prefix whose mass is ``top_p`` in exact arithmetic reaches it (the logits' float32 rounding
    does not push the next token in); tied tokens at the crossing stay together."""
    x = torch.log(torch.tensor(probs, dtype=torch.float64)).float().unsqueeze(0)
    assert _support(x, top_p=top_p) == kept


def test_top_k_at_least_vocab_is_no_filter():
    x = edge_rows()
    base = ss.sample(x, seed=3, offset=4)
    assert torch.equal(ss.sample(x, seed=3, offset=4, top_k=x.shape[1]), base)
    assert torch.equal(ss.sample(x, seed=3, offset=4, top_k=10 ** 6), base)
    assert torch.equal(ss.sample(x, seed=3, offset=4, top_p=1.0, min_p=0.0), base)


def test_topk_matches_a_stable_sort():
    x = edge_rows().double()
    x[4, 10:20] = 7.0   # ties
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        xd = x.to(dtype)
        for k in (1, 5, 64, 97):
            vals, idx = ss.topk(xd, k)
            sv, si = torch.sort(xd, dim=1, descending=True, stable=True)
            assert vals.dtype == dtype and idx.dtype == torch.int64
            assert torch.equal(idx, si[:, :k]), (dtype, k)
            assert torch.equal(vals.nan_to_num(123.0), sv[:, :k].nan_to_num(123.0))
    assert ss.topk(x, 0)[0].shape == (8, 0)


def test_bad_arguments():
    x = torch.randn(3, 10)
    for kw, name in [(dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
                     (dict(top_k=0), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                     (dict(min_p=-0.1), "min_p"), (dict(min_p=1.01), "min_p")]:
        with pytest.raises(ValueError, match=name):
            ss.sample(x, seed=0, offset=0, **kw)
    i64 = dict(dtype=torch.int64)
    bad_seeds = [(torch.zeros(4, **i64), ValueError), (torch.zeros(3, 1, **i64), ValueError),
                 (torch.zeros(3), TypeError), (1.5, TypeError)]
    for seed, exc in bad_seeds:
        with pytest.raises(exc, match="seed"):
            ss.sample(x, seed=seed, offset=0)
    with pytest.raises(ValueError, match="offset"):
        ss.sample(x, seed=0, offset=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="top_k"):
        ss.sample(x, seed=0, offset=0, top_k=2.0)
    with pytest.raises(ValueError, match="k=11"):
        ss.topk(x, 11)
    with pytest.raises(ValueError, match="logits"):
        ss.sample(x[0], seed=0, offset=0)
