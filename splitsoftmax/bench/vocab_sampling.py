"""Sampling part of ``bench vocab``: ``ss.sample`` against torch's sort-based samplers on one GPU.

``python -m splitsoftmax.bench.vocab_sampling --out DIR`` (``bench vocab`` calls :func:`run`):

1. Gate: the CUDA tokens equal the CPU path's bit for bit (the draw does not depend on the device)
   for every filter on rows of a 50k vocabulary with ties, masked and NaN rows; greedy equals
   ``torch.argmax``.
2. Timing at batch 1, 32 and 256 over V = 128256 float32 logits (``randn * 2``): plain sampling,
   top-k 50, top-p 0.9, top-k 50 + top-p 0.9, min-p 0.1 and greedy, for ss eager and replayed from
   a CUDA graph (seeds and offsets as device tensors), beside torch in the same run: multinomial of
   the softmax, ``torch.topk``, and top-p by a full sort + cumsum (the ``transformers`` /
   vLLM fallback way), eager and from a graph.

Writes ``vocab_sampling.json`` to ``--out`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import splitsoftmax as ss
from splitsoftmax.bench import best_ms, graph_ms

VOCAB = 128256
BATCHES = (1, 32, 256)
FILTERS = {"plain": {}, "top_k=50": dict(top_k=50), "top_p=0.9": dict(top_p=0.9),
           "top_k=50,top_p=0.9": dict(top_k=50, top_p=0.9), "min_p=0.1": dict(min_p=0.1),
           "greedy": dict(temperature=0.0)}


def _top_p_sorted(vals: torch.Tensor, idx: torch.Tensor, p: float) -> torch.Tensor:
    """Top-p on logits sorted descending (the crossing token kept), one draw per row."""
    probs = vals.softmax(dim=-1)
    remove = probs.cumsum(dim=-1) - probs > p
    pick = torch.multinomial(vals.masked_fill(remove, float("-inf")).softmax(dim=-1), 1)
    return idx.gather(-1, pick)[:, 0]


def torch_sampler(name: str):
    """The torch way of each filter (what sampling loops do without a fused kernel)."""
    kw = FILTERS[name]
    if name == "greedy":
        return lambda x: x.argmax(dim=-1)
    if name == "plain":
        return lambda x: torch.multinomial(x.softmax(dim=-1), 1)[:, 0]
    if name == "min_p=0.1":
        def min_p(x):
            probs = x.softmax(dim=-1)
            keep = probs >= kw["min_p"] * probs.amax(dim=-1, keepdim=True)
            return torch.multinomial(torch.where(keep, probs, 0.0), 1)[:, 0]
        return min_p
    if "top_k" in kw and "top_p" not in kw:
        def top_k(x):
            vals, idx = torch.topk(x, kw["top_k"], dim=-1)
            return idx.gather(-1, torch.multinomial(vals.softmax(dim=-1), 1))[:, 0]
        return top_k
    if "top_k" in kw:
        return lambda x: _top_p_sorted(*torch.topk(x, kw["top_k"], dim=-1), kw["top_p"])
    return lambda x: _top_p_sorted(*torch.sort(x, dim=-1, descending=True), kw["top_p"])


def gate() -> list:
    """CUDA tokens against the CPU path's, and greedy against torch.argmax."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 50000, generator=g) * 3
    x[1, 20000:] = float("-inf")
    x[2] = float("-inf")
    x[3, 17] = float("nan")
    x[4] = torch.round(x[4])
    seeds = torch.arange(16) * 7919
    rows = []
    for name, kw in FILTERS.items():
        cpu = ss.sample(x, seed=seeds, offset=5, **kw)
        cuda = ss.sample(x.cuda(), seed=seeds.cuda(), offset=5, **kw).cpu()
        ok = torch.equal(cpu, cuda)
        if name == "greedy":
            ok = ok and torch.equal(cuda[5:], x[5:].argmax(dim=-1))
        rows.append({"filter": name, "ok": ok, "cpu": cpu.tolist(), "cuda": cuda.tolist()})
    return rows


def _time(fn) -> tuple[float, float]:
    """(eager us, CUDA graph replay us)."""
    eager = best_ms(fn) * 1e3
    try:
        graph = graph_ms(fn) * 1e3
    except RuntimeError:          # a peer that cannot be captured
        graph = float("nan")
    return eager, graph


def run_bench() -> list:
    results = []
    for b in BATCHES:
        x = torch.randn(b, VOCAB, device="cuda") * 2
        seeds = torch.arange(b, device="cuda", dtype=torch.int64)
        offsets = torch.zeros(b, device="cuda", dtype=torch.int64)
        for name, kw in FILTERS.items():
            peer = torch_sampler(name)
            t_eager, t_graph = _time(lambda: peer(x))
            results.append({"batch": b, "filter": name, "impl": "torch", "eager_us": t_eager, "graph_us": t_graph})
            mine = lambda: ss.sample(x, seed=seeds, offset=offsets, **kw)  # noqa: E731
            s_eager, s_graph = _time(mine)
            results.append({"batch": b, "filter": name, "impl": "ss", "eager_us": s_eager, "graph_us": s_graph})
    return results


def table(gate_rows: list, results: list) -> str:
    lines = ["gate (CUDA tokens == CPU tokens): " + ", ".join(f"{r['filter']} {r['ok']}" for r in gate_rows),
             f"V={VOCAB} fp32: batch, filter, torch eager/graph us, ss eager/graph us, speed-up eager/graph"]
    peer = {(r["batch"], r["filter"]): r for r in results if r["impl"] == "torch"}
    for r in results:
        if r["impl"] != "ss":
            continue
        t = peer[(r["batch"], r["filter"])]
        lines.append(f"  {r['batch']:4} {r['filter']:20} {t['eager_us']:8.1f} {t['graph_us']:8.1f} "
                     f"{r['eager_us']:8.1f} {r['graph_us']:8.1f} {t['eager_us'] / r['eager_us']:6.2f}x "
                     f"{t['graph_us'] / r['graph_us']:6.2f}x")
    return "\n".join(lines)


def run(out: str) -> bool:
    """Gate, timings, ``vocab_sampling.json`` in ``out`` and the table; whether the gate passed."""
    os.makedirs(out, exist_ok=True)
    gate_rows = gate()
    results = run_bench()
    import triton
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with open(os.path.join(out, "vocab_sampling.json"), "w") as f:
        json.dump({"meta": meta, "gate": gate_rows, "results": results}, f, indent=1)
    print(json.dumps(meta))
    print(table(gate_rows, results))
    return all(r["ok"] for r in gate_rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="splitsoftmax bench vocab_sampling", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="folder for vocab_sampling.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench vocab_sampling needs a CUDA device", file=sys.stderr)
        return 2
    return 0 if run(args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
