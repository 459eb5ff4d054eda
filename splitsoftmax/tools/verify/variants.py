"""The attention variants in ``verify``: packed documents, a window, softcap, sinks and padding
through every sharded schedule, forward and backward (``q``, ``k``, ``v`` and ``sinks``).

The oracle is ``reference.attention_variants`` in float64; the peer that sets the tolerance is
an eager attention in the inputs' dtype with the same dense mask (what ``attn_implementation=
"eager"`` computes). Under ring / allgather a rank's sinks gradient is its rows' share, so the
shares are summed over the ranks before the comparison; under tree every rank holds the full one.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from ...core import reference as ref
from .compare import Row, Sharding, compare
from .job import Job, uneven_lengths


def eager(causal: bool, kw: dict) -> Callable:
    """Masked attention with sinks in the inputs' dtype (the peer)."""
    def f(q, k, v, sinks):
        b, h, sq, d = q.shape
        g = h // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        vis = {n: kw[n] for n in ("cu_seqlens", "window_size", "kv_range", "q_offset") if n in kw}
        ok = ref.variant_visible(b, sq, k.shape[2], causal=causal, **vis).to(q.device).unsqueeze(1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        cap = kw.get("softcap")
        if cap:
            s = cap * torch.tanh(s / cap)
        s = torch.cat((s.masked_fill(~ok, float("-inf")), sinks.view(1, h, 1, 1).expand(b, h, sq, 1).to(s.dtype)), -1)
        return torch.softmax(s, -1)[..., :-1] @ v
    return f


def _oracle(causal: bool, kw: dict) -> Callable:
    return lambda q, k, v, sinks: ref.attention_variants(q, k, v, causal=causal, sinks=sinks, **kw)[0]


def _summed(job: Job) -> Callable[[Tensor], Tensor]:
    """The sum over ranks of each rank's ``(H,)`` sinks gradient (its rows' share)."""
    import splitsoftmax as ss
    return lambda g: ss.unshard(g.reshape(1, -1), 0, group=job.group).sum(0)


def documents(s: int, world: int) -> tuple:
    """Documents of lengths 0, 1, 2P-1 and two that share the rest (longer than a shard)."""
    lengths = [0, 1, 2 * world - 1]
    rest = s - sum(lengths)
    lengths += [rest // 3, rest - rest // 3]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def sequence_rows(job: Job, schedule: str, layout: str) -> list[Row]:
    """Ring / allgather: documents + window + softcap + sinks + left padding, GQA 4/2, causal."""
    import splitsoftmax as ss
    s = 19 * job.world + 3
    docs = documents(s, job.world)
    q, k, v = job.randn(1, 4, s, 32, seed=21), job.randn(1, 2, s, 32, seed=22), job.randn(1, 2, s, 32, seed=23)
    sinks = job.randn(4, seed=24)
    kv = torch.tensor([[2, s]], dtype=torch.int32, device=job.device)
    kw = dict(cu_seqlens=docs, window_size=(s // job.world + 3, 0), softcap=5.0, kv_range=kv)
    if layout != "contiguous":
        split = lambda t: ss.shard(t, 2, group=job.group, layout=layout, cu_seqlens=docs)  # noqa: E731
        gather = lambda t: ss.unshard(t, 2, group=job.group, layout=layout, cu_seqlens=docs)  # noqa: E731
    else:
        split, gather = job.contiguous(uneven_lengths(s, job.world), 2)
    sh = Sharding([split] * 3 + [lambda t: t], [gather] * 3 + [_summed(job)], split, gather)

    def fn(q, k, v, sinks):
        return ss.sharded_attention(q, k, v, causal=True, group=job.group, schedule=schedule, layout=layout,
                                    sinks=sinks, **kw)
    name = f"sharded_attention variants S={s} docs+window+cap+sinks+pad"
    return compare(name, fn, eager(True, kw), _oracle(True, kw), [q, k, v, sinks], sharding=sh,
                   schedule=schedule, layout=layout, merges=job.world)


def tree_rows(job: Job) -> list[Row]:
    """Split-KV: 3 queries at the end of the keys, window + softcap + sinks + per-element KV lengths."""
    import splitsoftmax as ss
    sk = 23 * job.world + 2
    q, k, v = job.randn(2, 4, 3, 32, seed=25), job.randn(2, 1, sk, 32, seed=26), job.randn(2, 1, sk, 32, seed=27)
    sinks = job.randn(4, seed=28)
    kv = torch.tensor([[0, sk], [3, sk - 2]], dtype=torch.int32, device=job.device)
    kw = dict(window_size=(7, 0), softcap=5.0, kv_range=kv)
    split, gather = job.contiguous(uneven_lengths(sk, job.world), 2)
    same = lambda t: t  # noqa: E731
    sh = Sharding([same, split, split, same], [same, gather, gather, same], same, same)

    def fn(q, k, v, sinks):
        return ss.sharded_attention(q, k, v, causal=True, group=job.group, schedule="tree", sinks=sinks, **kw)
    full = {**kw, "q_offset": sk - 3}
    return compare(f"sharded_attention variants decode Sk={sk} window+cap+sinks+kv", fn, eager(True, full),
                   _oracle(True, full), [q, k, v, sinks], sharding=sh, schedule="tree", layout="contiguous",
                   merges=job.world)


def cases(job: Job) -> list:
    """``(title, rows function)`` of every variant case, for ``verify_sharded.cases``."""
    out = [(f"attention variants {sc} {lay}", lambda sc=sc, lay=lay: sequence_rows(job, sc, lay))
           for sc in ("ring", "allgather") for lay in ("contiguous", "zigzag", "balanced")]
    return out + [("attention variants tree", lambda: tree_rows(job))]
