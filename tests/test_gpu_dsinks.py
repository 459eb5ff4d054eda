"""GPU lane: the sinks' gradient in bfloat16 through ``ss.attention`` (the Gluon pair on sm_90) and the
sharded schedules, FlashAttention's rule for ``dsinks`` and every other gradient.

Random packed documents (about ten, uneven), causal and not, ``B=2, H=2, S=1536, D=128`` and a GQA
case, sinks in bf16 and float32, a cotangent through ``lse``: each gradient's error against the
rule written out in float64 (``test_variants._rule_written_out``) at most 2x that of the same
function run in bf16, plus twice the error of rounding the exact result to the result's dtype.
The dK/dV kernels sum ``p_sink P dP`` per key from their own float32 ``P`` and ``dP``, so ``dsinks``
does not see the rounding of the output (before, 4.8x the peer's error on packed documents).
"""
from __future__ import annotations

import math
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.distributed import LoopbackWorld  # noqa: E402
from _dsinks_rule import _err, _grads, _loss, _references, _within_rule  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
NEG_INF = float("-inf")


def _docs(s, seed):
    r = random.Random(seed)
    return [0, *sorted(r.sample(range(1, s), r.randint(8, 11))), s]


def _inputs(b, h, hkv, s, d, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, dout = (torch.randn(b, h, s, d, generator=g, device=DEV).to(BF16) for _ in range(2))
    k, v = (torch.randn(b, hkv, s, d, generator=g, device=DEV).to(BF16) for _ in range(2))
    sinks = torch.randn(h, generator=g, device=DEV) * 2
    dlse = torch.randn(b, h, s, generator=g, device=DEV)
    return q, k, v, dout, dlse, sinks


CASES = [(2, 2, 2), (1, 8, 2)]  # (B, H, Hkv): the reported shape, and GQA


@pytest.mark.parametrize("sinks_dtype", [torch.float32, BF16], ids=["fp32-sinks", "bf16-sinks"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", CASES, ids=["mha", "gqa"])
@pytest.mark.parametrize("seed", range(3))
def test_dsinks_within_the_flash_rule(seed, shape, causal, sinks_dtype):
    b, h, hkv = shape
    s, d = 1536, 128
    q, k, v, dout, dlse, sinks = _inputs(b, h, hkv, s, d, seed)
    scale = 1 / math.sqrt(d)
    kw = dict(causal=causal, cu_seqlens=_docs(s, seed))
    ours = lambda q, k, v, **w: ss.attention(q, k, v, scale=scale, return_lse=True, **w)  # noqa: E731
    got = _grads(ours, q, k, v, dout, dlse, sinks, BF16, sinks_dtype, kw)
    want, peer = _references(q, k, v, dout, dlse, sinks, scale, kw, sinks_dtype)
    for name, a, w, p in zip(("dq", "dk", "dv", "dsinks"), got, want, peer):
        assert a.dtype == (sinks_dtype if name == "dsinks" else BF16), name
        _within_rule(a, w, p, (name, kw["cu_seqlens"]))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_plain_masks(causal):
    """No documents: the plain pair (the Gluon dK/dV kernel's plain launch on sm_90)."""
    q, k, v, dout, dlse, sinks = _inputs(2, 4, 2, 1000, 128, 5)
    scale = 1 / math.sqrt(128)
    kw = dict(causal=causal)
    ours = lambda q, k, v, **w: ss.attention(q, k, v, scale=scale, return_lse=True, **w)  # noqa: E731
    got = _grads(ours, q, k, v, dout, dlse, sinks, BF16, torch.float32, kw)
    want, peer = _references(q, k, v, dout, dlse, sinks, scale, kw)
    _within_rule(got[3], want[3], peer[3], causal)


def test_dsinks_reproducible():
    """The sinks' sums are written without atomics and summed on the host in a fixed order: the same
    bits on every call."""
    q, k, v, dout, _, sinks = _inputs(2, 2, 2, 1536, 128, 7)
    sinks.requires_grad_()
    runs = []
    for _ in range(3):
        out = ss.attention(q, k, v, causal=True, cu_seqlens=_docs(1536, 7), sinks=sinks)
        runs.append(torch.autograd.grad((out.float() * dout.float()).sum(), sinks)[0])
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("schedule", ["ring", "allgather", "tree", "heads"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sharded_dsinks(schedule, causal):
    """Over 2 loopback ranks on the GPU, packed documents (the tree: a window, or a key range): the
    ranks' ``dsinks`` sum (the tree: each rank's, the same on both) within the rule of float64."""
    q, k, v, dout, dlse, sinks = _inputs(1, 4, 2, 768, 128, 11 + causal)
    kw = dict(causal=causal, cu_seqlens=_docs(768, 11))
    if schedule == "tree":
        kw = dict(causal=True, window_size=(300, 0)) if causal else dict(
            causal=False, kv_range=torch.tensor([[5, 768]], device=DEV))
    layout = "zigzag" if "cu_seqlens" in kw else "contiguous"
    got = [None, None]

    def case(g):
        shard = lambda t: ss.shard(t, 2, group=g, layout=layout,  # noqa: E731
                                   cu_seqlens=kw.get("cu_seqlens"))
        mine = (lambda t: t) if schedule == "tree" else shard
        leaves = [mine(q).clone().requires_grad_(), shard(k).clone().requires_grad_(),
                  shard(v).clone().requires_grad_(), sinks.clone().requires_grad_()]
        out, lse = ss.sharded_attention(*leaves[:3], group=g, schedule=schedule, layout=layout, sinks=leaves[3],
                                        return_lse=True, **kw)
        got[g.rank] = torch.autograd.grad(_loss(out, lse, mine(dout), mine(dlse)), leaves[3])[0]

    LoopbackWorld(2).run(case)
    want, peer = _references(q, k, v, dout, dlse, sinks, 1 / math.sqrt(128), kw)
    if schedule == "tree":
        assert torch.equal(got[0], got[1])
    _within_rule(got[0] if schedule == "tree" else got[0] + got[1], want[3], peer[3], schedule)
