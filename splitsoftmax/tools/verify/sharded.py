"""The sharded half of ``verify``: every sharded op on the ranks of this job against one device.

Every rank draws the same full inputs from one seed, takes its shard, runs the sharded op
forward and backward, and reassembles outputs and gradients with ``unshard``; the comparison
against float64 (and the tolerance from torch on one device) is :func:`compare.compare`'s.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

from ...core import reference as ref
from . import variants as verify_variants
from .compare import Row, Sharding, compare, sdpa
from .job import Job, uneven_lengths


def softmax_rows(job: Job) -> list[Row]:
    import splitsoftmax as ss
    x = job.randn(6, 13 * job.world + 5, seed=1, scale=4.0)
    x[2] = float("-inf")
    split, gather = job.contiguous(uneven_lengths(x.shape[1], job.world), 1)
    same = Sharding([split], [gather], split, gather)
    replicated = Sharding([split], [gather], lambda t: t, lambda t: t)
    g = job.group
    return (compare("sharded_softmax 6xN", lambda t: ss.sharded_softmax(t, group=g),
                    lambda t: torch.softmax(t, -1), ref.softmax, [x], sharding=same,
                    layout="contiguous", schedule="tree", merges=job.world)
            + compare("sharded_log_softmax 6xN", lambda t: ss.sharded_log_softmax(t, group=g),
                      lambda t: torch.log_softmax(t, -1), ref.log_softmax, [x], sharding=same,
                      layout="contiguous", schedule="tree", merges=job.world)
            + compare("sharded_logsumexp 6xN", lambda t: ss.sharded_logsumexp(t, group=g),
                      lambda t: torch.logsumexp(t, -1), ref.logsumexp, [x], sharding=replicated,
                      layout="contiguous", schedule="tree", merges=job.world))


def attention_rows(job: Job, schedule: str, layout: str, causal: bool) -> list[Row]:
    """Ring / allgather: q, k, v sharded alike along the sequence; GQA 4 query / 2 kv heads."""
    import splitsoftmax as ss
    s = 19 * job.world + 3
    q, k, v = job.randn(1, 4, s, 32, seed=2), job.randn(1, 2, s, 32, seed=3), job.randn(1, 2, s, 32, seed=4)
    split, gather = job.zigzag(2) if layout == "zigzag" else job.contiguous(uneven_lengths(s, job.world), 2)
    sh = Sharding([split] * 3, [gather] * 3, split, gather)
    name = f"sharded_attention GQA 4/2 S={s}{' causal' if causal else ''}"
    return compare(name, lambda q, k, v: ss.sharded_attention(q, k, v, causal=causal, group=job.group,
                                                              schedule=schedule, layout=layout),
                   sdpa(causal, 2), lambda q, k, v: ref.attention(q, k, v, causal=causal)[0], [q, k, v],
                   sharding=sh, schedule=schedule, layout=layout, merges=job.world)


def tree_rows(job: Job, causal: bool) -> list[Row]:
    """Split-KV: q (3 queries) on every rank, k/v in unequal contiguous shards; causal is bottom-right."""
    import splitsoftmax as ss
    sk = 23 * job.world + 2
    q, k, v = job.randn(2, 4, 3, 32, seed=5), job.randn(2, 1, sk, 32, seed=6), job.randn(2, 1, sk, 32, seed=7)
    split, gather = job.contiguous(uneven_lengths(sk, job.world), 2)
    same = lambda t: t  # noqa: E731
    sh = Sharding([same, split, split], [same, gather, gather], same, same)
    diag = sk - q.shape[2]

    def peer(q, k, v):
        mask = torch.ones(q.shape[2], sk, dtype=torch.bool, device=q.device).tril(diag) if causal else None
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask)
    return compare(f"sharded_attention decode MQA 4/1 Sk={sk}{' causal' if causal else ''}",
                   lambda q, k, v: ss.sharded_attention(q, k, v, causal=causal, group=job.group, schedule="tree"),
                   peer, lambda q, k, v: ref.attention(q, k, v, causal=causal, diag=diag)[0], [q, k, v],
                   sharding=sh, schedule="tree", layout="contiguous", merges=job.world)


def cross_entropy_rows(job: Job) -> list[Row]:
    """Vocabulary-sharded cross-entropy (uneven slices, label smoothing, an ignored row), per row."""
    import splitsoftmax as ss
    n, v = 8, 11 * job.world + 4
    logits = job.randn(n, v, seed=8, scale=3.0)
    target = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(9)).to(job.device)
    target[1] = -100
    split, gather = job.contiguous(uneven_lengths(v, job.world), 1)
    replicated = Sharding([split], [gather], lambda t: t, lambda t: t)
    kw = dict(reduction="none", label_smoothing=0.1)

    def torch_ce(t):
        return torch.nn.functional.cross_entropy(t, target, **kw)
    return compare(f"sharded_cross_entropy {n}xV smoothing 0.1",
                   lambda t: ss.sharded_cross_entropy(t, target, group=job.group, **kw), torch_ce, torch_ce,
                   [logits], sharding=replicated, layout="contiguous", schedule="tree", merges=job.world)


def vocab_rows(job: Job) -> list[Row]:
    """Vocabulary-sharded log-probabilities + entropy, entropy, KL (uneven slices, an all -inf row,
    an ignored row, a temperature), per row, against torch's log_softmax on one device."""
    import splitsoftmax as ss
    from ..bench.vocab import torch_kl, torch_stats
    n, v = 8, 13 * job.world + 3
    p, q = job.randn(n, v, seed=10, scale=3.0), job.randn(n, v, seed=11, scale=3.0)
    p[2], q[2] = float("-inf"), float("-inf")
    target = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(12)).to(job.device)
    target[1] = -100
    split, gather = job.contiguous(uneven_lengths(v, job.world), 1)
    one, two = (Sharding([split] * k, [gather] * k, lambda t: t, lambda t: t) for k in (1, 2))
    g, kw = job.group, dict(sharding=one, layout="contiguous", schedule="tree", merges=job.world)
    both = lambda f: lambda *a: torch.stack(f(*a), -1)  # noqa: E731
    return (compare(f"sharded_logprobs+entropy {n}xV T=0.8",
                    both(lambda t: ss.sharded_logprobs(t, target, temperature=0.8, return_entropy=True, group=g)),
                    both(lambda t: torch_stats(t, target, 0.8)),
                    both(lambda t: ref.vocab_stats(t, target, temperature=0.8)), [p], **kw)
            + compare(f"sharded_entropy {n}xV", lambda t: ss.sharded_entropy(t, group=g),
                      lambda t: torch_stats(t, target * 0)[1], lambda t: ref.vocab_stats(t, target * 0)[1], [p], **kw)
            + compare(f"sharded_kl_div {n}xV T=1.5", lambda a, b: ss.sharded_kl_div(a, b, temperature=1.5, group=g),
                      lambda a, b: torch_kl(a, b, 1.5), lambda a, b: ref.kl_div(a, b, temperature=1.5), [p, q],
                      **dict(kw, sharding=two)))


def selection_rows(job: Job) -> list[Row]:
    """Vocabulary-sharded top-k and sampling (uneven slices, ties, an all -inf row), which must
    equal the single-device twin exactly: the error is the count of entries that differ."""
    import time

    import splitsoftmax as ss
    n, v = 8, 13 * job.world + 3
    x = job.randn(n, v, seed=13, scale=3.0).float()
    x[2] = float("-inf")
    x[3, 5:9] = x[3].max()  # (ties at the top)
    mine = job.narrow(uneven_lengths(v, job.world), 1)(x)
    seed, offset = torch.arange(n, device=job.device), torch.arange(n, device=job.device) * 7
    rows = []
    for name, kw in [("greedy", dict(temperature=0.0)), ("T=0.8 top-k 7 top-p 0.9", dict(temperature=0.8, top_k=7,
                                                                                         top_p=0.9)),
                     ("min-p 0.05", dict(min_p=0.05)), ("plain", {})]:
        start = time.perf_counter()
        got = ss.sharded_sample(mine, seed=seed, offset=offset, group=job.group, **kw)
        seconds = time.perf_counter() - start
        bad = int((got != ss.sample(x, seed=seed, offset=offset, **kw)).sum())
        rows.append(Row(f"sharded_sample {n}xV {name}", "tree", "contiguous", float(bad), 0.0, seconds))
    start = time.perf_counter()
    values, idx = ss.sharded_topk(mine, 5, group=job.group)
    seconds = time.perf_counter() - start
    want_v, want_i = ss.topk(x, 5)
    bad = int((idx != want_i).sum()) + int(((values != want_v) & ~(values.isinf() & want_v.isinf())).sum())
    return rows + [Row(f"sharded_topk {n}xV k=5", "tree", "contiguous", float(bad), 0.0, seconds)]


def cases(job: Job) -> list[tuple[str, Callable[[], list[Row]]]]:
    out = [("softmax family", lambda: softmax_rows(job)), ("cross-entropy", lambda: cross_entropy_rows(job)),
           ("vocabulary statistics", lambda: vocab_rows(job)), ("top-k and sampling", lambda: selection_rows(job))]
    for schedule in ("ring", "allgather"):
        for layout in ("contiguous", "zigzag"):
            for causal in (False, True):
                out.append((f"attention {schedule} {layout}{' causal' if causal else ''}",
                            lambda s=schedule, l=layout, c=causal: attention_rows(job, s, l, c)))
    out += [(f"attention tree{' causal' if c else ''}", lambda c=c: tree_rows(job, c)) for c in (False, True)]
    return out + verify_variants.cases(job)


def sharded_rows(job: Job) -> list[Row]:
    """Run every case, printing progress on rank 0's stderr."""
    rows = []
    todo = cases(job)
    for i, (title, run) in enumerate(todo, 1):
        if job.rank == 0:
            print(f"[{i}/{len(todo)}] {title} on {job.world} ranks ({job.device.type})", file=sys.stderr, flush=True)
        rows += run()
    return rows
