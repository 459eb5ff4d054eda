"""Probe: where the time of split-KV decode across ranks (``schedule="tree"``) goes, NCCL, one GPU a rank.

    torchrun --standalone --nproc_per_node=2 benchmarks/probes/tree_decode_time.py [KEYS]

Times (host wall clock, synchronised, median of 30) the whole call and its parts on every rank:
the handshake alone, the local split-KV attention, the packed all-gather, the merge in torch eager
ops, a small all-reduce; then a torch.profiler table of the whole call on rank 0 (and its trace in
``$OUT/tree_decode_trace.json``). Backs the tree decode's order in ``ops/attention/schedules/tree.py`` and
``ops/attention/sharded.py`` (the handshake started, the local attention launched, then the
handshake waited on), the fused merge kernel for the gathered states, and NCCL's one
``all_gather_into_tensor``; numbers in docs/benchmarks/ring.md.

Backs no tile setting (the order and transport of ``schedule="tree"``, above).
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import splitsoftmax as ss
from splitsoftmax.core import state
from splitsoftmax.distributed.comm import as_comm
from splitsoftmax.distributed.handshake import handshake
from splitsoftmax.distributed.tree import allgather


def timed(fn, reps=30):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main():
    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    p = dist.get_world_size()
    sk = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    g = torch.Generator(device=dev).manual_seed(rank)
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 8, sk // p, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    comm = as_comm(None)
    out, lse = ss.attention(q, k, v, return_lse=True)
    packed = torch.cat((out.float(), lse.unsqueeze(-1)), -1).reshape(-1)
    parts = {
        "tree (whole call)": lambda: ss.sharded_attention(q, k, v, schedule="tree"),
        "handshake only": lambda: handshake(comm, "sharded_attention", {"a": 1, "b": 2}, {"n": sk}),
        "local ss.attention": lambda: ss.attention(q, k, v, return_lse=True),
        "allgather packed": lambda: allgather(comm, packed, "probe"),
        "merge_out_lse (eager)": lambda: state.merge_out_lse(torch.stack([out.float()] * p), torch.stack([lse] * p)),
        "all_reduce small": lambda: dist.all_reduce(packed),
    }
    with torch.no_grad():
        res = {name: timed(fn) for name, fn in parts.items()}
    lines = [f"rank {rank} keys {sk}: " + "; ".join(f"{n} {ms:.3f} ms" for n, ms in res.items())]
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            parts["tree (whole call)"]()
        torch.cuda.synchronize()
    if rank == 0:
        lines.append(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        out_dir = os.environ.get("OUT", ".")
        prof.export_chrome_trace(os.path.join(out_dir, "tree_decode_trace.json"))
    for r in range(p):
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
