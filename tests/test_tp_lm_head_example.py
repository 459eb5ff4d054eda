"""examples/tp_lm_head_example.py on 2 Gloo ranks (torchrun) and under mpirun: the GRPO loss, its
gradients and three decode steps of a vocabulary-sharded LM head match one process."""
import os
import sys

import pytest
from _dist_util import ROOT, _collect, _start, assert_ok, mpirun_path, worker_env
from test_launch_example import torchrun

EXAMPLE = os.path.join(ROOT, "examples", "tp_lm_head_example.py")


def check_output(out: str, kind: str) -> None:
    assert f"2 ranks ({kind}, cpu, torch.float32), V=5003, this rank's slice 2502 rows, 256 tokens" in out, out
    assert "OK: the sharded LM head matches one process" in out, out
    for name in ("loss", "log-probs", "entropy", "grad W slice", "grad hidden"):
        line = next(l for l in out.splitlines() if l.strip().startswith(name + " "))
        assert float(line.split("max rel err")[1].split()[0]) <= 1e-4, line
    assert sum("tokens equal" in l for l in out.splitlines()) == 3, out


@pytest.mark.distributed
def test_two_gloo_ranks():
    env = worker_env({"TORCHELASTIC_ERROR_FILE": os.devnull})
    p, log = _start([*torchrun(), "--standalone", "--nproc-per-node=2", "--max-restarts=0", EXAMPLE], env)
    results = _collect([p], [log], timeout=180)
    assert_ok(results, "torchrun --nproc-per-node=2")
    check_output(results[0][1], "torchrun")


@pytest.mark.mpi
@pytest.mark.skipif(mpirun_path() is None, reason="no mpirun")
def test_mpirun():
    p, log = _start([mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, EXAMPLE],
                    worker_env())
    results = _collect([p], [log], timeout=180)
    assert_ok(results, "mpirun -n 2")
    check_output(results[0][1], "mpi")
