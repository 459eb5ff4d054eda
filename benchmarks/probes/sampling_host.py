"""Probe: host time per ``ss.sample`` call at batch 1, and where it goes.

    PYTHONPATH=. python3 benchmarks/probes/sampling_host.py OUTDIR

V = 128256 float32 logits, batch 1, seeds and offsets as device tensors (as ``bench vocab``). Per
filter: host time (300 back-to-back calls with no synchronisation between them, divided by 300),
wall time of the same loop with the final synchronisation, and ``do_bench``'s eager time (L2
flushed between calls); the filters in order, then again in reverse order (host times that
depend on when they were taken show). Then cProfile over 300 calls of each filter, the 12
functions with the most own time, to OUTDIR/sampling_host.txt. Prints a table last.

Backs no setting: a diagnosis of the host time per draw.
"""
import cProfile
import io
import json
import os
import pstats
import sys

import torch

import splitsoftmax as ss
from splitsoftmax.tools.bench import best_ms
from splitsoftmax.tools.bench.host import per_call_us

V = 128256
FILTERS = {"plain": {}, "top_k=50": dict(top_k=50), "top_p=0.9": dict(top_p=0.9),
           "top_k=50,top_p=0.9": dict(top_k=50, top_p=0.9), "min_p=0.1": dict(min_p=0.1),
           "greedy": dict(temperature=0.0)}
CALLS = 300


def profile(fn) -> str:
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(CALLS):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    return buf.getvalue()


def main():
    out = sys.argv[1]
    x = torch.randn(1, V, device="cuda") * 2
    seeds = torch.zeros(1, device="cuda", dtype=torch.int64)
    offsets = torch.zeros(1, device="cuda", dtype=torch.int64)
    rows, text = [], []
    order = list(FILTERS)
    for rnd, names in enumerate((order, order[::-1])):
        for name in names:
            fn = lambda: ss.sample(x, seed=seeds, offset=offsets, **FILTERS[name])  # noqa: E731
            for _ in range(20):
                fn()
            host, wall = min(per_call_us(fn, CALLS) for _ in range(3))
            eager = best_ms(fn) * 1e3
            rows.append({"round": rnd, "filter": name, "host_us": host, "wall_us": wall, "eager_us": eager})
            if rnd == 0:
                text.append(f"==== {name}\n{profile(fn)}")
            print(f"{rnd} {name:20s} host {host:7.1f} wall {wall:7.1f} eager {eager:7.1f}", flush=True)
    with open(os.path.join(out, "sampling_host.txt"), "w") as f:
        f.write("\n".join(text))
    json.dump(rows, open(os.path.join(out, "sampling_host.json"), "w"), indent=1)
    print(f"\n{'filter':20s} {'host us':>8s} {'wall us':>8s} {'eager us':>8s}   (in order / in reverse)")
    by = {(r["round"], r["filter"]): r for r in rows}
    for name in order:
        a, b = by[0, name], by[1, name]
        print(f"{name:20s} " + " ".join(f"{a[k]:>5.1f}/{b[k]:<5.1f}" for k in ("host_us", "wall_us", "eager_us")))


if __name__ == "__main__":
    main()
