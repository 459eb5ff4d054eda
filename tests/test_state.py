"""The state algebra: identity, associativity, commutativity, the -inf guard, merge_states."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import splitsoftmax as ss
from splitsoftmax.core import reference as ref
from splitsoftmax.core import state

NEG_INF = float("-inf")


def states_of(x: torch.Tensor, v: torch.Tensor, cuts: list[int]) -> list[state.State]:
    """float64 states of the column blocks of scores ``x (R, N)`` with values ``v (N, Dv)``."""
    bounds = [0, *cuts, x.shape[1]]
    return [state.tile_state(x[:, a:b], v[a:b]) for a, b in zip(bounds, bounds[1:])]


def close(a: state.State, b: state.State) -> None:
    oa, la = state.to_out_lse(a)
    ob, lb = state.to_out_lse(b)
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(oa, ob, rtol=1e-12, atol=1e-12)


@st.composite
def split_rows(draw):
    n = draw(st.integers(0, 40))
    rows = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=5)))  # repeated cuts make empty blocks
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g, dtype=torch.float64) * draw(st.sampled_from([1.0, 30.0]))
    mask = torch.rand(rows, n, generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    x = x.masked_fill(mask, NEG_INF)
    v = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return x, v, cuts


@settings(max_examples=150, deadline=None)
@given(split_rows())
def test_any_split_merges_to_the_whole_row(case):
    x, v, cuts = case
    parts = states_of(x, v, cuts)
    merged = parts[0]
    for p in parts[1:]:
        merged = state.merge(merged, p)
    close(merged, state.tile_state(x, v))
    out, lse = state.to_out_lse(merged)
    torch.testing.assert_close(lse, ref.logsumexp(x, -1), rtol=1e-12, atol=1e-12)
    assert not torch.isnan(out).any()


@settings(max_examples=100, deadline=None)
@given(split_rows())
def test_identity_associativity_commutativity(case):
    x, v, cuts = case
    parts = states_of(x, v, cuts) + states_of(x.flip(1), v.flip(0), [])
    a, b, c = parts[0], parts[-1], parts[len(parts) // 2]
    e = state.empty_state((x.shape[0],), 3, dtype=torch.float64)
    close(state.merge(a, e), a)
    close(state.merge(e, a), a)
    close(state.merge(a, b), state.merge(b, a))
    close(state.merge(state.merge(a, b), c), state.merge(a, state.merge(b, c)))


def test_all_empty_merge_is_empty_not_nan():
    e = state.empty_state((2,), 4)
    out, lse = state.to_out_lse(state.merge(e, e))
    assert torch.equal(out, torch.zeros(2, 4)) and torch.equal(lse, torch.full((2,), NEG_INF))


def test_worked_merge_from_the_lesson():
    s = state.merge(state.State(torch.tensor([10.0]), torch.tensor([1.8])),
                    state.State(torch.tensor([12.0]), torch.tensor([1.3])))
    assert s.m.item() == 12.0
    assert s.l.item() == pytest.approx(math.exp(-2) * 1.8 + 1.3, rel=1e-6)
    assert s.l.item() == pytest.approx(1.544, abs=1e-3)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 97, 133])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_states_matches_split_then_merge(n, dtype):
    q = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    k = torch.randn(2, 3, n * 4, 16, dtype=torch.float64)
    v = torch.randn(2, 3, n * 4, 8, dtype=torch.float64)
    parts = [ref.attention(q, kb, vb) for kb, vb in zip(k.chunk(n, 2), v.chunk(n, 2))]
    outs = torch.stack([o for o, _ in parts]).to(dtype)
    lses = torch.stack([l for _, l in parts]).float()
    out, lse = ss.merge_states(outs, lses)
    want, want_lse = ref.attention(q, k, v)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_merge_states_ignores_empty_partials_even_nan():
    outs = torch.randn(4, 3, 6)
    lses = torch.randn(4, 3)
    lses[1] = NEG_INF
    outs[1] = float("nan")
    lses[3, 0] = NEG_INF
    outs[3, 0] = float("inf")
    out, lse = ss.merge_states(outs, lses)
    keep = torch.tensor([0, 2])
    want, want_lse = ss.merge_states(outs[keep], lses[keep])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1:], state.merge_out_lse(outs[[0, 2, 3]][:, 1:], lses[[0, 2, 3]][:, 1:])[0])
    torch.testing.assert_close(out[0], want[0])
    torch.testing.assert_close(lse[0], want_lse[0])


def test_merge_states_all_empty_rows_and_gradients_zero():
    outs = torch.full((3, 2, 5), float("nan"), requires_grad=True)
    lses = torch.full((3, 2), NEG_INF, requires_grad=True)
    out, lse = ss.merge_states(outs, lses)
    assert torch.equal(out, torch.zeros(2, 5)) and torch.equal(lse, torch.full((2,), NEG_INF))
    go, gl = torch.autograd.grad((out * torch.randn(2, 5)).sum() + lse.clamp(min=0).sum(), (outs, lses))
    assert torch.equal(go, torch.zeros_like(go)) and torch.equal(gl, torch.zeros_like(gl))


def test_merge_states_order_does_not_matter():
    outs, lses = torch.randn(5, 4, 7, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64) * 10
    perm = torch.randperm(5)
    a, la = ss.merge_states(outs, lses)
    b, lb = ss.merge_states(outs[perm], lses[perm])
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(la, lb)


def test_merge_states_gradients_match_float64_autograd():
    outs = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    lses = (torch.randn(3, 4, dtype=torch.float64) * 3).requires_grad_(True)
    with torch.no_grad():
        lses[2, 1] = NEG_INF
    go, gl = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    out, lse = ss.merge_states(outs, lses)
    got = torch.autograd.grad((out * go).sum() + (lse.double() * gl).sum(), (outs, lses))

    def plain(o, l):
        w = torch.softmax(l, 0)
        return (w.unsqueeze(-1) * o).sum(0), torch.logsumexp(l, 0)
    o2, l2 = plain(outs, lses)
    want = torch.autograd.grad((o2 * go).sum() + (l2 * gl).sum(), (outs, lses))
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)  # lse travels as float32


def test_merge_states_bad_arguments():
    with pytest.raises(TypeError, match="outs"):
        ss.merge_states([1.0], torch.zeros(1))
    with pytest.raises(ValueError, match="lses shape"):
        ss.merge_states(torch.zeros(3, 4, 5), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="outs"):
        ss.merge_states(torch.zeros(3), torch.zeros(3))
