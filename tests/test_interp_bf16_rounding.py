"""Interpreter lane: bfloat16 casts round to nearest even (as on the GPU), and with them the Triton
kernels' bf16 gradients at head dims 16 and 32 meet FlashAttention's rule against the rule written
out in bf16 (``test_variants._rule_written_out``: scores from bf16 products, softmax in float32,
P rounded before its product with V), as the peers' own suites apply it (at most 2x the peer's error
against float64, no rounding allowance), on one device and over 2 ranks (ring, allgather, tree).

Triton's interpreter truncates float32 -> bfloat16 (every P, dS and result rounded toward zero),
which took the gradients to 3x the peer's error; ``ops._triton._interpreter`` rounds to nearest even."""
from __future__ import annotations

import math
import os

import pytest
import torch

pytestmark = pytest.mark.interpreter

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter lane: set TRITON_INTERPRET=1 before importing triton", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.ops._triton import _interpreter  # noqa: E402,F401
from test_interp_attention_bwd import err  # noqa: E402
from test_variants import _rule_written_out  # noqa: E402

BF16 = torch.bfloat16


@triton.jit
def _cast_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, tl.load(X + offs).to(tl.bfloat16))


def test_float32_to_bf16_rounds_to_nearest_even():
    """Every magnitude, ties, subnormals, overflow, infinities: torch's bits; NaN stays NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=g) * 10.0 ** torch.randint(-40, 39, (4000,), generator=g).float()
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.3895e38, 1 + 2 ** -8, 1 + 3 * 2 ** -8,
                            -(1 + 2 ** -8), -0.0, 1e-40, -3e-39])
    x = torch.cat((x, special, torch.zeros(4096 - 4000 - special.numel())))
    y = torch.empty(x.shape, dtype=BF16)
    _cast_kernel[(1,)](x, y, x.numel())
    nan = x.isnan()
    assert torch.equal(y.view(torch.int16)[~nan], x.to(BF16).view(torch.int16)[~nan])
    assert y[nan].isnan().all()


def _grads(fn, q, k, v, dout, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad((fn(*leaves).double() * dout.double()).sum(), leaves)


def _inputs(s, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, s, d, generator=g).to(BF16) for h in (4, 2, 2, 4)]


def _check(got, q, k, v, dout, causal, what, mine=(lambda t: t,) * 3):
    scale = 1 / math.sqrt(q.shape[-1])
    written = lambda q, k, v: _rule_written_out(q, k, v, scale, causal=causal)[0]  # noqa: E731
    want = _grads(written, q, k, v, dout, torch.float64)
    peer = _grads(written, q, k, v, dout, BF16)
    for name, a, p, w, m in zip(("dq", "dk", "dv"), got, peer, want, mine):
        assert err(a, m(w)) <= 2 * err(m(p), m(w)), (what, name, err(a, m(w)), err(m(p), m(w)))


@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_gradients_within_the_rule(d, causal):
    q, k, v, dout = _inputs(100, d, seed=d + causal)
    got = _grads(lambda q, k, v: ss.attention(q, k, v, causal=causal), q, k, v, dout, BF16)
    _check(got, q, k, v, dout, causal, f"d={d} causal={causal}")


def _sharded_case(group, schedule, layout, causal, d):
    q, k, v, dout = _inputs(96, d, seed=3)
    shard = lambda t: ss.shard(t, 2, group=group, layout=layout)  # noqa: E731
    whole = lambda t: t  # noqa: E731
    mine = (whole, shard, shard) if schedule == "tree" else (shard,) * 3  # the tree splits the keys only
    leaves = [m(t).clone().requires_grad_() for m, t in zip(mine, (q, k, v))]
    out = ss.sharded_attention(*leaves, causal=causal, group=group, schedule=schedule, layout=layout)
    out.backward(mine[0](dout))
    _check([t.grad for t in leaves], q, k, v, dout, causal, (schedule, causal, d), mine)


@pytest.mark.parametrize("schedule,layout,causal,d", [("ring", "zigzag", True, 16), ("ring", "contiguous", False, 32),
                                                      ("allgather", "contiguous", True, 32),
                                                      ("tree", "contiguous", False, 16)])
def test_bf16_sharded_gradients_within_the_rule(schedule, layout, causal, d):
    from splitsoftmax.distributed import LoopbackWorld
    LoopbackWorld(2).run(lambda g: _sharded_case(g, schedule, layout, causal, d))
