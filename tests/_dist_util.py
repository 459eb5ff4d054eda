"""Launching distributed test workers: Gloo processes, mpirun, torchrun; deadlines, no leaks.

A worker runs ``python tests/_dist_util.py <gloo|nccl|mpi> <file.py>:<function>``: it joins the
group (Gloo or NCCL from RANK/WORLD_SIZE/MASTER_*; ``mpi``: ``MPI.COMM_WORLD``), calls
``function(group)`` and exits 0, or prints the traceback and exits 1. ``spawn`` and ``mpirun``
start the workers in their own session, wait at most ``timeout`` seconds and kill every process
group that is left, so a failing test never leaves processes behind.
"""
from __future__ import annotations

import faulthandler
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.abspath(__file__)
VENV_BIN = os.path.join(ROOT, ".venv", "bin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("TRITON_INTERPRET", None)
    env.update(extra or {})
    return env


def _collect(procs: list, logs: list, timeout: float) -> list:
    """Wait for every process until the deadline; kill what is left; return ``(rc, output)``."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    results = []
    for p, log in zip(procs, logs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = "killed at the deadline"
        else:
            rc = p.returncode
        log.seek(0)
        results.append((rc, log.read().decode(errors="replace")))
        log.close()
    return results


def _start(cmd: list, env: dict) -> tuple:
    log = tempfile.TemporaryFile()
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True), log


def spawn(size: int, target: str, *, timeout: float = 120.0, env: dict | None = None,
          backend: str = "gloo") -> list:
    """``size`` workers running ``target`` (``"tests/file.py:function"``) in a ``backend`` group.

    ``backend="nccl"``: rank ``r`` on GPU ``r``, and ``SPLITSOFTMAX_TEST_DEVICE=cuda`` so the
    cases build their tensors there.
    """
    port = free_port()
    device = {"SPLITSOFTMAX_TEST_DEVICE": "cuda"} if backend == "nccl" else {}
    procs, logs = [], []
    for r in range(size):
        e = worker_env({"RANK": str(r), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "SPLITSOFTMAX_TEST_DEADLINE": str(timeout), **device,
                        **(env or {})})
        p, log = _start([sys.executable, HERE, backend, target], e)
        procs.append(p)
        logs.append(log)
    return _collect(procs, logs, timeout)


def mpirun_path() -> str | None:
    path = os.path.join(VENV_BIN, "mpirun")
    return path if os.path.exists(path) else shutil.which("mpirun")


def mpirun(size: int, target: str, *, timeout: float = 120.0, env: dict | None = None) -> tuple:
    """``mpirun -n size`` workers running ``target``; returns ``(rc, output)``."""
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-n", str(size),
           sys.executable, HERE, "mpi", target]
    p, log = _start(cmd, worker_env(env))
    return _collect([p], [log], timeout)[0]


def torchrun_nodes(nnodes: int, nproc: int, target: str, *, timeout: float = 180.0) -> list:
    """``nnodes`` torchrun agents on this machine (``--nnodes``, rendezvous on 127.0.0.1)."""
    port = free_port()
    procs, logs = [], []
    for node in range(nnodes):
        cmd = [os.path.join(VENV_BIN, "torchrun"), f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
               f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=splitsoftmax-test", "--max-restarts=0", HERE, "gloo", target]
        p, log = _start(cmd, worker_env({"TORCHELASTIC_ERROR_FILE": os.devnull}))
        procs.append(p)
        logs.append(log)
    return _collect(procs, logs, timeout)


def assert_ok(results, what: str) -> None:
    """Every process exited 0; otherwise show every rank's output."""
    if isinstance(results, tuple):
        results = [results]
    bad = [i for i, (rc, _) in enumerate(results) if rc != 0]
    assert not bad, f"{what}: processes {bad} failed:\n" + "\n".join(
        f"--- process {i} (rc={rc}) ---\n{out[-4000:]}" for i, (rc, out) in enumerate(results))


def _load(target: str):
    path, name = target.rsplit(":", 1)
    path = path if os.path.isabs(path) else os.path.join(ROOT, path)
    spec = importlib.util.spec_from_file_location("dist_case_module", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def _worker(mode: str, target: str) -> None:
    deadline = float(os.environ.get("SPLITSOFTMAX_TEST_DEADLINE", "0"))
    if deadline > 10:  # a worker still running near its deadline shows where it is stuck
        faulthandler.dump_traceback_later(deadline - 8, exit=False)
    import torch
    torch.set_num_threads(1)
    fn = _load(target)
    if mode == "mpi":
        from mpi4py import MPI
        fn(MPI.COMM_WORLD)
        return
    import torch.distributed as dist
    if mode == "nccl":  # eager communicator setup (device_id), as README's NCCL launch advises
        device = torch.device("cuda", int(os.environ["RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group(mode, device_id=device)
    else:
        dist.init_process_group(mode)
    fn(None)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip teardown: fault cases may leave transfers pending


if __name__ == "__main__":
    try:
        _worker(sys.argv[1], sys.argv[2])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
