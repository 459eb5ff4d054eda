"""Probe: the host time of a ring step's own code, on a CPU, with the kernel launches stubbed.

    PYTHONPATH=. python3 benchmarks/probes/ring_step_host_cpu.py

``bench placement``'s ``RankWork`` (one rank's share of a ring of ``P`` over a pack of documents, the
ring's own visits) on CPU tensors taking the Triton path, every launch a no-op: what remains is the
Python of a step (plans, views, checks, the running state's bookkeeping) and its allocations. The
ranks ``bench placement`` times, forward, us a step, on the uniform pack it measures the planner's
``kernel.step_us`` on and on the published pack of R11, with the number of shapes a rank's steps
meet (each shape's launches are bound once). Backs no setting: it tells whether the pack changes a
step's own host work (docs/benchmarks/plan.md, host-bound ranks).
"""
import time
import types

import torch

from splitsoftmax.distributed.layout import shard_lengths
from splitsoftmax.distributed.work import nrows
from splitsoftmax.ops import _registry
from splitsoftmax.ops._triton import launch
from splitsoftmax.ops.attention import decode
from splitsoftmax.planning.validation import published_packs
from splitsoftmax.tools.bench import placement

CASES = (("uniform 131k", lambda: placement.uniform_pack(131072), 256, "zigzag"),
         ("uniform 131k", lambda: placement.uniform_pack(131072), 256, "balanced"),
         ("published 1M", lambda: tuple(published_packs(1 << 20, 1)[0]), 256, "balanced"),
         ("published 1M", lambda: tuple(published_packs(1 << 20, 1)[0]), 256, "zigzag"),
         ("published 1M", lambda: tuple(published_packs(1 << 20, 1)[0]), 1024, "zigzag"))


def stub_launches() -> None:
    """CPU tensors take the Triton path; no launch runs (the host work around them does)."""
    _registry.use_triton = lambda t: t.dtype != torch.float64
    launch.BoundLaunch.__call__ = lambda self, *values: None
    launch.Launcher.__call__ = lambda self, *args: None
    launch.BoundLaunch._bind_direct = lambda self: None
    decode.sm_count = lambda t: 132


def main(reps: int = 3) -> None:
    stub_launches()
    opts = types.SimpleNamespace(heads=32, kv_heads=8, dim=128, dtype=torch.bfloat16, min_gap=128, max_row_pieces=1)
    for name, lengths, p, layout in CASES:
        docs = placement.boundaries(lengths())
        lens = shard_lengths(docs[-1], p, layout, docs)
        pairs = placement.rank_pairs(layout, lens, docs, p)
        rows = []
        for r in placement.chosen_ranks(pairs):
            work = placement.RankWork(layout, docs, p, r, opts, torch.device("cpu"))
            work.forward()
            t0 = time.perf_counter()
            for _ in range(reps):
                work.forward()
            us = (time.perf_counter() - t0) / reps / len(work.steps) * 1e6
            shapes = len({nrows(work.spec.planned.plan.keys[s]) for s in work.steps})
            rows.append(f"rank {r}: {us:.1f} us a step, {len(work.steps)} steps, {shapes} key lengths")
        print(f"{name}, P={p}, {layout}: " + "; ".join(rows), flush=True)


if __name__ == "__main__":
    main()
