"""NaN or Inf only in positions that a causal mask hides changes nothing, forward and backward.

The same tests run the Triton kernels in tests/test_interp_masked_nan.py.
"""
import pytest
import torch

import splitsoftmax as ss

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_poison_in_the_last_position_reaches_only_the_last_row(where, bad, device):
    s = 150  # more than one key tile on the GPU
    q, k, v = (torch.randn(1, 2, s, 16, device=device) for _ in range(3))
    dict(q=q, k=k, v=v)[where][0, :, -1] = bad
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ss.attention(*leaves, causal=True)
    clean = [t[:, :, :-1].clone().requires_grad_(True) for t in (q, k, v)]
    want = ss.attention(*clean, causal=True)
    assert torch.isfinite(out[:, :, :-1]).all()
    torch.testing.assert_close(out[:, :, :-1], want, atol=1e-6, rtol=1e-5)
    if where == "q":  # the NaN query's own row is NaN; like torch, its zero cotangent times NaN
        return        # may still reach the keys' gradients, so only the forward is promised
    proj = torch.randn_like(want)
    got = torch.autograd.grad((out[:, :, :-1] * proj).sum(), leaves)
    exp = torch.autograd.grad((want * proj).sum(), clean)
    for g, e in zip(got, exp):
        assert torch.isfinite(g[:, :, :-1]).all()
        torch.testing.assert_close(g[:, :, :-1], e, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_visible_nan_value_poisons_the_rows_that_see_it(device):
    q, k, v = (torch.randn(1, 1, 24, 16, device=device) for _ in range(3))
    v[0, 0, 10] = float("nan")
    out = ss.attention(q, k, v, causal=True)
    rows_with_nan = torch.isnan(out[0, 0]).any(-1)
    assert rows_with_nan[10:].all() and not rows_with_nan[:10].any()
