"""The custom ops behind the public functions: opcheck, torch.compile(fullgraph=True) with no break, and
the direct path of plain eager calls."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import splitsoftmax as ss
from splitsoftmax.ops import _registry as ops
from splitsoftmax.core import reference as ref

OPS = torch.ops.splitsoftmax
NEG_INF = float("-inf")


def _rand(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _opcheck_cases():
    x = _rand(5, 37)
    x_inf = torch.randn(4, 19)
    x_inf[1] = NEG_INF
    q, k, v = _rand(2, 4, 9, 16), _rand(2, 2, 13, 16), _rand(2, 2, 13, 8)
    y, lse = OPS.softmax_fwd(x.detach(), False)
    delta = torch.randn(2, 4, 9)
    _, alse = OPS.attn_fwd(q.detach(), k.detach(), v.detach(), 0.25, True, 0)
    lses = torch.randn(3, 2, 5)
    lses[1, 0] = NEG_INF
    return [
        (OPS.softmax_fwd, (x, False)), (OPS.softmax_fwd, (x, True)), (OPS.softmax_fwd, (x_inf.requires_grad_(), True)),
        (OPS.softmax_fwd, (torch.randn(37, 5).t().requires_grad_(), False)),
        (OPS.attn_fwd, (*(t.transpose(1, 2) for t in (_rand(1, 7, 2, 8), _rand(1, 5, 1, 8), _rand(1, 5, 1, 4))), 0.5, False, 0)),
        (OPS.softmax_bwd, (y, torch.randn(5, 37), lse, False)),
        (OPS.logsumexp_fwd, (x,)), (OPS.logsumexp_bwd, (x.detach(), lse, torch.randn(5))),
        (OPS.attn_fwd, (q, k, v, 0.25, True, 0)), (OPS.attn_fwd, (q, k, v, 0.3, False, 0)),
        (OPS.attn_fwd, (q, k, v, 0.25, True, 4)),
        (OPS.attn_bwd, (q.detach(), k.detach(), v.detach(), torch.randn(2, 4, 9, 8), alse, delta, 0.25, True, 0)),
        (OPS.attn_bwd_prep, (torch.randn(2, 4, 9, 8), alse, torch.randn(2, 4, 9, 8), None)),
        (OPS.attn_bwd_prep, (torch.randn(2, 4, 9, 8), alse, torch.randn(2, 4, 9, 8), torch.randn(2, 4, 9))),
        (OPS.merge_fwd, (_rand(3, 2, 5, 8), lses.requires_grad_())),
        (OPS.merge_fwd, (_rand(2, 6, 4, dtype=torch.bfloat16), torch.randn(2, 6))),
    ]


@pytest.mark.parametrize("case", range(len(_opcheck_cases())))
def test_opcheck(case):
    fn, args = _opcheck_cases()[case]
    torch.library.opcheck(fn, args)


def test_every_op_is_registered_with_fake_and_autograd():
    names = {"softmax_fwd", "softmax_bwd", "logsumexp_fwd", "logsumexp_bwd", "attn_fwd", "attn_bwd", "attn_bwd_prep",
             "merge_fwd"}
    for name in names:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"splitsoftmax::{name}", "Meta"), name
    for name in ("softmax_fwd", "logsumexp_fwd", "attn_fwd", "merge_fwd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"splitsoftmax::{name}", "Autograd"), name


def model(q, k, v, x, outs, lses):
    """One function touching every public single-device op."""
    a = ss.attention(q, k, v, causal=True, scale=0.2)
    o, l = ss.attention(q, k, v, return_lse=True)
    m, ml = ss.merge_states(outs, lses)
    s = ss.softmax(x, dim=0) + ss.log_softmax(x).exp() + ss.logsumexp(x, dim=1).clamp(min=-10).unsqueeze(1)
    return a.sum() + (o * l.unsqueeze(-1)).sum() + (m * ml.unsqueeze(-1)).sum() + s.pow(2).sum()


def _inputs():
    x = torch.randn(6, 33)
    x[2] = NEG_INF
    lses = torch.randn(3, 2, 4, 7)
    lses[0, 1] = NEG_INF
    return [_rand(2, 4, 7, 16), _rand(2, 2, 11, 16), _rand(2, 2, 11, 8),
            x.requires_grad_(), _rand(3, 2, 4, 7, 8), lses.requires_grad_()]


def _compiled_matches_eager(backend: str, dynamic: bool):
    torch._dynamo.reset()
    eager_in, comp_in = _inputs(), None
    comp_in = [t.detach().clone().requires_grad_() for t in eager_in]
    want = model(*eager_in)
    gw = torch.autograd.grad(want, eager_in)
    explain = torch._dynamo.explain(model)(*comp_in)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    got = compiled(*comp_in)
    gg = torch.autograd.grad(got, comp_in)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return compiled


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_aot_eager(dynamic):
    _compiled_matches_eager("aot_eager", dynamic)


def test_compile_fullgraph_inductor():
    _compiled_matches_eager("inductor", False)


def test_compile_no_recompile_for_a_new_length():
    """With dynamic shapes a second sequence length reuses the compiled graph."""
    torch._dynamo.reset()
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    fn = torch.compile(lambda q, k, v: ss.attention(q, k, v, causal=True), backend=backend,
                       fullgraph=True, dynamic=True)
    for s in (9, 23):
        q, k, v = torch.randn(1, 2, s, 8), torch.randn(1, 2, s, 8), torch.randn(1, 2, s, 8)
        torch.testing.assert_close(fn(q, k, v).double(), ref.attention(q, k, v, causal=True)[0], atol=2e-6, rtol=2e-5)
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_opcheck_and_inductor_fullgraph(dtype):
    """The same ops on CUDA (Triton inside): opcheck, and an inductor fullgraph compile equal to eager."""
    dev = "cuda"
    q, k, v = (torch.randn(2, h, 70, 64, device=dev, dtype=dtype, requires_grad=True) for h in (8, 2, 2))
    x = torch.randn(33, 1000, device=dev, dtype=dtype, requires_grad=True)
    outs = torch.randn(3, 4, 16, 64, device=dev, dtype=dtype, requires_grad=True)
    lses = torch.randn(3, 4, 16, device=dev, requires_grad=True)
    for fn, args in [(OPS.attn_fwd, (q, k, v, 0.125, True, 0)), (OPS.softmax_fwd, (x, False)),
                     (OPS.logsumexp_fwd, (x,)), (OPS.merge_fwd, (outs, lses))]:
        torch.library.opcheck(fn, args, atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                              rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)

    def f(q, k, v, x, outs, lses):
        o, l = ss.merge_states(outs, lses)
        return (ss.attention(q, k, v, causal=True).float().sum() + ss.softmax(x).float().pow(2).sum()
                + (o.float() * l.unsqueeze(-1)).sum())

    torch._dynamo.reset()
    ins = [q, k, v, x, outs, lses]
    want = f(*ins)
    gw = torch.autograd.grad(want, ins)
    got = torch.compile(f, fullgraph=True)(*ins)
    gg = torch.autograd.grad(got, ins)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
        for a, b in zip(gg, gw):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        return
    # bf16: compiled and eager may take other kernel plans (strides) and fuse the float32 tails
    # differently, so both are held to the float64 result (CPU path): compiled within 2x eager's error
    ins64 = [t.detach().double().cpu().requires_grad_(True) for t in ins]
    ref = f(*ins64)
    gr = torch.autograd.grad(ref, ins64)
    assert abs(got.double().cpu() - ref) <= 2 * abs(want.double().cpu() - ref) + 1e-3 * abs(ref)
    for a, b, r in zip(gg, gw, gr):
        err_c = (a.double().cpu() - r).abs().max().item()
        err_e = (b.double().cpu() - r).abs().max().item()
        assert err_c <= 2 * err_e + 1e-6 * r.abs().max().item(), (err_c, err_e)


class _SeenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ``splitsoftmax::`` ops that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "splitsoftmax":
            self.seen.append(func._opname)
        return func(*args, **(kwargs or {}))


def _public_calls(q, k, v, x, outs, lses):
    return [ss.attention(q, k, v, causal=True), ss.softmax(x), ss.log_softmax(x, dim=0), ss.logsumexp(x),
            *ss.merge_states(outs, lses)]


def test_plain_eager_calls_skip_the_dispatcher_with_the_same_result(monkeypatch):
    """Without autograd, modes or tracing, the public calls run the ops' implementations directly
    (no dispatcher cost) and return exactly what the ops return."""
    ins = [t.detach() for t in _inputs()]
    real = torch.ops.splitsoftmax
    monkeypatch.setattr(torch.ops, "splitsoftmax", None)  # any dispatch through the namespace fails
    direct = _public_calls(*ins)
    monkeypatch.setattr(torch.ops, "splitsoftmax", real)
    with _SeenOps() as mode:  # a dispatch mode is active: every call goes through the op
        via_op = _public_calls(*ins)
    assert mode.seen == ["attn_fwd", "softmax_fwd", "softmax_fwd", "logsumexp_fwd", "merge_fwd"]
    for a, b in zip(direct, via_op):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert not ops.plain_eager(torch.ones(2, requires_grad=True))
    assert not ops.direct_one(torch.ones(2, requires_grad=True))
    with torch.no_grad():
        assert ops.plain_eager(torch.ones(2, requires_grad=True))
        assert ops.direct_one(torch.ones(2, requires_grad=True))
    assert not ops.direct_one(torch.ones(2, device="meta"))


def test_calls_needing_autograd_take_the_op():
    """Gradients (reverse and forward mode) and functorch transforms still see the registered op."""
    x = torch.randn(3, 7)
    assert ss.softmax(x.requires_grad_()).grad_fn is not None
    with _SeenOps() as mode, torch.no_grad():
        ss.softmax(x)
    assert mode.seen == ["softmax_fwd"]
    with fwAD.dual_level():
        assert not ops.plain_eager(x.detach()) and not ops.direct_one(x.detach())
    assert not torch.func.vmap(lambda r: torch.tensor(ops.plain_eager(r)))(x.detach()).any()
    assert not torch.func.vmap(lambda r: torch.tensor(ops.direct_one(r)))(x.detach()).any()


@pytest.mark.parametrize("what", ["attention", "cross_entropy", "kl_div"])
def test_double_backward_is_a_clear_error(what):
    """A second derivative through an op without one: our NotImplementedError naming the op, not
    torch's message about a missing autograd formula."""
    import splitsoftmax as ss
    gen = torch.Generator().manual_seed(0)
    if what == "attention":
        leaf, *rest = [torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)]
        loss = ss.attention(leaf, *rest).square().sum()
    elif what == "cross_entropy":
        leaf = torch.randn(4, 7, generator=gen, dtype=torch.float64, requires_grad=True)
        loss = ss.cross_entropy(leaf, torch.tensor([0, 3, 6, 2]))
    else:
        leaf = torch.randn(4, 7, generator=gen, dtype=torch.float64, requires_grad=True)
        loss = ss.kl_div(leaf, torch.randn(4, 7, generator=gen, dtype=torch.float64)).sum()
    (g,) = torch.autograd.grad(loss, leaf, create_graph=True)
    with pytest.raises(NotImplementedError, match=f"double backward through splitsoftmax {what} is not supported"):
        g.square().sum().backward()
