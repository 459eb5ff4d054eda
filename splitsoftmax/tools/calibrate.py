"""``python -m splitsoftmax calibrate --out FILE``: measure a planning profile on the ranks it is launched
with (torchrun, or ``--nproc N`` started here; on CPU ranks over Gloo it runs at toy sizes).

Kernel: ``ss.attention`` forward and forward+backward at a few lengths, full and causal, TFLOP/s
(forward ``4*B*H*S*S*D``, halved when causal; forward+backward 3.5x), on each rank's device (rank 0's
numbers are written). Links: point-to-point (pairs of ranks exchanging at once), all-to-all and
all-gather, bandwidth from a large message (its whole time, latency included) and latency from a
small one, per link class: ranks of
one host (``"intra"``) and of different hosts (``"inter"``, only where the job spans hosts). What is
not measured keeps the template profile's figure and its source (``vendor`` or ``estimate``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import socket
import statistics
import sys
import time
from typing import Optional, Sequence

import torch

from ..distributed.plan import MAX_ROW_PIECES
from ..ops._triton import configs
from ..planning import load_profile, shipped

GPU_SIZES = {"lengths": (256, 512, 1024, 2048, 4096, 8192, 16384), "tokens": 32768, "heads": 16, "head_dim": 128,
             "message": 256 * 2 ** 20, "reps": 10}
CPU_SIZES = {"lengths": (64, 128), "tokens": 256, "heads": 2, "head_dim": 32, "message": 2 ** 18, "reps": 3}


def _timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs, after one warm-up run."""
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def kernel_tables(device: torch.device, sizes: dict) -> dict:
    """TFLOP/s of ``ss.attention`` by length: ``{"fwd": {"full": [[S, r]...], "causal": ...}, "fwd_bwd": ...}``."""
    import splitsoftmax as ss
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h, d = sizes["heads"], sizes["head_dim"]
    out = {"fwd": {"full": [], "causal": []}, "fwd_bwd": {"full": [], "causal": []}}
    for s in sizes["lengths"]:
        b = max(1, sizes["tokens"] // s)
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device=device, dtype=dtype)
        for causal in (False, True):
            flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
            fwd = _timed(lambda: ss.attention(q, k, v, causal=causal), device, sizes["reps"])
            both = _timed(lambda: ss.attention(q, k, v, causal=causal).backward(grad), device, sizes["reps"])
            key = "causal" if causal else "full"
            out["fwd"][key].append([s, float(f"{flops / fwd / 1e12:.4g}")])
            out["fwd_bwd"][key].append([s, float(f"{3.5 * flops / both / 1e12:.4g}")])
    return out


def _hosts(world: int) -> list:
    import torch.distributed as dist
    names = [None] * world
    dist.all_gather_object(names, socket.gethostname())
    return names


def _pairs(hosts: list, same: bool) -> list:
    """Disjoint pairs of ranks on one host (``same``) or on two hosts, greedily from rank 0."""
    free, out = list(range(len(hosts))), []
    while free:
        a = free.pop(0)
        mate = next((b for b in free if (hosts[a] == hosts[b]) == same), None)
        if mate is not None:
            free.remove(mate)
            out.append((a, mate))
    return out


def p2p_rate(pairs: list, rank: int, device, nbytes: int, reps: int) -> Optional[tuple]:
    """(GB/s per direction, latency s) of pairs exchanging ``nbytes`` at once; ``None`` without pairs."""
    import torch.distributed as dist
    mate = next((b if a == rank else a for a, b in pairs if rank in (a, b)), None)

    def exchange(n):
        send = torch.ones(max(n // 4, 1), device=device)
        recv = torch.empty_like(send)

        def go():
            if mate is not None:
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, mate), dist.P2POp(dist.irecv, recv, mate)]):
                    w.wait()
        return _timed(go, device, reps)
    if not pairs:
        return None
    big, small = exchange(nbytes), exchange(4)
    dist.barrier()
    return nbytes / big / 1e9, small


def collective_rate(kind: str, world: int, device, nbytes: int, reps: int) -> tuple:
    """(GB/s, latency s) of ``"alltoall"`` (bytes a rank sends to the others / time) or ``"allgather"``
    (bus bandwidth: ``(P-1)/P`` of the gathered bytes / time) over the whole job."""
    import torch.distributed as dist

    def run(n):
        per = max(n // (4 * world), 1)
        x = torch.ones(per * world, device=device)
        y = torch.empty_like(x)
        if kind == "alltoall":
            return _timed(lambda: dist.all_to_all_single(y, x), device, reps)
        part = torch.ones(per, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return _timed(lambda: gather(y, part), device, reps)
    big, small = run(nbytes), run(4 * world)
    return nbytes * (world - 1) / world / big / 1e9, small


def measure(rank: int, world: int, device: torch.device, sizes: dict) -> dict:
    """Every rank calls it; returns rank 0's measurements: kernel tables and link rates by class."""
    out = {"kernel": kernel_tables(device, sizes), "links": {}}
    if world < 2:
        return out
    hosts = _hosts(world)
    spans = len(set(hosts)) > 1
    for cls, same in (("intra", True), ("inter", False)):
        r = p2p_rate(_pairs(hosts, same), rank, device, sizes["message"], sizes["reps"])
        if r is not None:
            out["links"].setdefault(cls, {})["p2p"] = r
    cls = "inter" if spans else "intra"
    for kind in ("alltoall", "allgather"):
        out["links"].setdefault(cls, {})[kind] = collective_rate(kind, world, device, sizes["message"], sizes["reps"])
    return out


def profile_from(measured: dict, template: str, device: torch.device, world: int) -> dict:
    """The template profile with the measured fields replaced and marked ``measured``."""
    prof = json.loads(json.dumps(load_profile(template).data))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    prof["name"] = f"calibrated-{where.replace(' ', '-').lower()}"
    prof["device"] = where
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        prof["sms"] = props.multi_processor_count
        prof["memory_gib"] = round(props.total_memory / 2 ** 30, 1)
    if measured["kernel"]:
        k = prof["kernel"]
        k.update(measured["kernel"])
        k["source"] = f"measured by calibrate, {when}, {where}, ss.attention at the lengths listed"
        if device.type != "cuda":
            k["head_dim"] = CPU_SIZES["head_dim"]
    prof["kernel"]["row_pieces"] = {"min_gap": configs.ATTN_PLAN_MIN_GAP, "most": MAX_ROW_PIECES,
                                    "source": "the package's rule: configs.ATTN_PLAN_MIN_GAP and distributed.plan.MAX_ROW_PIECES"}
    for cls, kinds in measured["links"].items():
        for kind, (gbs, lat) in kinds.items():
            prof["links"][cls][kind] = {"gbs": round(gbs, 3), "latency_us": round(lat * 1e6, 2),
                                       "source": f"measured by calibrate, {when}, {world} ranks"}
    return prof


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="splitsoftmax calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the profile JSON to write")
    parser.add_argument("--nproc", type=int, default=None, help="launch this many local ranks (default: one per "
                        "GPU, else 2 CPU ranks); one rank measures the kernel alone")
    parser.add_argument("--template", default="h100", choices=shipped(), help="profile whose unmeasured figures are kept")
    parser.add_argument("--deadline", type=float, default=1200.0, help="seconds before --nproc ranks are stopped")
    ns = parser.parse_args(argv)
    if ns.nproc is not None and ns.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {ns.nproc}")
    from . import launcher
    kind = launcher.launched_by()
    if kind is None:
        n = ns.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
        return launcher.spawn(n, ["calibrate", "--out", str(ns.out), "--template", ns.template], ns.deadline)
    if kind != "torchrun":
        parser.error("calibrate runs under torchrun or with --nproc (torch.distributed), not under mpirun")
    _, device, rank, world = launcher.init_ranks(kind)
    try:
        measured = measure(rank, world, device, GPU_SIZES if device.type == "cuda" else CPU_SIZES)
        if rank == 0:
            ns.out.parent.mkdir(parents=True, exist_ok=True)
            ns.out.write_text(json.dumps(profile_from(measured, ns.template, device, world), indent=1))
            print(f"wrote {ns.out} ({world} ranks on {device})", file=sys.stdout)
    finally:
        launcher.finish_ranks(kind)
    return 0
