"""Interpreter lane: the Triton attention, split-KV decode and merge kernels on tiny CPU shapes.

Run as ``TRITON_INTERPRET=1 python -m pytest -m interpreter``. Every result is compared with a
float64 reference written here in plain torch (full score matrix), outputs are NaN-poisoned by
conftest, and empty rows / -inf partials are checked for exact zeros and no NaN.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

pytestmark = pytest.mark.interpreter

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter lane: set TRITON_INTERPRET=1 before importing triton", allow_module_level=True)

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.core import reference as ref  # noqa: E402
from splitsoftmax.core import state  # noqa: E402
from splitsoftmax.ops.attention import fwd as A  # noqa: E402
from splitsoftmax.ops.attention import bwd as AB  # noqa: E402
from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.ops.attention import decode  # noqa: E402
from splitsoftmax.ops.merge import kernel as merge  # noqa: E402

NEG_INF = float("-inf")


def ref_attention(q, k, v, scale, causal, diag=0):
    """float64 ``(out, lse)`` from the package's oracle; empty rows ``(0, -inf)``."""
    return ref.attention(q, k, v, causal=causal, scale=scale, diag=diag)


def rel_err(x, ref):
    assert not torch.isnan(x).any(), "NaN in result"
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def inputs(b, h, hkv, sq, sk, d, dv, dtype):
    q = torch.randn(b, h, sq, d).to(dtype)
    k = torch.randn(b, hkv, sk, d).to(dtype)
    v = torch.randn(b, hkv, sk, dv).to(dtype)
    return q, k, v


# max |err| / max |ref| against float64 on the same (rounded) inputs: float32 math, or bf16
# operands with P and dS rounded to bf16 before their products (as on the GPU).
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}

FWD_CASES = [
    # b, h, hkv, sq, sk, d, dv, causal, diag
    (1, 2, 2, 17, 17, 32, 32, False, 0),
    (2, 4, 2, 17, 97, 32, 16, True, 0),
    (1, 4, 1, 33, 129, 16, 32, True, 96),   # bottom-right style offset, MQA
    (1, 2, 2, 40, 40, 80, 80, True, -7),    # first rows see no key; D=80 padded
    (1, 2, 1, 129, 20, 32, 32, True, 5),    # more queries than keys: fully masked tail tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", FWD_CASES)
def test_forward(case, dtype):
    b, h, hkv, sq, sk, d, dv, causal, diag = case
    q, k, v = inputs(b, h, hkv, sq, sk, d, dv, dtype)
    scale = 1 / math.sqrt(d)
    out, lse = A.attn_fwd(q, k, v, scale, causal, diag)
    ro, rl = ref_attention(q, k, v, scale, causal, diag)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert rel_err(out, ro) < TOL[dtype]
    fin = rl > NEG_INF
    assert torch.equal(lse == NEG_INF, ~fin)
    assert (lse[fin].double() - rl[fin]).abs().max().item() < TOL[dtype]
    assert torch.equal(out[~fin], torch.zeros_like(out[~fin]))


# (TMA layout, configs.ATTN_TMA_ROWS, configs.ATTN_TMA_STORE)
TMA_LAYOUTS = [("rows", True, True), ("heads", False, True), ("heads, pointer store", False, False)]


@pytest.mark.parametrize("layout", TMA_LAYOUTS, ids=[x[0] for x in TMA_LAYOUTS])
@pytest.mark.parametrize("case", [c for c in FWD_CASES if c[5] == decode.pad_dim(c[5])] + [
    (1, 2, 1, 20, 200, 32, 32, False, 0),   # split keys (few programs): ranges end inside tiles
    (1, 2, 2, 24, 150, 16, 16, True, 120),  # split and causal
    (2, 4, 2, 32, 48, 32, 16, True, 16),    # whole tiles (row views), GQA, causal offset
    (1, 2, 2, 48, 48, 16, 16, True, -16),   # whole tiles, first rows see no key
])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_tma_forward_matches_pointer_loads(case, layout, out_dtype, monkeypatch):
    """bf16 through TMA descriptors (zeros past S; row views where no tile crosses a head's end; the
    output stored through one too) gives bit for bit the pointer path's result; a NaN in V past
    every split's range end (keys a tile reads but no row sees) stays out."""
    b, h, hkv, sq, sk, d, dv, causal, diag = case
    _, rows, store = layout
    monkeypatch.setattr(configs, "ATTN_TMA_ROWS", rows)
    monkeypatch.setattr(configs, "ATTN_TMA_STORE", store)
    q, k, v = inputs(b, h, hkv, sq, sk, d, dv, torch.bfloat16)
    out = torch.empty(b, h, sq, dv, dtype=out_dtype or torch.float32)
    scale = 1 / math.sqrt(d)
    p = decode.plan(q, k, v, causal, diag)
    tma = A._tma_operands(q, k, v, out, p, store=p.nsplit == 1)
    whole = sq % p.tile[0] == 0 and sk % p.tile[1] == 0
    assert tma is not None and tma[4:6] == (store and p.nsplit == 1, rows and whole)
    keys = decode.visible_keys(sq, sk, causal, diag)
    if keys < sk:
        v[:, :, keys] = float("nan")
    got = A.attn_fwd(q, k, v, scale, causal, diag, out_dtype=out_dtype)
    monkeypatch.setattr(configs, "ATTN_TMA", False)
    assert A._tma_operands(q, k, v, out, p, store=True) is None
    want = A.attn_fwd(q, k, v, scale, causal, diag, out_dtype=out_dtype)
    for g, w in zip(got, want):
        assert not torch.isnan(w).any() and torch.equal(g, w)


def test_forward_noncontiguous_out_dtype_and_sk0():
    q = torch.randn(1, 17, 4, 32).transpose(1, 2)  # (B, H, Sq, D) view with odd strides
    kv = torch.randn(1, 97, 2, 2, 32)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    out, lse = A.attn_fwd(q, k, v, 0.3, True, 3, out_dtype=torch.bfloat16)
    ro, rl = ref_attention(q, k, v, 0.3, True, 3)
    assert out.dtype == torch.bfloat16 and rel_err(out, ro) < 1e-2
    assert rel_err(lse, rl) < 1e-5
    out0, lse0 = A.attn_fwd(q, k[:, :, :0], v[:, :, :0], 0.3, False)
    assert torch.equal(out0, torch.zeros_like(out0)) and bool((lse0 == NEG_INF).all())


def test_decode_split_matches_reference():
    q, k, v = inputs(2, 8, 2, 1, 300, 32, 32, torch.float32)
    p = decode.plan(q, k, v, False, 0)
    assert p.nsplit > 1 and p.pack
    out, lse = A.attn_fwd(q, k, v, 0.2, False)
    ro, rl = ref_attention(q, k, v, 0.2, False)
    assert rel_err(out, ro) < 2e-6 and rel_err(lse, rl) < 2e-6
    # bottom-right causal decode of 3 queries: diag = Sk - Sq
    q3 = torch.randn(2, 8, 3, 32)
    out, lse = A.attn_fwd(q3, k, v, 0.2, True, 297)
    ro, rl = ref_attention(q3, k, v, 0.2, True, 297)
    assert decode.plan(q3, k, v, True, 297).nsplit > 1
    assert rel_err(out, ro) < 2e-6 and rel_err(lse, rl) < 2e-6


@pytest.mark.parametrize("sq,sk", [(1, 300), (17, 40)], ids=["split", "one launch"])
def test_repeated_plain_forward_is_one_lookup(sq, sk, monkeypatch):
    """A plain forward of a geometry seen before works out nothing again: no plan, no launch bound,
    no merge looked up (its first call kept them under the geometry); each call equals float64."""
    q, k, v = inputs(2, 8, 2, sq, sk, 32, 32, torch.float32)
    monkeypatch.setattr(A, "_FWD_LAUNCHES", A.Memo())
    made = []
    for name in ("plan", "_plain_launch", "merge_launch"):
        fn = getattr(A, name)
        monkeypatch.setattr(A, name, lambda *a, _fn=fn, _n=name, **kw: made.append(_n) or _fn(*a, **kw))
    ro, rl = ref_attention(q, k, v, 0.2, False)
    for call in range(3):
        out, lse = A.attn_fwd(q, k, v, 0.2, False)
        assert rel_err(out, ro) < 2e-6 and rel_err(lse, rl) < 2e-6
        if call == 0:
            first = list(made)
    assert made == first and first[:2] == ["plan", "_plain_launch"]
    assert ("merge_launch" in first) == (decode.plan(q, k, v, False, 0).nsplit > 1) == (sq == 1)
    A.attn_fwd(q[:1], k[:1], v[:1], 0.2, False)  # another geometry: worked out anew
    assert made[len(first):len(first) + 2] == ["plan", "_plain_launch"]


@pytest.mark.parametrize("sq,sk,inner", [(1, 300, False), (17, 40, False), (17, 40, True)],
                         ids=["split", "one launch", "(B, S, H, D) views"])
def test_repeated_public_attention_is_one_lookup(sq, sk, inner, monkeypatch):
    """``ss.attention`` recording no gradient, at a geometry (and scale, causal) that ran before: no
    checks, no route, no plan, the outputs as the first call made them (dtype, layout), every call
    against float64. A setting the forward reads, another geometry, a misaligned copy or a gradient to
    record are worked out anew; a non-bool ``causal`` is refused after a ``True`` one ran."""
    from splitsoftmax.ops.attention import api
    from splitsoftmax.core.runtime import heads_inner
    monkeypatch.setattr(api, "_RUNNERS", A.Memo())
    worked = []
    for mod, name in ((api._checks, "attention_args"), (api, "call")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _n=name, **kw: worked.append(_n) or _fn(*a, **kw))
    q, k, v = inputs(2, 2, 1, sq, sk, 32, 32, torch.float32)
    if inner:
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert heads_inner(q)

    def run(qq, kk, vv, **kw):
        n = len(worked)
        out, lse = ss.attention(qq, kk, vv, return_lse=True, **kw)
        s = kw.get("scale") or 1 / math.sqrt(qq.shape[-1])
        ro, rl = ref_attention(qq, kk, vv, s, kw.get("causal", False))
        assert out.dtype == qq.dtype and lse.dtype == torch.float32 and out.shape == ro.shape
        assert rel_err(out, ro) < 2e-6 and rel_err(lse, rl) < 2e-6
        assert (out.transpose(1, 2).is_contiguous() if heads_inner(qq) else out.is_contiguous())
        return worked[n:]

    assert run(q, k, v) == ["attention_args", "call"] and run(q, k, v) == [] and run(q.clone(), k, v) == []
    assert run(q, k, v, causal=True) != [] and run(q, k, v, causal=True) == []
    with pytest.raises(TypeError, match="causal must be a bool, got int 1"):
        ss.attention(q, k, v, causal=1)
    assert run(q, k, v, scale=0.25) != [] and run(q, k, v, scale=0.25) == [] and run(q, k, v) == []
    monkeypatch.setattr(configs, "ATTN_SPLIT_PROGRAMS_PER_SM", configs.ATTN_SPLIT_PROGRAMS_PER_SM + 1)
    assert run(q, k, v) != [] and run(q, k, v) == []
    assert run(q[:1], k[:1], v[:1]) != [] and run(q[:1], k[:1], v[:1]) == []
    off = torch.empty(q.numel() + 1)[1:].view(q.shape).copy_(q)
    assert off.data_ptr() % 16 != 0 and run(off, k, v) != [] and run(off, k, v) == []
    qg = q.clone().requires_grad_()
    with torch.enable_grad():  # the same runner, under the op's autograd formula
        n = len(worked)
        out = ss.attention(qg, k, v)
        assert type(out.grad_fn).__name__ == "LeanAttentionBackward" and worked[n:] == []
    with torch.no_grad():
        assert run(qg, k, v) == []


@pytest.mark.parametrize("inner", [False, True])
def test_repeated_attention_with_gradient_is_one_lookup(inner, monkeypatch):
    """``ss.attention`` forward and backward recording a gradient, at a geometry (and scale, causal)
    that ran before: the forward is the runner its first call left under the op's autograd formula
    (no checks, no route), the backward one lookup of the runner its first backward left (no route,
    mask or plan); the gradients bitwise those of the op's own path and against float64 every call.
    A setting the backward reads or a cotangent of another layout is worked out anew; a gradient
    through ``lse`` takes the op's path; a double backward is refused as before."""
    from splitsoftmax.ops.attention import api, op as attention_op
    from splitsoftmax.core.runtime import heads_inner
    monkeypatch.setattr(api, "_RUNNERS", A.Memo())
    monkeypatch.setattr(attention_op, "_BWD_RUNNERS", A.Memo())
    worked = []
    for mod, name in ((api._checks, "attention_args"), (api, "call"), (attention_op, "attention_grads")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _n=name, **kw: worked.append(_n) or _fn(*a, **kw))
    q, k, v = inputs(2, 2, 1, 24, 40, 32, 32, torch.float32)
    if inner:
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert heads_inner(q)
    g = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = ref_attention(q64, k64, v64, 1 / math.sqrt(32), True)
    want = torch.autograd.grad((ro * g.double()).sum() + rl.sum(), (q64, k64, v64), retain_graph=True)
    want_plain = torch.autograd.grad((ro * g.double()).sum(), (q64, k64, v64))

    def step(dout, through_lse=False):
        n = len(worked)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = ss.attention(*leaves, causal=True, return_lse=True)
        assert rel_err(out, ro) < 2e-6 and rel_err(lse, rl) < 2e-6
        if through_lse:
            torch.autograd.backward((out, lse), (dout, torch.ones_like(lse)))
        else:
            out.backward(dout)
        for leaf, w in zip(leaves, want if through_lse else want_plain):
            assert rel_err(leaf.grad, w) < 4e-6
        return [t.grad for t in leaves], worked[n:]

    first, how = step(g)
    assert how == ["attention_args", "call", "attention_grads"]
    again, how = step(g)
    assert how == [] and all(torch.equal(a, b) for a, b in zip(first, again))
    assert step(g.clone())[1] == []
    monkeypatch.setattr(configs, "ATTN_BWD_DS_MIN_WAVES", configs.ATTN_BWD_DS_MIN_WAVES + 1)
    assert step(g)[1] == ["attention_grads"] and step(g)[1] == []
    wide = torch.empty(g.shape[0], g.shape[1], g.shape[2], 2 * g.shape[3])[..., ::2].copy_(g)  # (last stride 2)
    assert step(wide)[1] == ["attention_grads"] and step(wide)[1] == ["attention_grads"]
    assert step(g, through_lse=True)[1] == ["attention_grads"]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ss.attention(*leaves, causal=True)
    dq = torch.autograd.grad(out, leaves[0], g, create_graph=True)[0]
    with pytest.raises(NotImplementedError, match="double backward through splitsoftmax attention"):
        dq.sum().backward()


@pytest.mark.parametrize("split", [False, True])
def test_forward_accumulate_in_place(split):
    sq, sk = (1, 300) if split else (17, 40)
    q, k, v = inputs(1, 4, 2, sq, sk, 32, 32, torch.float32)
    diag = sk - sq
    half = sk // 2
    acc_out, acc_lse = A.attn_fwd(q, k[:, :, :half], v[:, :, :half], 0.25, True, diag)
    assert (decode.plan(q, k[:, :, half:], v, True, diag - half).nsplit > 1) == split
    A.attn_fwd_acc(q, k[:, :, half:], v[:, :, half:], 0.25, True, diag - half, acc_out, acc_lse)
    ro, rl = ref_attention(q, k, v, 0.25, True, diag)
    assert rel_err(acc_out, ro) < 2e-6 and rel_err(acc_lse, rl) < 2e-6


@pytest.mark.parametrize("layout", TMA_LAYOUTS, ids=[x[0] for x in TMA_LAYOUTS])
@pytest.mark.parametrize("case", [(1, 4, 2, 32, 64, 32, 32, 32), (1, 4, 2, 17, 40, 32, 16, 23),
                                  (1, 2, 1, 20, 400, 32, 32, 380)])  # b, h, hkv, sq, sk, d, dv, diag
def test_tma_accumulate_matches_pointer_loads(case, layout, monkeypatch):
    """A ring step merged in place (bf16 inputs, float32 state) through TMA descriptors (row views
    where the contiguous shard has whole tiles; split keys in the last case) gives bit for bit the
    pointer path's state."""
    b, h, hkv, sq, sk, d, dv, diag = case
    _, rows, store = layout
    monkeypatch.setattr(configs, "ATTN_TMA_ROWS", rows)
    monkeypatch.setattr(configs, "ATTN_TMA_STORE", store)
    q, k, v = inputs(b, h, hkv, sq, sk, d, dv, torch.bfloat16)
    half = sk // 2
    k2, v2 = k[:, :, half:].contiguous(), v[:, :, half:].contiguous()
    p = decode.plan(q, k2, v2, True, diag - half)
    assert (p.nsplit > 1) == (sk == 400)
    tma = A._tma_operands(q, k2, v2, torch.empty(b, h, sq, dv), p, store=False)
    assert tma is not None and tma[4:6] == (False, rows and sq % p.tile[0] == 0 and (sk - half) % p.tile[1] == 0)
    states = []
    for use_tma in (True, False):
        monkeypatch.setattr(configs, "ATTN_TMA", use_tma)
        acc_out, acc_lse = A.attn_fwd(q, k[:, :, :half], v[:, :, :half], 0.25, True, diag)
        A.attn_fwd_acc(q, k2, v2, 0.25, True, diag - half, acc_out, acc_lse)
        states.append((acc_out, acc_lse))
    (got_o, got_l), (want_o, want_l) = states
    assert not torch.isnan(want_o).any() and torch.equal(got_o, want_o) and torch.equal(got_l, want_l)
    ro, rl = ref_attention(q, k, v, 0.25, True, diag)
    assert rel_err(want_o, ro) < TOL[torch.bfloat16]


def test_accumulate_into_empty_state_ignores_nan():
    q, k, v = inputs(1, 2, 2, 17, 17, 32, 32, torch.float32)
    acc_out = torch.full((1, 2, 17, 32), float("nan"))
    acc_lse = torch.full((1, 2, 17), NEG_INF)
    A.attn_fwd_acc(q, k, v, 0.25, True, -3, acc_out, acc_lse)
    ro, rl = ref_attention(q, k, v, 0.25, True, -3)
    assert rel_err(acc_out, ro) < 2e-6
    assert torch.equal(acc_lse == NEG_INF, rl == NEG_INF)


BWD_CASES = [
    (1, 2, 2, 17, 17, 32, 32, False, 0),
    (1, 4, 2, 33, 20, 32, 16, True, 0),
    (2, 2, 1, 20, 33, 16, 32, True, 13),
    (1, 2, 2, 18, 18, 32, 32, True, -5),  # empty rows get zero gradient
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", BWD_CASES)
def test_backward(case, dtype):
    b, h, hkv, sq, sk, d, dv, causal, diag = case
    q, k, v = inputs(b, h, hkv, sq, sk, d, dv, dtype)
    dout = torch.randn(b, h, sq, dv).to(dtype)
    scale = 1 / math.sqrt(d)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = ref_attention(q64, k64, v64, scale, causal, diag)
    (ro * dout.double()).sum().backward()
    delta = (dout.double() * ro.detach()).sum(-1)
    dq, dk, dv_ = AB.attn_bwd(q, k, v, dout, rl.detach().float(), delta.float(), scale, causal, diag)
    for got, want in ((dq, q64.grad), (dk, k64.grad), (dv_, v64.grad)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert rel_err(got, want) < TOL[dtype] * 2
    if diag < 0:
        assert torch.equal(dq[:, :, :-diag], torch.zeros_like(dq[:, :, :-diag]))


def test_public_attention_autograd_routes_to_triton():
    q, k, v = inputs(1, 4, 2, 17, 17, 32, 32, torch.float32)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ss.attention(qr, kr, vr, causal=True, return_lse=True)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = ref_attention(q64, k64, v64, 1 / math.sqrt(32), True)
    (ro * g.double()).sum().backward()
    assert rel_err(out, ro) < 2e-6 and rel_err(lse, rl) < 2e-6
    for got, want in ((qr.grad, q64.grad), (kr.grad, k64.grad), (vr.grad, v64.grad)):
        assert rel_err(got, want) < 4e-6


def ref_merge(outs, lses):
    """float64 N-way merge: the package's torch path (``state.merge_out_lse``) on upcast inputs."""
    return state.merge_out_lse(outs.double(), lses.double())


class _Launches:
    """Stands in for a Triton kernel: records each launch, then launches the real one."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


@pytest.fixture(params=["_merge_fwd_kernel", "_merge_parts_kernel"])
def merge_kernel(request, monkeypatch):
    """Force the row-tiled merge kernel or the all-parts-at-once one; check that it ran."""
    monkeypatch.setattr(configs, "MERGE_PARTS_PROGRAMS_PER_SM", 1 << 20 if "parts" in request.param else 0)
    log = []
    for name, launcher in (("_merge_fwd_kernel", merge._MERGE_ROWS), ("_merge_parts_kernel", merge._MERGE_PARTS)):
        monkeypatch.setattr(launcher, "fn", _Launches(launcher.fn, name, log))
    yield request.param
    assert log and set(log) == {request.param}, log


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,rows,dv", [(1, (5,), 8), (3, (2, 7), 24), (8, (3, 11), 40)])
def test_merge(n, rows, dv, dtype, merge_kernel):
    outs = torch.randn(n, *rows, dv).to(dtype)
    lses = torch.randn(n, *rows) * 3
    lses[0, 0] = NEG_INF           # an empty partial with NaN inside
    outs[0, 0] = float("nan")
    if n > 1:
        lses[:, -1] = NEG_INF      # a row where every partial is empty
        outs[:, -1] = float("nan")
    out, lse = merge.merge_out_lse(outs, lses)
    ro, rl = ref_merge(outs, lses)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert rel_err(out, ro) < 1e-6
    assert torch.equal(lse == NEG_INF, rl == NEG_INF)
    fin = rl > NEG_INF
    assert (lse[fin].double() - rl[fin]).abs().max().item() < 1e-5
    if n > 1:
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_merge_noncontiguous_and_public(merge_kernel):
    outs = torch.randn(4, 16, 3, 8).transpose(1, 2)  # (N, 3, 16, 8) strided
    lses = torch.randn(4, 16, 3).transpose(1, 2)
    out, lse = ss.merge_states(outs, lses)
    ro, rl = ref_merge(outs, lses)
    assert rel_err(out, ro) < 1e-6 and rel_err(lse, rl) < 1e-6


def test_bwd_prep_kernel_matches_torch_path():
    """The fused (lse, delta) pass against the torch path: NaN in a zero-cotangent row drops out."""
    from splitsoftmax.ops.attention import prep as attn_prep, torch as cpu
    out, dout = torch.randn(2, 3, 17, 24), torch.randn(2, 3, 17, 24)
    lse, dlse = torch.randn(2, 3, 17), torch.randn(2, 3, 17)
    out[0, 1, 4] = float("nan")
    dout[0, 1, 4] = 0.0
    dlse[0, 1, 4] = 0.0
    dout[1, 2, 5] = 0.0
    for d in (None, dlse):
        got, want = attn_prep.attn_bwd_prep(out, lse, dout, d), cpu.attn_bwd_prep(out, lse, dout, d)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        assert got[0][0, 1, 4] == float("-inf") and got[1][0, 1, 4] == 0.0
