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
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_hidden_value_in_a_diagonal_tile_bf16(bad, device):
    """bf16 with whole tiles (the Triton forward reads TMA row views on Hopper and in the
    interpreter): a NaN/Inf value at key 100 reaches rows >= 100 only; rows < 100 are bit for bit
    those of the same inputs with that value finite."""
    q, k, v = (torch.randn(1, 2, 128, 16, device=device, dtype=torch.bfloat16) for _ in range(3))
    want = ss.attention(q, k, v, causal=True)
    v[0, :, 100, 3] = bad
    out = ss.attention(q, k, v, causal=True)
    assert torch.equal(out[:, :, :100], want[:, :, :100])
    assert (~torch.isfinite(out[:, :, 100:])).any(-1).all()


@pytest.mark.parametrize("device", DEVICES)
def test_visible_nan_value_poisons_the_rows_that_see_it(device):
    q, k, v = (torch.randn(1, 1, 24, 16, device=device) for _ in range(3))
    v[0, 0, 10] = float("nan")
    out = ss.attention(q, k, v, causal=True)
    rows_with_nan = torch.isnan(out[0, 0]).any(-1)
    assert rows_with_nan[10:].all() and not rows_with_nan[:10].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq,sk", [(2, 32), (1, 600)])  # (1, 600): split-KV partials on the GPU too
def test_a_nan_row_is_not_an_empty_row(sq, sk, device):
    """A row a NaN key reaches has lse NaN, never -inf (which means empty, and merges skip empty
    parts): merging it with a clean part keeps the NaN; rows of other kv heads stay clean."""
    q = torch.randn(1, 4, sq, 16, device=device)
    k, v = (torch.randn(1, 2, sk, 16, device=device) for _ in range(2))
    k[0, 0, 3, 0] = float("nan")  # kv head 0: query heads 0 and 1
    out, lse = ss.attention(q, k, v, return_lse=True)
    assert torch.isnan(lse[:, :2]).all() and torch.isnan(out[:, :2]).all()
    assert torch.isfinite(lse[:, 2:]).all() and torch.isfinite(out[:, 2:]).all()
    parts = [ss.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True) for a, b in ((0, sk // 2), (sk // 2, sk))]
    merged, mlse = ss.merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert torch.isnan(mlse[:, :2]).all() and torch.isnan(merged[:, :2]).all()
    torch.testing.assert_close(merged[:, 2:], out[:, 2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mlse[:, 2:], lse[:, 2:], atol=1e-5, rtol=1e-5)
