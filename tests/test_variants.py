"""The attention variants on one device (docs/API.md, "Attention variants"): the keyword rule against
the float64 oracle, gradients (gradcheck, and FlashAttention's rule: at most 2x the error of torch's
attention in the same precision), empty rows, NaN in hidden positions, every bad argument, the
local mask of any segment, torch.compile and opcheck."""
import math
import random

import pytest
import torch

import splitsoftmax as ss
from splitsoftmax.ops import _registry as local
from splitsoftmax.ops.attention import api as attention_api
from splitsoftmax.core import keywords as variants
from splitsoftmax.core import reference as ref
from splitsoftmax.core.mask import NO_MASK, Mask, visible

NEG_INF = float("-inf")
CPU = torch.device("cpu")


def _docs(s):
    """Documents of length 0, 1 and long (and what is left) covering ``s`` positions."""
    cuts = sorted({0, min(1, s), min(1 + (s - 1) // 3, s), s})
    return [0, 0, *cuts[1:]] if s else [0, 0]


def _case(name, b, s, h):
    """``(sk, keywords)`` of a named variant for ``b`` elements, ``s`` query rows, ``h`` heads."""
    g = torch.Generator().manual_seed(s)
    sinks = torch.randn(h, generator=g)
    sinks[0] = NEG_INF
    cases = {
        "docs": (s, dict(causal=False, cu_seqlens=_docs(s))),
        "docs_causal": (s, dict(causal=True, cu_seqlens=torch.tensor(_docs(s)))),
        "window_causal": (s, dict(causal=True, window_size=(5, 0))),
        "window_both": (s, dict(window_size=(3, 2))),
        "window_left": (s + 3, dict(window_size=(7, -1))),
        "window_right_causal": (s, dict(causal=True, window_size=(-1, 4))),
        "kv_left_pad": (s, dict(causal=True, kv_range=torch.tensor([[min(3, s), s], [0, s]][:b]))),
        "kv_right_pad": (s + 5, dict(kv_range=torch.tensor([[0, s // 2], [0, s + 5]][:b]))),
        "q_offset_int": (s + 6, dict(causal=True, q_offset=6)),
        "q_offset_tensor": (s + 6, dict(causal=True, window_size=(9, 0), q_offset=torch.tensor([6, 1][:b]))),
        "softcap": (s, dict(causal=True, softcap=1.5)),
        "sinks": (s, dict(sinks=sinks, kv_range=torch.tensor([[0, s], [min(2, s), min(2, s)]][:b]))),
        "everything": (s, dict(causal=True, cu_seqlens=_docs(s), window_size=(6, 0), softcap=2.0, sinks=sinks,
                               kv_range=torch.tensor([[1, s], [0, max(s - 2, 0)]][:b]))),
    }
    return cases[name]


CASES = ["docs", "docs_causal", "window_causal", "window_both", "window_left", "window_right_causal", "kv_left_pad",
         "kv_right_pad", "q_offset_int", "q_offset_tensor", "softcap", "sinks", "everything"]


def _inputs(b, h, hkv, sq, sk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            for shape in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), (b, h, sq, d))]


def _grads(fn, q, k, v, dout, kw, dlse=None):
    """``(out, lse, dq, dk, dv, dsinks)`` of ``fn`` with cotangents ``dout`` (and ``dlse``)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    kw = dict(kw)
    if kw.get("sinks") is not None:
        dt = torch.float64 if q.dtype == torch.float64 else kw["sinks"].dtype
        kw["sinks"] = kw["sinks"].detach().clone().to(dt).requires_grad_(True)
        leaves.append(kw["sinks"])
    out, lse = fn(*leaves[:3], **kw)
    loss = (out.to(dout.dtype) * dout).sum()
    if dlse is not None:
        loss = loss + (lse.to(dlse.dtype) * dlse).sum()
    grads = torch.autograd.grad(loss, leaves)
    return (out.detach(), lse.detach(), *grads)


def _ss(q, k, v, **kw):
    return ss.attention(q, k, v, return_lse=True, **kw)


def _torch(q, k, v, *, causal=False, cu_seqlens=None, window_size=None, softcap=None, sinks=None, kv_range=None,
           q_offset=0):
    """torch's attention written out in the inputs' precision (FlashAttention's ``attention_ref``
    without upcast): the baseline of the 2x rule."""
    b, h, sq, d = q.shape
    ok = ref.variant_visible(b, sq, k.shape[2], causal=causal, cu_seqlens=cu_seqlens, window_size=window_size,
                             kv_range=kv_range, q_offset=q_offset).unsqueeze(1)
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q / math.sqrt(d)) @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~ok, NEG_INF)
    if sinks is not None:
        s = torch.cat((s, sinks.view(1, h, 1, 1).expand(b, h, sq, 1).to(s.dtype)), -1)
    empty = (s == NEG_INF).all(-1, keepdim=True)
    p = torch.where(empty, 0.0, torch.softmax(torch.where(empty, 0.0, s), -1))
    lse = torch.logsumexp(torch.where(empty, 0.0, s), -1).masked_fill(empty.squeeze(-1), NEG_INF)
    return p[..., :k.shape[2]] @ v, lse


def _oracle(q, k, v, **kw):
    return ref.attention_variants(q, k, v, **kw)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("s,d", [(1, 32), (17, 80), (97, 128), (129, 32)])
def test_float64_rule_against_the_oracle(name, s, d, monkeypatch):
    monkeypatch.setattr("splitsoftmax.ops.attention.torch.CPU_BLOCK_KEYS", 32)
    b, h, hkv = 2, 4, 2
    sk, kw = _case(name, b, s, h)
    q, k, v, dout = _inputs(b, h, hkv, s, sk, d, torch.float64)
    dlse = torch.randn(b, h, s).double()  # the public lse is float32: so is its cotangent
    got = _grads(_ss, q, k, v, dout, kw, dlse)
    want = _grads(_oracle, q, k, v, dout, kw, dlse)
    names = ["out", "lse", "dq", "dk", "dv", "dsinks"]
    for n, a, w in zip(names, got, want):
        assert a.dtype == (torch.float32 if n == "lse" else torch.float64), (n, a.dtype)
        assert not a.isnan().any(), n
        tol = 1e-6 if n == "lse" else 1e-10
        torch.testing.assert_close(a.double(), w, atol=tol, rtol=tol, msg=f"{name} {n}")


def _err(a, w):
    return (a.double() - w).abs().max().item() if w.numel() else 0.0


@pytest.mark.parametrize("name,s,d", [(name, 97, 80) for name in CASES] + [("everything", 17, 32), ("sinks", 129, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_within_twice_torchs_error(name, s, d, dtype):
    b, h, hkv = 2, 4, 2
    sk, kw = _case(name, b, s, h)
    x = _inputs(b, h, hkv, s, sk, d, dtype, seed=1)
    want = _grads(_oracle, *(t.double() for t in x), kw)
    got = _grads(_ss, *x, kw)
    base = _grads(_torch, *x, kw)
    for n, a, t, w in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, base, want):
        if n == "lse":
            continue
        assert a.dtype == (kw["sinks"].dtype if n == "dsinks" else dtype), n
        ea, et = _err(a, w), _err(t, w)
        assert ea <= 2 * et + 1e-12, f"{name} {n}: error {ea:.3g} vs torch's {et:.3g}"


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("sq,sk", [(3, 799), (113, 799), (799, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_float32_gradients_within_twice_torchs_error(d, sq, sk, causal):
    """FlashAttention's grid on the CPU path: rows of 799 keys (and 799 rows of 3), head dims 128, 256."""
    x = _inputs(2, 2, 2, sq, sk, d, torch.float32, seed=d + sq)
    kw = dict(causal=causal)
    want = _grads(_oracle, *(t.double() for t in x), kw)
    got, base = _grads(_ss, *x, kw), _grads(_torch, *x, kw)
    for n, a, t, w in zip(["out", "lse", "dq", "dk", "dv"], got, base, want):
        if n != "lse":
            ea, et = _err(a, w), _err(t, w)
            assert ea <= 2 * et, f"{n}: error {ea:.3g} vs torch's {et:.3g}"


@pytest.mark.parametrize("kw", [
    dict(causal=True, cu_seqlens=[0, 2, 2, 3, 7], window_size=(2, 0), softcap=2.0, kv_range=torch.tensor([[1, 7]])),
    dict(window_size=(1, 2), q_offset=torch.tensor([3]), kv_range=torch.tensor([[0, 5]])),
    dict(causal=True, q_offset=-2, softcap=0.7),
])
def test_gradcheck_float64(kw):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_(True)
               for shape in ((1, 2, 7, 4), (1, 1, 7, 4), (1, 1, 7, 3)))
    sinks = torch.tensor([0.3, NEG_INF], dtype=torch.float64)
    sinks_var = torch.tensor([0.3, -1.0], dtype=torch.float64, requires_grad=True)
    for s in (sinks, sinks_var):
        assert torch.autograd.gradcheck(lambda q, k, v: ss.attention(q, k, v, sinks=s, **kw), (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v, s: ss.attention(q, k, v, sinks=s, **kw), (q, k, v, sinks_var))
    # the public lse is float32; the op's (float64 here) carries the same gradient
    scale = 1 / math.sqrt(q.shape[-1])
    kw = dict(kw)
    causal = kw.pop("causal", False)
    lse = lambda q, k, v, s: attention_api._variant_attention(q, k, v, scale, causal, sinks=s, **kw)[1]  # noqa: E731
    assert lse(q, k, v, sinks_var).dtype == torch.float64
    assert torch.autograd.gradcheck(lse, (q, k, v, sinks_var))


def _visible_written_out(b, sq, sk, causal=False, cu_seqlens=None, window_size=None, kv_range=None, q_offset=0,
                         device=None):
    """``(B, Sq, Sk)``: the contract's one rule, independent of ``reference``: key ``j`` is visible to
    query ``i`` of element ``b`` iff it lies in ``kv_range[b]``, in ``i``'s document, and inside the
    causal / window band around key position ``q_offset[b] + i``."""
    i, j = torch.arange(sq, device=device).view(1, sq, 1), torch.arange(sk, device=device).view(1, 1, sk)
    pos = i + torch.as_tensor(q_offset, device=device).reshape(-1, 1, 1)
    ok = torch.ones(b, sq, sk, dtype=torch.bool, device=device)
    if kv_range is not None:
        ok = ok & (j >= kv_range[:, :1, None]) & (j < kv_range[:, 1:, None])
    if cu_seqlens is not None:
        doc = torch.bucketize(torch.arange(sq, device=device), torch.as_tensor(cu_seqlens, device=device)[1:],
                              right=True)
        ok = ok & (doc.view(1, sq, 1) == doc.view(1, 1, sk))
    if causal:
        ok = ok & (j <= pos)
    if window_size is not None and window_size[0] >= 0:
        ok = ok & (j >= pos - window_size[0])
    if window_size is not None and window_size[1] >= 0:
        ok = ok & (j <= pos + window_size[1])
    return ok


def _rule_written_out(q, k, v, scale, causal=False, cu_seqlens=None, window_size=None, softcap=None, sinks=None,
                      kv_range=None, q_offset=0):
    """``(out, lse)`` of the contract's rule (:func:`_visible_written_out`), every visible pair and
    the sink (a virtual key of value 0) written out. In float64 exact; on 16-bit inputs it is torch's
    attention in that precision: scores from 16-bit products, softmax in float32, probabilities
    rounded to ``v``'s dtype before their product with V."""
    b, h, sq, _ = q.shape
    g = h // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    ok = _visible_written_out(b, sq, k.shape[2], causal, cu_seqlens, window_size, kv_range, q_offset, q.device)
    s = s.masked_fill(~ok.unsqueeze(1), NEG_INF)
    if sinks is not None:
        s = torch.cat((s, sinks.to(s.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)), -1)
    lse = torch.logsumexp(s, -1)
    p = torch.where(lse[..., None] == NEG_INF, 0.0, torch.exp(s - lse[..., None]))
    return p[..., :k.shape[2]].to(v.dtype) @ v.repeat_interleave(g, 1), lse


def _random_mix(seed):
    """``(shapes (B, H, Hkv, Sq, Sk, D, Dv), keywords)``: a random mix of every variant keyword."""
    r = random.Random(seed)
    hkv = r.choice([1, 2])
    b, h, d = r.choice([1, 2, 3]), hkv * r.choice([1, 2, 3]), r.choice([8, 16])
    sq = r.randint(1, 70)
    sk = sq if r.random() < 0.6 else r.randint(1, 70)
    kw = dict(causal=r.random() < 0.6, scale=r.choice([None, 0.3]))
    if sq == sk and r.random() < 0.5:
        cu = [0, *sorted(r.randint(0, sq) for _ in range(r.randint(0, 4))), sq]
        kw["cu_seqlens"] = cu if r.random() < 0.5 else torch.tensor(cu, dtype=r.choice([torch.int32, torch.int64]))
    if r.random() < 0.4:
        kw["window_size"] = (r.choice([-1, 0, 1, 5, 17]), r.choice([-1, 0, 3, 9]))
    if r.random() < 0.3:
        kw["softcap"] = r.choice([0.5, 5.0, 30.0])
    if r.random() < 0.3:
        kw["sinks"] = torch.tensor([r.gauss(0, 2) for _ in range(h)], dtype=torch.float64)
    if r.random() < 0.3:
        los = [r.randint(0, sk) for _ in range(b)]
        kw["kv_range"] = torch.tensor([[lo, r.randint(lo, sk)] for lo in los])
    if "cu_seqlens" not in kw and r.random() < 0.3:
        kw["q_offset"] = r.randint(0, 20) if r.random() < 0.5 else torch.tensor([r.randint(0, 20) for _ in range(b)])
    return (b, h, hkv, sq, sk, d, r.choice([d, 8])), kw


@pytest.mark.parametrize("seed", range(40))
def test_random_keyword_mixes_against_the_rule_written_out(seed):
    """Random mixes of every keyword (documents of any length, windows, softcap, sinks, key ranges,
    int and tensor offsets, GQA, odd lengths) on the CPU path in float64: out, lse and every gradient
    (the sinks' too) equal the rule written out pair by pair, empty rows exactly ``(0, -inf)``."""
    (b, h, hkv, sq, sk, d, dv), kw = _random_mix(seed)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_(True)
               for shape in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv)))
    leaves = [q, k, v] + ([kw["sinks"].requires_grad_(True)] if "sinks" in kw else [])
    out, lse = ss.attention(q, k, v, return_lse=True, **kw)
    scale = kw.pop("scale") or 1 / math.sqrt(d)
    want_out, want_lse = _rule_written_out(q, k, v, scale, **kw)
    torch.testing.assert_close(out, want_out, atol=1e-10, rtol=1e-10)
    seen = want_lse > NEG_INF
    assert torch.equal(lse == NEG_INF, ~seen) and torch.equal(out[~seen], torch.zeros_like(out[~seen]))
    torch.testing.assert_close(lse[seen].double(), want_lse[seen], atol=2e-6, rtol=2e-6)
    dout, dlse = torch.randn(out.shape, generator=g, dtype=torch.float64), torch.randn(lse.shape, generator=g)
    got = torch.autograd.grad((out * dout).sum() + (lse.masked_fill(~seen, 0) * dlse).sum(), leaves)
    want = torch.autograd.grad((want_out * dout).sum() + (want_lse.masked_fill(~seen, 0) * dlse).sum(), leaves)
    for name, a, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, w, atol=1e-8, rtol=1e-8, msg=name)


def test_empty_rows_and_sinks():
    """Rows that see no key: out 0, lse -inf (or sinks[h]), zero gradients, never NaN; a -inf sink
    is no sink and has gradient 0."""
    b, h, s, d = 2, 3, 6, 8
    q, k, v, dout = _inputs(b, h, h, s, s, d, torch.float32)
    kv = torch.tensor([[0, 6], [4, 4]])  # element 1 sees nothing
    sinks = torch.tensor([NEG_INF, 0.5, -2.0], requires_grad=True)
    out, lse, dq, dk, dv, dsinks = _grads(_ss, q, k, v, dout, dict(kv_range=kv, sinks=sinks), torch.randn(b, h, s))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(lse[1], torch.tensor([NEG_INF, 0.5, -2.0]).view(h, 1).expand(h, s))
    assert torch.equal(dq[1], torch.zeros_like(dq[1])) and torch.equal(dk[1], torch.zeros_like(dk[1]))
    assert torch.equal(dv[1], torch.zeros_like(dv[1]))
    assert dsinks[0] == 0 and torch.isfinite(dsinks).all() and (dsinks[1:] != 0).all()
    plain = ss.attention(q[:, :1], k[:, :1], v[:, :1], kv_range=kv, return_lse=True)
    assert torch.equal(out[:, :1], plain[0]) and torch.equal(lse[:, :1], plain[1])


def test_sinks_gradient_keeps_its_dtype():
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.bfloat16) for _ in range(3))
    sinks = torch.zeros(2, dtype=torch.float32, requires_grad=True)
    ss.attention(q, k, v, sinks=sinks).float().sum().backward()
    assert sinks.grad.dtype == torch.float32 and torch.isfinite(sinks.grad).all()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_values_in_hidden_positions_change_nothing(poison):
    b, h, s, d = 2, 2, 9, 8
    q, k, v, dout = _inputs(b, h, h, s, s + 3, d, torch.float32)
    kv = torch.tensor([[2, 7], [0, 12]])
    kw = dict(causal=True, window_size=(4, 1), softcap=3.0, kv_range=kv, q_offset=torch.tensor([2, 3]),
              sinks=torch.randn(h))
    clean = _grads(_ss, q, k, v, dout, kw)
    hidden = ~ref.variant_visible(b, s, s + 3, causal=True, window_size=(4, 1), kv_range=kv,
                                  q_offset=kw["q_offset"]).any(1)  # (B, Sk): keys no row sees
    assert hidden.any() and not hidden.all()
    kp, vp = k.clone(), v.clone()
    kp.masked_fill_(hidden.view(b, 1, -1, 1), poison)
    vp.masked_fill_(hidden.view(b, 1, -1, 1), poison)
    dirty = _grads(_ss, q, kp, vp, dout, kw)
    for n, a, c in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], dirty, clean):
        assert torch.equal(a, c), n


def test_nan_query_in_an_empty_row_changes_nothing():
    q, k, v, dout = _inputs(2, 2, 2, 5, 5, 8, torch.float32)
    kw = dict(kv_range=torch.tensor([[0, 5], [3, 3]]))
    clean = _grads(_ss, q, k, v, dout, kw)
    qp = q.clone()
    qp[1] = float("nan")
    dirty = _grads(_ss, qp, k, v, dout, kw)
    for n, a, c in zip(["out", "lse", "dq", "dk", "dv"], dirty, clean):
        assert torch.equal(a, c), n


def test_defaults_are_todays_contract():
    q, k, v = _inputs(2, 4, 2, 13, 13, 16, torch.float32)[:3]
    plain = ss.attention(q, k, v, causal=True, return_lse=True)
    same = ss.attention(q, k, v, causal=True, return_lse=True, cu_seqlens=None, window_size=(-1, -1), softcap=None,
                        sinks=None, kv_range=None, q_offset=0)
    one_doc = ss.attention(q, k, v, causal=True, return_lse=True, cu_seqlens=[0, 13],
                           kv_range=torch.tensor([[0, 13], [0, 13]]))
    no_offset = ss.attention(q, k, v, causal=True, return_lse=True, q_offset=torch.tensor([0, 0]))
    for a, b, c, d in zip(plain, same, one_doc, no_offset):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


def test_key_blocks_no_row_sees_are_skipped(monkeypatch):
    """Documents of 32 keys with blocks of 32: each block of rows reads its own key block only."""
    monkeypatch.setattr("splitsoftmax.ops.attention.torch.CPU_BLOCK_KEYS", 32)
    seen = []
    real = torch.Tensor.__matmul__

    def spy(a, b):
        seen.append(tuple(b.shape))
        return real(a, b)
    q, k, v = _inputs(1, 1, 1, 128, 128, 8, torch.float32)[:3]
    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    ss.attention(q, k, v, window_size=(0, 0))
    assert len(seen) == 2 * 4  # QK^T and PV per key block; no block is hidden from every row
    seen.clear()
    ss.attention(q, k, v, kv_range=torch.tensor([[40, 70]]))
    assert len(seen) == 2 * 2  # key blocks [32, 64) and [64, 96) only


def test_local_mask_of_any_segment_is_the_rule():
    rnd = random.Random(0)
    for _ in range(120):
        b, s = rnd.choice([1, 2, 3]), rnd.choice([1, 5, 17, 33])
        cu = [0, *sorted(rnd.randint(0, s) for _ in range(rnd.randint(0, 4))), s] if rnd.random() < 0.5 else None
        sk = s if cu else rnd.choice([s, s + 4, max(1, s - 3)])
        lo = torch.randint(0, sk + 1, (b,))
        kv = torch.stack((lo, torch.minimum(lo + torch.randint(0, sk + 1, (b,)), torch.tensor(sk))), 1)
        kw = dict(causal=rnd.random() < 0.5, cu_seqlens=cu, window_size=rnd.choice([None, (3, 0), (0, 2), (5, -1),
                                                                                    (-1, 4), (2, 2)]),
                  kv_range=kv if rnd.random() < 0.5 else None,
                  q_offset=0 if cu else rnd.choice([0, 3, -2, torch.randint(-3, 6, (b,))]))
        spec = variants.parse(batch=b, heads=2, sq=s, sk=sk, device=CPU, **kw)
        full = ref.variant_visible(b, s, sk, **kw)
        for _ in range(4):
            qs, ks = rnd.randint(0, s), rnd.randint(0, sk)
            ql, kl = rnd.randint(0, s - qs), rnd.randint(0, sk - ks)
            mask, causal, diag = variants.local_mask(spec, qs, ql, ks, kl, CPU)
            assert torch.equal(visible(mask, causal, diag, b, ql, kl), full[:, qs:qs + ql, ks:ks + kl]), (kw, qs, ks)


def test_local_mask_fields():
    spec = variants.parse(batch=2, heads=1, sq=8, sk=8, device=CPU, causal=True, window_size=(3, -1), softcap=5.0,
                          kv_range=torch.tensor([[0, 8], [2, 6]], dtype=torch.int64), q_offset=2)
    mask, causal, diag = variants.local_mask(spec, 4, 4, 2, 6, CPU)
    assert causal and diag == 2 + 4 - 2 and mask.lo == 2 + 4 - 2 - 3 and mask.softcap == 5.0
    assert mask.kv_range.dtype == torch.int32 and mask.kv_range.tolist() == [[0, 6], [0, 4]]
    assert mask.q_offset is None and mask.rows is None
    spec = variants.parse(batch=2, heads=1, sq=8, sk=8, device=CPU, causal=False, q_offset=torch.tensor([1, 2]))
    mask, causal, diag = variants.local_mask(spec, 0, 8, 0, 8, CPU)
    assert not causal and mask.q_offset.dtype == torch.int32 and mask.q_offset.tolist() == [1, 2]
    spec = variants.parse(batch=1, heads=1, sq=8, sk=8, device=CPU, causal=True, cu_seqlens=[0, 3, 3, 8])
    mask, _, _ = variants.local_mask(spec, 2, 4, 0, 8, CPU)
    assert mask.rows.dtype == torch.int32 and mask.rows.tolist() == [[0, 3, 3, 3], [3, 8, 8, 8]]
    plain = variants.parse(batch=1, heads=1, sq=8, sk=8, device=CPU, causal=True, window_size=(-1, -1))
    assert plain.plain() and variants.local_mask(plain, 0, 8, 0, 8, CPU) == (NO_MASK, True, 0)


def _bad(**kw):
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    return ss.attention(q, k, v, **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(cu_seqlens=torch.tensor([[0, 6]])), "cu_seqlens.*1-D"),
    (dict(cu_seqlens=torch.tensor([0.0, 6.0])), "cu_seqlens.*integer"),
    (dict(cu_seqlens=[0, 2.5, 6]), "cu_seqlens"),
    (dict(cu_seqlens="06"), "cu_seqlens"),
    (dict(cu_seqlens=[1, 6]), r"cu_seqlens\[0\]"),
    (dict(cu_seqlens=[0, 5]), r"cu_seqlens\[-1\]"),
    (dict(cu_seqlens=[0, 4, 2, 6]), "cu_seqlens.*non-decreasing"),
    (dict(cu_seqlens=[0, 6], q_offset=1), "cu_seqlens.*q_offset"),
    (dict(cu_seqlens=[0, 6], q_offset=torch.tensor([0, 0])), "cu_seqlens.*q_offset"),
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(window_size=(3,)), "window_size"),
    (dict(window_size=(1.5, 0)), "window_size"),
    (dict(window_size=4), "window_size"),
    (dict(softcap=0.0), "softcap"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(softcap=float("nan")), "softcap"),
    (dict(softcap="1"), "softcap"),
    (dict(sinks=torch.zeros(2)), "sinks"),
    (dict(sinks=torch.zeros(4, 1)), "sinks"),
    (dict(sinks=torch.zeros(4, dtype=torch.long)), "sinks"),
    (dict(kv_range=torch.tensor([0, 6])), "kv_range"),
    (dict(kv_range=torch.tensor([[0, 6]])), "kv_range"),
    (dict(kv_range=torch.tensor([[0.0, 6.0], [0.0, 6.0]])), "kv_range"),
    (dict(kv_range=torch.tensor([[4, 2], [0, 6]])), "kv_range"),
    (dict(kv_range=torch.tensor([[-1, 2], [0, 6]])), "kv_range"),
    (dict(kv_range=torch.tensor([[0, 7], [0, 6]])), "kv_range"),
    (dict(q_offset=torch.tensor([1, 2, 3])), "q_offset"),
    (dict(q_offset=torch.tensor(1)), "q_offset"),
    (dict(q_offset=torch.tensor([1.0, 2.0])), "q_offset"),
    (dict(q_offset=1.5), "q_offset"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        _bad(**kw)


@pytest.mark.parametrize("off", [2 ** 32, -2 ** 32, 2 ** 31 + 7, 2 ** 30 + 3])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window_size=(2, 0)), dict(window_size=(1, 1))],
                         ids=["causal", "causal-window", "window"])
def test_a_tensor_q_offset_beyond_int32_means_what_the_int_means(off, kw):
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    want = ss.attention(q, k, v, q_offset=off, return_lse=True, **kw)
    got = ss.attention(q, k, v, q_offset=torch.tensor([off]), return_lse=True, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.isinf(want[1]).all() == (off < 0 or "window_size" in kw)  # (none or all keys seen)


def test_cu_seqlens_needs_self_attention():
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    with pytest.raises(ValueError, match="cu_seqlens.*Sq == Sk"):
        ss.attention(q, k, v, cu_seqlens=[0, 4])


def test_a_triton_launcher_without_mask_refuses_variants(monkeypatch):
    def launcher(q, k, v, scale, causal, diag=0, out_dtype=None):
        return "ran"

    def launcher_with_mask(q, k, v, scale, causal, diag=0, out_dtype=None, *, mask=NO_MASK):
        return mask
    t = torch.zeros(1)
    monkeypatch.setattr(local, "op", lambda name, t: launcher)
    assert local.masked_op("attn_fwd", t, NO_MASK) is launcher
    with pytest.raises(NotImplementedError, match="attn_fwd.*softcap"):
        local.masked_op("attn_fwd", t, Mask(softcap=2.0))
    monkeypatch.setattr(local, "op", lambda name, t: launcher_with_mask)
    assert local.masked_op("attn_fwd", t, Mask(lo=3))(t, t, t, 1.0, False) == Mask(lo=3)


def test_compile_fullgraph_with_variants():
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_(True) for t in _inputs(2, 4, 2, 17, 17, 16, torch.float32)[:3])
    sinks = torch.randn(4, requires_grad=True)
    kv, qo, cu = torch.tensor([[0, 17], [3, 12]]), torch.tensor([0, 2]), torch.tensor([0, 4, 4, 11, 17])

    def f(q, k, v, sinks, kv, qo, cu):
        a = ss.attention(q, k, v, causal=True, window_size=(4, 0), softcap=3.0, sinks=sinks, kv_range=kv, q_offset=qo)
        b = ss.attention(q, k, v, causal=True, cu_seqlens=[0, 4, 4, 11, 17], window_size=(5, -1))
        c = ss.attention(q, k, v, cu_seqlens=cu)
        return (a * a).sum() + (b * b).sum() + (c * c).sum()
    leaves = (q, k, v, sinks)
    got = torch.compile(f, fullgraph=True)(*leaves, kv, qo, cu)
    g_got = torch.autograd.grad(got, leaves)
    want = f(*leaves, kv, qo, cu)
    g_want = torch.autograd.grad(want, leaves)
    torch.testing.assert_close(got, want)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)


def _opcheck_cases():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(s, generator=g).requires_grad_(True) for s in ((2, 4, 9, 16), (2, 2, 9, 16), (2, 2, 9, 8)))
    kv, qo = torch.tensor([[0, 9], [2, 7]], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    rows = torch.tensor([[0, 0, 0, 3, 3, 3, 3, 3, 8], [3, 3, 3, 8, 8, 8, 8, 8, 9]], dtype=torch.int32)
    sinks = torch.randn(4, generator=g).requires_grad_(True)
    lse = torch.randn(2, 4, 9)
    ops = torch.ops.splitsoftmax
    return [
        (ops.attn_fwd, (q, k, v, 0.25, True, 0, -3, 2.0, kv, None, rows, sinks)),
        (ops.attn_fwd, (q, k, v, 0.25, False, 1, None, 0.0, None, qo, None, None)),
        (ops.attn_fwd, (q, k, v, 0.3, True, 2, 0, 0.0, kv, qo, rows, sinks)),
        (ops.attn_bwd, (q.detach(), k.detach(), v.detach(), torch.randn(2, 4, 9, 8), lse, torch.randn(2, 4, 9), 0.25,
                        True, 0, -3, 2.0, kv, qo, rows)),
        (ops.attn_bwd, (q.detach(), k.detach(), v.detach(), torch.randn(2, 4, 9, 8), lse, torch.randn(2, 4, 9), 0.25,
                        False, 0, None, 0.0, kv, None, None, sinks.detach(), torch.randn(2, 4, 9))),
    ]


@pytest.mark.parametrize("case", range(len(_opcheck_cases())))
def test_opcheck_variant_ops(case):
    fn, args = _opcheck_cases()[case]
    torch.library.opcheck(fn, args)


@pytest.mark.gpu
def test_cuda_cu_seqlens_is_read_once_per_version():
    cu = torch.tensor([0, 3, 3, 8], device="cuda")
    kw = dict(batch=1, heads=1, sq=8, sk=8, device=cu.device, causal=True, cu_seqlens=cu)
    first = variants.parse(**kw)
    variants.local_mask(first, 0, 8, 0, 8, cu.device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # the same unmodified tensor: no host read, no upload
        again = variants.parse(**kw)
        variants.local_mask(again, 0, 8, 0, 8, cu.device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert again.cu == first.cu == (0, 3, 3, 8)
    cu[1] = 2  # modified in place: read again
    assert variants.parse(**kw).cu == (0, 2, 3, 8)


def test_a_device_cu_seqlens_is_read_once_while_unmodified(monkeypatch):
    reads = []
    real = variants._host_values
    monkeypatch.setattr(variants, "_host_values", lambda t: reads.append(1) or real(t))
    cu = torch.tensor([0, 3, 3, 8])
    assert variants.cached_values(cu) == (0, 3, 3, 8) and variants.cached_values(cu) == (0, 3, 3, 8)
    assert len(reads) == 1
    cu[1] = 2  # modified in place: its _version moves on
    assert variants.cached_values(cu) == (0, 2, 3, 8) and len(reads) == 2
    other = cu.clone()
    assert variants.cached_values(other) == (0, 2, 3, 8) and len(reads) == 3
