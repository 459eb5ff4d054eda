"""The Triton sampling passes under TRITON_INTERPRET=1 against the torch path: the same records,
masses and tokens bit for bit (tiny records, bins and tiles, so that every path runs in seconds)."""
import os

import pytest
import torch

pytestmark = pytest.mark.interpreter
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter lane: run with TRITON_INTERPRET=1", allow_module_level=True)

import splitsoftmax as ss  # noqa: E402
import splitsoftmax.sampling_flow as flow  # noqa: E402
from splitsoftmax import sampling_rows as rows  # noqa: E402
from _sampling_cases import rows_and_seeds, split_widths  # noqa: E402
from splitsoftmax.distributed import LoopbackWorld  # noqa: E402
from splitsoftmax.kernels import configs, sampling_cpu  # noqa: E402
from splitsoftmax.kernels import sampling as tk  # noqa: E402
from splitsoftmax.kernels import sampling_math as sm  # noqa: E402

CONFIGS = [dict(temperature=0.0), dict(), dict(top_k=3, top_p=0.8, min_p=0.05), dict(top_p=0.7),
           dict(top_p=0.95, temperature=2.0), dict(min_p=0.1), dict(top_k=12)]


@pytest.fixture(autouse=True)
def small(monkeypatch):
    for name, value in [("SAMPLE_RECORDS_MIN", 4), ("SAMPLE_RECORDS_MAX", 8), ("SAMPLE_CAP", 3), ("SAMPLE_BINS", 64),
                        ("SAMPLE_BIN_SPAN", 6.0), ("CPU_BLOCK_COLS", 11), ("SAMPLE_GROUP_INTERPRET", 8),
                        ("SAMPLE_TILE_INTERPRET", 32)]:
        monkeypatch.setattr(configs, name, value)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rows():
    """Seven rows of 29: random, masked tail, NaN, rounded (ties), one finite, spread, all equal."""
    x, seeds, offset = rows_and_seeds(29)
    pick = [0, 1, 3, 4, 5, 6, 7]
    return x[pick], seeds[pick], offset


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


def test_tokens_match_the_torch_path(monkeypatch):
    x, seeds, offset = _rows()
    for kw in CONFIGS:
        got = ss.sample(x, seed=seeds, offset=offset, **kw)
        with monkeypatch.context() as m:
            m.setattr(flow, "use_triton", lambda t: False)
            want = ss.sample(x, seed=seeds, offset=offset, **kw)
        assert torch.equal(got, want), (kw, got, want)


def test_sharded_over_the_kernels():
    """3 ranks (one empty, widths not divisible by 4) on the kernels: the one-device tokens."""
    x, seeds, offset = _rows()
    widths = split_widths(x.shape[1], 3, True)
    parts = torch.split(x, widths, dim=1)
    for kw in (CONFIGS[2], CONFIGS[4]):
        want = ss.sample(x, seed=seeds, offset=offset, **kw)
        for got in LoopbackWorld(3).run(lambda c: ss.sharded_sample(parts[c.rank], seed=seeds, offset=offset,
                                                                    group=c, **kw)):
            assert torch.equal(got, want), (kw, widths)
    vals, idx = ss.topk(x, 6)
    for gv, gi in LoopbackWorld(3).run(lambda c: ss.sharded_topk(parts[c.rank], 6, group=c)):
        assert torch.equal(gi, idx) and torch.equal(gv.nan_to_num(9.0), vals.nan_to_num(9.0))


def test_device_path_reads_nothing_back(monkeypatch):
    """The one-CUDA-device schedule (every pass launched, refinement rounds in one kernel, no mode
    read on the host) gives the torch path's tokens."""
    from splitsoftmax import sampling
    x, seeds, offset = _rows()
    offsets = torch.full_like(seeds, offset)
    refined = []
    real = tk.refine_rows
    monkeypatch.setattr(tk, "refine_rows", lambda x, plan, spec: (refined.append(int((plan.mode == 3).sum())),
                                                                   real(x, plan, spec))[1])
    for kw in CONFIGS:
        filters = sampling._filters(kw.get("temperature", 1.0), kw.get("top_k"), kw.get("top_p"), kw.get("min_p"))
        spec, plain = sampling._spec(*filters, x.shape[1])
        ex = flow.Exchange(None, None, "device", x.device)
        ex.sync = False
        got = flow.draw(ex, x, 0, spec, seeds, offsets, plain)
        with monkeypatch.context() as m:
            m.setattr(flow, "use_triton", lambda t: False)
            want = ss.sample(x, seed=seeds, offset=offset, **kw)
        assert torch.equal(got, want), (kw, got, want)
    assert sum(refined) >= 2, refined   # rows went through the refinement kernel


def test_near_ties_of_the_keys():
    """Logits that cancel each token's noise: every key lies within 1e-5 of the others, so the
    kernels' bound on the keys keeps every lane and the exact keys (and the lower id) decide."""
    n, v = 3, 40
    seeds, offsets = torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3])
    noise = sm.gumbel_key(torch.zeros(n, v), sm.words(seeds[:, None], offsets[:, None], 0, v))
    x = (-noise / sm.temperature_scale(1.0)).float()
    want = sampling_cpu.sample(x, 0, rows.plain_plan(n, x.device), seeds, offsets, sm.temperature_scale(1.0), 45,
                               16, 6.0, 0)[0].amax(dim=1)
    got = tk.sample(x, 0, rows.plain_plan(n, x.device), seeds, offsets, sm.temperature_scale(1.0), 45, 16, 6.0,
                    0)[0].amax(dim=1)
    assert torch.equal(got, want)
    keys = sm.gumbel_key(x * sm.temperature_scale(1.0), sm.words(seeds[:, None], offsets[:, None], 0, v))
    assert (keys.amax(dim=1) - keys.amin(dim=1)).max() < 1e-4
