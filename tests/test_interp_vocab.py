"""The Triton vocabulary-statistics kernels under TRITON_INTERPRET=1, at tiny sizes: every path
(rows batched per program, rows split over programs, masked tails) against the torch path in
float64 and the float64 oracles; the sharded ops on the loopback world."""
import os

import pytest
import torch

pytestmark = pytest.mark.interpreter
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter lane: run with TRITON_INTERPRET=1", allow_module_level=True)

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.core import reference as ref  # noqa: E402
from splitsoftmax.distributed import LoopbackWorld  # noqa: E402
from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.ops.vocab import torch as vocab_cpu  # noqa: E402
from splitsoftmax.ops.vocab import kernel as tv  # noqa: E402

import test_vocab_sharded as cases  # noqa: E402

NEG_INF = float("-inf")
# the interpreter truncates float32 to bf16 where the GPU rounds: one bf16 ulp, relative
BF16_GRAD_RTOL = 2 ** -7
# (rows, V): rows batched per program (V <= 16), split rows (few rows, V over several tiles), both
SHAPES = [(40, 13), (3, 97), (9, 40), (1, 1)]


def make(n, v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
    q = p + torch.randn(n, v, generator=g, dtype=torch.float64)
    p[0, : v // 2] = NEG_INF
    q[0, : v // 2] = NEG_INF
    if n > 2:
        p[2], q[2] = NEG_INF, NEG_INF
    target = torch.randint(0, v, (n,), generator=g)
    return p.to(dtype), q.to(dtype), target


def test_paths_are_reached():
    assert tv.plan(40, 13, configs.VOCAB_FWD_TILE, torch.device("cpu"))[0] > 1, "rows batched per program"
    assert tv.plan(3, 97, configs.VOCAB_FWD_TILE, torch.device("cpu"))[4] > 1, "rows split over programs"


@pytest.mark.parametrize("n,v", SHAPES)
@pytest.mark.parametrize("col0", [0, 7, -5])
def test_records_match_the_torch_path(n, v, col0):
    """Records of a slice starting at global column ``col0`` (targets inside and outside it)."""
    p, q, target = make(n, v, torch.float32, seed=n * v)
    target = target + col0
    for entropy in (True, False):
        got = tv.vocab_records(p, target, col0, 1 / 0.7, entropy)
        want = vocab_cpu.vocab_records(p.double(), target, col0, 1 / 0.7, entropy)
        assert got.dtype == torch.float32 and got.shape == (n, 4)
        torch.testing.assert_close(got[:, 0].double(), want[:, 0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[:, [1, 3]].double(), want[:, [1, 3]], atol=1e-6, rtol=1e-5)
        if entropy:
            torch.testing.assert_close(got[:, 2].double(), want[:, 2], atol=1e-5, rtol=1e-5)
    got = tv.kl_records(p, q, 1 / 0.7)
    want = vocab_cpu.kl_records(p.double(), q.double(), 1 / 0.7)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_finish_matches_the_torch_path():
    """Records with empty rows, a NaN row and ignored rows, turned into statistics by both paths."""
    p, q, target = make(7, 30, torch.float32, seed=3)
    p[4, 3] = float("nan")
    target[5] = -100
    rec, krec = vocab_cpu.vocab_records(p, target, 0, 1.0, True), vocab_cpu.kl_records(p, q, 1.0)
    for got, want in ((tv.vocab_finish(rec, target, -100), vocab_cpu.vocab_finish(rec, target, -100)),
                      (tv.vocab_finish(rec, None, -100), vocab_cpu.vocab_finish(rec, None, -100)),
                      (tv.kl_finish(krec), vocab_cpu.kl_finish(krec))):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("n,v", SHAPES)
def test_backward_matches_the_torch_path(n, v):
    p, q, target = make(n, v, torch.bfloat16, seed=n + v)
    col0 = 3
    target = target + col0
    rec = vocab_cpu.vocab_records(p, target, col0, 2.0, True)
    _, _, rows = vocab_cpu.vocab_finish(rec, target, -100)
    g = torch.linspace(-1, 1, n)
    for g_logp, g_ent in ((g, g.flip(0)), (g, None), (None, g)):
        t = target if g_logp is not None else None
        gl, gh = vocab_cpu.stats_coefs(rows, t, -100, g_logp, g_ent)  # 0 in the all -inf row
        got = tv.vocab_bwd(p, t, rows, gl, gh, 2.0, col0)
        want = vocab_cpu.vocab_bwd(p.double(), t, rows.double(), gl, gh, 2.0, col0)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=BF16_GRAD_RTOL)
    _, krows = vocab_cpu.kl_finish(vocab_cpu.kl_records(p, q, 2.0))
    g = vocab_cpu.kl_coef(krows, g)
    got = tv.kl_bwd(p, q, krows, g, 2.0)
    want = vocab_cpu.kl_bwd(p.double(), q.double(), krows.double(), g, 2.0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-6, rtol=BF16_GRAD_RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_public_ops_match_float64(dtype):
    """ss.logprobs / entropy / kl_div on the Triton kernels against the float64 oracles."""
    p, q, target = make(6, 75, dtype, seed=11)
    target[3] = -100
    w = torch.linspace(0.5, 1.5, 6).bfloat16().double()
    for ours, oracle, inputs in (
            (lambda a: ss.logprobs(a, target, temperature=0.8, return_entropy=True),
             lambda a: ref.vocab_stats(a, target, temperature=0.8), (p,)),
            (lambda a: (ss.entropy(a),), lambda a: (ref.vocab_stats(a, target * 0)[1],), (p,)),
            (lambda a, b: (ss.kl_div(a, b, temperature=1.5),), lambda a, b: (ref.kl_div(a, b, temperature=1.5),),
             (p, q))):
        leaves = [t.clone().requires_grad_() for t in inputs]
        d_leaves = [t.double().requires_grad_() for t in inputs]
        got, want = ours(*leaves), oracle(*d_leaves)
        g = torch.autograd.grad(sum((o * w.float()).sum() for o in got), leaves)
        gw = torch.autograd.grad(sum((o * w).sum() for o in want), d_leaves)
        for a, b in zip(got, want):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a.double(), b, atol=4e-6, rtol=2e-6)
        for a, b in zip(g, gw):
            assert a.dtype == dtype
            rtol = 1e-5 if dtype == torch.float32 else BF16_GRAD_RTOL
            torch.testing.assert_close(a.double(), b, atol=1e-6, rtol=rtol)


@pytest.mark.parametrize("size", [2, 3])
def test_sharded_on_the_kernels(size):
    """The sharded cases (odd widths, an empty slice at P = 3) with Triton kernels on every rank."""
    def run(group):
        for dtype, stol, gtol in cases.CASES[1:]:
            gtol = dict(gtol, rtol=BF16_GRAD_RTOL) if dtype == torch.bfloat16 else gtol
            cases.check_stats(group, dtype, stol, gtol, 0.6, seed=20)
    LoopbackWorld(size).run(run)
