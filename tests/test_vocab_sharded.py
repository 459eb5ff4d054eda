"""ss.sharded_logprobs / sharded_entropy / sharded_kl_div against float64 on the full logits.

Each ``case_*(group)`` builds the full logits from a fixed seed on every rank, takes this rank's
slice of the vocabulary (odd widths, an empty slice when P > 2) and asserts every statistic and
its gradient slice against ``splitsoftmax.core.reference`` in float64, with results identical on every
rank. Here they run on the loopback world (P = 1, 2, 3, 5); the same functions run in 2 and 3 Gloo
processes and under mpirun (and in NCCL workers from the gpu lane).
"""
from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

import splitsoftmax as ss
from splitsoftmax.core import reference as ref
from splitsoftmax.distributed import LoopbackWorld, as_comm, handshake, tree, unshard
from splitsoftmax.ops.vocab import torch as vocab_cpu

from _dist_util import assert_ok, mpirun, mpirun_path, spawn

NEG_INF = float("-inf")
DEVICE = torch.device(os.environ.get("SPLITSOFTMAX_TEST_DEVICE", "cpu"))
N, V = 9, 37
# (dtype, statistics tolerance, gradient tolerance) against float64 on the same (rounded) inputs:
# float32 statistics (float64 ones rounded once to the float32 result); gradients rounded once to
# the logits' dtype
CASES = [(torch.float64, dict(atol=1e-7, rtol=1.2e-7), dict(atol=1e-12, rtol=1e-10)),
         (torch.float32, dict(atol=4e-6, rtol=2e-6), dict(atol=1e-6, rtol=1e-5)),
         (torch.bfloat16, dict(atol=4e-6, rtol=2e-6), dict(atol=1e-5, rtol=2 ** -8))]


def widths(p: int, v: int, seed: int) -> list:
    """Unequal slice widths summing to ``v``, one of them 0 when P > 2."""
    if p == 1:
        return [v]
    cuts = sorted(torch.randint(0, v + 1, (p - 1,), generator=torch.Generator().manual_seed(seed)).tolist())
    w = [b - a for a, b in zip([0, *cuts], [*cuts, v])]
    if p > 2:
        w[1], w[-1] = 0, w[-1] + w[1]
    return w


def logits_pair(seed: int, dtype, n=N, v=V):
    """``(p, q, target)``: row 2 all -inf in both, row 4 -inf on its first columns in both, row 6
    holding a NaN in p; targets with ignored rows (and row 4's target on a -inf column)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
    q = p + torch.randn(n, v, generator=g, dtype=torch.float64)
    for t in (p, q):
        t[2] = NEG_INF
        t[4, : v // 3] = NEG_INF
    p[6, v - 2] = float("nan")
    target = torch.randint(0, v, (n,), generator=g)
    target[[1, 7]] = -100
    target[4] = 1
    return p.to(DEVICE, dtype), q.to(DEVICE, dtype), target.to(DEVICE)


@contextlib.contextmanager
def small_blocks(cols: int = 8):
    """The torch path walks V in blocks of ``cols`` columns, so a slice spans several."""
    saved = vocab_cpu.CPU_BLOCK_COLS
    vocab_cpu.CPU_BLOCK_COLS = cols
    try:
        yield
    finally:
        vocab_cpu.CPU_BLOCK_COLS = saved


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=g).bfloat16().to(DEVICE, torch.float64) for _ in range(3)]  # exact in bf16


def _grad(outs, weights, leaves):
    return torch.autograd.grad(sum((o * w.to(o.dtype)).sum() for o, w in zip(outs, weights)), leaves)


def _same_everywhere(t, group, what):
    every = unshard(t.detach().double().unsqueeze(0), 0, group=group)
    for e in every:
        torch.testing.assert_close(e, every[0], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{what}: results differ across ranks: {m}")


def _close(got, want, tol, what, nan_rows=(6,)):
    """``got`` against float64 ``want``; ``nan_rows`` must be NaN in both, the others match."""
    assert got.dtype == torch.float32 and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    keep = [i for i in range(got.shape[0]) if i not in nan_rows]
    for i in nan_rows:
        assert torch.isnan(got[i]) and torch.isnan(want[i]), f"{what}: row {i} is not NaN"
    torch.testing.assert_close(got[keep].double(), want[keep], **tol, msg=lambda m: f"{what}: {m}")


ROWS = [i for i in range(N) if i != 6]  # gradients through every row but the NaN one


def _references(p, q, target, temperature, seed):
    """float64 statistics and gradients (of the weighted sums over ROWS) on the full logits."""
    pf, qf = p.double().requires_grad_(), q.double().requires_grad_()
    lp, h = ref.vocab_stats(pf, target, temperature=temperature)
    h_all = ref.vocab_stats(pf, torch.zeros_like(target), temperature=temperature)[1]  # nothing ignored
    kl = ref.kl_div(pf, qf, temperature=temperature)
    ws = _weights(seed)
    grads = {"logprobs": _grad([lp[ROWS], h[ROWS]], [ws[0][ROWS], ws[1][ROWS]], [pf]),
             "entropy": _grad([h_all[ROWS]], [ws[1][ROWS]], [pf]),
             "kl": _grad([kl[ROWS]], [ws[2][ROWS]], [pf, qf])}
    return {"logp": lp, "entropy": h, "h_all": h_all, "kl": kl}, grads, ws


def check_stats(group, dtype, stol, gtol, temperature, seed):
    c = as_comm(group)
    w = widths(c.size, V, seed)
    lo, hi = sum(w[:c.rank]), sum(w[:c.rank + 1])
    p, q, target = logits_pair(seed, dtype)
    what = f"{dtype} T={temperature} widths={w} rank {c.rank}"
    want, wgrads, ws = _references(p, q, target, temperature, seed)
    ps, qs = (t[:, lo:hi].clone().requires_grad_() for t in (p, q))
    lp, h = ss.sharded_logprobs(ps, target, temperature=temperature, return_entropy=True, group=group)
    h_all = ss.sharded_entropy(ps, temperature=temperature, group=group)
    kl = ss.sharded_kl_div(ps, qs, temperature=temperature, group=group)
    for name, got in (("logp", lp), ("entropy", h), ("h_all", h_all), ("kl", kl)):
        _close(got, want[name].detach(), stol, f"{what} {name}")
        _same_everywhere(got, group, f"{what} {name}")
    assert lp[2] == NEG_INF and h[2] == 0 and kl[2] == 0 and h_all[2] == 0, f"{what}: the all -inf row"
    assert lp[4] == NEG_INF and lp[1] == 0 and h[1] == 0 and lp[7] == 0, f"{what}: -inf target, ignored rows"
    grads = {"logprobs": _grad([lp[ROWS], h[ROWS]], [ws[0][ROWS], ws[1][ROWS]], [ps]),
             "entropy": _grad([h_all[ROWS]], [ws[1][ROWS]], [ps]),
             "kl": _grad([kl[ROWS]], [ws[2][ROWS]], [ps, qs])}
    for name, got in grads.items():
        for g, g_ref in zip(got, wgrads[name]):
            assert g.dtype == dtype and g.shape == ps.shape and torch.isfinite(g).all(), f"{what} d{name}"
            assert not g[6].any(), f"{what} d{name}: gradient in a row outside the loss"
            torch.testing.assert_close(g[ROWS].double(), g_ref[ROWS, lo:hi], **gtol,
                                       msg=lambda m: f"{what} d{name}: {m}")


def case_stats(group):
    """Every statistic and gradient against float64, three dtypes, two temperatures."""
    with small_blocks():
        for i, (dtype, stol, gtol) in enumerate(CASES):
            for temperature in (1.0, 0.6):
                check_stats(group, dtype, stol, gtol, temperature, seed=10 + i)


def case_mismatch(group):
    """Ranks that disagree (N, dtype, temperature, ignore_index, target, return_entropy) or a rank
    with a bad argument: ValueError on every rank, naming the field; the group stays usable."""
    c = as_comm(group)
    if c.size == 1:
        return
    p, q, target = logits_pair(3, torch.float32)
    w = widths(c.size, V, 3)
    mine = p[:, sum(w[:c.rank]):sum(w[:c.rank + 1])]
    last = c.rank == c.size - 1
    with pytest.raises(ValueError, match=r"N differs across ranks"):
        ss.sharded_logprobs(mine[: N - last], target[: N - last], group=group)
    with pytest.raises(ValueError, match=r"dtype differs across ranks"):
        ss.sharded_entropy(mine.double() if last else mine, group=group)
    with pytest.raises(ValueError, match=r"temperature differs across ranks.*\]: 0\.5"):
        ss.sharded_kl_div(mine, mine, temperature=0.5 if last else 1.0, group=group)
    with pytest.raises(ValueError, match=r"ignore_index differs"):
        ss.sharded_logprobs(mine, target, ignore_index=-1 if last else -100, group=group)
    with pytest.raises(ValueError, match=r"return_entropy differs"):
        ss.sharded_logprobs(mine, target, return_entropy=last, group=group)
    other = target.clone()
    other[0] = (other[0] + 1) % V
    with pytest.raises(ValueError, match=r"target differs"):
        ss.sharded_logprobs(mine, other if last else target, group=group)
    with pytest.raises(ValueError, match=r"temperature=-1.0 must be|rejected their arguments \(rank .*: temperature"):
        ss.sharded_logprobs(mine, target, temperature=-1.0 if last else 1.0, group=group)
    with pytest.raises(ValueError, match=r"logits_q shape|rejected their arguments \(rank .*: logits_q"):
        ss.sharded_kl_div(mine, torch.zeros(N, mine.shape[1] + last, device=DEVICE), group=group)
    got = ss.sharded_entropy(mine, group=group)  # the group still works
    assert torch.isfinite(got[[0, 1, 3]]).all()


def case_all(group):
    """Every case, in one worker start."""
    case_stats(group)
    case_mismatch(group)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("case", [case_stats, case_mismatch], ids=lambda f: f.__name__)
def test_loopback(size, case):
    LoopbackWorld(size).run(case)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_one_packed_exchange_per_forward(size):
    """Forward: the handshake, then one record buffer per tree round (4 floats a row: 5 for KL);
    backward: no transfer at all."""
    p, q, target = logits_pair(1, torch.float32)
    world = LoopbackWorld(size)
    w = widths(size, V, 1)
    rounds = math.ceil(math.log2(size))

    def run(c):
        sl = slice(sum(w[:c.rank]), sum(w[:c.rank + 1]))
        ps, qs = p[:, sl].clone().requires_grad_(), q[:, sl].clone().requires_grad_()
        return ss.sharded_logprobs(ps, target, return_entropy=True, group=c), ss.sharded_kl_div(ps, qs, group=c)

    results = world.run(run)
    blocks = sum(min(k, size - k) for k in (2 ** i for i in range(rounds)))  # blocks each rank receives
    assert world.sends[tree.TAG_TREE] == 2 * size * rounds
    assert world.bytes[tree.TAG_TREE] == size * blocks * N * (4 + 5) * 4
    assert world.sends[handshake.TAG_META] == 2 * size * (size - 1)
    before = dict(world.sends)
    for (lp, h), kl in results:
        (lp[[0, 3, 5]].sum() + h.sum() + kl[[0, 3]].sum()).backward()
    assert dict(world.sends) == before


@pytest.mark.distributed
@pytest.mark.parametrize("size", [2, 3])
def test_gloo(size):
    assert_ok(spawn(size, "tests/test_vocab_sharded.py:case_all", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              f"gloo world of {size}")


@pytest.mark.mpi
@pytest.mark.skipif(mpirun_path() is None, reason="mpirun is not installed")
@pytest.mark.parametrize("size", [2, 3])
def test_mpi(size):
    pytest.importorskip("mpi4py")
    assert_ok(mpirun(size, "tests/test_vocab_sharded.py:case_all", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              f"mpirun -n {size}")


def test_an_int_past_int64_on_one_rank_is_refused_by_every_rank():
    """``k = 2^70`` on the last rank only: it does not fit the handshake's int64 words, so that rank
    raises the ValueError naming ``k`` and its peers refuse in the same exchange."""
    x = torch.randn(3, 10)

    def case(group):
        last = group.rank == group.size - 1
        mine = x.tensor_split(group.size, dim=1)[group.rank]
        with pytest.raises(ValueError, match=r"k=1180591620717411303424 is out of range" if last
                           else r"rank\(s\) \[1\] rejected their arguments \(rank 1: k"):
            ss.sharded_topk(mine, 2 ** 70 if last else 2, group=group)
    LoopbackWorld(2).run(case, timeout=60)
