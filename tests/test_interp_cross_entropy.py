"""The Triton cross-entropy kernels under TRITON_INTERPRET=1, at tiny sizes, against float64."""
import os
import threading

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.interpreter
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter lane: run with TRITON_INTERPRET=1", allow_module_level=True)

from _ce_util import loss_and_grad as grad_of  # noqa: E402
from splitsoftmax.distributed import LoopbackWorld  # noqa: E402
from splitsoftmax.ops.cross_entropy import kernel as tce  # noqa: E402
from splitsoftmax.ops.cross_entropy import torch as ce_cpu  # noqa: E402
from splitsoftmax.ops.cross_entropy.api import cross_entropy, sharded_cross_entropy  # noqa: E402

NEG_INF = float("-inf")


def make(n, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[torch.rand(n, generator=g) < 0.25] = -100
    return logits, target


def _locked(lock, fn, *args):
    with lock:
        return fn(*args)


@pytest.mark.parametrize("with_sum", [True, False])
@pytest.mark.parametrize("n,v,col0", [(1, 1, 0), (3, 97, 0), (5, 40, 13), (20, 33, -7)])
def test_stats_match_torch_path(n, v, col0, with_sum):
    """Split rows (few rows: several programs per row) and single-program rows, any slice offset;
    the row-sum column only when asked (0 otherwise)."""
    logits, target = make(n, v, torch.float32, seed=n)
    target = target.clamp(min=0) + max(col0, 0)
    logits[0, : v // 2] = NEG_INF
    got = tce.ce_stats(logits, target, col0, with_sum)
    want = ce_cpu.ce_stats(logits.double(), target, col0, with_sum)
    ours = ce_cpu.ce_stats(logits, target, col0, with_sum)
    if not with_sum:
        assert torch.equal(got[:, 3], torch.zeros(n)) and torch.equal(want[:, 3], torch.zeros(n, dtype=torch.float64))
    torch.testing.assert_close(got[:, 0].double(), want[:, 0])  # max: exact
    for c in (1, 2, 3):
        torch.testing.assert_close(got[:, c].double(), want[:, c], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, 2], ours[:, 2])
    assert tce._splits(3, 97, 16, logits.device)[0] > 1  # the split path ran


@pytest.mark.parametrize("parts,n,smoothing", [(1, 1, 0.0), (1, 37, 0.1), (3, 5, 0.0), (5, 130, 0.2)])
def test_rows_kernel_merges_slices_into_losses(parts, n, smoothing):
    """``ce_rows``: the statistics of ``parts`` slices (ranks) merged into each row's loss and lse,
    as the torch path does in float64; an empty slice (``m = -inf, l = 0``), an all-empty row, a
    NaN row and ignored rows included."""
    g = torch.Generator().manual_seed(parts * 100 + n)
    stats = torch.randn(parts, n, 4, generator=g, dtype=torch.float64) * 3
    stats[..., 1] = stats[..., 1].abs() + 0.1
    stats[0, : n // 2, 0], stats[0, : n // 2, 1] = NEG_INF, 0.0
    if n > 2:
        stats[:, 1, 0], stats[:, 1, 1] = NEG_INF, 0.0  # no class visible anywhere: lse -inf
        stats[-1, 2, 1] = float("nan")
    target = torch.randint(0, 50, (n,), generator=g)
    target[::4] = -100
    loss, lse = tce.ce_rows(stats.float(), target, -100, smoothing, 50)
    want_loss, want_lse = ce_cpu.ce_rows(stats, target, -100, smoothing, 50)
    assert loss.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(loss.double(), want_loss, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.equal(loss[target == -100], torch.zeros(int((target == -100).sum())))


def _stats(parts, n, seed):
    """Random slice statistics ``(parts, N, 4)`` float64: an empty slice in the first half of the
    rows, a row empty everywhere (ignored: its loss would be inf) and a NaN in an ignored row."""
    g = torch.Generator().manual_seed(seed)
    stats = torch.randn(parts, n, 4, generator=g, dtype=torch.float64) * 3
    stats[..., 1] = stats[..., 1].abs() + 0.1
    stats[0, : n // 2, 0], stats[0, : n // 2, 1] = NEG_INF, 0.0
    target = torch.randint(0, 50, (n,), generator=g)
    target[::4] = -100
    if n > 4:
        stats[:, 4, 0], stats[:, 4, 1] = NEG_INF, 0.0
        stats[-1, 8 % n, 1] = float("nan")
        target[4] = target[8 % n] = -100
    return stats, target


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("parts,n,programs", [(1, 1, 1), (1, 6, 1), (1, 8, 1), (3, 8, 4), (1, 9, 2), (2, 37, 10),
                                              (5, 70, 35)])
def test_loss_kernel_reduces_like_the_torch_path(parts, n, programs, reduction):
    """``ce_loss``: the float32 sum or mean of the row losses and the count of rows not ignored, in
    one program or in per-program partial sums and a second launch (the interpreter's tiles: 4 rows
    of one slice, 2 tiles a program); an ignored row that is empty or NaN adds nothing."""
    stats, target = _stats(parts, n, seed=parts * 100 + n)
    loss, lse, count = tce.ce_loss(stats.float(), target, -100, 0.1, 50, reduction, torch.float32)
    want, want_lse, want_count = ce_cpu.ce_loss(stats, target, -100, 0.1, 50, reduction, torch.float64)
    assert loss.dtype == torch.float32 and loss.shape == want.shape and count.shape == want_count.shape
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert lse[8 % n].isnan() == (n > 4)
    torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=1e-5, equal_nan=True)  # n=1: all ignored
    assert loss.isnan().any() == (n == 1 and reduction == "mean")
    if reduction != "none":
        assert count.dtype == torch.float32 and count.item() == int((target != -100).sum())
        assert tce._total_plan(n, parts)[3] == programs


def test_loss_kernel_empty_and_all_ignored():
    """No row, or every row ignored: the mean is 0 / 0 = NaN and the sum 0, like torch."""
    for n in (0, 5):
        stats, target = torch.randn(1, n, 4).abs(), torch.full((n,), -100)
        for reduction, want in (("mean", float("nan")), ("sum", 0.0)):
            loss, lse, count = tce.ce_loss(stats, target, -100, 0.0, 7, reduction, torch.bfloat16)
            assert loss.dtype == torch.bfloat16 and loss.shape == () and count.item() == 0
            torch.testing.assert_close(loss.float(), torch.tensor(want), equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_grad_kernel_takes_the_coefficient_in_the_kernel(reduction):
    """``ce_grad``: the loss gradient read per row (any stride, 0 included) or once (a scalar), over
    the count for the mean, 0 in ignored rows; a slice of the classes (``col0``)."""
    logits, target = make(7, 40, torch.float32, seed=11)
    target[2] = 39
    lse = torch.logsumexp(logits.double(), 1)
    count = (target != -100).sum().double()
    gs = [torch.randn(14, dtype=torch.float64)[::2], torch.tensor(0.75, dtype=torch.float64).expand(7)]
    if reduction != "none":
        gs = [torch.tensor(-1.25, dtype=torch.float64)]
    for g in gs:
        want = ce_cpu.ce_grad(logits.double()[:, 10:], target, lse, g, count, 10, -100, 0.1, 40, reduction)
        got = tce.ce_grad(logits[:, 10:], target, lse.float(), g.float(), count.float(), 10, -100, 0.1, 40, reduction)
        assert got.dtype == torch.float32 and got.shape == (7, 30)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)
        assert torch.equal(got[target == -100], torch.zeros_like(got[target == -100]))


@pytest.mark.parametrize("n", [6, 37])  # 6: rows split in 3 programs; 37: the sum in 5 programs, then one
@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.0), ("none", 0.1), ("sum", 0.3), ("mean", 0.2)])
def test_cross_entropy_matches_torch(reduction, smoothing, n):
    logits, target = make(n, 75, torch.float32, seed=3)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    want, gwant = grad_of(F.cross_entropy, logits.double(), target, **kw)
    got, g = grad_of(cross_entropy, logits, target, **kw)
    assert got.dtype == torch.float32 and g.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(g.double(), gwant, atol=2e-6, rtol=2e-5)
    assert torch.equal(g[target == -100], torch.zeros_like(g[target == -100]))


def test_bfloat16_within_one_ulp_of_float32_math():
    """bf16 logits: loss and gradient within one bf16 ulp of the same math on the upcast logits.
    (The interpreter truncates float32 -> bfloat16 stores where the GPU rounds to nearest, so
    this lane checks one ulp; the GPU lane checks the 2x-torch error rule.)"""
    logits, target = make(6, 75, torch.bfloat16, seed=3)
    got, g = grad_of(cross_entropy, logits, target, reduction="none", label_smoothing=0.1)
    want, gwant = grad_of(F.cross_entropy, logits.double(), target, reduction="none", label_smoothing=0.1)
    assert got.dtype == torch.bfloat16 and g.dtype == torch.bfloat16
    for mine, ref, f32_atol in ((got, want, 2e-5), (g, gwant, 2e-6)):  # float32 tolerances as above
        ulp = ref.abs() * 2.0 ** -7
        assert ((mine.double() - ref).abs() <= ulp + f32_atol).all(), (mine.double() - ref).abs().max()


def test_sharded_on_the_triton_path(monkeypatch):
    """Ranks are threads here and the interpreter keeps its grid in globals: launches take a lock."""
    lock = threading.Lock()
    for name in ("ce_stats", "ce_loss", "ce_grad"):
        real = getattr(tce, name)
        monkeypatch.setattr(tce, name, lambda *a, _real=real: _locked(lock, _real, *a))
    logits, target = make(4, 50, torch.float32, seed=5)
    bounds = [0, 17, 17, 50]
    want, gwant = grad_of(F.cross_entropy, logits.double(), target, label_smoothing=0.1)

    def rank(comm):
        sl = logits[:, bounds[comm.rank]:bounds[comm.rank + 1]]
        return grad_of(lambda a, b, **k: sharded_cross_entropy(a, b, group=comm, **k), sl, target,
                       label_smoothing=0.1)

    for r, (loss, g) in enumerate(LoopbackWorld(3).run(rank)):
        torch.testing.assert_close(loss.double(), want, atol=2e-5, rtol=2e-6)
        torch.testing.assert_close(g.double(), gwant[:, bounds[r]:bounds[r + 1]], atol=2e-6, rtol=2e-5)
