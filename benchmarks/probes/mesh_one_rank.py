"""The sequence schedules on one rank, through a 1-D group and through a ``1 x 1`` mesh: device time
per call (``helpers.bench``) and each call's kernels and host synchronisations (torch.profiler).

No setting: it looks for what makes ``heads+allgather`` on a ``1 x 1`` mesh slower than the
allgather it runs (``sharded_attention`` hands a heads degree of 1 to the sequence schedule).
A world of one NCCL rank, B 1, H 32, Hkv 8, D 128, bf16, causal, zigzag shards, forward::

    PYTHONPATH=. python3 benchmarks/probes/mesh_one_rank.py OUTDIR [--seq 32768]
"""
import argparse
import json
import os

import torch
import torch.distributed as dist

from helpers import bench


def _profile(fn, calls: int = 3) -> dict:
    """Per call: every kernel's name, count and device ms; the CUDA runtime calls that block the
    host (synchronisations, copies to the host) and their host ms; the wall ms."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels, runtime = {}, {}
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type.name == "CUDA" or (dev and e.count and e.key.startswith(("_", "void", "triton", "nccl"))):
            kernels[e.key] = (e.count / calls, dev / 1e3 / calls)
        elif e.key.startswith(("cuda", "cu")) and any(w in e.key for w in ("Synchronize", "Memcpy", "EventSync")):
            runtime[e.key] = (e.count / calls, e.cpu_time_total / 1e3 / calls)
    return {"kernels": kernels, "blocking": runtime}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--seq", type=int, default=32768)
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    import splitsoftmax as ss
    g = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(0)
    full = [torch.randn(1, n, a.seq, 128, generator=gen, device="cuda", dtype=torch.bfloat16) for n in (32, 8, 8)]
    rows = []
    cases = [("allgather", g), ("heads+allgather", (g, g)), ("ring", g), ("heads+ring", (g, g)),
             ("allgather (again)", g)]
    outs = {}
    for name, group in cases:
        sched = name.split()[0]
        local = [ss.shard(t, 2, group=group, layout="zigzag") for t in full]

        def fn():
            with torch.no_grad():
                return ss.sharded_attention(*local, causal=True, group=group, schedule=sched, layout="zigzag")
        outs[name] = fn()
        row = {"case": name, "ms": bench(fn), **_profile(fn),
               "inputs": [(tuple(t.shape), t.stride(), t.data_ptr() % 128) for t in local]}
        rows.append(row)
        print(f"{name:20s} {row['ms']:8.3f} ms", flush=True)
    same = {n: bool(torch.equal(outs[n], outs["allgather"])) for n in outs}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "mesh_one_rank.json"), "w") as f:
        json.dump({"rows": rows, "bitwise_equal_to_allgather": same}, f, indent=1)
    for r in rows:
        print(f"\n== {r['case']}: {r['ms']:.3f} ms, inputs {r['inputs']}")
        for k, (n, ms) in sorted(r["kernels"].items(), key=lambda kv: -kv[1][1])[:8]:
            print(f"   {ms:9.3f} ms  x{n:5.1f}  {k[:110]}")
        for k, (n, ms) in r["blocking"].items():
            print(f"   host-blocking {k}: x{n:.1f}, {ms:.3f} ms")
    print("\nbitwise equal to the allgather's output:", same)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
