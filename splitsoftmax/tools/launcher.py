"""How a command finds its ranks: under torchrun, under mpirun, or launched here with ``--nproc``.

``spawn(n, argv)`` starts ``n`` copies of ``python -m splitsoftmax <argv>`` as ranks of one
torch.distributed job on 127.0.0.1 (NCCL when there is a GPU per rank, Gloo otherwise), streams
rank 0's output, and bounds the whole run by a deadline so a stuck rank cannot hang it.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Optional, Sequence

import torch

MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


def launched_by() -> Optional[str]:
    """``"torchrun"`` (RANK/WORLD_SIZE set), ``"mpi"`` (an MPI launcher's variables), or ``None``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "torchrun"
    if any(v in os.environ for v in MPI_SIZE_VARS):
        return "mpi"
    return None


def rank_device(local_rank: int, world: int, want: Optional[str] = None) -> torch.device:
    """``cuda:<local_rank>`` when every local rank has its own GPU (or ``want="cuda"``), else the CPU
    (always with ``want="cpu"``). ``want="cuda"`` without a GPU for this rank is a ``ValueError``."""
    local_world = min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want == "cuda" and gpus < local_world:
        raise ValueError(f"device='cuda' needs a GPU per local rank: {local_world} local ranks, {gpus} GPU(s) visible")
    if want != "cpu" and gpus >= local_world:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_ranks(kind: str, device: Optional[str] = None):
    """Initialise this rank; returns ``(group, device, rank, world)`` (``group`` for the ss.* calls).

    ``device="cuda"`` under MPI puts ranks on GPUs even when they must share one (the MPI
    communicator stages CUDA tensors through the host); under torchrun it needs a GPU per local rank.
    ``device="cpu"`` keeps every rank on the CPU (Gloo) even where there are GPUs.
    """
    if kind == "mpi":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        dev = torch.device("cpu")
        if device == "cuda":
            dev = torch.device("cuda", int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", comm.Get_rank()))
                               % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        return comm, dev, comm.Get_rank(), comm.Get_size()
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = rank_device(int(os.environ.get("LOCAL_RANK", rank)), world, device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=300),
                                **({"device_id": device} if device.type == "cuda" else {}))
    return None, device, rank, world


def mesh_groups(group, rank: int, seq: int, heads: int):
    """The ``group`` of a ``seq x heads`` mesh of the launched ranks for the ss.* calls: ``group``
    itself (``init_ranks``'s: the MPI communicator, or None for torch.distributed's world) for a
    1-D shape; else ``(seq_group, heads_group)`` of rank ``rank`` (heads groups are contiguous
    ranks, as a 2-D DeviceMesh's last dimension), MPI communicators split from ``group`` or
    torch.distributed groups (every rank creates every group, in the same order: call it on all)."""
    if seq == 1 or heads == 1:
        return group
    if group is not None:  # MPI
        return group.Split(rank % heads, rank), group.Split(rank // heads, rank)
    import torch.distributed as dist
    mine = []
    for ranks in [[s * heads + h for s in range(seq)] for h in range(heads)] + \
                 [[s * heads + h for h in range(heads)] for s in range(seq)]:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine.append(g)
    return tuple(mine)


def finish_ranks(kind: str) -> None:
    """End this rank's part of a torchrun job: every rank arrives, then the process group is taken
    down before exit (a Gloo group left to the interpreter's exit can abort the process when its
    peer is already gone: "terminate called without an active exception")."""
    import torch.distributed as dist
    if kind == "torchrun" and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def default_nproc() -> int:
    """Ranks to start when none were given: one per GPU when there are several, else 4 CPU ranks."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpus if gpus >= 2 else 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(nproc: int, argv: Sequence[str], deadline_s: float = 1800.0) -> int:
    """Run ``python -m splitsoftmax <argv>`` as ``nproc`` local ranks; the worst exit code wins."""
    port = free_port()
    procs, logs = [], []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        quiet = r > 0  # rank 0 speaks for the job; the others' stderr is shown if they fail
        logs.append(tempfile.TemporaryFile() if quiet else None)
        procs.append(subprocess.Popen([sys.executable, "-m", "splitsoftmax", *argv], env=env,
                                      stdout=subprocess.DEVNULL if quiet else None, stderr=logs[-1]))
    end = time.monotonic() + deadline_s
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > end:
                print(f"ranks still running after {deadline_s:g} s: stopping them", file=sys.stderr)
                return 124
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(5)  # let the others notice and report; then stop whoever is left
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for r, (p, log) in enumerate(zip(procs, logs)):
        if log is not None:
            log.seek(0)
            if p.returncode:
                err = log.read().decode(errors="replace")
                print(f"rank {r} exited with {p.returncode}:\n{err[-4000:]}", file=sys.stderr)
            log.close()
    return max((abs(p.returncode) for p in procs), default=0)
