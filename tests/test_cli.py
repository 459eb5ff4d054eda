"""The command line: trace, env, verify (its default: 4 CPU ranks), bench usage."""
import subprocess
import sys

import numpy as np
import pytest

from splitsoftmax import reference as ref
from splitsoftmax import trace


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "splitsoftmax", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_trace_prints_the_state_trace_and_error_table():
    r = run("trace")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "12.0   12.0     1.00006241" in out  # the rescaled sum right after the maximum change
    assert "3.00673795" in out  # the no-rescale sum at the same step
    assert "1.5436" in out and "3.1" in out  # the lesson's worked merge
    for name in ("scalar online", "vectorised online", "no rescale (wrong)"):
        assert name in out


def test_trace_numbers():
    rows = trace.random_rows()
    assert rows.shape == (1000, 64) and (rows >= 50).any() and (rows <= 100).all()
    want = ref.two_pass_softmax_np(rows)
    good = ref.online_softmax_vectorised(rows, block=8)[0]
    wrong = np.array([ref.online_softmax_scalar(r, rescale=False)[0] for r in rows])
    assert trace.errors(good, want)[0] < 1e-14
    assert trace.errors(wrong, want)[0] > 0.1
    p, steps = ref.online_softmax_scalar(trace.ROW)
    assert [s.m for s in steps] == [1.0, 2.0, 2.0, 12.0, 12.0, 12.0]
    np.testing.assert_allclose(p, ref.two_pass_softmax_np(np.array([trace.ROW]))[0], rtol=1e-14)


def test_env_reports_versions_and_backends():
    r = run("env")
    assert r.returncode == 0, r.stderr
    for key in ("torch", "triton", "devices", "torch.distributed", "Triton kernels run"):
        assert key in r.stdout


def test_bench_without_a_name_is_a_usage_error():
    assert run("bench").returncode == 2


@pytest.mark.timeout(300)
def test_verify_default_runs_every_sharded_op_on_cpu_ranks():
    r = run("verify")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checks passed" in r.stdout and "MISMATCH" not in r.stdout
    for what in ("sharded_softmax", "sharded_logsumexp", "sharded_topk", "sharded_sample", "ring", "allgather", "tree",
                 "zigzag", "contiguous"):
        assert what in r.stdout, what
    assert "on 4 ranks (cpu)" in r.stderr  # progress lines
