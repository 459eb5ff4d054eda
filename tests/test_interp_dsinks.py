"""Interpreter lane: the sinks' gradient in bfloat16 through the Triton backward kernels on small shapes.

The dK/dV kernels sum ``p_sink * P * dP`` per key from their own float32 ``P`` and ``dP = dout . v_j``
(``bwd_common``), and the heads schedule takes each row's ``rowsum(dout * out)`` from its output before
rounding, so ``dsinks`` no longer sees the rounding of the output to bf16. FlashAttention's rule: the
error against the rule written out in float64 (``test_variants._rule_written_out``) at most 2x that
of the same function run in bf16, plus twice the error of rounding the exact result to the result's
dtype; and closer to float64 than the formula from the rounded output (``state.sink_grad`` of
``delta``). Packed documents of uneven lengths, causal and not, GQA, a cotangent through ``lse``;
single-device (the general pair, atomic and deterministic, and the plain pair) and the ring,
allgather, tree and heads schedules.
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
from splitsoftmax.core import state  # noqa: E402
from splitsoftmax.core.mask import NO_MASK  # noqa: E402
from splitsoftmax.distributed import LoopbackWorld  # noqa: E402
from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.ops.attention import bwd as AB  # noqa: E402
from splitsoftmax.ops.attention import bwd_plain as ABP  # noqa: E402
from splitsoftmax.ops.attention.op import backward_stats  # noqa: E402
from _dsinks_rule import _err, _grads, _loss, _references, _within_rule  # noqa: E402

BF16 = torch.bfloat16
NEG_INF = float("-inf")


def _inputs(b, h, hkv, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, h, s, d, generator=g).to(BF16) for _ in range(2))
    k, v = (torch.randn(b, hkv, s, d, generator=g).to(BF16) for _ in range(2))
    sinks = torch.randn(h, generator=g) * 2
    dlse = torch.randn(b, h, s, generator=g)
    return q, k, v, dout, sinks, dlse


def _old_formula(q, k, v, dout, sinks, dlse, scale, kw):
    """The sinks' gradient from ``delta = rowsum(dout * out) - dlse`` of the rounded bf16 output: the
    formula the Triton path used before its kernels summed ``P dP``."""
    out, lse = ss.attention(q, k, v, scale=scale, sinks=sinks, return_lse=True, **kw)
    lse2, delta = backward_stats(out, lse, dout, dlse.masked_fill(lse == NEG_INF, 0))
    return state.sink_grad(lse2, delta, sinks)


def _check(q, k, v, dout, sinks, dlse, kw, what, sinks_dtype=torch.float32, old=True):
    scale = 1 / math.sqrt(q.shape[-1])
    ours = lambda q, k, v, **w: ss.attention(q, k, v, scale=scale, return_lse=True, **w)  # noqa: E731
    got = _grads(ours, q, k, v, dout, dlse, sinks, BF16, sinks_dtype, kw)
    want, peer = _references(q, k, v, dout, dlse, sinks, scale, kw, sinks_dtype)
    for name, a, w, p in zip(("dq", "dk", "dv", "dsinks"), got, want, peer):
        assert a.dtype == (sinks_dtype if name == "dsinks" else BF16), (what, name)
        _within_rule(a, w, p, (what, name))
    if old:
        before = _old_formula(q, k, v, dout, sinks.to(sinks_dtype), dlse, scale, kw)
        assert _err(got[3], want[3]) < _err(before, want[3]), (what, _err(got[3], want[3]), _err(before, want[3]))


DOCS = [0, 7, 40, 41, 66, 96]  # uneven documents (one of a single row)


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True])
def test_documents_on_the_general_pair(causal, det, monkeypatch):
    """Packed documents take ``bwd``'s general pair (masks): the five-product path and the
    deterministic one (GQA group 2; a split of the dK/dV work over query heads and query pieces,
    each piece's masked and interior tiles in their own parts of the sinks' buffer)."""
    monkeypatch.setattr(configs, "ATTN_BWD_ATOMIC", True)
    monkeypatch.setattr(AB, "deterministic", lambda: det)
    monkeypatch.setattr(configs, "ATTN_BWD_SPLIT_MIN_BLOCKS", 1)
    monkeypatch.setattr(AB, "sm_count", lambda t: 32)
    q, k, v, dout, sinks, dlse = _inputs(2, 4, 2, 96, 32, seed=causal + 2 * det)
    assert AB._atomic(q, k, v) == (not det)
    assert AB.splits(q, k, AB.attn_tile("bwd_kv" if det else "bwd", BF16, 32, 32)) > (1, 1)
    _check(q, k, v, dout, sinks, dlse, dict(causal=causal, cu_seqlens=DOCS), (causal, det))


@pytest.mark.parametrize("sinks_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_pair(causal, sinks_dtype):
    """Plain visibility takes ``bwd_plain``'s pair; sinks in float32 and bf16 (one of them ``-inf``:
    no weight, a zero gradient)."""
    q, k, v, dout, sinks, dlse = _inputs(1, 4, 2, 80, 32, seed=5 + causal)
    sinks[1] = NEG_INF
    assert ABP.takes(q, k, v, dout, NO_MASK)
    # (bf16 sinks: the rounded gradient's error is the bar; the old formula is not always above it)
    _check(q, k, v, dout, sinks, dlse, dict(causal=causal), (causal, sinks_dtype), sinks_dtype,
           old=sinks_dtype == torch.float32)


def test_empty_rows_and_no_lse_cotangent():
    """A key range that leaves rows without keys (their ``lse`` is the sink's) and no ``dlse``: the
    kernels' sums skip them, and ``dsinks`` still matches float64."""
    q, k, v, dout, sinks, _ = _inputs(2, 2, 2, 40, 16, seed=9)
    kw = dict(causal=True, kv_range=torch.tensor([[0, 40], [30, 40]]))
    _check(q, k, v, dout, sinks, torch.zeros(2, 2, 40), kw, "empty rows", old=False)


def _sharded_dsinks(schedule, q, k, v, dout, dlse, sinks, kw, size=2):
    """Each rank's ``dsinks`` of ``ss.sharded_attention`` over ``size`` loopback ranks (zigzag per
    document with documents, else contiguous; the tree: contiguous keys, the whole ``q`` on every
    rank), bf16 inputs, float32 sinks, cotangents ``dout``, ``dlse``."""
    got = [None] * size
    docs = kw.get("cu_seqlens")
    layout = "zigzag" if docs is not None and schedule != "tree" else "contiguous"

    def case(g):
        shard = lambda t: ss.shard(t, 2, group=g, layout=layout,  # noqa: E731
                                   cu_seqlens=docs if layout == "zigzag" else None)
        mine = (lambda t: t) if schedule == "tree" else shard  # (the tree's q is whole on every rank)
        leaves = [mine(q).clone().requires_grad_(), shard(k).clone().requires_grad_(),
                  shard(v).clone().requires_grad_(), sinks.clone().requires_grad_()]
        out, lse = ss.sharded_attention(*leaves[:3], group=g, schedule=schedule, layout=layout, sinks=leaves[3],
                                        return_lse=True, **kw)
        got[g.rank] = torch.autograd.grad(_loss(out, lse, mine(dout), mine(dlse)), leaves[3])[0]

    LoopbackWorld(size).run(case)
    return got


@pytest.mark.parametrize("schedule", ["ring", "allgather", "tree", "heads"])
@pytest.mark.parametrize("causal", [False, True])
def test_sharded(schedule, causal):
    """Over 2 ranks, packed documents: the ranks' ``dsinks`` (ring, allgather, heads: their rows'
    shares) sum to within the rule of float64 and beat the rounded output's formula; the tree's (the
    full gradient on every rank) is the same on both (it takes no documents: a window, or a key
    range)."""
    q, k, v, dout, sinks, dlse = _inputs(1, 4, 2, 64, 16, seed=11 + causal)
    kw = dict(causal=causal, cu_seqlens=[0, 5, 30, 31, 64])
    if schedule == "tree":
        kw = dict(causal=True, window_size=(20, 0)) if causal else dict(causal=False, kv_range=torch.tensor([[3, 64]]))
    got = _sharded_dsinks(schedule, q, k, v, dout, dlse, sinks, kw)
    scale = 1 / math.sqrt(16)
    want, peer = _references(q, k, v, dout, dlse, sinks, scale, kw)
    total = got[0] if schedule == "tree" else got[0] + got[1]
    if schedule == "tree":
        assert torch.equal(got[0], got[1])
    _within_rule(total, want[3], peer[3], schedule)
    before = _old_formula(q, k, v, dout, sinks, dlse, scale, kw)
    assert _err(total, want[3]) < _err(before, want[3]), (schedule, _err(total, want[3]), _err(before, want[3]))


def test_heads_rank_shares_are_their_rows():
    """Under the heads schedule each rank's ``dsinks`` is its own rows' share: the float64 gradient of
    the loss restricted to its sequence shard's rows, within the rule."""
    q, k, v, dout, sinks, dlse = _inputs(1, 4, 2, 48, 16, seed=21)
    kw = dict(causal=True)
    got = _sharded_dsinks("heads", q, k, v, dout, dlse, sinks, kw)
    scale = 1 / math.sqrt(16)
    for r, rows in enumerate((slice(0, 24), slice(24, 48))):
        sel = torch.zeros(48)
        sel[rows] = 1
        want, peer = _references(q, k, v, dout * sel[:, None].to(BF16), dlse * sel, sinks, scale, kw)
        _within_rule(got[r], want[3], peer[3], ("heads rank", r))
