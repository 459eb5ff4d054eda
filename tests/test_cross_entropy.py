"""ss.cross_entropy and ss.sharded_cross_entropy against torch.nn.functional.cross_entropy (float64)."""
import pytest
import torch
import torch.nn.functional as F

from _ce_util import loss_and_grad as ours
from splitsoftmax.distributed import LoopbackWorld, tree
from splitsoftmax.ops.cross_entropy.api import cross_entropy, sharded_cross_entropy

NEG_INF = float("-inf")
REDUCTIONS = ["mean", "sum", "none"]


def make(n, v, dtype, seed=0, ignore_frac=0.25, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[torch.rand(n, generator=g) < ignore_frac] = ignore_index
    return logits, target


def torch_ce(logits, target, **kw):
    """Loss and logits gradient of torch's cross_entropy (projected on a ramp for reduction='none')."""
    return ours(F.cross_entropy, logits, target, **kw)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("n,v", [(1, 1), (7, 97), (33, 1000)])
def test_float32_matches_torch_float64(reduction, smoothing, n, v, monkeypatch):
    monkeypatch.setattr("splitsoftmax.ops.cross_entropy.torch.CPU_BLOCK_COLS", 64)
    logits, target = make(n, v, torch.float32)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    want, gwant = torch_ce(logits.double(), target, **kw)
    got, g = ours(cross_entropy, logits, target, **kw)
    assert got.dtype == torch.float32 and got.shape == want.shape and g.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-6, equal_nan=True)
    torch.testing.assert_close(g.double(), gwant, atol=2e-6, rtol=2e-5, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_precision_error_within_torch_error(dtype, reduction):
    logits, target = make(64, 3000, dtype, seed=1)
    kw = dict(reduction=reduction, label_smoothing=0.05)
    want, gwant = torch_ce(logits.double(), target, **kw)
    tl, tg = torch_ce(logits, target, **kw)
    got, g = ours(cross_entropy, logits, target, **kw)
    assert got.dtype == dtype and g.dtype == dtype
    for mine, theirs, ref in ((got, tl, want), (g, tg, gwant)):
        err = (mine.double() - ref).abs().max().item()
        torch_err = (theirs.double() - ref).abs().max().item()
        assert err <= 2 * torch_err + 1e-6, (err, torch_err)


def test_ignore_index_and_edge_rows():
    logits, target = make(6, 50, torch.float32, ignore_frac=0.0)
    target[[1, 4]] = 7  # custom ignore index
    logits[2, 30:] = NEG_INF  # masked classes; the target stays finite
    target[2] = 3
    for red in REDUCTIONS:
        want, gwant = torch_ce(logits.double(), target, ignore_index=7, reduction=red)
        got, g = ours(cross_entropy, logits, target, ignore_index=7, reduction=red)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-6)
        torch.testing.assert_close(g.double(), gwant, atol=2e-6, rtol=2e-5)
        assert torch.equal(g[[1, 4]], torch.zeros(2, 50))
    all_ignored = torch.full((6,), -100)
    assert torch.isnan(cross_entropy(logits, all_ignored))  # 0 / 0, like torch
    assert cross_entropy(logits, all_ignored, reduction="sum").item() == 0.0
    assert torch.isnan(cross_entropy(logits[:0], target[:0]))


def test_no_float32_copy_of_the_logits(monkeypatch):
    """bf16 logits are converted to float32 one column block at a time, never whole."""
    monkeypatch.setattr("splitsoftmax.ops.cross_entropy.torch.CPU_BLOCK_COLS", 128)
    n, v = 16, 1000
    widest = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if self.dtype == torch.bfloat16 and out.dtype == torch.float32:
            widest.append(out.numel())
        return out
    monkeypatch.setattr(torch.Tensor, "to", spy)
    logits, target = make(n, v, torch.bfloat16)
    x = logits.requires_grad_(True)
    cross_entropy(x, target, label_smoothing=0.1).backward()
    assert widest and max(widest) <= n * 128, max(widest)
    assert x.grad.dtype == torch.bfloat16


def test_bad_arguments():
    x, t = torch.randn(4, 10), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="logits"):
        cross_entropy(x[0], t)
    with pytest.raises(TypeError, match="target"):
        cross_entropy(x, t.float())
    with pytest.raises(ValueError, match="target shape"):
        cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="class 10"):
        cross_entropy(x, torch.tensor([1, 10, 3, 4]))
    with pytest.raises(ValueError, match="class -3"):
        cross_entropy(x, torch.tensor([1, -3, 3, 4]))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_opcheck_and_compile(reduction):
    logits, target = make(5, 40, torch.float32)
    x = logits.requires_grad_(True)
    torch.library.opcheck(torch.ops.splitsoftmax.ce_fwd, (x, target, -100, 0.1, reduction))
    _, lse, count = torch.ops.splitsoftmax.ce_fwd(logits.detach(), target, -100, 0.1, reduction)
    g = torch.randn(5) if reduction == "none" else torch.tensor(0.7)
    torch.library.opcheck(torch.ops.splitsoftmax.ce_bwd, (logits.detach(), target, lse, g, count, -100, 0.1, reduction))
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b: cross_entropy(a, b, label_smoothing=0.1, reduction=reduction), backend="aot_eager",
                       fullgraph=True)
    got, g = ours(fn, logits, target)
    want, gwant = torch_ce(logits.double(), target, label_smoothing=0.1, reduction=reduction)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(g.double(), gwant, atol=2e-6, rtol=2e-5)


def test_one_autograd_node():
    """The loss, its reduction and dtype are one node of the graph, for every reduction (no
    SumBackward / DivBackward / ToCopyBackward between it and the logits)."""
    logits, target = make(6, 30, torch.bfloat16)
    x = logits.requires_grad_(True)
    for red in REDUCTIONS:
        loss = cross_entropy(x, target, reduction=red)
        assert loss.dtype == torch.bfloat16 and loss.shape == ((6,) if red == "none" else ())
        after = [f for f, _ in loss.grad_fn.next_functions if f is not None]
        assert len(after) == 1 and type(after[0]).__name__ == "AccumulateGrad" and after[0].variable is x, red


def _widths(p, v, seed):
    """Unequal slice widths summing to ``v``, with an empty slice when P > 2."""
    if p == 1:
        return [v]
    cuts = sorted(torch.randint(0, v + 1, (p - 1,), generator=torch.Generator().manual_seed(seed)).tolist())
    w = [b - a for a, b in zip([0, *cuts], [*cuts, v])]
    if p > 2:
        w[1], w[-1] = 0, w[-1] + w[1]
    return w


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.0), ("sum", 0.2), ("none", 0.1)])
def test_sharded_matches_full(p, reduction, smoothing):
    logits, target = make(9, 61, torch.float32, seed=p)
    widths = _widths(p, 61, seed=p)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    want, gwant = torch_ce(logits.double(), target, **kw)
    bounds = torch.tensor([0, *widths]).cumsum(0).tolist()

    def rank(comm):
        sl = logits[:, bounds[comm.rank]:bounds[comm.rank + 1]]
        return ours(lambda a, b, **k: sharded_cross_entropy(a, b, group=comm, **k), sl, target, **kw)

    results = LoopbackWorld(p).run(rank)
    for r, (loss, g) in enumerate(results):
        assert torch.equal(loss, results[0][0]), "the loss differs between ranks"
        torch.testing.assert_close(loss.double(), want, atol=2e-5, rtol=2e-6)
        torch.testing.assert_close(g.double(), gwant[:, bounds[r]:bounds[r + 1]], atol=2e-6, rtol=2e-5)


def test_sharded_one_packed_exchange():
    """Forward: one statistics buffer per tree round (plus the handshake); backward: no transfer."""
    logits, target = make(4, 30, torch.float32)
    world = LoopbackWorld(4)

    def rank(comm):
        x = logits[:, comm.rank * 7:(comm.rank + 1) * 7 + (2 if comm.rank == 3 else 0)].clone().requires_grad_()
        return sharded_cross_entropy(x, target, group=comm), x

    results = world.run(rank)
    assert world.sends[tree.TAG_TREE] == 2 * 4  # ceil(log2 4) rounds, one message per rank each
    assert world.bytes[tree.TAG_TREE] == 4 * (1 + 2) * 4 * 4 * 4  # (1 + 2) blocks of (N=4, 4) float32
    before = dict(world.sends)
    for loss, _ in results:
        loss.backward()
    assert dict(world.sends) == before


def test_sharded_disagreement_raises_on_every_rank():
    logits, target = make(4, 12, torch.float32)

    def rank(comm):
        t = target.clone()
        if comm.rank == 1:
            t[0] = (t[0] + 1) % 12
        with pytest.raises(ValueError, match="target differs"):
            sharded_cross_entropy(logits[:, comm.rank * 6:(comm.rank + 1) * 6], t, group=comm)
        with pytest.raises(ValueError, match="label_smoothing"):
            sharded_cross_entropy(logits[:, comm.rank * 6:(comm.rank + 1) * 6], target, group=comm,
                                  label_smoothing=0.1 * comm.rank)
        return True

    assert LoopbackWorld(2).run(rank) == [True, True]


@pytest.mark.gpu
@pytest.mark.parametrize("n,v", [(3, 50000), (300, 4099), (2, 131072)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_triton_matches_torch(n, v, dtype):
    """The Triton kernels on CUDA (few rows: split rows): error at most 2x torch's, float32 floor."""
    logits, target = make(n, v, dtype, seed=n)
    target[0] = 1  # with every row ignored the mean is 0/0 = NaN, in torch and here alike
    logits, target = logits.cuda(), target.cuda()
    for eps in (0.0, 0.1):
        want, gwant = torch_ce(logits.double(), target, label_smoothing=eps)
        tl, tg = torch_ce(logits, target, label_smoothing=eps)
        got, g = ours(cross_entropy, logits, target, label_smoothing=eps)
        assert got.dtype == dtype and g.dtype == dtype
        for mine, theirs, ref in ((got, tl, want), (g, tg, gwant)):
            err = (mine.double() - ref).abs().max().item()
            assert err <= 2 * (theirs.double() - ref).abs().max().item() + 2e-6, err


@pytest.mark.gpu
def test_gpu_sharded_matches_full():
    logits, target = make(16, 3001, torch.bfloat16, seed=7)
    logits, target = logits.cuda(), target.cuda()
    want, gwant = torch_ce(logits.double(), target, label_smoothing=0.1)
    bounds = [0, 1000, 1000, 3001]

    def rank(comm):
        sl = logits[:, bounds[comm.rank]:bounds[comm.rank + 1]]
        return ours(lambda a, b, **k: sharded_cross_entropy(a, b, group=comm, **k), sl, target, label_smoothing=0.1)

    for r, (loss, g) in enumerate(LoopbackWorld(3).run(rank)):
        torch.testing.assert_close(loss.double(), want, atol=2e-2, rtol=1e-2)
        ref = gwant[:, bounds[r]:bounds[r + 1]]
        assert g.shape == ref.shape
        if ref.numel():  # rank 1 holds an empty slice
            assert (g.double() - ref).abs().max().item() <= 2 ** -7 * ref.abs().max().item() + 1e-6


@pytest.mark.gpu
def test_gpu_bad_target_fails_on_device():
    """On CUDA a target outside [0, V) fails a device-side assertion (no host sync), like torch's;
    it poisons the CUDA context, so it runs in a child process."""
    import subprocess
    import sys
    code = ("import torch, splitsoftmax as ss\n"
            "x = torch.randn(4, 10, device='cuda')\n"
            "ss.cross_entropy(x, torch.tensor([1, 10, 3, 4], device='cuda'))\n"
            "torch.cuda.synchronize()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "assert" in (done.stderr + done.stdout).lower(), done.stderr[-2000:]
