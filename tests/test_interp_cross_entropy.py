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
from splitsoftmax.kernels import cpu  # noqa: E402
from splitsoftmax.kernels import cross_entropy as tce  # noqa: E402
from splitsoftmax.losses import cross_entropy, sharded_cross_entropy  # noqa: E402

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
    want = cpu.ce_stats(logits.double(), target, col0, with_sum)
    ours = cpu.ce_stats(logits, target, col0, with_sum)
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
    want_loss, want_lse = cpu.ce_rows(stats, target, -100, smoothing, 50)
    assert loss.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(loss.double(), want_loss, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.equal(loss[target == -100], torch.zeros(int((target == -100).sum())))


@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.0), ("none", 0.1), ("sum", 0.3)])
def test_cross_entropy_matches_torch(reduction, smoothing):
    logits, target = make(6, 75, torch.float32, seed=3)
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
