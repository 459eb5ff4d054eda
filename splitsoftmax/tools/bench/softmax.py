"""Benchmark of the softmax family: torch.softmax / log_softmax / logsumexp beside splitsoftmax.

``python -m splitsoftmax bench softmax --out DIR``: the reference shapes and a sweep of row lengths,
correctness against float64 first (a few rows of every shape), then medians of
``triton.testing.do_bench``, through the public calls and (the reference shapes) replayed from a
CUDA graph, which leaves out the host's launch cost. GB/s counts the 2N elements softmax must move (N for logsumexp);
the device copy rate (read + write) is measured in the same run as the ceiling. Writes
``softmax.json`` and ``softmax.png`` (GB/s vs row length) to ``--out``, and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

import splitsoftmax as ss
from splitsoftmax.ops._triton import configs

from . import best_ms, graph_ms

PERF_SHAPES = [("4096x32768 fp32", 4096, 32768, torch.float32), ("16384x4096 fp32", 16384, 4096, torch.float32),
               ("512x262144 bf16", 512, 262144, torch.bfloat16), ("8x16M fp32", 8, 1 << 24, torch.float32),
               ("1x268M fp32", 1, 1 << 28, torch.float32)]
SWEEP_ELEMS = 1 << 27  # elements per sweep point (512 MB of fp32: far beyond L2)
OPS = {  # name: (torch, splitsoftmax, elements moved per input element)
    "softmax": (lambda x: torch.softmax(x, -1), ss.softmax, 2),
    "log_softmax": (lambda x: torch.log_softmax(x, -1), ss.log_softmax, 2),
    "logsumexp": (lambda x: torch.logsumexp(x, -1), ss.logsumexp, 1),
}
# Config variants timed beside the default on the reference shapes (tuning data for configs.py).
VARIANTS = {
    "two_pass": dict(one_pass_max_cols=8192, split_rows_per_sm=0.0),
    "split": dict(one_pass_max_cols=8192, split_rows_per_sm=1e9),
    "tile32k": dict(loop_tile_bytes=32768),
    "warp1024": dict(loop_elems_per_warp=1024),
    "warp512": dict(loop_elems_per_warp=512),
    "stages1": dict(loop_stages=1),
}


def copy_rates() -> dict:
    """Device copy (read + write) and read-only (sum) rates in GB/s on 1 GiB of float32."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    copy = 2 * nbytes / best_ms(lambda: dst.copy_(src)) / 1e6
    read = nbytes / best_ms(lambda: src.sum()) / 1e6
    return {"copy_gbs": copy, "read_gbs": read}


def check(x: torch.Tensor, name: str) -> float:
    """``max |ss - ref| / (|ref| + 1)`` on a few rows of ``x``, ``ref`` the float64 torch op
    (NaN when an output is NaN)."""
    idx = torch.unique(torch.linspace(0, x.shape[0] - 1, min(4, x.shape[0])).long()).to(x.device)
    got = OPS[name][1](x)[idx].double()
    ref = OPS[name][0](x[idx].double())
    if torch.isnan(got).any():
        return float("nan")
    return ((got - ref).abs() / (ref.abs() + 1)).max().item()


TOL = {"float32": 1e-5, "bfloat16": 2 ** -7}  # one ulp of the output dtype


def measure(label: str, rows: int, cols: int, dtype, variants: bool, graphs: bool = False) -> list[dict]:
    """Rows of results (one per op) for one shape: torch and splitsoftmax GB/s, error, variants;
    with ``graphs`` also both replayed from CUDA graphs."""
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    out = []
    for name, (tfn, sfn, moved) in OPS.items():
        gb = moved * x.numel() * x.element_size() / 1e9
        rec = {"shape": label, "rows": rows, "cols": cols, "dtype": str(dtype).split(".")[-1], "op": name,
               "max_err": check(x, name), "torch_gbs": gb / best_ms(lambda: tfn(x)) * 1e3,
               "ss_gbs": gb / best_ms(lambda: sfn(x)) * 1e3}
        if graphs:
            rec["torch_graph_gbs"] = gb / graph_ms(lambda: tfn(x)) * 1e3
            rec["ss_graph_gbs"] = gb / graph_ms(lambda: sfn(x)) * 1e3
        if variants and name != "log_softmax":
            for vname, over in VARIANTS.items():
                saved = configs.SOFTMAX
                configs.SOFTMAX = replace(saved, **over)
                try:
                    rec[f"ss_{vname}_gbs"] = gb / best_ms(lambda: sfn(x)) * 1e3
                finally:
                    configs.SOFTMAX = saved
        out.append(rec)
    del x
    torch.cuda.empty_cache()
    return out


def plot(results: list[dict], rates: dict, path: str) -> bool:
    """GB/s vs row length of the sweep, copy rate as the ceiling; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sweep = [r for r in results if r["shape"].startswith("sweep")]
    if not sweep:  # --no-sweep: nothing to draw against row length
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for op, style in (("softmax", "-"), ("logsumexp", "--")):
        pts = sorted((r["cols"], r["torch_gbs"], r["ss_gbs"]) for r in sweep if r["op"] == op)
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "o" + style, label=f"splitsoftmax {op}")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "x" + style, label=f"torch {op}")
    ax.axhline(rates["copy_gbs"], color="k", lw=1, label=f"copy rate {rates['copy_gbs']:.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("row length N (fp32, R*N = 2^27)")
    ax.set_ylabel("GB/s (2N softmax, N logsumexp)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def table(results: list[dict]) -> str:
    lines = [f"{'shape':18} {'op':11} {'torch':>7} {'ss':>7} {'ratio':>6} {'err':>8} | graph: {'torch':>7} {'ss':>7}"]
    for r in results:
        graph = f" | graph: {r['torch_graph_gbs']:7.0f} {r['ss_graph_gbs']:7.0f}" if "ss_graph_gbs" in r else ""
        lines.append(f"{r['shape']:18} {r['op']:11} {r['torch_gbs']:7.0f} {r['ss_gbs']:7.0f} "
                     f"{r['ss_gbs'] / r['torch_gbs']:6.2f} {r['max_err']:8.1e}{graph}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="splitsoftmax bench softmax", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="folder for softmax.json and softmax.png")
    ap.add_argument("--variants", action="store_true", help="also time config variants on the reference shapes")
    ap.add_argument("--no-sweep", action="store_true", help="skip the sweep of row lengths")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench softmax needs a CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    rates = copy_rates()
    results = []
    for label, rows, cols, dtype in PERF_SHAPES:
        results += measure(label, rows, cols, dtype, args.variants, graphs=True)
    if not args.no_sweep:
        for k in range(7, 25, 2):
            results += measure(f"sweep N=2^{k}", SWEEP_ELEMS >> k, 1 << k, torch.float32, False)
    import triton
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            **rates}
    with open(os.path.join(args.out, "softmax.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    plotted = plot(results, rates, os.path.join(args.out, "softmax.png"))
    print(json.dumps(meta))
    print(table(results))
    bad = [r for r in results if not r["max_err"] <= TOL[r["dtype"]]]
    for r in bad:
        print(f"WRONG: {r['shape']} {r['op']} max err {r['max_err']}")
    if not plotted:
        print("no plot (matplotlib missing, or --no-sweep)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
