"""examples/long_context_example.py under the launchers its docstring names: torchrun (one node, and
two agents meeting at a rendezvous endpoint, as on two nodes) and mpirun; 2 CPU ranks, a deadline."""
import os
import sys

import pytest
from _dist_util import ROOT, VENV_BIN, _collect, _start, assert_ok, free_port, mpirun_path, worker_env

EXAMPLE = os.path.join(ROOT, "examples", "long_context_example.py")
GRADS = ("grad x", "grad wq.weight", "grad wk.weight", "grad wv.weight", "grad wo.weight")


def torchrun() -> list:
    exe = os.path.join(VENV_BIN, "torchrun")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]


def check_output(out: str, world: int, kind: str) -> None:
    assert f"{world} ranks ({kind}, cpu, torch.float32), S=256, this rank's shard 128 positions" in out, out
    assert "OK: sharded block matches one process" in out, out
    for name in ("output", *GRADS):
        line = next(l for l in out.splitlines() if l.strip().startswith(name + " "))
        err = float(line.split("max rel err")[1].split()[0])
        assert err <= 1e-4, line


@pytest.mark.distributed
def test_torchrun_one_node():
    env = worker_env({"TORCHELASTIC_ERROR_FILE": os.devnull})
    p, log = _start([*torchrun(), "--standalone", "--nproc-per-node=2", "--max-restarts=0", EXAMPLE], env)
    results = _collect([p], [log], timeout=120)
    assert_ok(results, "torchrun --nproc-per-node=2")
    check_output(results[0][1], 2, "torchrun")


@pytest.mark.distributed
def test_torchrun_two_agents_rendezvous():
    port = free_port()
    started = [_start([*torchrun(), "--nnodes=2", "--nproc-per-node=1", f"--node-rank={n}", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=ss-example", "--max-restarts=0", EXAMPLE],
                      worker_env({"TORCHELASTIC_ERROR_FILE": os.devnull})) for n in range(2)]
    results = _collect([p for p, _ in started], [log for _, log in started], timeout=150)
    assert_ok(results, "torchrun --nnodes=2 --rdzv-endpoint")
    check_output("\n".join(out for _, out in results), 2, "torchrun")


@pytest.mark.mpi
@pytest.mark.skipif(mpirun_path() is None, reason="no mpirun")
def test_mpirun():
    p, log = _start([mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, EXAMPLE],
                    worker_env())
    results = _collect([p], [log], timeout=120)
    assert_ok(results, "mpirun -n 2")
    check_output(results[0][1], 2, "mpi")


def test_not_launched_says_how():
    import subprocess
    r = subprocess.run([sys.executable, EXAMPLE], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in worker_env().items() if k not in ("RANK", "WORLD_SIZE")})
    assert r.returncode == 2 and "torchrun" in r.stderr
