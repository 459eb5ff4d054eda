"""examples/mesh_2d_example.py: 4 Gloo ranks as a 2 x 2 (dp, cp) mesh, DDP over every rank and
sequence-parallel attention over cp; loss and gradients equal one process on the whole batch."""
import os
import sys

import pytest

pytest.importorskip("transformers")
from _dist_util import ROOT, VENV_BIN, _collect, _start, assert_ok, worker_env  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "mesh_2d_example.py")


@pytest.mark.distributed
def test_ddp_times_context_parallel_equals_one_process():
    exe = os.path.join(VENV_BIN, "torchrun")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]
    env = worker_env({"TORCHELASTIC_ERROR_FILE": os.devnull, "HF_HUB_OFFLINE": "1", "SPLITSOFTMAX_TIMEOUT": "60"})
    p, log = _start([*cmd, "--standalone", "--nproc-per-node=4", "--max-restarts=0", EXAMPLE, "--dp", "2", "--cp", "2"],
                    env)
    results = _collect([p], [log], timeout=240)
    assert_ok(results, "torchrun mesh_2d_example.py --dp 2 --cp 2")
    out = results[0][1]
    assert "4 ranks as dp=2 x cp=2 (cpu), S=64" in out and "OK: DDP x context parallel equals one process" in out, out
