"""Probe: ``ss.sample`` time per ``sampling_config`` setting, at the bench's shapes.

    PYTHONPATH=. python3 benchmarks/probes/sampling_configs.py OUTDIR [--batches 1,256] [--filters F:F...]
        [--no-profile] [NAME ...]

V = 128256 float32 logits (``randn * 2``, as ``bench vocab``), batch 1 and 256, seeds and offsets as
device tensors; each filter of the bench timed eager and replayed from a CUDA graph (``bench.best_ms``,
L2 flushed between calls), for each named setting of ``SETTINGS`` (all by default). The kernels of
every setting are compiled first in one process per setting (Triton's cache is shared), then timed
one after another in this process, after the device time of each pass under the first setting
(unless ``--no-profile``). Every setting's tokens are checked equal to the first's (``!`` marks a
difference). Prints a table last (``graph/eager`` us per batch and filter) and writes
OUTDIR/sampling_configs.json.

Backs ``ops/sampling/config.py``'s settings (``TILE``, ``WARPS``, ``STAGES``, ``PROGRAMS_PER_SM``,
``FEW_ROWS``, ``FEW_ROWS_TILE``, ``FEW_ROWS_MERGE``) and ``configs.SAMPLE_TILE``.
"""
import json
import os
import subprocess
import sys

import torch

import splitsoftmax as ss
from splitsoftmax.tools.bench import best_ms, graph_ms
from splitsoftmax.ops.sampling import config as sc

V = 128256
BATCHES = (1, 256)
FILTERS = {"plain": {}, "top_k=50": dict(top_k=50), "top_p=0.9": dict(top_p=0.9),
           "top_k=50,top_p=0.9": dict(top_k=50, top_p=0.9), "min_p=0.1": dict(min_p=0.1),
           "greedy": dict(temperature=0.0)}
SETTINGS = {
    "base": {},
    "pps4": dict(PROGRAMS_PER_SM=4),
    "pps8": dict(PROGRAMS_PER_SM=8),
    "w4": dict(WARPS=4),
    "w4t512": dict(WARPS=4, TILE=512),
    "w4t512pps4": dict(WARPS=4, TILE=512, PROGRAMS_PER_SM=4),
    "t512": dict(TILE=512),
    "t256": dict(TILE=256),
    "t2048": dict(TILE=2048),
    "merge1024": dict(MERGE_MAX=1024),
    "merge4096": dict(MERGE_MAX=4096),
    "t256merge1024": dict(TILE=256, MERGE_MAX=1024),
    "stages2": dict(STAGES=2),
    "few0": dict(FEW_ROWS=0),
    "few64": dict(FEW_ROWS=64),
    "fm512": dict(FEW_ROWS_MERGE=512),
    "fm2048": dict(FEW_ROWS_MERGE=2048),
    "fm4096": dict(FEW_ROWS_MERGE=4096),
    "ft128": dict(FEW_ROWS_TILE=128),
    "ft512": dict(FEW_ROWS_TILE=512),
    "ft128fm2048": dict(FEW_ROWS_TILE=128, FEW_ROWS_MERGE=2048),
}


def _apply(name):
    for k, v in SETTINGS[name].items():
        setattr(sc, k, v)


def _inputs(b):
    g = torch.Generator(device="cuda").manual_seed(b)
    x = torch.randn(b, V, device="cuda", generator=g) * 2
    return x, torch.arange(b, device="cuda", dtype=torch.int64), torch.zeros(b, device="cuda", dtype=torch.int64)


def warm(name):
    _apply(name)
    for b in BATCHES:
        x, seeds, offsets = _inputs(b)
        for kw in FILTERS.values():
            ss.sample(x, seed=seeds, offset=offsets, **kw)
    torch.cuda.synchronize()


def time_all(names):
    base = {}
    rows = []
    for name in names:
        _apply(name)
        for b in BATCHES:
            x, seeds, offsets = _inputs(b)
            for f, kw in FILTERS.items():
                fn = lambda: ss.sample(x, seed=seeds, offset=offsets, **kw)  # noqa: E731
                try:
                    tok = fn()
                    same = bool(torch.equal(tok, base.setdefault((b, f), tok)))
                    eager = best_ms(fn) * 1e3
                    graph = graph_ms(fn) * 1e3
                except Exception as e:  # noqa: BLE001  (a setting that fails is recorded, the rest go on)
                    rows.append({"setting": name, "batch": b, "filter": f, "error": f"{type(e).__name__}: {e}"[:400]})
                    print(f"{name:14s} {b:4d} {f:20s} FAILED {rows[-1]['error']}", flush=True)
                    continue
                rows.append({"setting": name, "batch": b, "filter": f, "eager_us": eager, "graph_us": graph,
                             "same_tokens": same})
                print(f"{name:14s} {b:4d} {f:20s} {eager:8.1f} {graph:8.1f} {same}", flush=True)
        for k in SETTINGS[name]:
            setattr(sc, k, DEFAULTS[k])
    return rows


DEFAULTS = {k: getattr(sc, k) for s in SETTINGS.values() for k in s}


def kernel_times(name):
    """The torch profiler's device time per kernel of a draw under setting ``name``, per batch and
    filter (averaged over 20 draws, L2 flushed before each, as ``do_bench`` does)."""
    from torch.profiler import ProfilerActivity, profile
    _apply(name)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    out = {}
    for b in BATCHES:
        x, seeds, offsets = _inputs(b)
        for f, kw in FILTERS.items():
            fn = lambda: ss.sample(x, seed=seeds, offset=offsets, **kw)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(20):
                    flush.zero_()
                    fn()
                torch.cuda.synchronize()
            ev = [(e.key[:48], round(e.device_time_total / 20, 1)) for e in p.key_averages()
                  if e.device_time_total > 0 and "elementwise" not in e.key and "fill" not in e.key]
            out[f"{b} {f}"] = ev
            print(f"kernels {b:4d} {f:20s} " + "; ".join(f"{k} {t}" for k, t in ev), flush=True)
    for k in SETTINGS[name]:
        setattr(sc, k, DEFAULTS[k])
    return out


def _options(argv):
    """``--batches`` (commas) and ``--filters`` (colons) taken out of ``argv``, into the module's tables."""
    global BATCHES, FILTERS
    rest = [a for a in argv if a != "--no-profile"]
    for flag in ("--batches", "--filters"):
        if flag in rest:
            i = rest.index(flag)
            value = rest[i + 1]
            del rest[i:i + 2]
            if flag == "--batches":
                BATCHES = tuple(int(b) for b in value.split(","))
            else:
                FILTERS = {f: FILTERS[f] for f in value.split(":")}
    return rest


def main():
    argv = _options(sys.argv[1:])
    out = argv[0]
    if len(argv) > 1 and argv[1] == "--warm":
        warm(argv[2])
        return
    names = argv[1:] or list(SETTINGS)
    opts = [a for f in ("--batches", "--filters") if f in sys.argv for a in (f, sys.argv[sys.argv.index(f) + 1])]
    procs = [subprocess.Popen([sys.executable, __file__, out, "--warm", n, *opts]) for n in names]
    for p in procs:
        p.wait()
    prof = kernel_times(names[0]) if "--no-profile" not in sys.argv else {}
    rows = time_all(names)
    json.dump({"rows": rows, "kernels": prof}, open(os.path.join(out, "sampling_configs.json"), "w"), indent=1)
    print(f"\n{'setting':14s} " + " ".join(f"b{b}:{f[:12]:>12s}" for b in BATCHES for f in FILTERS))
    by = {(r["setting"], r["batch"], r["filter"]): r for r in rows}
    for name in names:
        cells = []
        for b in BATCHES:
            for f in FILTERS:
                r = by.get((name, b, f), {})
                cells.append(f"{r['graph_us']:>6.1f}/{r['eager_us']:>6.1f}{'' if r['same_tokens'] else '!'}"
                             if "graph_us" in r else f"{'err':>16s}")
        print(f"{name:14s} " + " ".join(cells))


if __name__ == "__main__":
    main()
