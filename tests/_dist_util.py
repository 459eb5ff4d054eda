"""Launching distributed test workers: Gloo processes, mpirun, torchrun; deadlines, no leaks.

A worker runs ``python tests/_dist_util.py <gloo|nccl|mpi> <file.py>:<function>``: it joins the
group (Gloo or NCCL from RANK/WORLD_SIZE/MASTER_*; ``mpi``: ``MPI.COMM_WORLD``), calls
``function(group)`` and exits 0, or prints the traceback and exits 1. ``spawn`` and ``mpirun``
start the workers in their own session, wait at most ``timeout`` seconds and kill every process
group that is left, so a failing test never leaves processes behind.
"""
from __future__ import annotations

import atexit
import faulthandler
import importlib.util
import json
import os
import random
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
VENV_BIN = os.path.dirname(sys.executable)  # torchrun and mpirun of the environment the tests run in


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


class _Forked:
    """A worker forked by the zygote, waited on like a ``subprocess.Popen``: the zygote reaps it
    and writes its exit code (``-signal`` when killed) to ``rc_path``."""

    def __init__(self, pid: int, rc_path: str):
        self.pid, self.rc_path, self.returncode = pid, rc_path, None

    def poll(self):
        if self.returncode is None and os.path.exists(self.rc_path):
            with open(self.rc_path) as f:
                text = f.read()
            if text.endswith("\n"):
                self.returncode = int(text)
                os.unlink(self.rc_path)
        return self.returncode

    def wait(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


class _Zygote:
    """One process per test session with torch and torch.distributed imported, that forks the Gloo
    workers: each worker starts in milliseconds instead of importing torch again (seconds of CPU
    each, most of the cpu lane's time). A forked worker is what a started one is: its own session
    (process group), this module's ``_worker`` on its environment, its output in its log, its exit
    code; only the import is shared (nothing else runs in the zygote before the fork)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, HERE, "zygote", "-"], env=worker_env(), cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.dir = tempfile.mkdtemp(prefix="splitsoftmax-zygote-")
        atexit.register(self.close)

    def close(self) -> None:
        """End the zygote (it exits when its input closes) and remove its folder."""
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self, argv: list, env: dict) -> tuple:
        log = tempfile.NamedTemporaryFile(dir=self.dir)
        rc_path = log.name + ".rc"
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "log": log.name, "rc": rc_path}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the test zygote exited (rc {self.proc.wait()})")
        return _Forked(int(line), rc_path), log


_ZYGOTE: list = []


def _zygote():
    """The session's zygote, started on first use (``SPLITSOFTMAX_TEST_NO_ZYGOTE=1``: none)."""
    if os.environ.get("SPLITSOFTMAX_TEST_NO_ZYGOTE") == "1":
        return None
    if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
        _ZYGOTE[:] = [_Zygote()]
    return _ZYGOTE[0]


def _serve_forks() -> None:
    """The zygote's loop: for each request line fork a worker, answer its pid; reap the workers
    and write each exit code; end when the test session closes the pipe."""
    import torch  # noqa: F401  (what every worker imports first; the package itself, which reads
    import torch._dynamo  # noqa: F401  its environment on import, is imported by each worker)
    import torch.distributed  # noqa: F401
    rc_paths = {}

    def reap(*_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            path = rc_paths.pop(pid, None)
            if path is not None:
                with open(path + ".tmp", "w") as f:
                    f.write(f"{os.waitstatus_to_exitcode(status)}\n")
                os.replace(path + ".tmp", path)
    signal.signal(signal.SIGCHLD, reap)
    for line in sys.stdin:
        req = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
        pid = os.fork()
        if pid == 0:
            _forked_worker(req)
        rc_paths[pid] = req["rc"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        reap()
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


def _forked_worker(req: dict) -> None:
    """In the forked child: a session of its own, the request's environment and log, a fresh
    random seed, then the worker; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        os.setsid()
        fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        sys.argv = [HERE, *req["argv"]]
        _main(req["argv"])
    finally:
        os._exit(code)


def spawn(size: int, target: str, *, timeout: float = 120.0, env: dict | None = None,
          backend: str = "gloo") -> list:
    """``size`` workers running ``target`` (``"tests/file.py:function"``) in a ``backend`` group.

    Gloo workers are forked by the session's zygote (torch imported once); ``backend="nccl"``:
    rank ``r`` on GPU ``r`` in a process started afresh, and ``SPLITSOFTMAX_TEST_DEVICE=cuda`` so
    the cases build their tensors there.
    """
    port = free_port()
    device = {"SPLITSOFTMAX_TEST_DEVICE": "cuda"} if backend == "nccl" else {}
    zygote = _zygote() if backend == "gloo" else None
    procs, logs = [], []
    for r in range(size):
        e = worker_env({"RANK": str(r), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "SPLITSOFTMAX_TEST_DEADLINE": str(timeout), **device,
                        **(env or {})})
        p, log = zygote.start([backend, target], e) if zygote else _start([sys.executable, HERE, backend, target], e)
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


def _main(argv: list) -> None:
    """A worker's entry: ``_worker(mode, target)``, or exit 1 with the traceback."""
    try:
        _worker(argv[0], argv[1])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        _serve_forks()
    else:
        _main(sys.argv[1:])
