"""ss.logprobs / ss.entropy / ss.kl_div on one device (the torch path) against float64 oracles."""
import pytest
import torch
import torch.nn.functional as F

import splitsoftmax as ss
from splitsoftmax.core import reference as ref

NEG_INF = float("-inf")
# (statistics, gradient) tolerances against float64 on the same rounded inputs: float32 statistics;
# gradients rounded once to the logits' dtype (half an ulp, relative) after float32 math
TOL = {torch.float64: (dict(atol=1e-7, rtol=1.2e-7), dict(atol=1e-12, rtol=1e-10)),
       torch.float32: (dict(atol=4e-6, rtol=2e-6), dict(atol=1e-6, rtol=1e-5)),
       torch.bfloat16: (dict(atol=4e-6, rtol=2e-6), dict(atol=1e-6, rtol=2 ** -8)),
       torch.float16: (dict(atol=4e-6, rtol=2e-6), dict(atol=1e-6, rtol=2 ** -11))}


def make(n, v, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, v, generator=g, dtype=torch.float64) * scale
    q = p + torch.randn(n, v, generator=g, dtype=torch.float64)
    target = torch.randint(0, max(v, 1), (n,), generator=g)
    target[torch.rand(n, generator=g) < 0.25] = -100
    return p.to(dtype), q.to(dtype), target


def weights(n, seed=1):
    """Per-row weights exact in bf16 (so the weighted sums agree in every dtype)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).bfloat16().double()


def grads(fn, tensors, w):
    """``fn(*leaves)`` (a tuple of per-row outputs) and the gradients of ``sum(w * out)``."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    outs = fn(*leaves)
    loss = sum((o * w.to(o.dtype)).sum() for o in outs)
    return [o.detach() for o in outs], torch.autograd.grad(loss, leaves)


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr("splitsoftmax.ops.vocab.torch.CPU_BLOCK_COLS", 16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,v", [(1, 1), (7, 97), (20, 33), (5, 1000)])
@pytest.mark.parametrize("temperature", [1.0, 0.45, 2])
def test_matches_float64(dtype, n, v, temperature, small_blocks):
    """Each op's gradient comes from one backward (a low-precision sum of two ops' gradients would
    add its own rounding)."""
    p, q, target = make(n, v, dtype, seed=n + v)
    stol, gtol = TOL[dtype]
    w = weights(n)
    kw = dict(temperature=temperature)
    pairs = [("logprobs", lambda a: ss.logprobs(a, target, return_entropy=True, **kw),
              lambda a: ref.vocab_stats(a, target, **kw), (p,)),
             ("entropy", lambda a: (ss.entropy(a, **kw),), lambda a: (ref.vocab_stats(a, target * 0, **kw)[1],), (p,)),
             ("kl_div", lambda a, b: (ss.kl_div(a, b, **kw),), lambda a, b: (ref.kl_div(a, b, **kw),), (p, q))]
    for name, ours, oracle, inputs in pairs:
        got, g = grads(ours, inputs, w)
        want, gwant = grads(oracle, [t.double() for t in inputs], w)
        for mine, theirs in zip(got, want):
            assert mine.dtype == torch.float32 and mine.shape == (n,), name
            torch.testing.assert_close(mine.double(), theirs, **stol, msg=lambda m: f"{name}: {m}")
        for mine, theirs in zip(g, gwant):
            assert mine.dtype == dtype, name
            torch.testing.assert_close(mine.double(), theirs, **gtol, msg=lambda m: f"{name} gradient: {m}")
    lp_only = ss.logprobs(p, target, **kw)
    assert torch.equal(lp_only, ss.logprobs(p, target, return_entropy=True, **kw)[0])


def test_oracle_is_torch_on_finite_rows():
    """The float64 oracles equal torch's log_softmax / kl_div where every logit is finite."""
    p, q, target = make(6, 50, torch.float64)
    lp, h = ref.vocab_stats(p, target, temperature=0.7)
    ls, lq = F.log_softmax(p / 0.7, -1), F.log_softmax(q / 0.7, -1)
    keep = target != -100
    torch.testing.assert_close(lp[keep], ls[keep].gather(1, target[keep, None]).squeeze(1), atol=1e-13, rtol=0)
    torch.testing.assert_close(h[keep], -(ls.exp() * ls).sum(-1)[keep], atol=1e-13, rtol=0)
    kl = F.kl_div(lq, ls, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(ref.kl_div(p, q, temperature=0.7), kl, atol=1e-13, rtol=0)


def test_edge_rows(small_blocks):
    """All -inf rows: logp -inf, entropy 0, KL 0, zero gradients; NaN only in its own row; masked
    columns have probability 0; ignored rows give 0 and no gradient; a target on a -inf column
    gives -inf (gradient as torch's log_softmax: 1 at the target, -P elsewhere)."""
    p, q, target = make(6, 40, torch.float32, seed=5)
    p[0], q[0] = NEG_INF, NEG_INF
    p[1, 10:30], q[1, 10:30] = NEG_INF, NEG_INF
    p[2, 7] = float("nan")
    target[3] = 11
    target[1] = 12
    target[4] = 5
    w = weights(6)
    (lp, h), (gp,) = grads(lambda a: ss.logprobs(a, target, ignore_index=11, return_entropy=True), (p,), w)
    (kl,), (gkp, gq) = grads(lambda a, b: (ss.kl_div(a, b),), (p, q), w)
    assert lp[0] == NEG_INF and h[0] == 0 and kl[0] == 0 and lp[1] == NEG_INF
    assert torch.isnan(lp[2]) and torch.isnan(h[2]) and torch.isnan(kl[2]) and torch.isnan(gp[2]).all()
    assert lp[3] == 0 and h[3] == 0 and not gp[3].any()
    assert not gp[0].any() and not gkp[0].any() and not gq[0].any(), "an all -inf row has a gradient"
    masked = [c for c in range(10, 30) if c != 12]
    assert not gp[1, masked].any() and not gkp[1, 10:30].any() and not gq[1, 10:30].any()
    assert gp[1, 12] == w[1].float(), "logp's gradient at a -inf target is torch's: 1 - P = 1"
    rows = [0, 1, 3, 4, 5]
    want, (gwant,) = grads(lambda a: ref.vocab_stats(a, target, ignore_index=11), (p.double(),), w)
    kwant, kgwant = grads(lambda a, b: (ref.kl_div(a, b),), (p.double(), q.double()), w)
    assert gwant[1, 12] == w[1] and want[0][1] == NEG_INF, "the oracle: torch's gradient at the target"
    for mine, theirs in zip((lp, h, gp, kl, gkp, gq), (*want, gwant, *kwant, *kgwant)):
        assert torch.isfinite(mine[rows]).all() or mine.dim() == 1
        torch.testing.assert_close(mine[rows].double(), theirs[rows], atol=4e-6, rtol=1e-5)


def test_empty_shapes():
    for n, v in ((0, 5), (3, 0)):
        x = torch.randn(n, v, requires_grad=True)
        t = torch.full((n,), -100)
        lp, h = ss.logprobs(x, t, return_entropy=True)
        e, kl = ss.entropy(x), ss.kl_div(x, x)
        assert lp.shape == h.shape == e.shape == kl.shape == (n,)
        assert (lp == 0).all() and (h == 0).all() and (e == 0).all() and (kl == 0).all()
        (lp.sum() + e.sum() + kl.sum()).backward()
        assert x.grad.shape == (n, v) and not x.grad.any()


def test_strided_inputs_and_logits_untouched():
    """A column slice of a wider tensor (row stride != V) and a transposed view (column stride != 1)
    give the contiguous result; the logits are never written."""
    base = torch.randn(9, 60, dtype=torch.float32) * 3
    target = torch.randint(0, 40, (9,))
    x = base[:, 5:45]
    before = base.clone()
    want = ss.logprobs(x.contiguous(), target, return_entropy=True)
    xs = x.detach().requires_grad_()
    got = ss.logprobs(xs, target, return_entropy=True)
    (got[0].sum() + got[1].sum()).backward()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    xt = x.t().contiguous().t()
    y = torch.randn(9, 40)
    assert xt.stride(1) != 1
    torch.testing.assert_close(ss.kl_div(xt, y), ss.kl_div(x.contiguous(), y), atol=1e-6, rtol=1e-6)
    assert torch.equal(base, before)


def test_no_float32_copy_of_the_logits(monkeypatch):
    """bf16 logits are converted to float32 one column block at a time, never whole."""
    monkeypatch.setattr("splitsoftmax.ops.vocab.torch.CPU_BLOCK_COLS", 128)
    n, v = 16, 1000
    widest = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if self.dtype == torch.bfloat16 and out.dtype == torch.float32:
            widest.append(out.numel())
        return out
    monkeypatch.setattr(torch.Tensor, "to", spy)
    p, q, target = make(n, v, torch.bfloat16)
    p.requires_grad_(True)
    q.requires_grad_(True)
    lp, h = ss.logprobs(p, target, return_entropy=True)
    (lp.sum() + h.sum() + ss.kl_div(p, q).sum()).backward()
    assert widest and max(widest) <= n * 128, max(widest)
    assert p.grad.dtype == q.grad.dtype == torch.bfloat16


def test_bad_arguments():
    x, t = torch.randn(4, 10), torch.tensor([1, 2, 3, 4])
    cases = [(ValueError, "logits must be 2-D", lambda: ss.logprobs(x[0], t)),
             (ValueError, "logits must be 2-D", lambda: ss.entropy(x[None])),
             (TypeError, "logits must be a torch.Tensor", lambda: ss.entropy([[1.0]])),
             (TypeError, "logits must have a floating dtype", lambda: ss.entropy(t[None])),
             (TypeError, "target must", lambda: ss.logprobs(x, t.float())),
             (ValueError, "target shape", lambda: ss.logprobs(x, t[:3])),
             (ValueError, r"temperature=-0.5 must be", lambda: ss.logprobs(x, t, temperature=-0.5)),
             (ValueError, r"temperature=0 \(greedy", lambda: ss.entropy(x, temperature=0)),
             (ValueError, r"temperature=nan", lambda: ss.kl_div(x, x, temperature=float("nan"))),
             (ValueError, r"temperature=inf", lambda: ss.kl_div(x, x, temperature=float("inf"))),
             (TypeError, "temperature must be a float", lambda: ss.entropy(x, temperature=True)),
             (TypeError, "temperature must be a float", lambda: ss.entropy(x, temperature=torch.tensor(1.0))),
             (TypeError, "return_entropy must be a bool", lambda: ss.logprobs(x, t, return_entropy=1)),
             (TypeError, "ignore_index must be an int", lambda: ss.logprobs(x, t, ignore_index=1.0)),
             (ValueError, "class 10, outside", lambda: ss.logprobs(x, torch.tensor([1, 10, 3, 4]))),
             (ValueError, "class -3, outside", lambda: ss.logprobs(x, torch.tensor([1, -3, 3, 4]))),
             (ValueError, "logits_q shape", lambda: ss.kl_div(x, x[:, :9])),
             (TypeError, "logits_q dtype torch.bfloat16 must equal", lambda: ss.kl_div(x, x.bfloat16())),
             (ValueError, "logits_p must be 2-D", lambda: ss.kl_div(x[0], x[0]))]
    for kind, match, call in cases:
        with pytest.raises(kind, match=match):
            call()
    assert ss.logprobs(x, torch.tensor([1, 10, 3, 4]), ignore_index=10)[1] == 0  # an ignored id may be any value


def test_opcheck_and_compile():
    p, q, target = make(5, 40, torch.float32)
    torch.library.opcheck(torch.ops.splitsoftmax.vocab_fwd, (p.requires_grad_(), target, 0.8, -100, True))
    torch.library.opcheck(torch.ops.splitsoftmax.kl_fwd, (p, q.requires_grad_(), 0.8))
    _, _, rows = torch.ops.splitsoftmax.vocab_fwd(p.detach(), target, 0.8, -100, True)
    torch.library.opcheck(torch.ops.splitsoftmax.vocab_bwd, (p.detach(), target, rows, torch.randn(5),
                                                              torch.randn(5), 0.8, 0))
    _, krows = torch.ops.splitsoftmax.kl_fwd(p.detach(), q.detach(), 0.8)
    torch.library.opcheck(torch.ops.splitsoftmax.kl_bwd, (p.detach(), q.detach(), krows, torch.randn(5), 0.8))
    torch._dynamo.reset()

    def step(a, b):
        lp, h = ss.logprobs(a, target, temperature=0.8, return_entropy=True)
        return lp, h, ss.kl_div(a, b, temperature=0.8), ss.entropy(b)
    w = weights(5)
    got, g = grads(torch.compile(step, backend="aot_eager", fullgraph=True), (p, q), w)
    want, gwant = grads(step, (p, q), w)
    for a, b in zip((*got, *g), (*want, *gwant)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_bench_gate_and_peers_on_cpu():
    """``bench vocab``'s correctness gate on small CPU shapes: its torch peers agree with the oracles
    and ss passes the 2x rule (the harness the GPU run relies on)."""
    from splitsoftmax.tools.bench import vocab as bench
    rows = bench.gate_stats([(3, 500, torch.float32, 1.0), (16, 300, torch.bfloat16, 0.7)], device="cpu")
    assert len(rows) == 4 and all(r["ok"] for r in rows), rows
    assert all(r["torch_err"] < 1e-2 for r in rows), rows
