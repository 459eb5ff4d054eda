"""Sharded attention under the variant keywords, against the float64 single-device oracle.

Each ``case_*(group)`` builds the full inputs from a fixed seed on every rank, shards them and
asserts forward and backward (q, k, v and the sinks' share of this rank's rows) against
``reference.attention_variants``. Here they run on the loopback world (P in 1, 2, 3, 5);
test_dist_gloo.py runs the same functions on Gloo ranks. The transfer tests count every message
and byte the schedules send against the pairs that a dense visibility matrix says are needed.
"""
from __future__ import annotations

import random

import pytest
import torch

from splitsoftmax.core import reference as ref
from splitsoftmax import sharded_attention
from splitsoftmax.distributed import LoopbackWorld, as_comm, shard, unshard
from _dist_util import assert_ok, spawn
from test_dist_cases import DEVICE, F32, F64, _randn, uneven_lengths

NEG_INF = float("-inf")
B, H, HKV, D, DV = 2, 4, 2, 8, 6


def _inputs(seed: int, s: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (_randn(g, *shape, dtype=dtype) for shape in ((B, H, s, D), (B, HKV, s, D), (B, HKV, s, DV)))
    wo, wl = _randn(g, B, H, s, DV), _randn(g, B, H, s).float().double()
    return q, k, v, wo, wl


def _loss(out, lse, wo, wl):
    """Weighted sum of outputs and (finite) lse: every output's gradient enters."""
    return (out * wo).sum() + (lse.masked_fill(lse == NEG_INF, 0.0) * wl).sum()


def _oracle(q, k, v, wo, wl, kw: dict, causal: bool, rows):
    """float64 ``(out, lse, dq, dk, dv, dsinks of the rows ``rows``)`` of the whole sequence."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    sinks = kw.get("sinks")
    sinks = None if sinks is None else sinks.detach().double().requires_grad_()
    out, lse = ref.attention_variants(q, k, v, causal=causal, **{**kw, "sinks": sinks})
    _loss(out, lse, wo, wl).backward(retain_graph=sinks is not None)
    grads = [out.detach(), lse.detach(), q.grad, k.grad, v.grad, None]
    if sinks is not None:
        keep = torch.zeros(out.shape[2], dtype=torch.bool)
        keep[rows] = True
        sel = keep.view(1, 1, -1).to(out.device)
        grads[5] = torch.autograd.grad(_loss(out, lse, wo * sel.unsqueeze(-1), wl * sel), sinks)[0]
    return grads


def _sharder(group, layout, lens, docs):
    """This rank's part of a full tensor along dim 2 (``lens``: contiguous with those lengths)."""
    if lens is not None:
        return lambda t: t.split(lens, 2)[as_comm(group).rank]
    return lambda t: shard(t, 2, group=group, layout=layout, cu_seqlens=docs)


def check(group, schedule, layout, causal, kw, s=None, lens=None, dtype=torch.float64, tol=F64, seed=3):
    """One sharded call against the oracle: out, lse, dq, dk, dv and this rank's sinks share."""
    c = as_comm(group)
    s = sum(lens) if lens is not None else s
    q, k, v, wo, wl = _inputs(seed, s, dtype)
    mine = _sharder(group, layout, lens, kw.get("cu_seqlens"))
    rows = mine(torch.arange(s, device=DEVICE).view(1, 1, s)).view(-1).cpu()
    want = _oracle(q, k, v, wo, wl, kw, causal, rows)
    ql, kl, vl = (mine(t).detach().clone().requires_grad_() for t in (q, k, v))
    sinks = kw.get("sinks")
    sl = None if sinks is None else sinks.detach().clone().requires_grad_()
    out, lse = sharded_attention(ql, kl, vl, causal=causal, group=group, schedule=schedule, layout=layout,
                                 return_lse=True, **{**kw, "sinks": sl})
    what = f"{schedule} {layout} causal={causal} {sorted(kw)} S={s} lens={lens} rank {c.rank}/{c.size}"
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (B, H, len(rows), DV), what
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), what
    torch.testing.assert_close(out.double(), mine(want[0]), **tol, msg=lambda m: f"{what} out: {m}")
    torch.testing.assert_close(lse.double(), mine(want[1]), **F32, msg=lambda m: f"{what} lse: {m}")
    _loss(out, lse, mine(wo).to(dtype), mine(wl).float()).backward()
    for name, got, exp in (("dq", ql.grad, mine(want[2])), ("dk", kl.grad, mine(want[3])),
                           ("dv", vl.grad, mine(want[4])), ("dsinks", None if sl is None else sl.grad, want[5])):
        if exp is not None:
            torch.testing.assert_close(got.double(), exp, **tol, msg=lambda m: f"{what} {name}: {m}")
    return out, lse


def documents(p: int, s: int) -> tuple:
    """Documents of lengths 0, 1, < 2P, 0, and the rest (much longer than a shard)."""
    lengths = [0, 1, 2 * p - 1, 0]
    lengths.append(s - sum(lengths))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def sinks_of(h: int = H) -> torch.Tensor:
    return torch.tensor([0.5, NEG_INF, -1.0, 2.0][:h], dtype=torch.float64, device=DEVICE)


def configs(p: int, s: int) -> list:
    """``(causal, keywords)`` of the cases: documents, windows longer than a shard and shorter than a
    chunk, softcap, sinks (one -inf), kv_range padding on either side (rows empty on some ranks only)."""
    docs = documents(p, s)
    kv = torch.tensor([[3, s], [0, s - 4]], dtype=torch.int32, device=DEVICE)
    return [(True, dict(cu_seqlens=docs)), (False, dict(cu_seqlens=torch.tensor(docs))),
            (True, dict(window_size=(s // p + 2, 0))), (True, dict(window_size=(1, 0))),
            (False, dict(window_size=(2, 3))),
            (True, dict(cu_seqlens=docs, window_size=(2, 0), softcap=1.5, sinks=sinks_of())),
            (True, dict(kv_range=kv, sinks=sinks_of())), (False, dict(kv_range=kv, softcap=0.8)),
            (True, dict(cu_seqlens=docs, kv_range=kv, window_size=(s // p + 2, 0)))]


def case_variants(group):
    """ring and allgather, contiguous (uneven lengths, one rank empty) and zigzag (per document)."""
    p = as_comm(group).size
    s = 6 * p + 5
    for i, (causal, kw) in enumerate(configs(p, s)):
        for schedule in ("ring", "allgather")[:2 - i % 2]:  # allgather (the ring's visits) on every other
            check(group, schedule, "zigzag", causal, kw, s=s)
            lens = uneven_lengths(p, 4)
            lens[-1] += s - sum(lens)
            check(group, schedule, "contiguous", causal, kw, lens=lens)
    check(group, "ring", "zigzag", True, configs(p, s)[5][1], s=s, dtype=torch.float32, tol=F32)
    for tiny in (1, 2 * p - 1):  # shorter than 2P: most ranks hold no row
        check(group, "ring", "zigzag", True, dict(cu_seqlens=(0, 0, tiny), window_size=(1, 0), sinks=sinks_of()), s=tiny)
        check(group, "allgather", "zigzag", False, dict(cu_seqlens=(0, tiny - 1, tiny)), s=tiny)


def check_tree(group, lens, sq, causal, kw, seed, label):
    """One split-KV call over key shards of ``lens`` and ``sq`` query rows against the oracle: out
    and lse identical on every rank, out, lse, dq, dk, dv and the sinks' full gradient."""
    c = as_comm(group)
    sk = sum(lens)
    q, k, v, wo, wl = _inputs(seed, max(sk, sq))
    q, k, v, wo, wl = q[:, :, :sq], k[:, :, :sk], v[:, :, :sk], wo[:, :, :sq], wl[:, :, :sq]
    want = _oracle(q, k, v, wo, wl, {**kw, "q_offset": kw.get("q_offset", sk - sq)}, causal, torch.arange(sq))
    ql = q.clone().requires_grad_()
    kl, vl = (t.split(lens, 2)[c.rank].clone().requires_grad_() for t in (k, v))
    sl = None if "sinks" not in kw else kw["sinks"].clone().requires_grad_()
    out, lse = sharded_attention(ql, kl, vl, causal=causal, group=group, schedule="tree", return_lse=True,
                                 **{**kw, "sinks": sl})
    what = f"tree {label} sq={sq} lens={lens} causal={causal} {sorted(kw)} rank {c.rank}"
    every = unshard(torch.cat((out.detach(), lse.detach().unsqueeze(-1).double()), -1)[None], 0, group=group)
    assert all(torch.equal(e, every[0]) for e in every), f"{what}: ranks differ"
    torch.testing.assert_close(out, want[0], **F64, msg=lambda m: f"{what} out: {m}")
    torch.testing.assert_close(lse.double(), want[1], **F32, msg=lambda m: f"{what} lse: {m}")
    _loss(out, lse, wo, wl.float()).backward()
    torch.testing.assert_close(ql.grad, want[2], **F64, msg=lambda m: f"{what} dq: {m}")
    torch.testing.assert_close(kl.grad, want[3].split(lens, 2)[c.rank], **F64, msg=lambda m: f"{what} dk: {m}")
    torch.testing.assert_close(vl.grad, want[4].split(lens, 2)[c.rank], **F64, msg=lambda m: f"{what} dv: {m}")
    if sl is not None:
        torch.testing.assert_close(sl.grad, want[5], **F64, msg=lambda m: f"{what} dsinks: {m}")


def case_tree(group):
    """Split-KV under the keywords: windows, softcap, sinks (full gradient on every rank), kv_range,
    q_offset as an int and as a tensor; out and lse identical on every rank."""
    lens = uneven_lengths(as_comm(group).size, 5)
    lens[-1] += 4
    sk = sum(lens)
    cases = [(True, dict(window_size=(3, 0), sinks=sinks_of())), (True, dict(q_offset=2, softcap=1.2)),
             (True, dict(q_offset=torch.tensor([1, sk - 3], device=DEVICE), window_size=(4, 0))),
             (False, dict(kv_range=torch.tensor([[1, sk], [0, 2]], device=DEVICE), sinks=sinks_of())),
             (False, dict(window_size=(-1, 1), q_offset=0))]
    for sq in (1, 3):
        for causal, kw in cases:
            check_tree(group, lens, sq, causal, kw, 6, "")


def case_tree_random_mixes(group):
    """Split-KV under random mixes of its keywords (a window, softcap, sinks, key ranges, int or
    tensor offsets; causal or not; 1-5 query rows over random per-rank key lengths, 0 included)."""
    p = as_comm(group).size
    for seed in range(12):
        r = random.Random(1000 * p + seed)
        lens = [r.choice([0, 1, 3, 7]) for _ in range(p)]
        lens[-1] += 1
        sk, sq = sum(lens), r.randint(1, 5)
        kw = random_keywords(r, sk)
        if r.random() < 0.5:
            off = [r.randint(-2, sk) for _ in range(B)]
            kw["q_offset"] = off[0] if r.random() < 0.5 else torch.tensor(off, device=DEVICE)
        check_tree(group, lens, sq, r.random() < 0.6, kw, seed, f"seed {seed}")


def case_hidden_nan(group):
    """NaN in keys and values that kv_range or another document hides changes nothing."""
    p = as_comm(group).size
    s = 4 * p + 3
    q, k, v, _, _ = _inputs(9, s)
    kv = torch.tensor([[2, s], [0, s - 3]], dtype=torch.int32, device=DEVICE)
    k[0, :, :2], v[0, :, :2], k[1, :, s - 3:], v[1, :, s - 3:] = (float("nan"),) * 4
    for schedule, layout in (("ring", "zigzag"), ("allgather", "contiguous"), ("ring", "contiguous")):
        for kw in (dict(kv_range=kv), dict(kv_range=kv, window_size=(3, 0), cu_seqlens=(0, 1, s))):
            ql, kl, vl = (shard(t, 2, group=group, layout=layout, cu_seqlens=kw.get("cu_seqlens")) for t in (q, k, v))
            out = sharded_attention(ql, kl, vl, causal=True, group=group, schedule=schedule, layout=layout, **kw)
            full = unshard(out, 2, group=group, layout=layout, cu_seqlens=kw.get("cu_seqlens"))
            want = ref.attention_variants(q.nan_to_num(7.0), k.nan_to_num(7.0), v.nan_to_num(7.0), causal=True, **kw)[0]
            assert not torch.isnan(full).any(), f"{schedule} {layout}: a hidden NaN reached the output"
            torch.testing.assert_close(full, want, **F64)


def case_shard_docs(group):
    """shard / unshard with cu_seqlens: per-document zigzag at odd lengths, round trip and gradients."""
    c = as_comm(group)
    p = c.size
    for cu in ((0, 0), (0, 1), (0, 2 * p - 1, 2 * p - 1, 2 * p + 4), (0, 3, 4, 9 * p + 2)):
        s = cu[-1]
        x = _randn(torch.Generator().manual_seed(s), 2, 3, s, 4)
        want = []
        for a, e in zip(cu[:-1], cu[1:]):
            ch = torch.tensor_split(x[:, :, a:e], 2 * p, 2)
            want += [ch[c.rank], ch[2 * p - 1 - c.rank]]
        xl = x.clone().requires_grad_()
        mine = shard(xl, 2, group=group, layout="zigzag", cu_seqlens=torch.tensor(cu))
        assert torch.equal(mine, torch.cat(want, 2)), f"shard per document cu={cu} rank {c.rank}"
        full = unshard(mine * 2.0, 2, group=group, layout="zigzag", cu_seqlens=cu)
        assert torch.equal(full, 2.0 * x), f"unshard per document cu={cu} rank {c.rank}"
        (full * x).sum().backward()
        assert torch.equal(xl.grad, 2.0 * x), f"shard/unshard grad cu={cu}"
        assert torch.equal(shard(x, 2, group=group, cu_seqlens=cu), torch.tensor_split(x, p, 2)[c.rank])


def random_keywords(r: random.Random, s: int) -> dict:
    """A random draw of a window, softcap, sinks and key ranges over ``s`` keys (each or none)."""
    kw = {}
    if r.random() < 0.5:
        kw["window_size"] = (r.choice([-1, 0, 1, 4, s]), r.choice([-1, 0, 2]))
    if r.random() < 0.3:
        kw["softcap"] = r.choice([0.8, 3.0])
    if r.random() < 0.3:
        kw["sinks"] = sinks_of()
    if r.random() < 0.4:
        los = [r.randint(0, s) for _ in range(B)]
        kw["kv_range"] = torch.tensor([[lo, r.randint(lo, s)] for lo in los], dtype=torch.int32, device=DEVICE)
    return kw


def random_mix(p: int, seed: int) -> tuple:
    """``(schedule, layout, causal, keywords, S, lens)``: a random mix of the keywords the ring and
    allgather take (documents of any length, a window, softcap, sinks, key ranges) at a random
    length, zigzag or contiguous with random per-rank lengths (0 included)."""
    r = random.Random(seed)
    lens = [r.choice([0, 1, 2, 5, 9]) for _ in range(p)]
    s = sum(lens) or 1
    lens[-1] += s - sum(lens)
    kw = random_keywords(r, s)
    if r.random() < 0.6:
        kw["cu_seqlens"] = (0, *sorted(r.randint(0, s) for _ in range(r.randint(0, 3))), s)
    layout = r.choice(["zigzag", "contiguous"])
    return r.choice(["ring", "allgather"]), layout, r.random() < 0.6, kw, s, lens if layout == "contiguous" else None


def case_random_mixes(group):
    """Random keyword mixes (:func:`random_mix`), each against the oracle: out, lse, every gradient."""
    p = as_comm(group).size
    for seed in range(25):
        schedule, layout, causal, kw, s, lens = random_mix(p, 100 * p + seed)
        check(group, schedule, layout, causal, kw, s=None if lens else s, lens=lens, seed=seed)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("case", [case_variants, case_tree, case_hidden_nan, case_shard_docs,
                                  case_random_mixes, case_tree_random_mixes],
                         ids=lambda f: f.__name__)
def test_loopback(size, case):
    LoopbackWorld(size).run(case)


TAGS = {"meta": 11, "kv": 21, "dkv": 22, "gather": 31, "scatter": 32}


def rank_positions(layout: str, lens, p: int, docs) -> list:
    """Each rank's global positions, by definition: contiguous slices of ``lens``, or chunks ``r``
    and ``2P-1-r`` of ``torch.tensor_split`` of every document (the whole sequence without)."""
    if layout == "contiguous":
        return [list(range(sum(lens[:r]), sum(lens[:r + 1]))) for r in range(p)]
    out = [[] for _ in range(p)]
    for a, e in zip(docs[:-1], docs[1:]):
        ch = torch.tensor_split(torch.arange(a, e), 2 * p)
        for r in range(p):
            out[r] += ch[r].tolist() + ch[2 * p - 1 - r].tolist()
    return out


def _traffic(p, schedule, layout, causal, kw, s, lens=None, backward=False):
    """Messages and bytes per tag of one call (and its backward) on a loopback world, float32."""
    docs = kw.get("cu_seqlens")
    pos = rank_positions(layout, lens, p, docs if docs is not None else (0, s))
    q, k, v, _, _ = _inputs(8, s, torch.float32)
    world = LoopbackWorld(p)

    def run(c):
        mine = [t[:, :, pos[c.rank]].clone().requires_grad_() for t in (q, k, v)]
        out = sharded_attention(*mine, causal=causal, group=c, schedule=schedule, layout=layout, **kw)
        if backward:
            out.sum().backward()
    world.run(run)
    return ({n: world.sends.get(t, 0) for n, t in TAGS.items()}, {n: world.bytes.get(t, 0) for n, t in TAGS.items()},
            pos)


def _needed(pos, vis) -> dict:
    """``{(owner, receiver): rows}`` of keys some query of the receiver sees, receiver != owner."""
    p = len(pos)
    need = {}
    for o in range(p):
        for r in range(p):
            if o != r and pos[o] and pos[r]:
                n = int(vis[pos[r]][:, pos[o]].any(0).sum())
                if n:
                    need[(o, r)] = n
    return need


ROW = B * HKV * (D + DV) * 4  # bytes of one packed float32 K/V row


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("schedule", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_transfers_are_what_is_seen(p, schedule, layout):
    """Documents and windows: every transfer carries exactly the key rows some query of the
    receiver sees (no message where none are), forward and backward (dK/dV rows go home)."""
    s = 7 * p + 3
    lens = uneven_lengths(p, 2)
    lens[-1] += s - sum(lens)
    docs = documents(p, s)
    for causal, kw in ((True, dict(cu_seqlens=docs)), (True, dict(window_size=(3, 0))),
                       (False, dict(window_size=(2, 1), cu_seqlens=docs)), (True, dict(window_size=(s // p + 2, 0)))):
        sends, nbytes, pos = _traffic(p, schedule, layout, causal, kw, s, lens)
        vis = ref.variant_visible(1, s, s, causal=causal, **kw)[0]
        need = _needed(pos, vis)
        kv, dkv = ("kv", "dkv") if schedule == "ring" else ("gather", "scatter")
        what = f"{schedule} {layout} P={p} {kw}"
        assert sends[kv] == len(need) and nbytes[kv] == ROW * sum(need.values()), (what, sends, nbytes, need)
        assert sends["meta"] == p * (p - 1), what
        sends_b, nbytes_b, _ = _traffic(p, schedule, layout, causal, kw, s, lens, backward=True)
        assert sends_b[kv] == 2 * len(need) and nbytes_b[kv] == 2 * ROW * sum(need.values()), what
        assert sends_b[dkv] == len(need) and nbytes_b[dkv] == ROW * sum(need.values()), what


@pytest.mark.parametrize("p", [2, 3, 5])
def test_window_halo_traffic(p):
    """A window shorter than a chunk: contiguous sends one halo of ``left`` rows to the next rank,
    zigzag one to each neighbour; steps with nothing visible send nothing, whatever P."""
    left, chunk = 3, 5
    s = 2 * p * chunk
    sends, nbytes, _ = _traffic(p, "ring", "contiguous", True, dict(window_size=(left, 0)), s, [s // p] * p)
    assert sends["kv"] == p - 1 and nbytes["kv"] == (p - 1) * left * ROW, (sends, nbytes)
    sends, nbytes, _ = _traffic(p, "ring", "zigzag", True, dict(window_size=(left, 0)), s)
    assert sends["kv"] == 2 * (p - 1) and nbytes["kv"] == 2 * (p - 1) * left * ROW, (sends, nbytes)
    sends, nbytes, _ = _traffic(p, "ring", "zigzag", True, dict(window_size=(left, 0)), s, backward=True)
    assert sends["dkv"] == 2 * (p - 1) and nbytes["dkv"] == 2 * (p - 1) * left * ROW, (sends, nbytes)


def test_documents_inside_shards_send_nothing():
    """Documents that never cross a shard boundary: no K/V transfer at all, on any rank."""
    s, p = 24, 3
    sends, _, _ = _traffic(p, "ring", "contiguous", True, dict(cu_seqlens=(0, 3, 8, 8, 16, 24)), s, [8, 8, 8],
                           backward=True)
    assert sends["kv"] == 0 and sends["dkv"] == 0 and sends["meta"] == p * (p - 1), sends


def _raises(fn, pattern):
    with pytest.raises(ValueError, match=pattern):
        fn()


def case_agreement(group):
    """Every variant field that differs across ranks raises ValueError on every rank, naming the
    field and the ranks, before any bulk transfer; global checks raise on every rank alike."""
    c = as_comm(group)
    if c.size == 1:
        return
    last, other = c.size - 1, c.rank == c.size - 1
    s = 4 * c.size + 2
    q, k, v, _, _ = _inputs(7, s)
    ql, kl, vl = (shard(t, 2, group=group, layout="zigzag") for t in (q, k, v))
    kv = torch.tensor([[0, s], [1, s]], device=DEVICE)

    def attn(schedule="ring", **kw):
        return lambda: sharded_attention(ql, kl, vl, causal=True, group=group, schedule=schedule, layout="zigzag", **kw)
    differs = {
        "cu_seqlens": dict(cu_seqlens=(0, 3 if other else 2, s)),
        "window_size": dict(window_size=(3, 0) if other else (2, 0)),
        "softcap": dict(softcap=2.0 if other else None),
        "sinks": dict(sinks=sinks_of() if other else None),
        "kv_range": dict(kv_range=kv + other),
    }
    for field, kw in differs.items():
        _raises(attn(**kw) if field != "cu_seqlens" else
                (lambda: sharded_attention(*(t[:, :, :0] for t in (ql, kl, vl)), group=group, **kw)),
                rf"{field} differs across ranks \(.*rank\(s\) \[{last}\]")
    _raises(attn(sinks=sinks_of().float() if other else sinks_of()), r"sinks differs across ranks")
    tree = lambda **kw: lambda: sharded_attention(q[:, :, :2], kl, vl, causal=True, group=group,  # noqa: E731
                                                  schedule="tree", **kw)
    _raises(tree(q_offset=2 if other else 1), rf"q_offset differs across ranks \(.*rank\(s\) \[{last}\]")
    _raises(tree(q_offset=torch.tensor([1, 2 + other], device=DEVICE)), r"q_offset differs across ranks")
    _raises(tree(cu_seqlens=(0, s)), r"cu_seqlens is not taken by schedule='tree'|rejected their arguments")
    _raises(attn(q_offset=torch.tensor([0, 1], device=DEVICE)), r"q_offset must be 0 with schedule='ring'; rank\(s\) \[0")
    _raises(attn(q_offset=1 if other else 0), rf"q_offset must be 0|rank\(s\) \[{last}\] rejected their arguments "
                                               rf"\(rank {last}: q_offset")
    _raises(attn(kv_range=kv + s), rf"kv_range must satisfy .* <= Sk = {s}")
    _raises(attn(cu_seqlens=(0, 1, s + 1)), rf"cu_seqlens\[-1\] must equal the sequence length {s}")
    _raises(attn(cu_seqlens=(0, 1, s), q_offset=torch.zeros(2, dtype=torch.long, device=DEVICE)),
            r"cu_seqlens needs q_offset == 0")  # (as on one device: a tensor's values are not read)
    _raises(attn(cu_seqlens=(0, 1, s)), r"not of a per-document zigzag split of cu_seqlens")
    _raises(attn(sinks=sinks_of()[:2] if other else sinks_of()), rf"sinks must have shape|rank\(s\) \[{last}\]")
    _raises(attn(window_size=(-2, 0) if other else None), rf"window_size entries|rank\(s\) \[{last}\]")
    _raises(lambda: unshard(ql, 2, group=group, layout="zigzag", cu_seqlens=(0, 2 + other, s)),
            rf"cu_seqlens differs across ranks \(.*rank\(s\) \[{last}\]")


@pytest.mark.parametrize("size", [2, 3])
def test_agreement_before_bulk_transfer(size):
    world = LoopbackWorld(size)
    world.run(case_agreement)
    sent = {n: world.sends.get(t, 0) for n, t in TAGS.items()}
    assert sent["kv"] == sent["gather"] == sent["dkv"] == sent["scatter"] == 0, sent
    world.run(lambda g: check(g, "ring", "zigzag", True, dict(window_size=(2, 0), sinks=sinks_of()), s=4 * size + 2))


def case_all(group):
    """Every case above, in one worker start (process groups are slow to start)."""
    for case in (case_variants, case_tree, case_hidden_nan, case_shard_docs, case_agreement, case_random_mixes,
                 case_tree_random_mixes):
        case(group)


@pytest.mark.distributed
@pytest.mark.parametrize("size", [2, 3])
def test_gloo(size):
    """The cases on Gloo process groups of 2 and 3 ranks."""
    assert_ok(spawn(size, "tests/test_dist_variants.py:case_all", timeout=300, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              f"gloo world of {size}")


@pytest.mark.parametrize("size", [2, 3])
def test_tree_with_no_queries(size):
    """Split-KV attention with no query rows: outputs of the right shapes, a backward of zeros."""
    def case(group):
        q = torch.randn(2, 4, 0, 8, requires_grad=True)
        k, v = (torch.randn(2, 2, 3, 8, requires_grad=True) for _ in range(2))
        for causal in (False, True):
            out, lse = sharded_attention(q, k, v, schedule="tree", group=group, causal=causal, return_lse=True)
            assert out.shape == (2, 4, 0, 8) and lse.shape == (2, 4, 0)
            grads = torch.autograd.grad(out.sum(), (k, v))
            assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    LoopbackWorld(size).run(case)


def test_out_of_range_arguments_on_one_rank():
    """An argument too large for a float, on the last rank only: that rank raises the ValueError
    naming it and the others learn of it in the same exchange (no wait for a timeout); a q_offset
    past int64 and a window edge 2^31 - 1 or more away, on every rank, run."""
    import time
    q = torch.randn(1, 2, 8, 8)
    cases = [(dict(scale=10 ** 400), r"scale=1000*0* is out of the range of a float"),
             (dict(softcap=10 ** 400), r"softcap=.* is out of the range of a float"),
             (dict(schedule="tree", q_offset=2 ** 70), None)]

    def case(group):
        last = group.rank == group.size - 1
        for kw, mine in cases:
            if mine is None:  # (on every rank: an offset that far acts as where every key is seen)
                sharded_attention(q, q, q, causal=True, group=group, **kw)
                continue
            bad = kw if last else {}
            start = time.monotonic()
            with pytest.raises(ValueError, match=mine if last else r"rank\(s\) \[\d+\] rejected their arguments"):
                sharded_attention(q, q, q, causal=True, group=group, **bad)
            assert time.monotonic() - start < 5
        wide = sharded_attention(q, q, q, causal=True, window_size=(2 ** 31, 0), group=group)
        assert torch.equal(wide, sharded_attention(q, q, q, causal=True, group=group))
    LoopbackWorld(2).run(case, timeout=60)
