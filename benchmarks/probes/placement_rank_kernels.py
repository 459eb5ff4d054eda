"""Where one rank's forward+backward goes under ``bench placement``: device time per kernel (the
profiler's CUDA activities) of the most loaded rank of a pack at ``P`` ranks, per placement, beside
what the planner's profile predicts for that rank's pieces.

No setting: it explains the planner's misses on the published pack (docs/benchmarks/plan.md). The
rank's work is ``bench placement``'s (``RankWork``: the ring's own visits on random buffers of the
plan's sizes), run once to warm up, then once under the profiler::

    PYTHONPATH=. python3 benchmarks/probes/placement_rank_kernels.py OUTDIR [P ...]

Writes ``OUTDIR/rank_kernels.json`` (per P and placement: the rank, its launches, each kernel's
calls and device ms in the forward and the backward, the wall ms of each) and prints a short table.
"""
import json
import os
import statistics
import sys
import time
import types

import torch
from torch.profiler import ProfilerActivity, profile

from splitsoftmax.distributed import plan as pl
from splitsoftmax.distributed.layout import shard_lengths
from splitsoftmax.ops._triton import configs
from splitsoftmax.planning.validation import published_packs
from splitsoftmax.tools.bench.placement import RankWork, boundaries, rank_pairs


def _kernels(fn) -> tuple:
    """``(wall ms, {kernel name: [calls, device ms]})`` of one call of ``fn`` under the profiler."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    out = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            c = out.setdefault(e.name[:120], [0, 0.0])
            c[0] += 1
            c[1] += e.device_time / 1e3
    return wall, out


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "rank_kernels_out"
    ranks = [int(a) for a in sys.argv[2:]] or [64]
    os.makedirs(out, exist_ok=True)
    opts = types.SimpleNamespace(heads=32, kv_heads=8, dim=128, dtype=torch.bfloat16, min_gap=configs.ATTN_PLAN_MIN_GAP,
                                 max_row_pieces=pl.MAX_ROW_PIECES)
    docs = boundaries(published_packs(1 << 20, 1)[0])
    dev = torch.device("cuda")
    rows = []
    for p in ranks:
        for layout in ("zigzag", "balanced"):
            lens = shard_lengths(docs[-1], p, layout, docs)
            pairs = rank_pairs(layout, lens, docs, p)
            r = max(range(p), key=lambda i: pairs[i])
            work = RankWork(layout, docs, p, r, opts, dev)
            work.prepare_backward()
            work.backward()  # warm-up: compiles, bound launches, buffers
            fwd_ms, fwd = _kernels(work.forward)
            work.prepare_backward()
            bwd_ms, bwd = _kernels(work.backward)
            row = {"P": p, "layout": layout, "rank": r, "pairs_vs_mean": pairs[r] / statistics.fmean(pairs),
                   "launches_fwd": work.launches, "steps": len(work.steps), "piece_rows": work.piece_rows,
                   "fwd_wall_ms": fwd_ms, "bwd_wall_ms": bwd_ms, "fwd": fwd, "bwd": bwd}
            rows.append(row)
            with open(os.path.join(out, "rank_kernels.json"), "w") as f:
                json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, f,
                          indent=1)
            del work
    print(f"{'P':>4} {'layout':<9} {'pass':<4} {'wall ms':>8} {'dev ms':>8}  top kernels (calls, ms)")
    for row in rows:
        for name in ("fwd", "bwd"):
            ks = row[name]
            top = sorted(ks.items(), key=lambda kv: -kv[1][1])[:4]
            dev_ms = sum(v[1] for v in ks.values())
            print(f"{row['P']:>4} {row['layout']:<9} {name:<4} {row[name + '_wall_ms']:8.2f} {dev_ms:8.2f}  "
                  + "; ".join(f"{k[:48]} ({v[0]}, {v[1]:.2f})" for k, v in top))


if __name__ == "__main__":
    main()
