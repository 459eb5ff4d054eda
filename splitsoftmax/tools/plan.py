"""``python -m splitsoftmax plan`` (the planner's ranking) and ``simulate`` (predicted time and efficiency
of each schedule from 8 to 4096 GPUs, as CSV, JSON and a plot). Every number they print is a
prediction of the cost model in ``splitsoftmax.planning``."""
from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys
import time
from typing import Optional, Sequence

from ..planning import load_profile, plan_attention, shipped
from ..planning.plan import candidates, documents, element_bytes, rank
from ..planning.sim import SCHEDULES, Problem, Simulator

DEFAULT_GPUS = tuple(2 ** k for k in range(3, 13))


def _problem_args(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--seq-len", type=int, help="tokens of one sequence")
    what.add_argument("--docs", type=pathlib.Path,
                      help="a file of document lengths (whitespace or comma separated), packed into one sequence")
    parser.add_argument("--heads", type=int, required=True, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-causal", dest="causal", action="store_false", help="full (non-causal) attention")
    parser.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), default=None,
                        help="window_size as in ss.attention")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--profile", default="h100",
                        help=f"a shipped profile ({', '.join(shipped())}) or a JSON file from `calibrate --out`")


def _cu_seqlens(path: Optional[pathlib.Path]) -> Optional[list]:
    if path is None:
        return None
    text = path.read_text().replace(",", " ").split()
    try:
        lengths = [int(x) for x in text]
    except ValueError as e:
        raise SystemExit(f"--docs {path}: expected integers, {e}")
    if not lengths or any(n < 0 for n in lengths):
        raise SystemExit(f"--docs {path}: expected non-negative document lengths, got {lengths[:8]}")
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _kwargs(ns) -> dict:
    return dict(seq_len=ns.seq_len, cu_seqlens=_cu_seqlens(ns.docs), heads=ns.heads,
                kv_heads=ns.kv_heads or ns.heads, head_dim=ns.head_dim, causal=ns.causal,
                window_size=tuple(ns.window) if ns.window else None, dtype=ns.dtype,
                gpus_per_host=ns.gpus_per_host, profile=ns.profile)


def plan_main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="splitsoftmax plan", description="rank every schedule and mesh shape "
                                     "for one attention layer on WORLD GPUs by predicted time (a prediction of the "
                                     "cost model, not a measurement)")
    parser.add_argument("world", type=int, help="GPUs")
    _problem_args(parser)
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the plan as JSON here")
    ns = parser.parse_args(argv)
    try:
        plan = plan_attention(ns.world, **_kwargs(ns))
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    print(plan.table())
    print(f"\nplan: schedule={plan.schedule!r} mesh={plan.mesh} (heads x sequence) layout={plan.layout!r}")
    if ns.json:
        ns.json.write_text(json.dumps(plan.as_dict(), indent=1))
    return 0


def _simulator(kwargs: dict) -> tuple:
    """The simulator of the problem that ``plan_attention``'s keywords describe, and its layouts."""
    kw = dict(kwargs)
    docs, kinds = documents(kw.pop("seq_len"), kw.pop("cu_seqlens"), kw.pop("window_size"), kw["causal"])
    pb = Problem(docs, kw["causal"], kw["heads"], kw["kv_heads"], kw["head_dim"], element_bytes(kw["dtype"]))
    return Simulator(pb, load_profile(kw["profile"]), kw["gpus_per_host"]), kinds


def sweep(kwargs: dict, gpus: Sequence[int]) -> list:
    """Per GPU count: the plan's choice and each schedule's best candidate, simulated event by event."""
    sim, kinds = _simulator(kwargs)
    rows = []
    for world in gpus:
        results, one = rank(sim, candidates(world, sim.pb.heads, kinds))
        best = {}
        for r in results:
            best.setdefault(r.candidate.schedule, r)
        for sched, r in best.items():
            if r.bound:
                r = sim.score(sim.run(r.candidate), one)
            rows.append({"gpus": world, "schedule": sched, "chosen": r.candidate == results[0].candidate,
                         "mesh": f"{r.candidate.heads_degree}x{r.candidate.seq_degree}", "layout": r.candidate.layout,
                         "fwd_ms": r.fwd_s * 1e3, "bwd_ms": r.bwd_s * 1e3, "efficiency": r.efficiency,
                         "tflops_per_gpu": r.tflops_per_gpu, "kernel_share": r.kernel_share, "peak_gib": r.peak_bytes / 2 ** 30,
                         "one_gpu_ms": one * 1e3})
    return rows


def _write_timeline(kwargs: dict, world: int, path: pathlib.Path) -> None:
    sim, kinds = _simulator(kwargs)
    best = rank(sim, candidates(world, sim.pb.heads, kinds))[0][0].candidate
    events = sim.timeline(best)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(events[0]))
        w.writeheader()
        w.writerows(events)
    print(f"wrote {path}: {best.label()} on {world} GPUs, {len(events)} events of its slowest rank")


def _plot(rows: list, path: pathlib.Path) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written (pip install matplotlib)"
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for sched in SCHEDULES:
        mine = [r for r in rows if r["schedule"] == sched]
        if mine:
            g = [r["gpus"] for r in mine]
            a.plot(g, [r["fwd_ms"] + r["bwd_ms"] for r in mine], marker="o", label=sched)
            b.plot(g, [100 * r["efficiency"] for r in mine], marker="o", label=sched)
    chosen = [r for r in rows if r["chosen"]]
    b.plot([r["gpus"] for r in chosen], [100 * r["efficiency"] for r in chosen], "k--", label="plan")
    for ax, label in ((a, "predicted fwd+bwd ms per layer"), (b, "predicted efficiency vs one GPU, %")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.set_yscale("log")
    b.legend(fontsize=8)
    fig.suptitle("predictions of the cost model (not measurements)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def simulate_main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="splitsoftmax simulate", description="simulate one attention layer's "
                                     "forward and backward (compute, transfers, their overlap) under each schedule "
                                     "for 8 to 4096 GPUs; writes simulate.csv, simulate.json and simulate.png "
                                     "(predictions of the cost model)")
    _problem_args(parser)
    parser.add_argument("--gpus", default=",".join(map(str, DEFAULT_GPUS)), help="comma-separated GPU counts")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."), help="folder for the files")
    parser.add_argument("--timeline", type=int, default=None, metavar="GPUS",
                        help="also write timeline.csv: the events of the plan's choice on GPUS GPUs, its slowest "
                             "rank (compute, transfers, their overlap)")
    ns = parser.parse_args(argv)
    try:
        gpus = [int(g) for g in ns.gpus.split(",") if g.strip()]
        if not gpus or min(gpus) < 1:
            raise ValueError(f"--gpus must list positive counts, got {ns.gpus!r}")
        start = time.perf_counter()
        rows = sweep(_kwargs(ns), gpus)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    ns.out.mkdir(parents=True, exist_ok=True)
    with open(ns.out / "simulate.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (ns.out / "simulate.json").write_text(json.dumps({"prediction": True, "args": vars(ns) | {
        "docs": str(ns.docs) if ns.docs else None, "out": str(ns.out)}, "rows": rows}, indent=1))
    for r in rows:
        mark = "*" if r["chosen"] else " "
        print(f"{r['gpus']:>6} {mark} {r['schedule']:<16}{r['mesh']:>9} {r['layout']:<11}"
              f"{r['fwd_ms'] + r['bwd_ms']:>12.3f} ms {100 * r['efficiency']:>6.1f}%")
    if ns.timeline:
        _write_timeline(_kwargs(ns), ns.timeline, ns.out / "timeline.csv")
    msg = _plot(rows, ns.out / "simulate.png")
    print(msg or f"wrote {ns.out / 'simulate.png'}", file=sys.stderr if msg else sys.stdout)
    print(f"wrote {ns.out / 'simulate.csv'} and simulate.json ({time.perf_counter() - start:.1f} s; "
          f"* = the plan's choice; predictions of the model)")
    return 0
