"""GPU lane: no host synchronisation in any public op, CUDA graph capture and replay equal to eager,
``torch.compile(mode="reduce-overhead")`` over ``ss.attention``, and no compile at a new length of
an already compiled bucket (``splitsoftmax.tools.warmup``)."""
from __future__ import annotations

import pytest
import torch

import splitsoftmax as ss

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DEV = "cuda"


def _leaf(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEV, dtype=dtype, requires_grad=True)


def _attention(causal):
    q, k, v = _leaf(1, 8, 300, 64), _leaf(1, 2, 300, 64), _leaf(1, 2, 300, 64)
    return (q, k, v), lambda: ss.attention(q, k, v, causal=causal)


def _decode():
    q, k, v = _leaf(2, 8, 1, 128), _leaf(2, 2, 4100, 128), _leaf(2, 2, 4100, 128)
    return (q, k, v), lambda: ss.attention(q, k, v)


def _softmax():
    x = _leaf(8, 4097, dtype=torch.float32)
    return (x,), lambda: ss.softmax(x) * 3 + ss.log_softmax(x) + ss.logsumexp(x).unsqueeze(1)


def _cross_entropy():
    logits, target = _leaf(64, 3000), torch.randint(0, 3000, (64,), device=DEV)
    return (logits,), lambda: ss.cross_entropy(logits, target, label_smoothing=0.1)


def _merge():
    outs, lses = _leaf(3, 4, 8, 64, dtype=torch.float32), _leaf(3, 4, 8, dtype=torch.float32)
    return (outs, lses), lambda: ss.merge_states(outs, lses)[0]


CASES = {"attention": lambda: _attention(False), "attention causal": lambda: _attention(True),
         "decode": _decode, "softmax": _softmax, "cross_entropy": _cross_entropy, "merge_states": _merge}


def _step(inputs, fn):
    """Forward and backward of ``fn`` with a fixed cotangent; returns the output and the gradients."""
    for t in inputs:
        t.grad = None
    out = fn()
    out.backward(torch.ones_like(out) * 0.5)
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_backward_never_synchronise(name):
    inputs, fn = CASES[name]()
    _step(inputs, fn)  # compiles and caches plans first: a first call may read device properties
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(inputs, fn)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("b, h, hkv, s, inner", [(1, 8, 8, 512, False), (2, 32, 8, 1024, True), (1, 8, 2, 300, False)])
def test_repeated_attention_with_gradient_is_the_ops_path(b, h, hkv, s, inner, monkeypatch):
    """Forward and backward of ``ss.attention`` at a geometry seen before (the runners its first call
    left: ``op.LeanAttention`` and the backward's ``LeanBackward``, one lookup each) give bitwise the
    op's path's outputs and gradients on the GPU's kernels (the Gluon pair and its dS buffer at D 128,
    the Triton pair at D 64)."""
    from splitsoftmax.core.runtime import Memo
    from splitsoftmax.ops.attention import api, op as attention_op
    monkeypatch.setattr(api, "_RUNNERS", Memo())
    monkeypatch.setattr(attention_op, "_BWD_RUNNERS", Memo())
    worked = []
    grads_fn = attention_op.attention_grads
    monkeypatch.setattr(attention_op, "attention_grads", lambda *a, **kw: worked.append(1) or grads_fn(*a, **kw))
    d = 128 if s > 300 else 64
    q, k, v = (torch.randn(b, s, n, d, device=DEV, dtype=torch.bfloat16) for n in (h, hkv, hkv))
    q, k, v = (t.transpose(1, 2) if inner else t.transpose(1, 2).contiguous() for t in (q, k, v))
    g = torch.randn(b, h, s, d, device=DEV, dtype=torch.bfloat16)

    def step():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = ss.attention(*leaves, causal=True)
        out.backward(g)
        return type(out.grad_fn).__name__, out.detach(), *(t.grad for t in leaves)

    first, second, third = step(), step(), step()
    assert first[0] == "_EagerBackward" and second[0] == third[0] == "LeanAttentionBackward"
    assert len(worked) == 1 and len(attention_op._BWD_RUNNERS) == 1  # (the first backward took the op's path)
    for got in (second, third):
        for x, y in zip(first[1:], got[1:]):
            assert torch.equal(x, y) and x.stride() == y.stride()


@pytest.mark.parametrize("name", ["attention causal", "decode", "softmax", "cross_entropy"])
def test_cuda_graph_replays_forward_and_backward(name):
    inputs, fn = CASES[name]()
    want_out, want_grads = _step(inputs, fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(inputs, fn)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in inputs:
        t.grad = None
    with torch.cuda.graph(graph):
        out = fn()
        out.backward(torch.ones_like(out) * 0.5)
    for t, g in zip(inputs, want_grads):
        t.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want_out), name
    for t, g in zip(inputs, want_grads):
        assert torch.equal(t.grad, g), name


def test_reduce_overhead_compile_matches_eager():
    torch._dynamo.reset()

    def block(q, k, v, w):
        return (ss.attention(q, k, v, causal=True) @ w).float().square().mean()

    q, k, v = _leaf(2, 4, 256, 64), _leaf(2, 4, 256, 64), _leaf(2, 4, 256, 64)
    w = _leaf(64, 64)
    want = block(q, k, v, w)
    want_grads = torch.autograd.grad(want, (q, k, v, w))
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # the graph is recorded on a later call, then replayed
        got = compiled(q, k, v, w)
        grads = torch.autograd.grad(got, (q, k, v, w))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_compile_at_a_new_length_of_a_compiled_bucket():
    from splitsoftmax.tools import warmup
    warmup.warm(64, torch.bfloat16, (True, False), heads=4, kv_heads=2)
    before = warmup.compiled_variants()
    # short partial (odd, multiple of 16, of 4), short whole, long partial, long whole, past the split
    for sq in (1001, 1040, 1500, 2048, 3000, 4097, 8192, 9000):
        for causal in (True, False):
            q, k, v = _leaf(1, 4, sq, 64), _leaf(1, 2, sq, 64), _leaf(1, 2, sq, 64)
            ss.attention(q, k, v, causal=causal).sum().backward()
    for sk in (7777, 12345):  # decode: 30 and 48 key splits
        q, k, v = _leaf(1, 4, 1, 64), _leaf(1, 2, sk, 64), _leaf(1, 2, sk, 64)
        ss.attention(q, k, v).sum().backward()
    grew = {n: c - before.get(n, 0) for n, c in warmup.compiled_variants().items() if c != before.get(n, 0)}
    assert not grew, f"compiled again at a length of a warmed bucket: {grew}"
