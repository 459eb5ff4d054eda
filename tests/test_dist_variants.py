"""Sharded attention under the variant keywords, against the float64 single-device oracle.

Each ``case_*(group)`` builds the full inputs from a fixed seed on every rank, shards them and
asserts forward and backward (q, k, v and the sinks' share of this rank's rows) against
``reference.attention_variants``. Here they run on the loopback world (P in 1, 2, 3, 5);
test_dist_gloo.py runs the same functions on Gloo ranks. The transfer tests count every message
and byte the schedules send against the pairs that a dense visibility matrix says are needed.
"""
from __future__ import annotations

import pytest
import torch

from splitsoftmax import reference as ref
from splitsoftmax.distributed import LoopbackWorld, as_comm, shard, sharded_attention, unshard
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
    for causal, kw in configs(p, s):
        for schedule in ("ring", "allgather"):
            check(group, schedule, "zigzag", causal, kw, s=s)
            lens = uneven_lengths(p, 4)
            lens[-1] += s - sum(lens)
            check(group, schedule, "contiguous", causal, kw, lens=lens)
    check(group, "ring", "zigzag", True, configs(p, s)[5][1], s=s, dtype=torch.float32, tol=F32)


def case_tree(group):
    """Split-KV under the keywords: windows, softcap, sinks (full gradient on every rank), kv_range,
    q_offset as an int and as a tensor; out and lse identical on every rank."""
    c = as_comm(group)
    lens = uneven_lengths(c.size, 5)
    lens[-1] += 4
    sk = sum(lens)
    cases = [(True, dict(window_size=(3, 0), sinks=sinks_of())), (True, dict(q_offset=2, softcap=1.2)),
             (True, dict(q_offset=torch.tensor([1, sk - 3], device=DEVICE), window_size=(4, 0))),
             (False, dict(kv_range=torch.tensor([[1, sk], [0, 2]], device=DEVICE), sinks=sinks_of())),
             (False, dict(window_size=(-1, 1), q_offset=0))]
    for sq in (1, 3):
        for causal, kw in cases:
            q, k, v, wo, wl = _inputs(6, sk)
            q, wo, wl = q[:, :, :sq], wo[:, :, :sq], wl[:, :, :sq]
            off = kw.get("q_offset", sk - sq)
            want = _oracle(q, k, v, wo, wl, {**kw, "q_offset": off}, causal, torch.arange(sq))
            ql = q.clone().requires_grad_()
            kl, vl = (t.split(lens, 2)[c.rank].clone().requires_grad_() for t in (k, v))
            sl = None if "sinks" not in kw else kw["sinks"].clone().requires_grad_()
            out, lse = sharded_attention(ql, kl, vl, causal=causal, group=group, schedule="tree", return_lse=True,
                                         **{**kw, "sinks": sl})
            what = f"tree sq={sq} causal={causal} {sorted(kw)} rank {c.rank}"
            every = unshard(torch.cat((out.detach(), lse.detach().unsqueeze(-1).double()), -1)[None], 0, group=group)
            assert all(torch.equal(e, every[0]) for e in every), f"{what}: ranks differ"
            torch.testing.assert_close(out, want[0], **F64, msg=lambda m: f"{what} out: {m}")
            torch.testing.assert_close(lse.double(), want[1], **F32, msg=lambda m: f"{what} lse: {m}")
            _loss(out, lse, wo, wl.float()).backward()
            torch.testing.assert_close(ql.grad, want[2], **F64, msg=lambda m: f"{what} dq: {m}")
            torch.testing.assert_close(kl.grad, want[3].split(lens, 2)[c.rank], **F64)
            torch.testing.assert_close(vl.grad, want[4].split(lens, 2)[c.rank], **F64)
            if sl is not None:
                torch.testing.assert_close(sl.grad, want[5], **F64, msg=lambda m: f"{what} dsinks: {m}")


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


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("case", [case_variants, case_tree, case_hidden_nan, case_shard_docs],
                         ids=lambda f: f.__name__)
def test_loopback(size, case):
    LoopbackWorld(size).run(case)
