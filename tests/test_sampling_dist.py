"""ss.sharded_sample / ss.sharded_topk: the same tokens as one device for every world size and split,
every path of the passes, the exchanges counted, disagreeing ranks refused; Gloo and mpirun."""
import pytest
import torch

import splitsoftmax as ss
from _dist_util import assert_ok, mpirun, mpirun_path, spawn
from _sampling_cases import CONFIGS, check_all, check_disagreement, rows_and_seeds, split_widths
from splitsoftmax.distributed import LoopbackWorld
from splitsoftmax.ops._triton import configs
from splitsoftmax.ops.sampling import torch as sampling_cpu

TAG_META, TAG_TREE = 11, 41


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("size,empty", [(1, False), (2, False), (2, True), (3, False), (3, True)])
def test_loopback_matches_one_device(size, empty):
    LoopbackWorld(size).run(lambda c: check_all(c, rank_zero_empty=empty))


@pytest.mark.parametrize("size", [2, 3])
def test_loopback_disagreement(size):
    LoopbackWorld(size).run(check_disagreement)


def _small_passes(monkeypatch):
    """Tiny records, bins, candidate slots and column blocks: every path of the passes runs."""
    for name, value in [("SAMPLE_RECORDS_MIN", 4), ("SAMPLE_RECORDS_MAX", 8), ("SAMPLE_CAP", 2), ("SAMPLE_BINS", 8),
                        ("SAMPLE_BIN_SPAN", 4.0), ("CPU_BLOCK_COLS", 13)]:
        monkeypatch.setattr(configs, name, value)


def test_tokens_do_not_depend_on_the_passes(monkeypatch):
    """The draw is defined by the logits and the noise alone: tiny records (the mass pass, top-k
    from a full sort), tiny brackets (refinement rounds, candidate lists) and small column blocks
    give the same tokens as the defaults, and the batch slot of a row with its own seed does not
    matter."""
    x, seeds, offset = rows_and_seeds()
    want = {i: ss.sample(x, seed=seeds, offset=offset, **kw) for i, kw in enumerate(CONFIGS)}
    calls = {"mass": 0, "refine": 0}
    for name in calls:
        real = getattr(sampling_cpu, name)
        monkeypatch.setattr(sampling_cpu, name, lambda *a, _real=real, _name=name, **k: (
            calls.__setitem__(_name, calls[_name] + 1), _real(*a, **k))[1])
    _small_passes(monkeypatch)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    for i, kw in enumerate(CONFIGS):
        assert torch.equal(ss.sample(x, seed=seeds, offset=offset, **kw), want[i]), kw
        got = ss.sample(x[perm], seed=seeds[perm], offset=torch.full_like(seeds, offset), **kw)
        assert torch.equal(got, want[i][perm]), kw
    assert calls["mass"] >= 3 and calls["refine"] >= 2, calls


def test_small_passes_across_ranks(monkeypatch):
    _small_passes(monkeypatch)
    LoopbackWorld(3).run(lambda c: check_all(c, rank_zero_empty=True))


def _exchanges(size: int, kw: dict, calls: int = 2) -> tuple[int, int]:
    """(handshake sends, exchange rounds per rank) over ``calls`` identical calls on ``size`` ranks
    (random rows: no tie at a top-k cut-off reaches beyond the records)."""
    x = torch.randn(6, 97, generator=torch.Generator().manual_seed(2)) * 2
    seeds, offset = torch.arange(6), 3
    world = LoopbackWorld(size)
    parts = torch.tensor_split(x, size, dim=1)

    def run(c):
        for _ in range(calls):
            ss.sharded_sample(parts[c.rank], seed=seeds, offset=offset, group=c, **kw)
    world.run(run)
    return world.sends.get(TAG_META, 0), world.sends.get(TAG_TREE, 0) // size


@pytest.mark.parametrize("kw,per_call", [(dict(temperature=0), 1), (dict(), 1), (dict(top_k=5), 1),
                                         (dict(top_k=5, top_p=0.9, min_p=0.05), 1)])
def test_one_exchange_for_greedy_plain_and_top_k(kw, per_call):
    """Two calls of one configuration on 2 ranks: one handshake (2 sends), one exchange each."""
    meta, rounds = _exchanges(2, kw)
    assert meta == 2 and rounds == 2 * per_call, (meta, rounds)


def test_handshake_every_call_when_asked(monkeypatch):
    monkeypatch.setenv("SPLITSOFTMAX_HANDSHAKE", "always")
    meta, rounds = _exchanges(3, dict(top_k=5), calls=3)
    assert meta == 3 * 6 and rounds == 3 * 2, (meta, rounds)


def test_many_worlds_in_one_process_keep_their_sessions():
    """Each group keeps its own sessions (one per operation), so a hundred three-rank worlds in one
    process, each drawing twice (the second call skipping the handshake), never leave one rank
    handshaking while its peers exchange data; the sessions go with their groups."""
    import gc
    from splitsoftmax.distributed import session
    x = torch.randn(2, 8)
    want = ss.sample(x, seed=1, offset=0)

    def draw(group):
        mine = torch.tensor_split(x, 3, dim=1)[group.rank]
        return [ss.sharded_sample(mine, seed=1, offset=0, group=group) for _ in range(2)]
    for _ in range(100):
        for tokens in LoopbackWorld(3).run(draw, timeout=30):
            assert all(torch.equal(t, want) for t in tokens)
    gc.collect()
    assert len(session._TABLES) == 0


def test_split_widths():
    for v, p in [(97, 1), (97, 2), (97, 3), (5, 3)]:
        for empty in (False, True):
            w = split_widths(v, p, empty)
            assert sum(w) == v and len(w) == p and min(w) >= 0 and (not empty or p == 1 or w[0] == 0)


@pytest.mark.distributed
@pytest.mark.parametrize("size", [2, 3])
def test_gloo(size):
    assert_ok(spawn(size, "tests/_sampling_cases.py:case_all", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              f"gloo {size} ranks")


@pytest.mark.mpi
@pytest.mark.skipif(mpirun_path() is None, reason="mpirun is not installed")
@pytest.mark.parametrize("size", [2, 3])
def test_mpirun(size):
    pytest.importorskip("mpi4py")
    assert_ok(mpirun(size, "tests/_sampling_cases.py:case_all", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              f"mpirun -n {size}")
