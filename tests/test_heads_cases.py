"""``schedule="heads"`` (all-to-all) against the float64 single-device oracle, runnable on any group.

Each ``case_*(group)`` builds the full inputs from a fixed seed on every rank, shards them along the
sequence and asserts forward and backward (q, k, v and the sinks' share of this rank's rows) against
``reference.attention_variants``: MHA and GQA with ``Hkv < P``, ``H`` not divisible by ``P``, ranks
with no head, uneven and empty sequence shards, zigzag (per document), every variant keyword. Here
they run on the loopback world (P in 1..5), with the number of all-to-alls and their bytes counted;
test_heads_gloo.py and test_heads_mpi.py run the same functions in worker processes.
"""
from __future__ import annotations

import random

import pytest
import torch

from splitsoftmax import sharded_attention
from splitsoftmax.core import reference as ref
from splitsoftmax.distributed import LoopbackWorld, as_comm, shard, unshard
from splitsoftmax.distributed.alltoall import message
from splitsoftmax.ops.attention.schedules.heads import head_split, kv_runs, q_chunks
from test_dist_cases import DEVICE, F32, F64, _randn, uneven_lengths
from test_dist_variants import _loss, _oracle, documents, random_keywords

NEG_INF = float("-inf")
B, D, DV = 2, 8, 6


def head_shapes(p: int) -> list:
    """``(H, Hkv)``: MHA with ``H = P + 1``; GQA with ``Hkv < P`` where P > 2 and ``H`` not a multiple
    of ``P``; fewer query heads than ranks (ranks with none); MQA; a split where some rank's query
    heads read its kv heads unevenly (:func:`uneven_grouping`)."""
    return [(p + 1, p + 1), (6, 2), (max(p - 2, 1), 1), (4, 4 if p < 4 else 2), uneven_grouping(p)]


def uneven_grouping(p: int) -> tuple:
    """The first ``(H, Hkv)`` (by ``H``) for which some rank's query heads read their kv heads in
    runs of unequal lengths (e.g. 3 heads over 2 kv heads), where one exists; else ``(8, 2)``."""
    for h in range(2, 16):
        for hkv in range(1, h):
            if h % hkv == 0 and any(kv_runs(s, h // hkv) for s in head_split(h, hkv, p)):
                return h, hkv
    return 8, 2


def sinks_of(h: int) -> torch.Tensor:
    return torch.tensor([0.5, NEG_INF, -1.0, 2.0, 0.0, -3.0, 1.0][:h] + [0.25] * max(h - 7, 0),
                        dtype=torch.float64, device=DEVICE)


def _inputs(seed: int, s: int, h: int, hkv: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (_randn(g, *shape, dtype=dtype) for shape in ((B, h, s, D), (B, hkv, s, D), (B, hkv, s, DV)))
    return q, k, v, _randn(g, B, h, s, DV), _randn(g, B, h, s).float().double()


def _sharder(group, layout, lens, docs):
    if lens is not None:
        return lambda t: t.split(lens, 2)[as_comm(group).rank]
    return lambda t: shard(t, 2, group=group, layout=layout, cu_seqlens=docs)


def check(group, layout, causal, kw, h, hkv, s=None, lens=None, dtype=torch.float64, tol=F64, seed=3):
    """One heads call against the oracle: out, lse, dq, dk, dv and this rank's rows' sinks share."""
    c = as_comm(group)
    s = sum(lens) if lens is not None else s
    q, k, v, wo, wl = _inputs(seed, s, h, hkv, dtype)
    mine = _sharder(group, layout, lens, kw.get("cu_seqlens"))
    rows = mine(torch.arange(s, device=DEVICE).view(1, 1, s)).view(-1).cpu()
    want = _oracle(q, k, v, wo, wl, kw, causal, rows)
    ql, kl, vl = (mine(t).detach().clone().requires_grad_() for t in (q, k, v))
    sl = None if kw.get("sinks") is None else kw["sinks"].detach().clone().requires_grad_()
    out, lse = sharded_attention(ql, kl, vl, causal=causal, group=group, schedule="heads", layout=layout,
                                 return_lse=True, **{**kw, "sinks": sl})
    what = f"heads {layout} causal={causal} {sorted(kw)} H={h} Hkv={hkv} S={s} lens={lens} rank {c.rank}/{c.size}"
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (B, h, len(rows), DV), what
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), what
    torch.testing.assert_close(out.double(), mine(want[0]), **tol, msg=lambda m: f"{what} out: {m}")
    torch.testing.assert_close(lse.double(), mine(want[1]), **F32, msg=lambda m: f"{what} lse: {m}")
    _loss(out, lse, mine(wo).to(dtype), mine(wl).float()).backward()
    for name, got, exp in (("dq", ql.grad, mine(want[2])), ("dk", kl.grad, mine(want[3])),
                           ("dv", vl.grad, mine(want[4])), ("dsinks", None if sl is None else sl.grad, want[5])):
        if exp is not None:
            assert got.dtype == (dtype if name != "dsinks" else sl.dtype), (what, name, got.dtype)
            torch.testing.assert_close(got.double(), exp, **tol, msg=lambda m: f"{what} {name}: {m}")
    return out, lse


def _lens(p: int, s: int, seed: int) -> list:
    """Uneven contiguous lengths summing to ``s``, one rank empty (P > 1)."""
    lens = uneven_lengths(p, seed)
    lens[-1 if p == 1 or seed % p != p - 1 else 0] += s - sum(lens)
    return lens


def case_shapes(group):
    """Every head split (uneven, Hkv < P, ranks with no head, MQA), contiguous (uneven, one rank
    empty) and zigzag, causal and not; one float32 call."""
    p = as_comm(group).size
    s = 4 * p + 3
    for i, (h, hkv) in enumerate(head_shapes(p)):
        check(group, "contiguous", i % 2 == 0, {}, h, hkv, lens=_lens(p, s, 4 + i))
        check(group, "zigzag", i % 2 == 1, {}, h, hkv, s=s)
    check(group, "zigzag", True, {}, 6, 2, s=s, dtype=torch.float32, tol=F32)


def configs(p: int, s: int, h: int) -> list:
    """``(causal, keywords)``: documents (0, 1, < 2P and long ones), windows longer than a shard and
    short, softcap, sinks (one -inf), kv_range padding on either side, and mixes."""
    docs = documents(p, s)
    kv = torch.tensor([[3, s], [0, s - 4]], dtype=torch.int32, device=DEVICE)
    return [(True, dict(cu_seqlens=docs)), (False, dict(cu_seqlens=torch.tensor(docs))),
            (True, dict(window_size=(s // p + 2, 0))), (False, dict(window_size=(2, 3), softcap=1.5)),
            (True, dict(cu_seqlens=docs, window_size=(2, 0), softcap=1.5, sinks=sinks_of(h))),
            (True, dict(kv_range=kv, sinks=sinks_of(h))), (False, dict(kv_range=kv, softcap=0.8)),
            (True, dict(cu_seqlens=docs, kv_range=kv, window_size=(s // p + 2, 0))),
            (False, dict(scale=0.3, softcap=2.0, q_offset=0))]


def case_variants(group):
    """Every keyword in its global meaning, zigzag per document and contiguous, over head splits
    that share kv heads and leave ranks without heads."""
    p = as_comm(group).size
    s = 5 * p + 4
    shapes = head_shapes(p)
    for i, (causal, kw) in enumerate(configs(p, s, 6)):
        h, hkv = shapes[i % len(shapes)]
        kw = {**kw, "sinks": sinks_of(h)} if "sinks" in kw else kw
        check(group, "zigzag", causal, kw, h, hkv, s=s, seed=i)
        check(group, "contiguous", causal, kw, h, hkv, lens=_lens(p, s, i), seed=i)
    check(group, "zigzag", True, dict(cu_seqlens=(0, 0, 1), sinks=sinks_of(3)), 3, 1, s=1)  # most ranks: no row
    check(group, "contiguous", False, dict(window_size=(1, 0)), 5, 5, lens=[0] * p)  # no row anywhere


def case_hidden_nan(group):
    """NaN in keys that kv_range hides changes nothing; a visible NaN key reaches exactly the query
    heads of its kv head, in the rows that see it; results are the same bits run to run."""
    p = as_comm(group).size
    s = 3 * p + 2
    q, k, v, _, _ = _inputs(9, s, 6, 2)
    kv = torch.tensor([[2, s], [0, s - 3]], dtype=torch.int32, device=DEVICE)
    k[0, :, :2], v[0, :, :2], k[1, :, s - 3:], v[1, :, s - 3:] = (float("nan"),) * 4
    ql, kl, vl = (shard(t, 2, group=group, layout="zigzag") for t in (q, k, v))
    out = sharded_attention(ql, kl, vl, causal=True, group=group, schedule="heads", layout="zigzag", kv_range=kv)
    again = sharded_attention(ql, kl, vl, causal=True, group=group, schedule="heads", layout="zigzag", kv_range=kv)
    assert torch.equal(out, again), "not reproducible"
    full = unshard(out, 2, group=group, layout="zigzag")
    want = ref.attention_variants(*(t.nan_to_num(7.0) for t in (q, k, v)), causal=True, kv_range=kv)[0]
    torch.testing.assert_close(full, want, **F64)
    k2 = k.nan_to_num(7.0)
    k2[1, 1, 3] = float("nan")  # kv head 1 = query heads 3, 4, 5 of batch element 1, key 3
    full = unshard(sharded_attention(ql, shard(k2, 2, group=group, layout="zigzag"), vl.nan_to_num(7.0), causal=True,
                                     group=group, schedule="heads", layout="zigzag"), 2, group=group, layout="zigzag")
    assert torch.isnan(full[1, 3:, 3:]).all(), "a row that sees the NaN key is not NaN"
    nan = torch.zeros_like(full, dtype=torch.bool)
    nan[1, 3:, 3:] = True
    assert not torch.isnan(full[~nan]).any(), "the NaN key reached a row that does not see it"


def case_random_mixes(group):
    """Random head counts, lengths per rank (0 included), layouts and keyword mixes (documents of
    any length, a window, softcap, sinks, key ranges), each against the oracle."""
    p = as_comm(group).size
    for seed in range(10):
        r = random.Random(100 * p + seed)
        hkv = r.choice([1, 2, 3])
        h = hkv * r.choice([1, 2, 3])
        lens = [r.choice([0, 1, 2, 5]) for _ in range(p)]
        s = sum(lens) or 1
        lens[-1] += s - sum(lens)
        kw = random_keywords(r, s)
        kw = {**kw, "sinks": sinks_of(h)} if "sinks" in kw else kw
        if r.random() < 0.5:
            kw["cu_seqlens"] = (0, *sorted(r.randint(0, s) for _ in range(r.randint(0, 3))), s)
        layout = r.choice(["zigzag", "contiguous"])
        check(group, layout, r.random() < 0.6, kw, h, hkv, s=s, lens=lens if layout == "contiguous" else None,
              seed=seed)


def case_all(group):
    """Every case above, in one worker start (process groups are slow to start)."""
    for case in (case_shapes, case_variants, case_hidden_nan, case_random_mixes):
        case(group)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("case", [case_shapes, case_variants, case_hidden_nan, case_random_mixes],
                         ids=lambda f: f.__name__)
def test_loopback(size, case):
    LoopbackWorld(size).run(case)


TAGS = {"meta": 11, "kv": 21, "dkv": 22, "gather": 31, "scatter": 32, "tree": 41, "qkv": 51, "out": 52,
        "dout": 53, "grads": 54}


def _pad(n: int) -> int:
    return -(-n // 16) * 16


def _expected(p: int, h: int, hkv: int, lens: list, fsize: int) -> tuple:
    """``({tag: messages}, {tag: bytes})`` of one call and its backward, from the head split, its
    query-head chunks and the lengths alone: a message for every pair with something to carry, each
    kv head to its readers; k and v in one message, then q and dout in one message per chunk."""
    split = head_split(h, hkv, p)
    chunks, groups = q_chunks(split, h // hkv), q_chunks(split, h // hkv, True)
    sends, nbytes = {}, {}

    def add(tag, parts):
        if sum(parts):
            sends[tag] = sends.get(tag, 0) + 1
            nbytes[tag] = nbytes.get(tag, 0) + sum(_pad(x) for x in parts)
    for r in range(p):  # sequence rank
        for t, hd in enumerate(split):  # heads rank
            if t == r:
                continue
            n, m = hd.nq * lens[r], hd.nkv * lens[r]
            shared = sum(x.nkv for x in split) > hkv
            add("qkv", [B * m * D * fsize, B * m * DV * fsize])
            for a, b in zip(chunks[t], chunks[t][1:]):
                add("qkv", [B * (b - a) * lens[r] * D * fsize])
            add("out", [B * n * DV * fsize, B * n * 4])
            for a, b in zip(groups[t], groups[t][1:]):
                add("dout", [B * (b - a) * lens[r] * x for x in (DV * fsize, 4, 4)])
            gk = 4 if shared else fsize
            add("grads", [B * n * D * fsize, B * m * D * gk, B * m * DV * gk])
    return sends, nbytes


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_alltoall_count(size):
    """Two all-to-alls forward (k, v then q in head chunks to heads; out and lse back) and two
    backward (dout with the rows' statistics, in chunks; dq, dk, dv back): each one message per pair
    with something to carry (q and dout: one per chunk), of
    exactly its bytes (every kv head only to the ranks that read it; bfloat16 rows, float32
    statistics, and float32 dK/dV where a kv head has several readers); nothing on the ring's or the
    tree's tags; one handshake (P-1 sends per rank) per call."""
    for h, hkv in head_shapes(size):
        lens = _lens(size, 3 * size + 1, 2)
        q, k, v, _, _ = _inputs(1, sum(lens), h, hkv, torch.bfloat16)
        world = LoopbackWorld(size)

        def run(c):
            mine = [t.split(lens, 2)[c.rank].clone().requires_grad_() for t in (q, k, v)]
            out = sharded_attention(*mine, causal=True, group=c, schedule="heads", window_size=(3, 0))
            out.sum().backward()
        world.run(run)
        want_sends, want_bytes = _expected(size, h, hkv, lens, 2)
        got_sends = {n: world.sends[t] for n, t in TAGS.items() if world.sends.get(t)}
        got_bytes = {n: world.bytes[t] for n, t in TAGS.items() if world.bytes.get(t) and n != "meta"}
        meta = {"meta": size * (size - 1)} if size > 1 else {}
        assert got_sends == {**want_sends, **meta}, (size, h, hkv, lens, got_sends, want_sends)
        assert got_bytes == want_bytes, (size, h, hkv, lens, got_bytes, want_bytes)


def test_head_split():
    """Query heads as tensor_split, each rank's kv heads those its query heads read; the local
    grouping named where it is uneven."""
    split = head_split(8, 2, 3)  # query heads [0, 3) [3, 6) [6, 8); kv head = h // 4
    assert [(s.q0, s.q1, s.k0, s.k1) for s in split] == [(0, 3, 0, 1), (3, 6, 0, 2), (6, 8, 1, 2)]
    assert [kv_runs(s, 4) for s in split] == [None, ((0, 1), (1, 3)), None]
    assert [(s.q0, s.q1, s.k0, s.k1) for s in head_split(2, 1, 4)] == [(0, 1, 0, 1), (1, 2, 0, 1), (2, 2, 0, 0),
                                                                      (2, 2, 0, 0)]
    assert [kv_runs(s, 2) for s in head_split(6, 3, 2)] == [((0, 2), (2, 3)), ((0, 1), (1, 3))]
    assert [kv_runs(s, 2) for s in head_split(8, 4, 2)] == [None, None]  # 2 query heads per kv head


def test_q_chunks():
    """q arrives in two chunks of whole kv groups where the local op reads several kv heads, of
    query heads where it reads one (or each its own, the grouping uneven); as many on every rank.
    dout: whole kv groups only."""
    assert q_chunks(head_split(8, 2, 1), 4) == ((0, 4, 8),)  # two kv groups of 4
    assert q_chunks(head_split(12, 6, 2), 2) == ((0, 4, 6), (0, 4, 6))  # 3 kv groups of 2: 2 + 1
    assert q_chunks(head_split(8, 1, 2), 8) == ((0, 2, 4), (0, 2, 4))  # one kv head: query heads
    assert q_chunks(head_split(6, 3, 2), 2) == ((0, 2, 3), (0, 2, 3))  # uneven grouping: kv expanded
    assert q_chunks(head_split(2, 1, 4), 2) == ((0, 1), (0, 1), (0, 0), (0, 0))  # one head: one chunk
    assert q_chunks(head_split(3, 3, 2), 1) == ((0, 1, 2), (0, 1, 1))  # padded with an empty chunk
    assert q_chunks(head_split(8, 1, 2), 8, True) == ((0, 4), (0, 4))  # dout: whole kv groups only
    assert q_chunks(head_split(12, 6, 2), 2, True) == ((0, 4, 6), (0, 4, 6))


def test_message_layout():
    """Pieces of a message start at 16-byte offsets (each read back as a view of its dtype)."""
    pieces, n = message([((2, 3), torch.float16), ((5,), torch.float64), ((0, 4), torch.float32), ((1,), torch.int8)])
    assert [pc.offset for pc in pieces] == [0, 16, 64, 64] and n == 80


@pytest.mark.parametrize("p", [2, 3])
def test_context_parallel_heads(p):
    """``ss.context_parallel(..., schedule="heads")``: a training step's loss, gradients and logits
    equal one process's, zigzag and contiguous."""
    from test_context_parallel import check_training

    def case(group):
        check_training(group, 16, "zigzag", "heads")
        check_training(group, 13, "contiguous", "heads")
    LoopbackWorld(p).run(case)


@pytest.mark.parametrize("seq", [1, 2, 3])
def test_heads_degree_one_is_the_sequence_schedule(seq):
    """Where the heads degree is 1 (``"heads"`` on one rank, a 2-D mesh ``seq x 1``) no all-to-all
    runs: the call is the sequence schedule's (the ring's on one rank), bit for bit, forward and
    backward, with documents and sinks."""
    h, hkv, s = 4, 2, 24
    q, k, v, dout, _ = _inputs(5, s, h, hkv, torch.bfloat16)
    docs = [0, 5, 5, 17, s]
    sinks = sinks_of(h)
    results = {}

    def run(c, schedule, group):
        mine = [shard(t, 2, group=c, layout="zigzag", cu_seqlens=docs).clone().requires_grad_() for t in (q, k, v)]
        sk = sinks.clone().requires_grad_()
        out = sharded_attention(*mine, causal=True, group=group, schedule=schedule, layout="zigzag",
                                cu_seqlens=docs, sinks=sk)
        out.backward(shard(dout, 2, group=c, layout="zigzag", cu_seqlens=docs))
        results.setdefault(schedule, {})[c.rank] = [out, *(t.grad for t in mine), sk.grad]

    cases = [("ring", lambda c: c), ("allgather", lambda c: c)] + ([("heads", lambda c: c)] if seq == 1 else []) + \
        [(f"heads+{inner}", lambda c: c.mesh(seq, 1)) for inner in ("ring", "allgather")]
    for schedule, group in cases:
        world = LoopbackWorld(seq)
        world.run(lambda c, sc=schedule, g=group: run(c, sc, g(c)))
        assert not any(world.sends.get(TAGS[t]) for t in ("qkv", "out", "dout", "grads")), (schedule, world.sends)
    for schedule, got in results.items():
        want = results["allgather" if schedule.endswith("allgather") else "ring"]
        for r in range(seq):
            for a, b in zip(got[r], want[r]):
                assert torch.equal(a, b), (schedule, r)
