"""The Triton sampling passes under TRITON_INTERPRET=1 against the torch path: the same records,
masses and tokens bit for bit (tiny records, tiles and lists, so that every path runs in seconds).

The one-device draw (``ops.sampling.device``) is checked on each of its paths, and each test
asserts that its path ran (the row modes between the passes): the records alone, an approximate
bracket listed by the draw, a bracket the exact masses refute, rows the approximate rounds leave
to the exact ones, the records' slow path, keys too close for the draw's bound, and top-p alone by
candidates (kept, none kept: the exact rounds, three near the cut at one position: a rescan)."""
import os

import pytest
import torch

pytestmark = pytest.mark.interpreter
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter lane: run with TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import splitsoftmax as ss  # noqa: E402
import splitsoftmax.ops.sampling.flow as flow  # noqa: E402
from splitsoftmax.ops.sampling import api as sampling  # noqa: E402
from splitsoftmax.ops.sampling import rows  # noqa: E402
from _sampling_cases import rows_and_seeds, split_widths  # noqa: E402
from splitsoftmax.distributed import LoopbackWorld  # noqa: E402
from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.ops.sampling import torch as sampling_cpu, device as sampling_device  # noqa: E402
from splitsoftmax.ops.sampling import kernel as tk  # noqa: E402
from splitsoftmax.ops.sampling import config as sc  # noqa: E402
from splitsoftmax.ops.sampling import numerics as sm  # noqa: E402
from splitsoftmax.ops.sampling.span import _row_seed  # noqa: E402

CONFIGS = [dict(temperature=0.0), dict(), dict(top_k=3, top_p=0.8, min_p=0.05), dict(top_p=0.7),
           dict(top_p=0.95, temperature=2.0), dict(min_p=0.1), dict(top_k=12), dict(top_k=12, top_p=0.6)]
DONE, THRESH, COLLECT, PIVOT, EXACT, NUCLEUS = range(6)


@pytest.fixture(autouse=True)
def small(monkeypatch):
    for name, value in [("SAMPLE_RECORDS_MIN", 4), ("SAMPLE_RECORDS_MAX", 8), ("SAMPLE_CAP", 3), ("SAMPLE_BINS", 64),
                        ("SAMPLE_BIN_SPAN", 6.0), ("CPU_BLOCK_COLS", 11), ("SAMPLE_TILE_INTERPRET", 32)]:
        monkeypatch.setattr(configs, name, value)
    monkeypatch.setattr(sc, "CAP", 8)
    monkeypatch.setattr(sc, "TILE_INTERPRET", 16)
    monkeypatch.setattr(sampling_device, "_CACHE", {})
    monkeypatch.setattr(sampling_device, "_PLANS", {})
    real_init = sampling_device._Work.__init__

    def poisoned(self, *args):
        """The buffers a pass writes before another reads them start as NaN and garbage: a read
        of what no pass wrote shows."""
        real_init(self, *args)
        for name in ("planf", "mom", "part_p"):
            getattr(self, name).fill_(float("nan"))
        for name in ("mode", "part_r", "ties", "part_d", "cand", "part_n", "nuc"):
            getattr(self, name).fill_(0x7F7F7F7F7F7F7F7F)
    monkeypatch.setattr(sampling_device._Work, "__init__", poisoned)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rows():
    """Seven rows of 29: random, masked tail, NaN, rounded (ties), one finite, spread, all equal."""
    x, seeds, offset = rows_and_seeds(29)
    pick = [0, 1, 3, 4, 5, 6, 7]
    return x[pick], seeds[pick], offset


def _torch_tokens(monkeypatch, x, seeds, offset, **kw):
    with monkeypatch.context() as m:
        m.setattr(sampling, "use_triton", lambda t: False)
        m.setattr(flow, "use_triton", lambda t: False)
        return ss.sample(x, seed=seeds, offset=offset, **kw)


def _counters_clear() -> bool:
    """Whether every per-row counter of the one-device draw is back at zero (the last program of a
    row resets it: a count left over would corrupt the next draw)."""
    return all(int(w.cnt.abs().sum()) == 0 and int(w.ccount.abs().sum()) == 0 for w in sampling_device._CACHE.values())


def _modes(monkeypatch) -> list:
    """Records ``(pass, modes)`` after each launch of the one-device draw."""
    seen = []
    monkeypatch.setattr(sampling_device, "_PLANS", {})       # plans keep the launchers they were built with
    for name in ("_RECORDS", "_PIVOTS", "_DRAW", "_KEYS", "_MASSES"):
        real = getattr(sampling_device, name)

        def launch(grid, key, args, consts, _real=real, _name=name):
            _real(grid, key, args, consts)
            seen.append((_name, args[_real.fn.arg_names.index("MODE")].tolist()))
        monkeypatch.setattr(sampling_device, name, launch)
    return seen


def test_philox_matches_tl_philox():
    """The torch Philox and the kernels' ``tl.philox`` give the same words (through the sample pass's
    Gumbel keys of single-token rows at many ids and offsets)."""
    x = torch.zeros(6, 37)
    seeds = torch.tensor([0, 1, -1, 2 ** 62, -(2 ** 63), 12345])
    offsets = torch.tensor([0, 7, 2 ** 40 + 3, -5, 1, 2 ** 32])
    plan = rows.plain_plan(6, x.device)
    got = tk.sample(x, 5, plan, seeds, offsets, 1.0, 45, 16, 6.0, 0)[0].amax(dim=1)
    want = sampling_cpu.sample(x, 5, plan, seeds, offsets, 1.0, 45, 16, 6.0, 0)[0].amax(dim=1)
    assert torch.equal(got, want)
    assert (sm.packed_gid(got) >= 5).all() and (sm.packed_gid(got) < 42).all()


@triton.jit
def _row_seed_kernel(SEED, OUT, base, seed_ptr, seed_lo, seed_hi):
    row = tl.program_id(0).to(tl.int64) + base
    tl.store(OUT + tl.program_id(0), _row_seed(SEED - base, row, seed_ptr, seed_lo, seed_hi))


def test_row_seed_matches_row_seeds():
    """The kernels' row keys (``_row_seed``) are the torch path's (``row_seeds``) bit for bit: an int
    seed of every size keyed with row indices low and beyond 32 bits; a seed tensor as it is."""
    own = torch.tensor([5, -1, 2 ** 62, -(2 ** 63)])
    for base in (0, 2 ** 33 - 2):
        for seed in (0, 3, -1, 2 ** 63 - 1, -(2 ** 63), 2 ** 32 + 7):
            out = torch.empty(4, dtype=torch.int64)
            _row_seed_kernel[(4,)](own, out, base, *sampling_device._seed_args(seed, own)[1:])
            assert torch.equal(out, sm.row_seeds(seed, torch.arange(4) + base)), (seed, base)
        out = torch.empty(4, dtype=torch.int64)
        _row_seed_kernel[(4,)](own, out, 0, *sampling_device._seed_args(own, own)[1:])
        assert torch.equal(out, own)


def test_own_philox_and_int_seeds(monkeypatch):
    """The draw kernels' Philox rounds, with seeds and offsets as per-row tensors and as ints of
    every size (kernel arguments), give the torch path's tokens (the last rows repeat the first:
    under an int seed each is keyed with its index)."""
    x = torch.randn(3, 23, generator=torch.Generator().manual_seed(2))
    x = torch.cat((x, x[:1].expand(3, -1)))
    for seed, offset in [(torch.tensor([0, -1, 2 ** 62, 0, 0, 9]), 7),
                         (-(2 ** 63), torch.tensor([2 ** 40 + 3, -5, 1, 1, 1, 2])),
                         (2 ** 64 - 1, 2 ** 33 + 5), (3, 0)]:
        want = _torch_tokens(monkeypatch, x, seed, offset)
        assert torch.equal(ss.sample(x, seed=seed, offset=offset), want), (seed, offset)


@pytest.mark.parametrize("kr,k_tie", [(1, 0), (4, 3), (8, 5)])
def test_records_match(kr, k_tie):
    """Merged records and the tie counts a top-k needs, from the kernels' splits and the torch path."""
    x, _, _ = _rows()
    x = x.to(torch.bfloat16)
    keys, ties = tk.records(x, 3, kr, k_tie)
    vals, ids = tk.decode(keys)
    got = rows.merge_partials(vals, ids, ties, kr)
    want = [t[:, 0] for t in sampling_cpu.records(x, 3, kr, k_tie)]
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].nan_to_num(9.0), want[0].nan_to_num(9.0))
    known = got[2] >= 0
    assert torch.equal(got[2][known], want[2][known])
    need = (got[0][:, k_tie - 1] == got[0][:, -1]) if k_tie else torch.zeros_like(known)
    assert bool(known[need & (got[1][:, -1] != rows.SENT_ID)].all())
    assert torch.equal(torch.stack(tk.merge_top((keys, ties), kr)[1:]).squeeze(0), want[1])


def _most_at_one_position(top: torch.Tensor, lo: int, hi: int, tile: int, rotate: bool) -> int:
    """The most top columns of ``[lo, hi)`` that one tile position of the records pass takes."""
    cols = torch.arange(lo, hi)[top[lo:hi]]
    j = (cols - lo) // tile
    pos = ((cols - lo) % tile - 97 * j) % tile if rotate else (cols - lo) % tile
    return int(torch.bincount(pos).max())


@pytest.mark.parametrize("stride", [16, 256])
def test_records_on_periodic_logits(monkeypatch, stride):
    """Top keys every ``stride`` columns: at stride 16 they all fall on one tile position (more than
    the four it keeps) and the pass's other assignment of columns to positions finds them; at
    stride 256 that assignment puts them together too and the records are found one pass per
    record; as the torch path does."""
    monkeypatch.setattr(sc, "INTERPRET_SMS", 1)          # two spans per row
    v = 200 if stride == 16 else 2100
    cols = torch.arange(v)
    top = cols % stride == 5
    x = torch.where(top, cols.float() / 10, -cols.float() / 1000).unsqueeze(0)
    span = sampling_device._splits(1, v, 16, sampling_device.records_splits(8, x.device), x.device)[1] * 16
    assert _most_at_one_position(top, 0, span, 16, False) > 4
    assert (_most_at_one_position(top, 0, span, 16, True) > 4) == (stride == 256)
    keys, ties = tk.records(x, 0, 8)
    vals, ids = tk.decode(keys)
    got = rows.merge_partials(vals, ids, ties, 8)
    want = sampling_cpu.records(x, 0, 8)
    assert torch.equal(got[1], want[1][:, 0]) and torch.equal(got[0], want[0][:, 0])


def test_records_three_at_one_position(monkeypatch):
    """A span whose three largest logits share a tile position (they sit in its third slot and
    below): its records are selected from all four slots, as the torch path finds them."""
    monkeypatch.setattr(sc, "INTERPRET_SMS", 1)          # two spans of three tiles
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(8)) * 0.1
    x[0, [5, 21, 37]] = torch.tensor([3.0, 2.0, 1.0])
    assert _most_at_one_position(torch.arange(96) % 16 == 5, 0, 48, 16, False) == 3
    keys, ties = tk.records(x, 0, 4)
    vals, ids = tk.decode(keys)
    got = rows.merge_partials(vals, ids, ties, 4)
    want = sampling_cpu.records(x, 0, 4)
    assert torch.equal(got[1], want[1][:, 0]) and torch.equal(got[0], want[0][:, 0])
    assert got[1][0, :3].tolist() == [5, 21, 37]


@pytest.mark.parametrize("fifth", [False, True])
def test_records_rescan_only_where_a_top_key_was_dropped(monkeypatch, fifth):
    """A tile position holding four of a span's top eight keys, and a fifth column of its own below
    them, keeps its four and drops nothing the records need: no second pass over the span. With
    that fifth column among the top keys too, it dropped one: the second pass runs. Records as the
    torch path finds them either way."""
    from splitsoftmax.ops.sampling import span as sampling_span
    monkeypatch.setattr(sc, "INTERPRET_SMS", 1)          # two spans of five tiles
    x = torch.randn(1, 160, generator=torch.Generator().manual_seed(3)) * 0.1
    x[0, [5, 21, 37, 53]] = torch.tensor([9.0, 8.0, 7.0, 6.0])
    x[0, [2, 40, 60, 78]] = torch.tensor([5.0, 4.0, 3.0, 2.0])
    x[0, 69] = 8.5 if fifth else -1.0
    real, rescans = sampling_span._top4_span, []

    def counted(*args):
        rescans.extend([1] * (len(args) == 9))            # the other assignment of columns (``ROTATE``)
        return real(*args)
    monkeypatch.setattr(sampling_span, "_top4_span", counted)
    keys, ties = tk.records(x, 0, 8)
    vals, ids = tk.decode(keys)
    got = rows.merge_partials(vals, ids, ties, 8)
    want = sampling_cpu.records(x, 0, 8)
    assert torch.equal(got[1], want[1][:, 0]) and torch.equal(got[0], want[0][:, 0])
    assert len(rescans) == (1 if fifth else 0), rescans


def test_tokens_match_the_torch_path(monkeypatch):
    x, seeds, offset = _rows()
    for kw in CONFIGS:
        got = ss.sample(x, seed=seeds, offset=offset, **kw)
        want = _torch_tokens(monkeypatch, x, seeds, offset, **kw)
        assert torch.equal(got, want), (kw, got, want)
        assert _counters_clear(), kw


def _wide_rows():
    """Four rows of 100 whose top-p sets overflow the records: flat, spread, rounded (ties), peaked."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 100, generator=g) * torch.tensor([[0.5], [2.0], [1.0], [6.0]])
    x[2] = torch.round(x[2] * 2)
    return x, torch.arange(4) * 13 + 1


@pytest.mark.parametrize("case", ["listed", "refuted", "left to the exact rounds"])
def test_top_p_paths(monkeypatch, case):
    """Top-p over more tokens than the records hold, on each path of the one-device draw: the
    bracket listed; refuted by the exact masses (a negative slack makes the approximate brackets
    wrong: without exact rounds the rows stay unfinished); left by the approximate rounds."""
    x, seeds = _wide_rows()
    monkeypatch.setattr(sc, "TILE_INTERPRET", 32)
    monkeypatch.setattr(sc, "CAP", 64)
    monkeypatch.setattr(sc, "NUCLEUS_MISS", 0.0)            # top-p alone too takes the records and pivots
    if case == "refuted":
        monkeypatch.setattr(sc, "SLACK", -0.2)
    if case == "left to the exact rounds":
        monkeypatch.setattr(sc, "PIVOT_ROUNDS", 0)
        monkeypatch.setattr(sc, "CAP", 8)
    seen = _modes(monkeypatch)
    filters = [dict(top_p=0.9), dict(top_p=0.6, min_p=0.02)] + [dict(top_k=6, top_p=0.5, temperature=1.7),
                                                                dict(top_k=30, top_p=0.8)] * (case == "listed")
    for kw in filters:
        if case == "refuted" and "top_k" not in kw:
            with monkeypatch.context() as m:
                m.setattr(sc, "EXACT_ROUNDS", 0)
                seen.clear()
                ss.sample(x, seed=seeds, offset=3, **kw)
                assert EXACT in dict(seen)["_DRAW"], seen
        seen.clear()
        got = ss.sample(x, seed=seeds, offset=3, **kw)
        assert torch.equal(got, _torch_tokens(monkeypatch, x, seeds, 3, **kw)), (case, kw)
        after = dict(seen)
        assert set(after["_DRAW"]) <= {DONE, THRESH} and _counters_clear(), seen
        if case == "listed" and "top_k" not in kw:
            assert COLLECT in after["_PIVOTS"], seen
        if case == "left to the exact rounds":
            assert PIVOT in after["_RECORDS"] and "_PIVOTS" not in after, seen


def test_top_k_settles_top_p(monkeypatch):
    """Top-p (and min-p) after a top-k inside the records: two launches, records and draw, no pivot
    rounds; the records decide every row (DONE) but those whose cut-off ties run past them (THRESH:
    the draw takes them), tokens the torch path's. The rows: random, rounded to many ties, all
    equal, and one whose top-k cut-off value fills a span past its records."""
    x, seeds = _wide_rows()
    flat = torch.full((1, 100), -3.0)
    flat[0, 20:32] = torch.tensor([4.0, 3.5] + [3.0] * 10)
    x = torch.cat((x, torch.zeros(1, 100), flat))
    seeds = torch.cat((seeds, torch.tensor([77, 78])))
    seen = _modes(monkeypatch)
    for kw in (dict(top_k=3, top_p=0.9), dict(top_k=6, top_p=0.5, temperature=1.7),
               dict(top_k=6, top_p=0.95, min_p=0.2)):
        seen.clear()
        got = ss.sample(x, seed=seeds, offset=3, **kw)
        assert torch.equal(got, _torch_tokens(monkeypatch, x, seeds, 3, **kw)), (kw, got)
        assert [name for name, _ in seen] == ["_RECORDS", "_DRAW"], seen
        modes = seen[0][1]
        assert set(modes) <= {DONE, THRESH} and modes[-2:] == [THRESH, THRESH], (kw, modes)
        assert dict(seen)["_DRAW"] == modes and _counters_clear(), seen


def test_min_p_alone_takes_the_row_maximum(monkeypatch):
    """Min-p alone: a records pass of one record (the row's largest logit places the cut-off), then
    the draw above the cut-off for every row but the invalid ones; tokens the torch path's, on the
    edge rows (NaN, all equal, masked) and on wide rows."""
    x, seeds, offset = _rows()
    wide, _ = _wide_rows()
    kr, modes = [], []
    real = sampling_device._RECORDS

    def records(grid, key, args, consts):
        kr.append(consts["KR"])
        real(grid, key, args, consts)
        modes.append(args[real.fn.arg_names.index("MODE")].tolist())
    monkeypatch.setattr(sampling_device, "_RECORDS", records)
    monkeypatch.setattr(sampling_device, "_PLANS", {})
    for rows_, seeds_ in ((x, seeds), (torch.cat((wide, x[:, :29].repeat(1, 4)[:, :100])), torch.arange(11))):
        for kw in (dict(min_p=0.1), dict(min_p=0.6, temperature=0.7), dict(min_p=1.0)):
            got = ss.sample(rows_, seed=seeds_, offset=offset, **kw)
            assert torch.equal(got, _torch_tokens(monkeypatch, rows_, seeds_, offset, **kw)), (kw, got)
            assert _counters_clear(), kw
            # every valid row is left to the draw; an invalid one (NaN) is done with -1
            assert modes[-1] == [DONE if t < 0 else THRESH for t in got.tolist()], (kw, modes[-1], got)
    assert kr == [1] * 6, kr


def _first_keys(x, seeds, offset, m: int) -> torch.Tensor:
    """The ids of each row's ``m`` best exact Gumbel keys (ties to the lower id): ``(N, m)``."""
    n, v = x.shape
    offsets = torch.as_tensor(offset).expand(n)
    key = sm.gumbel_key(x.float() * sm.temperature_scale(1.0), sm.words(seeds[:, None], offsets[:, None], 0, v))
    packed = torch.where(torch.isnan(key), sm.PACKED_NONE, sm.pack(key, torch.arange(v).expand(n, v)))
    return sm.packed_gid(torch.topk(packed, m, dim=1).values)


def test_top_p_alone_by_candidates(monkeypatch):
    """Top-p alone takes the two candidate passes (no records, pivots or draw) on rows with ties,
    NaN, masked and infinite logits, peaked and flat rows, at several top-p and temperatures, with
    the approximate masses deciding and with exact ones everywhere (an error bound above 1): the
    torch path's tokens; every row settled by the second pass, or by the first (invalid rows, a
    best key at the largest logit)."""
    x, seeds, offset = _rows()
    wide, wide_seeds = _wide_rows()
    peaked = torch.zeros(2, 29)
    peaked[:, 4] = 9.0
    seen = _modes(monkeypatch)
    after_keys = set()
    # every row set and every setting under both slacks (pairs, not the whole product)
    cases = [(r, kw, (1.0, 1e7)[(i + j) % 2]) for i, r in enumerate(((x, seeds), (wide, wide_seeds),
                                                                      (peaked, torch.tensor([3, 4]))))
             for j, kw in enumerate((dict(top_p=0.9), dict(top_p=0.6), dict(top_p=0.999, temperature=0.7),
                                     dict(top_p=0.8, temperature=3.0)))]
    assert sampling_device.nucleus_slack(29, 16) < 1e-4 and sampling_device.nucleus_slack(29, 16) * 1e7 > 1
    for (rows_, s_), kw, slack in cases:
        monkeypatch.setattr(sc, "NUCLEUS_SLACK", slack)
        seen.clear()
        got = ss.sample(rows_, seed=s_, offset=offset, **kw)
        assert torch.equal(got, _torch_tokens(monkeypatch, rows_, s_, offset, **kw)), (kw, rows_.shape, slack)
        passes = dict(seen)
        assert [n for n, _ in seen] == ["_KEYS", "_MASSES"], seen
        assert set(passes["_KEYS"]) <= {DONE, NUCLEUS}, seen
        assert set(passes["_MASSES"]) == {DONE} and _counters_clear(), seen
        after_keys |= set(passes["_KEYS"])
    assert after_keys == {DONE, NUCLEUS}


def test_top_p_alone_none_kept(monkeypatch):
    """Rows none of whose four candidates top-p keeps (top_p 0.3 on flat rows, four candidates
    allowed by a miss bound of 1): the mass pass finishes them by the exact rounds, as the torch
    path draws them."""
    monkeypatch.setattr(sc, "NUCLEUS_MISS", 1.0)
    assert sampling_device.nucleus_candidates(0.3) == 4
    x = torch.randn(12, 61, generator=torch.Generator().manual_seed(2)) * 0.7
    seeds = torch.arange(12) * 7 + 3
    want = _torch_tokens(monkeypatch, x, seeds, 5, top_p=0.3)
    missed = [r for r in range(12) if int(want[r]) not in _first_keys(x, seeds, 5, 4)[r].tolist()]
    assert len(missed) >= 2, missed
    seen = _modes(monkeypatch)
    assert torch.equal(ss.sample(x, seed=seeds, offset=5, top_p=0.3), want)
    assert [n for n, _ in seen] == ["_KEYS", "_MASSES"] and set(seen[1][1]) == {DONE} and _counters_clear(), seen


def test_top_p_alone_near_ties(monkeypatch):
    """Keys all within 1e-4 of each other: every position holds three keys near the cut, so each
    span's candidates come from its rescan by exact keys; the torch path's tokens."""
    monkeypatch.setattr(sc, "INTERPRET_SMS", 1)          # one span of three tiles a row
    x, seeds, offsets = _near_ties(3, 40)
    assert sampling_device._splits(3, 40, 16, sampling_device.row_splits(3, x.device), x.device) == (1, 3)
    keys = sm.gumbel_key(x * sm.temperature_scale(1.0), sm.words(seeds[:, None], offsets[:, None], 0, 40))
    assert (keys.amax(dim=1) - keys.amin(dim=1)).max() < 1e-4
    for kw in (dict(top_p=0.9), dict(top_p=0.6)):
        assert torch.equal(ss.sample(x, seed=seeds, offset=offsets, **kw),
                           _torch_tokens(monkeypatch, x, seeds, offsets, **kw)), kw


def test_sharded_over_the_kernels(monkeypatch):
    """3 ranks (one empty, widths not divisible by 4) on the kernels: the one-device tokens, with
    per-row seeds and, on repeating rows, with an int seed (row keys from the host and in-kernel)."""
    x, seeds, offset = _rows()
    widths = split_widths(x.shape[1], 3, True)
    parts = torch.split(x, widths, dim=1)
    for kw in (CONFIGS[2], CONFIGS[4]):
        want = ss.sample(x, seed=seeds, offset=offset, **kw)
        for got in LoopbackWorld(3).run(lambda c: ss.sharded_sample(parts[c.rank], seed=seeds, offset=offset,
                                                                    group=c, **kw)):
            assert torch.equal(got, want), (kw, widths)
    twins = x[[0, 0, 0, 3, 3, 6, 6, 6]]
    twin_parts = torch.split(twins, widths, dim=1)
    for kw in (CONFIGS[1], CONFIGS[2], CONFIGS[3]):
        want = ss.sample(twins, seed=2 ** 63 + 9, offset=offset, **kw)
        assert torch.equal(want, _torch_tokens(monkeypatch, twins, 2 ** 63 + 9, offset, **kw)), kw
        for got in LoopbackWorld(3).run(lambda c: ss.sharded_sample(twin_parts[c.rank], seed=2 ** 63 + 9,
                                                                    offset=offset, group=c, **kw)):
            assert torch.equal(got, want), (kw, widths)
    vals, idx = ss.topk(x, 6)
    for gv, gi in LoopbackWorld(3).run(lambda c: ss.sharded_topk(parts[c.rank], 6, group=c)):
        assert torch.equal(gi, idx) and torch.equal(gv.nan_to_num(9.0), vals.nan_to_num(9.0))


def _near_ties(n: int = 3, v: int = 40):
    seeds, offsets = torch.arange(n) + 5, torch.arange(n) + 1
    noise = sm.gumbel_key(torch.zeros(n, v), sm.words(seeds[:, None], offsets[:, None], 0, v))
    return (-noise / sm.temperature_scale(1.0)).float(), seeds, offsets


def test_near_ties_of_the_keys(monkeypatch):
    """Logits that cancel each token's noise: every key lies within 1e-5 of the others, so the
    kernels' bound on the keys keeps every lane and the exact keys (and the lower id) decide, in
    the sharded draw's pass and in the one-device draw."""
    x, seeds, offsets = _near_ties()
    n, v = x.shape
    want = sampling_cpu.sample(x, 0, rows.plain_plan(n, x.device), seeds, offsets, sm.temperature_scale(1.0), 45,
                               16, 6.0, 0)[0].amax(dim=1)
    got = tk.sample(x, 0, rows.plain_plan(n, x.device), seeds, offsets, sm.temperature_scale(1.0), 45, 16, 6.0,
                    0)[0].amax(dim=1)
    assert torch.equal(got, want)
    keys = sm.gumbel_key(x * sm.temperature_scale(1.0), sm.words(seeds[:, None], offsets[:, None], 0, v))
    assert (keys.amax(dim=1) - keys.amin(dim=1)).max() < 1e-4
    assert torch.equal(ss.sample(x, seed=seeds, offset=offsets), _torch_tokens(monkeypatch, x, seeds, offsets))


def test_infinite_logits(monkeypatch):
    """A row whose largest scaled logit is +inf draws nothing (-1), on one device and sharded, where
    the spans without the infinite logit have a finite winner."""
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    x[0, 3] = float("inf")
    x[1, :] = float("-inf")
    x[1, 37] = float("inf")
    parts = torch.split(x, [13, 27], dim=1)
    for kw in (dict(), dict(top_p=0.5), dict(top_p=0.9), dict(min_p=0.1)):
        want = _torch_tokens(monkeypatch, x, 1, 2, **kw)
        assert want[:2].tolist() == [-1, -1] and torch.equal(ss.sample(x, seed=1, offset=2, **kw), want), kw
        for got in LoopbackWorld(2).run(lambda c: ss.sharded_sample(parts[c.rank], seed=1, offset=2, group=c, **kw)):
            assert torch.equal(got, want), kw
