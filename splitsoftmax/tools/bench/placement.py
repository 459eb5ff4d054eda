"""``python -m splitsoftmax bench placement``: what one rank's share of packed documents costs under
each placement, from 16 to 1024 ranks, measured on one GPU.

A sharded call's compute on rank ``r`` is the local op run on the pieces of ``r``'s plan
(``distributed.plan.make_plan``): its queries against the keys each step brings, one launch per
piece. That work depends only on the placement, not on the transport, so one GPU can run any rank's
share of a job of any size: this bench builds rank ``r``'s plan for ``P`` ranks and runs the ring's
own visits (``schedules/ring.py``, which the all-gather shares) on random buffers of the plan's
sizes. The most loaded rank sets the step time (the others wait for it): its time against the whole
pack on one GPU divided by ``P`` is the placement's compute efficiency, before any transfer.

Packs (1M tokens by default, ``--tokens``): ``published``, the documents of the first pack of
MagiAttention's published benchmark (``planning.validation.published_packs``: 5 tokens to a quarter
of the pack), and ``uniform``, lengths uniform in 256-32k tokens (seed 0), the last one cut to fit.
Placements: ``zigzag`` (every document cut into ``2P`` chunks, chunks ``r`` and ``2P-1-r`` on rank
``r``) and ``balanced`` (short documents whole on one rank, long ones zigzagged). Ranks timed: the
most and the least loaded by causal pairs and the median one (every rank where ``P`` <= 16).

Shapes: Llama-3-8B's attention (B 1, H 32, Hkv 8, D 128, bf16), causal within each document.
A step's pieces by rows are cut as the sharded calls cut them (``--min-gap``, ``--max-row-pieces``:
others to compare; ``--max-row-pieces 1``: one span over the rows that see keys); each rank's
``piece_rows`` counts the rows its pieces walk, summed over the steps.
Times per rank: ``eager`` (CUDA events around the rank's calls, launches included: host time shows
where a rank's pieces are many and small) and ``graph`` (the same calls replayed from a CUDA graph:
the device time alone), forward and forward+backward, medians. It runs in one process and writes
``placement.json`` to ``--out`` after every rank timed (``complete`` false until the end), then
prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch

import splitsoftmax as ss
from splitsoftmax.distributed import plan as pl
from splitsoftmax.distributed.attn_meta import Keywords
from splitsoftmax.distributed.layout import causal_work, segments, shard_lengths
from splitsoftmax.distributed.work import AttnSpec, Planned, nrows
from splitsoftmax.ops._triton import configs
from splitsoftmax.ops.attention.schedules.ring import attn_bwd_visit, attn_fwd_visit, dq_of, state_of
from splitsoftmax.planning.validation import published_packs
from splitsoftmax.tools.bench import best_ms, graph_ms

LAYOUTS = ("zigzag", "balanced")


def uniform_pack(total: int, lo: int = 256, hi: int = 32768, seed: int = 0) -> tuple:
    """Document lengths uniform in ``[lo, hi]`` laid end to end up to ``total`` tokens (the last cut)."""
    rng, out, at = random.Random(seed), [], 0
    while at < total:
        n = min(rng.randint(lo, hi), total - at)
        out.append(n)
        at += n
    return tuple(out)


def boundaries(lengths: Sequence[int]) -> tuple:
    """``cu_seqlens`` of documents of ``lengths``, as host ints."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def rank_pairs(layout: str, lens: list, docs: tuple, p: int) -> list:
    """Each rank's causal (query, key) pairs: per run of a segment within one document, its rows
    against the keys before them in their document."""
    out = []
    for r in range(p):
        total = 0
        for g, n, start, _ in pl.doc_runs(segments(layout, lens, r, docs), docs):
            total += causal_work(g - start + n) - causal_work(g - start)
        out.append(total)
    return out


def chosen_ranks(pairs: list) -> list:
    """The ranks to time: all of them up to 4, else the most and least loaded and the median."""
    p = len(pairs)
    if p <= 4:
        return list(range(p))
    order = sorted(range(p), key=lambda r: pairs[r])
    return sorted({order[-1], order[0], order[p // 2]})


class RankWork:
    """Rank ``rank``'s share of one sharded causal call over documents ``docs`` on ``p`` ranks:
    its plan, random buffers of its sizes, and its forward (and backward) as the ring's visits."""

    def __init__(self, layout: str, docs: tuple, p: int, rank: int, opts, device):
        lens = shard_lengths(docs[-1], p, layout, docs)
        plan = pl.make_plan(rank, lens, lens, layout, True, docs, min_gap=opts.min_gap, max_rows=opts.max_row_pieces)
        self.spec = AttnSpec(b=1, h=opts.heads, hkv=opts.kv_heads, d=opts.dim, dv=opts.dim,
                             scale=opts.dim ** -0.5, causal=True, layout=layout, q_lens=lens, k_lens=lens,
                             rank=rank, kw=Keywords(docs=docs), planned=Planned(plan))
        self.steps = [s for s in range(p) if plan.pieces[s]]
        self.launches = sum(len(plan.pieces[s]) for s in range(p))
        self.piece_rows = sum(pc.nq for s in range(p) for pc in plan.pieces[s])  # rows the kernels walk
        n, most = lens[rank], max([nrows(plan.keys[s]) for s in self.steps] or [0])
        gen = torch.Generator(device=device).manual_seed(rank)

        def rand(h, m):
            return torch.randn(1, h, m, opts.dim, generator=gen, device=device, dtype=opts.dtype)
        self.q, self.dout = rand(opts.heads, n), rand(opts.heads, n)
        self.k, self.v = rand(opts.kv_heads, most), rand(opts.kv_heads, most)
        self.rows = {s: nrows(plan.keys[s]) for s in self.steps}
        self.lse = self.delta = None

    def kv(self, s: int) -> tuple:
        m = self.rows[s]
        return self.k[:, :, :m], self.v[:, :, :m]

    def forward(self):
        acc = [None]
        visit = attn_fwd_visit(self.spec, self.q, acc)
        for s in self.steps:
            visit(s, *self.kv(s))
        return state_of(acc, self.spec, self.q)

    def prepare_backward(self) -> None:
        out, lse = self.forward()
        self.lse = lse
        self.delta = (out * self.dout.float()).sum(-1)

    def backward(self):
        dq = [None]
        visit = attn_bwd_visit(self.spec, self.q, self.dout, self.lse, self.delta, dq)
        grads = [visit(s, *self.kv(s)) for s in self.steps]
        return dq_of(dq, self.q), grads

    def fwd_bwd(self):
        self.forward()
        return self.backward()


def whole_pack(docs: tuple, opts, device) -> tuple:
    """The whole pack on one GPU (``ss.attention`` over the documents): ``(forward, forward+backward)``
    callables."""
    gen = torch.Generator(device=device).manual_seed(1)
    s = docs[-1]

    def rand(h, grad):
        return torch.randn(1, h, s, opts.dim, generator=gen, device=device, dtype=opts.dtype).requires_grad_(grad)
    q, k, v = rand(opts.heads, True), rand(opts.kv_heads, True), rand(opts.kv_heads, True)
    cu = torch.tensor(docs, dtype=torch.int32, device=device)
    dout = torch.randn(1, opts.heads, s, opts.dim, generator=gen, device=device, dtype=opts.dtype)

    def fwd():
        with torch.no_grad():
            return ss.attention(q, k, v, causal=True, cu_seqlens=cu)

    def fwd_bwd():
        out = ss.attention(q, k, v, causal=True, cu_seqlens=cu)
        return torch.autograd.grad(out, (q, k, v), dout)
    return fwd, fwd_bwd


def timed(fn: Callable, cuda: bool, graph: bool, rep: int) -> float:
    """Median ms of ``fn`` on CUDA: eager (launches included) or replayed from a CUDA graph (device
    time)."""
    if not cuda:  # toy sizes: one run after a warm-up
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return graph_ms(fn, rep=rep) if graph else best_ms(fn, rep=rep)


def bench_pack(name: str, lengths: tuple, opts, device, rows: list, save: Callable[[], None]) -> None:
    """Append to ``rows`` one pack's: the whole pack on one GPU, then per ``P`` and placement the
    timed ranks; ``save()`` after each row (a run stopped early keeps what it measured)."""
    docs, cuda = boundaries(lengths), device.type == "cuda"
    fwd, fwd_bwd = whole_pack(docs, opts, device)
    one = {"fwd": timed(fwd, cuda, False, opts.rep), "fwd+bwd": timed(fwd_bwd, cuda, False, opts.rep)}
    print(f"{name}: {len(lengths)} documents, {docs[-1]} tokens; one GPU fwd {one['fwd']:.2f} ms, "
          f"fwd+bwd {one['fwd+bwd']:.2f} ms", file=sys.stderr, flush=True)
    rows.append({"pack": name, "P": 1, "layout": "one GPU", "docs": len(lengths), "tokens": docs[-1], **one})
    save()
    for p in opts.ranks:
        for layout in LAYOUTS:
            lens = shard_lengths(docs[-1], p, layout, docs)
            pairs = rank_pairs(layout, lens, docs, p)
            mean = statistics.fmean(pairs)
            for r in chosen_ranks(pairs):
                t0 = time.perf_counter()
                work = RankWork(layout, docs, p, r, opts, device)
                plan_s = time.perf_counter() - t0
                work.prepare_backward()
                row = {"pack": name, "P": p, "layout": layout, "rank": r, "pairs": pairs[r],
                       "pairs_vs_mean": pairs[r] / mean, "rows": lens[r], "launches_fwd": work.launches,
                       "piece_rows": work.piece_rows,
                       "steps": len(work.steps), "plan_s": plan_s}
                for mode, fn in (("fwd", work.forward), ("fwd+bwd", work.fwd_bwd)):
                    row[mode] = timed(fn, cuda, False, opts.rep)
                    if cuda:
                        try:
                            row[f"{mode}_graph"] = timed(fn, cuda, True, opts.rep)
                        except RuntimeError as e:  # recorded: the summary then has no graph column
                            row[f"{mode}_graph_error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                save()
                print(f"  P={p} {layout} rank {r}: pairs/mean {row['pairs_vs_mean']:.3f}, {work.launches} launches, "
                      f"fwd {row['fwd']:.3f} ms, fwd+bwd {row['fwd+bwd']:.3f} ms", file=sys.stderr, flush=True)
                del work


def summary(rows: list) -> list:
    """Per pack, ``P`` and placement: the slowest timed rank against the whole pack's one-GPU time
    over ``P`` (compute efficiency before transfers), eager and graph."""
    ones = {r["pack"]: r for r in rows if r["P"] == 1}
    out = []
    keys = sorted({(r["pack"], r["P"], r["layout"]) for r in rows if r["P"] > 1}, key=lambda k: (k[0], k[1], k[2]))
    for pack, p, layout in keys:
        mine = [r for r in rows if (r["pack"], r["P"], r["layout"]) == (pack, p, layout)]
        line = {"pack": pack, "P": p, "layout": layout,
                "max_pairs_vs_mean": max(r["pairs_vs_mean"] for r in mine),
                "max_launches": max(r["launches_fwd"] for r in mine)}
        for mode in ("fwd", "fwd+bwd"):
            for suffix in ("", "_graph"):
                key = mode + suffix
                if all(key in r for r in mine):
                    slowest = max(r[key] for r in mine)
                    line[key + "_slowest_ms"] = slowest
                    line[key + "_efficiency"] = ones[pack][mode] / (p * slowest)
        out.append(line)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="splitsoftmax bench placement", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out", help="folder for placement.json")
    ap.add_argument("--tokens", type=int, default=1 << 20, help="tokens in a pack (default 1M)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256, 1024], help="rank counts P")
    ap.add_argument("--packs", nargs="+", default=["published", "uniform"], choices=("published", "uniform"))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rep", type=int, default=20, help="timing budget per measurement (ms, do_bench's rep)")
    ap.add_argument("--min-gap", type=int, default=configs.ATTN_PLAN_MIN_GAP,
                    help="rows that see nothing in a step, at least this many between two runs that do, cut its "
                         "pieces by rows (default: the sharded calls', configs.ATTN_PLAN_MIN_GAP)")
    ap.add_argument("--max-row-pieces", type=int, default=pl.MAX_ROW_PIECES,
                    help="pieces by rows of a step at most (default: plan.MAX_ROW_PIECES; 1: one span over the rows that see keys)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu (toy sizes only)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    opts.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    packs = {"published": lambda: published_packs(opts.tokens, 1)[0], "uniform": lambda: uniform_pack(opts.tokens)}
    os.makedirs(opts.out, exist_ok=True)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "shape": {"H": opts.heads, "Hkv": opts.kv_heads, "D": opts.dim, "dtype": str(opts.dtype)},
            "argv": list(sys.argv[1:] if argv is None else argv),
            "plan": {"min_gap": opts.min_gap, "max_row_pieces": opts.max_row_pieces}}
    rows: list = []

    def save(complete: bool = False) -> list:
        lines = summary(rows)
        with open(os.path.join(opts.out, "placement.json"), "w") as f:
            json.dump({"meta": meta, "complete": complete, "rows": rows, "summary": lines}, f, indent=1)
        return lines
    for name in opts.packs:
        bench_pack(name, packs[name](), opts, device, rows, save)
    lines = save(complete=True)
    print(f"{'pack':<10} {'P':>5} {'layout':<9} {'max/mean':>8} {'launches':>8} "
          f"{'fwd eff':>8} {'f+b eff':>8} {'fwd dev':>8} {'f+b dev':>8}")
    for ln in lines:
        def pct(key):
            return f"{100 * ln[key]:7.1f}%" if key in ln else f"{'-':>8}"
        print(f"{ln['pack']:<10} {ln['P']:>5} {ln['layout']:<9} {ln['max_pairs_vs_mean']:8.3f} {ln['max_launches']:>8} "
              f"{pct('fwd_efficiency')} {pct('fwd+bwd_efficiency')} {pct('fwd_graph_efficiency')} "
              f"{pct('fwd+bwd_graph_efficiency')}")
    return 0
