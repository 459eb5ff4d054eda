"""The command line: trace, env, verify (its default: 4 CPU ranks), bench usage."""
import subprocess
import sys

import numpy as np
import pytest

from splitsoftmax.core import reference as ref
from splitsoftmax.tools import trace


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


@pytest.mark.once
@pytest.mark.timeout(300)
def test_verify_default_runs_every_sharded_op_on_cpu_ranks():
    r = run("verify")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checks passed" in r.stdout and "MISMATCH" not in r.stdout
    for what in ("sharded_softmax", "sharded_logsumexp", "sharded_topk", "sharded_sample", "ring", "allgather", "tree",
                 "zigzag", "contiguous"):
        assert what in r.stdout, what
    assert "on 4 ranks (cpu)" in r.stderr  # progress lines


def test_bench_help_lists_the_benches():
    r = run("bench", "--help")
    assert r.returncode == 0, r.stderr
    from splitsoftmax.tools.cli import BENCH_HELP
    for name, what in BENCH_HELP.items():
        assert f"{name}  " in r.stdout and what in r.stdout.replace("\n", " ")


def test_without_a_command_only_the_command_is_required():
    r = run()
    assert r.returncode == 2
    assert "required: command" in r.stderr and "args" not in r.stderr, r.stderr


def test_env_without_cuda_lists_nccl_unavailable(monkeypatch):
    """torch built with NCCL on a machine without a GPU: NCCL is listed as unavailable, with why."""
    import torch

    from splitsoftmax.tools import env
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = next(x for x in env.report().splitlines() if x.startswith("torch.distributed"))
    assert "NCCL unavailable (no CUDA device)" in line
    assert "NCCL" not in line.replace("NCCL unavailable (no CUDA device)", "")


def test_verify_table_aligned_on_long_names():
    from splitsoftmax.tools.verify.compare import Row, table
    rows = [Row("short fwd", "ring", "zigzag", 1e-7, 2e-7, 0.5),
            Row("sharded_attention variants S=79 docs+window+cap+sinks+pad bwd", "tree", "contiguous", 3e-7, 2e-7,
                None)]
    lines = table(rows).splitlines()
    col = lines[0].index("schedule")
    assert [line[col:col + 4] for line in lines[1:]] == ["ring", "tree"]
    assert len({line.index("e-07") for line in lines[1:]}) == 1


def test_verify_bf16_tolerance_scales_with_the_result(monkeypatch):
    """bf16 softmax off by 0.02 in one entry (within the old 4 ulps at 1, 0.031) is a mismatch: the
    bound is torch's own error and the rounding of the truth, both relative to the result; the
    table exits non-zero, and every other row still passes."""
    import io

    import torch

    import splitsoftmax as F
    from splitsoftmax.tools.verify import run as verify
    right = F.softmax

    def wrong(x, *a, **kw):
        y = right(x, *a, **kw)
        return y + torch.zeros_like(y).index_put_((torch.tensor([0]), torch.tensor([7])), torch.tensor(0.02, dtype=y.dtype))
    monkeypatch.setattr(F, "softmax", wrong)
    torch.manual_seed(0)
    rows = verify.single_device_rows("cpu", torch.bfloat16)
    bad = [r for r in rows if not r.ok]
    assert [r.op for r in bad] == ["softmax 33x1000 fwd"] and bad[0].tol < 0.02, [(r.op, r.err, r.tol) for r in rows]
    assert all(r.tol < 0.2 for r in rows)  # the peer's own error bounds the widest (logsumexp's gradient)
    out = io.StringIO()
    assert verify.run_table(lambda: rows, stream=out) == 1 and "MISMATCH" in out.getvalue()


def test_a_quiet_rank_shows_its_mismatches(capsys):
    """A rank other than 0 prints its table nowhere; its failing rows reach its stderr (which the
    launcher shows when the rank exits non-zero), and it exits non-zero."""
    import io
    from splitsoftmax.tools.verify.compare import Row
    from splitsoftmax.tools.verify.run import run_table
    rows = [Row("softmax 3x4 fwd", "local", "-", 1e-7, 1e-6, 0.01),
            Row("softmax 3x4 bwd", "ring", "zigzag", 2e-5, 1e-6, None)]
    assert run_table(lambda: rows, stream=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert "softmax 3x4 bwd" in err and "MISMATCH" in err and "3x4 fwd" not in err
    assert run_table(lambda: rows[:1], stream=io.StringIO()) == 0 and capsys.readouterr().err == ""
