"""Sampling part of ``bench vocab``: ``ss.sample`` against torch's sort-based samplers on one GPU.

``python -m splitsoftmax bench vocab --parts sampling --out DIR`` (``PART``), or on its own
``python -m splitsoftmax.tools.bench.vocab_sampling --out DIR``:

1. Gate: the CUDA tokens equal the CPU path's bit for bit (the draw does not depend on the device)
   for every filter on rows of a 50k vocabulary with ties, masked and NaN rows; greedy equals
   ``torch.argmax``.
2. Timing at batch 1, 32 and 256 over V = 128256 float32 logits (``randn * 2``, seeded by the
   batch: a row's records, and so whether a filter is settled by them, depend on its logits): plain sampling,
   top-k 50, top-p 0.9, top-k 50 + top-p 0.9, min-p 0.1 and greedy, for ss eager and replayed from
   a CUDA graph (seeds and offsets as device tensors), beside torch in the same run: multinomial of
   the softmax, ``torch.topk``, and top-p by a full sort + cumsum (the ``transformers`` /
   vLLM fallback way), eager and from a graph.

Targets (one H200): top-p at batch 256 <= 200 us, any filter at batch 1 <= 40 us. Writes
``vocab_sampling.json`` (on its own) or the ``sampling`` entry of ``vocab.json``, a plot, a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import splitsoftmax as ss
from splitsoftmax.tools.bench import best_ms, graph_ms

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
        x = torch.randn(b, VOCAB, device="cuda", generator=torch.Generator("cuda").manual_seed(b)) * 2
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


TARGETS = {"top_p=0.9 at batch 256": (256, ("top_p=0.9",), 200.0),
           "every filter at batch 1": (1, tuple(FILTERS), 40.0)}


def _targets(results: list) -> dict:
    """Each target: the slowest ss time it covers, eager and from a graph, and whether it is met."""
    out = {}
    for name, (batch, filters, limit) in TARGETS.items():
        rows = [r for r in results if r["impl"] == "ss" and r["batch"] == batch and r["filter"] in filters]
        eager, graph = max(r["eager_us"] for r in rows), max(r["graph_us"] for r in rows)
        out[name] = {"limit_us": limit, "eager_us": eager, "graph_us": graph, "eager_met": eager <= limit,
                     "graph_met": graph <= limit}
    return out


def sampling_part(args=None) -> dict:
    gate_rows = gate()
    results = run_bench()
    return {"vocab": VOCAB, "gate": gate_rows, "results": results, "targets": _targets(results)}


def table_sampling(r: dict) -> str:
    lines = ["gate (CUDA tokens == CPU tokens): " + ", ".join(f"{g['filter']} {g['ok']}" for g in r["gate"]),
             f"sampling, V={r['vocab']} fp32: batch, filter, torch eager/graph us, ss eager/graph us, "
             f"speed-up eager/graph"]
    peer = {(x["batch"], x["filter"]): x for x in r["results"] if x["impl"] == "torch"}
    for x in r["results"]:
        if x["impl"] != "ss":
            continue
        t = peer[(x["batch"], x["filter"])]
        lines.append(f"  {x['batch']:4} {x['filter']:20} {t['eager_us']:8.1f} {t['graph_us']:8.1f} "
                     f"{x['eager_us']:8.1f} {x['graph_us']:8.1f} {t['eager_us'] / x['eager_us']:6.2f}x "
                     f"{t['graph_us'] / x['graph_us']:6.2f}x")
    lines += [f"  target {name}: <= {t['limit_us']:.0f} us: eager {t['eager_us']:.1f} ({t['eager_met']}), "
              f"graph {t['graph_us']:.1f} ({t['graph_met']})" for name, t in r["targets"].items()]
    return "\n".join(lines)


def plot_sampling(r: dict, path: str) -> bool:
    """Per batch, bars of torch and ss time per filter (eager and graph replay), log scale."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(BATCHES), figsize=(5 * len(BATCHES), 4.5), sharey=True)
    names = list(FILTERS)
    for ax, b in zip(axes, BATCHES):
        for i, (impl, key) in enumerate([("torch", "eager_us"), ("torch", "graph_us"), ("ss", "eager_us"),
                                         ("ss", "graph_us")]):
            vals = {x["filter"]: x[key] for x in r["results"] if x["batch"] == b and x["impl"] == impl}
            bars = ax.bar([j + 0.2 * i for j in range(len(names))], [vals[n] for n in names], 0.2,
                          label=f"{impl} {key.split('_')[0]}")
            ax.bar_label(bars, fmt="%.0f", fontsize=6)
        ax.set_xticks([j + 0.3 for j in range(len(names))], names, rotation=30, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"batch {b}")
    axes[0].set_ylabel("us")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"sampling over V = {r['vocab']} (float32)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def passed(r: dict) -> bool:
    return all(g["ok"] for g in r["gate"])


# the ``bench vocab`` part: (run(args), table(result), plot(result, path), passed(result))
PART = (sampling_part, table_sampling, plot_sampling, passed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m splitsoftmax.tools.bench.vocab_sampling",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="folder for vocab_sampling.json and the plot")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("the sampling bench needs a CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    r = sampling_part(args)
    import triton
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with open(os.path.join(args.out, "vocab_sampling.json"), "w") as f:
        json.dump({"meta": meta, "sampling": r}, f, indent=1)
    print(json.dumps(meta))
    print(table_sampling(r))
    plot_sampling(r, os.path.join(args.out, "vocab_sampling.png"))
    return 0 if passed(r) else 1


if __name__ == "__main__":
    sys.exit(main())
