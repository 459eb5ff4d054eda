"""GPU lane: the Gluon forward (ops/attention/gluon/fwd.py) on sm_90, against float64 and the Triton kernel.

FlashAttention's rule (error against float64 at most 2x torch's attention in bf16) for the output,
the lse within the Triton kernel's error; odd lengths, GQA, (B, S, H, D) views, a diagonal
offset in both directions (empty rows: ``(0, -inf)``); a NaN/Inf value in a diagonal block reaches
the same rows as under the Triton kernel; launched persistent on any number of programs, the
result is bit for bit that of one program per tile; merged into a ring step's running state as the
Triton kernel merges. Outputs are NaN-poisoned (conftest).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from splitsoftmax.core import reference as ref  # noqa: E402
from splitsoftmax.ops.attention import fwd as A  # noqa: E402
from splitsoftmax.ops._triton import configs, launch  # noqa: E402
from splitsoftmax.ops._triton.device import sm90  # noqa: E402
from splitsoftmax.core.mask import Mask  # noqa: E402
from test_gpu_attention import sdpa  # noqa: E402

if not (torch.cuda.is_available() and sm90(torch.empty(0, device="cuda"))):
    pytest.skip("the Gluon forward runs on sm_90", allow_module_level=True)

CASES = [
    # b, h, hkv, sq, sk, views, causal, diag
    (2, 8, 2, 1000, 1000, False, True, 0),
    (2, 8, 2, 1000, 1000, False, False, 0),
    (1, 16, 4, 777, 777, True, True, 0),
    (2, 16, 4, 1024, 1024, True, True, 0),
    (4, 16, 4, 300, 1000, False, True, 700),
    (2, 8, 2, 640, 512, True, True, -100),
    (8, 16, 2, 129, 2000, False, False, 0),
]


def _inputs(b, h, hkv, sq, sk, views, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def t(n, s):
        x = torch.randn(b, s, n, 128, device="cuda", generator=g).to(torch.bfloat16)
        return x.transpose(1, 2) if views else x.transpose(1, 2).contiguous()
    return t(h, sq), t(hkv, sk), t(hkv, sk)


@pytest.fixture(autouse=True)
def _every_length(monkeypatch):
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_MIN_SQ", (0, 0))


def _fwd(q, k, v, causal, diag, gluon, monkeypatch):
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON", gluon)
    scale = q.shape[-1] ** -0.5
    p = A.plan(q, k, v, causal, diag)
    ran = A._gluon_fwd_tile(q, k, v, A._empty_out(q, 128, torch.bfloat16), scale, causal, p, False, False) is not None
    assert ran == gluon
    return A.attn_fwd(q, k, v, scale, causal, diag, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("case", CASES)
def test_flash_rule(case, monkeypatch):
    b, h, hkv, sq, sk, views, causal, diag = case
    q, k, v = _inputs(b, h, hkv, sq, sk, views)
    scale = q.shape[-1] ** -0.5
    o64, l64 = ref.attention(q, k, v, causal=causal, scale=scale, diag=diag)
    out, lse = _fwd(q, k, v, causal, diag, True, monkeypatch)
    tri_out, tri_lse = _fwd(q, k, v, causal, diag, False, monkeypatch)
    seen = l64 > float("-inf")
    assert not out[seen].isnan().any() and not lse.isnan().any()
    assert (out[~seen] == 0).all() and (lse[~seen] == float("-inf")).all()
    peer = sdpa(q, k, v, scale, causal, diag).double()[seen]
    err = (out[seen].double() - o64[seen]).abs().max().item()
    assert err <= 2 * (peer - o64[seen]).abs().max().item() + 1e-6
    err_l = (lse[seen].double() - l64[seen]).abs().max().item()
    tri_l = (tri_lse[seen].double() - l64[seen]).abs().max().item()
    assert err_l <= 2 * tri_l + 1e-6, (err_l, tri_l)
    assert (out.double() - tri_out.double()).abs().max().item() <= 2 * err + 1e-6


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["k", "v"])
def test_hidden_poison_reaches_the_same_rows(bad, where, monkeypatch):
    q, k, v = _inputs(4, 8, 1, 1000, 1000, False)
    for key in (200, 999, 130):  # inside diagonal blocks: seen by the rows at or below it only
        (k if where == "k" else v)[0, 0, key, 5] = bad
    outs = {g: _fwd(q, k, v, True, 0, g, monkeypatch) for g in (True, False)}
    # the rows a poisoned key reaches (which of their entries turn non-finite depends on the tile:
    # a guarded diagonal block poisons the whole row, as attention._guarded_pv does)
    reached = {g: (~torch.isfinite(o)).any(-1) for g, (o, _) in outs.items()}
    assert torch.equal(reached[True], reached[False]), (reached[True] != reached[False]).nonzero()[:8]
    assert torch.equal(outs[True][1].isnan(), outs[False][1].isnan())
    assert not reached[True][:, :, :130].any() and not reached[True][1:].any()
    if where == "v" or bad != bad:  # (an infinite key may give a row -inf scores only: not reached)
        assert reached[True][0, :, 130:].all()


def _state(b, h, sq, seed):
    """A running float32 state ``(out (B, H, Sq, 128), lse)``: every third row empty (``lse = -inf``, its
    ``out`` NaN, which a merge must never multiply in), the others with lse around the block's."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.randn(b, h, sq, 128, device="cuda", generator=g)
    lse = torch.randn(b, h, sq, device="cuda", generator=g) * 2 + 6
    out[:, :, ::3], lse[:, :, ::3] = float("nan"), float("-inf")
    return out, lse


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[4], CASES[5]])
def test_merge_into_a_state(case, monkeypatch):
    """A ring step's forward (``attn_fwd_acc``) on the Gluon kernel merges the block's attention into a
    float32 running state: against float64 (``state.merge_out_lse`` of the state and the float64
    attention) within 2x the Triton kernel's error for the output and the lse, rows empty in the
    state, in the block (a negative diagonal) or in both as the float64 merge has them."""
    from splitsoftmax.core import state
    b, h, hkv, sq, sk, views, causal, diag = case
    q, k, v = _inputs(b, h, hkv, sq, sk, views, seed=11)
    scale = q.shape[-1] ** -0.5
    o64, l64 = ref.attention(q, k, v, causal=causal, scale=scale, diag=diag)
    st_out, st_lse = _state(b, h, sq, 12)
    want_o, want_l = state.merge_out_lse(torch.stack((st_out.double().nan_to_num(), o64)),
                                         torch.stack((st_lse.double(), l64)))
    got = {}
    for gluon in (True, False):
        monkeypatch.setattr(configs, "ATTN_FWD_GLUON", gluon)
        p = A.plan(q, k, v, causal, diag)
        assert (A._gluon_fwd_tile(q, k, v, st_out, scale, causal, p, True, False) is not None) == gluon
        out, lse = st_out.clone(), st_lse.clone()
        A.attn_fwd_acc(q, k, v, scale, causal, diag, out, lse)
        got[gluon] = out, lse
    seen = want_l > float("-inf")
    assert seen.any()
    for gluon, (out, lse) in got.items():
        assert not out[seen].isnan().any() and not lse.isnan().any(), gluon
        assert (out[~seen] == 0).all() and (lse[~seen] == float("-inf")).all(), gluon
    err = {g: (o[seen].double() - want_o[seen]).abs().max().item() for g, (o, _) in got.items()}
    err_l = {g: (lse[seen].double() - want_l[seen]).abs().max().item() for g, (_, lse) in got.items()}
    assert err[True] <= 2 * err[False] + 1e-6, err
    assert err_l[True] <= 2 * err_l[False] + 1e-6, err_l


@pytest.mark.parametrize("programs", [1, 3, 7, 132])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4], CASES[5], (2, 16, 4, 4096, 4096, True, True, 0)])
def test_persistent_equals_one_program_per_tile(case, programs, monkeypatch):
    """``programs`` persistent programs (each taking tiles from the launch's counter) give the
    output and lse of a grid of one program per tile, bit for bit, and leave the counter zero."""
    b, h, hkv, sq, sk, views, causal, diag = case
    q, k, v = _inputs(b, h, hkv, sq, sk, views, seed=3)
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_PERSISTENT", False)
    one = _fwd(q, k, v, causal, diag, True, monkeypatch)
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_PERSISTENT", True)
    monkeypatch.setattr(A, "sm_count", lambda t: programs)
    monkeypatch.setattr(A, "_FWD_LAUNCHES", launch.Memo())
    few = _fwd(q, k, v, causal, diag, True, monkeypatch)
    assert not one[0].isnan().any()
    assert torch.equal(A.tile_counter(q), torch.zeros(2, dtype=torch.int32, device="cuda"))  # left zero
    for x, y in zip(few, one):
        assert torch.equal(x, y), (x.double() - y.double()).abs().max()


@pytest.mark.parametrize("programs", [1, 7, 132])
def test_persistent_variants_equal_one_program_per_tile(programs, monkeypatch):
    """Under a variant's mask (window, documents, kv_range, softcap) as well: ``programs`` persistent
    programs give one program per tile's output and lse bit for bit."""
    from test_gpu_attention_mask import docs, i32
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_VARIANTS", True)
    q, k, v = _inputs(2, 8, 2, 1500, 1500, True, seed=5)
    mask = Mask(lo=-400, softcap=20.0, kv_range=i32([0, 1500], [30, 1400]), rows=docs([0, 1, 700, 700, 1500]))
    scale = q.shape[-1] ** -0.5

    def fwd():
        monkeypatch.setattr(A, "_FWD_LAUNCHES", launch.Memo())
        p = A.plan(q, k, v, True, 0, mask)
        assert A._gluon_fwd_tile(q, k, v, A._empty_out(q, 128, q.dtype), scale, True, p, False, False)
        return A.attn_fwd(q, k, v, scale, True, 0, out_dtype=torch.bfloat16, mask=mask)
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_PERSISTENT", False)
    one = fwd()
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_PERSISTENT", True)
    monkeypatch.setattr(A, "sm_count", lambda t: programs)
    few = fwd()
    assert not one[0].isnan().any() and (one[1] == float("-inf")).any()  # rows past kv_range see nothing
    for x, y in zip(few, one):
        assert torch.equal(x, y), (x.double() - y.double()).abs().max()


def test_launches_in_turn_and_on_two_streams(monkeypatch):
    """Launches back to back on one stream, and at once on two (each stream has its own tile
    counter), give the same output bit for bit."""
    q, k, v = _inputs(2, 16, 4, 4096, 4096, True, seed=4)
    monkeypatch.setattr(A, "sm_count", lambda t: 5)  # few programs: each takes many tiles
    monkeypatch.setattr(A, "_FWD_LAUNCHES", launch.Memo())
    first = _fwd(q, k, v, True, 0, True, monkeypatch)[0]
    again = [_fwd(q, k, v, True, 0, True, monkeypatch)[0] for _ in range(4)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = _fwd(q, k, v, True, 0, True, monkeypatch)[0]
    mine = _fwd(q, k, v, True, 0, True, monkeypatch)[0]
    torch.cuda.current_stream().wait_stream(side)
    for out in again + [other, mine]:
        assert torch.equal(out, first)


RING_VARIANTS = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "documents": dict(causal=True, cu_seqlens=[0, 1, 700, 700, 2100, 3000]),
    "window": dict(causal=True, window_size=(400, 0)),
    "softcap": dict(causal=True, softcap=20.0),
}


@pytest.mark.parametrize("variant", sorted(RING_VARIANTS))
def test_ring_steps_merge_on_the_gluon_forward(variant, monkeypatch):
    """A zigzag ring of 3 loopback ranks over 3000 bf16 positions, GQA, (B, S, H, D) views, plain or
    under a variant: the steps' merges into the running state run on the Gluon kernel (its merging
    launches counted; a rank's first call, covering every row, writes the state on it without one),
    and the sharded output and lse are within 2x the error against float64 of the same ring merging
    on the Triton kernel."""
    from splitsoftmax import sharded_attention
    from splitsoftmax.distributed import LoopbackWorld, shard, unshard
    kw = dict(RING_VARIANTS[variant])
    docs = kw.pop("cu_seqlens", None)
    cu = None if docs is None else torch.tensor(docs, dtype=torch.int32, device="cuda")
    q, k, v = _inputs(2 if cu is None else 1, 8, 2, 3000, 3000, True, seed=13)
    scale = q.shape[-1] ** -0.5
    o64, l64 = ref.attention_variants(q, k, v, scale=scale, cu_seqlens=cu, **kw)
    ran = []
    run_gluon = A._run_gluon_fwd
    monkeypatch.setattr(A, "_run_gluon_fwd", lambda run, *a: ran.append(run.kwargs["ACC"]) or run_gluon(run, *a))

    def ring(comm):
        ql, kl, vl = (shard(t, 2, group=comm, layout="zigzag", cu_seqlens=cu) for t in (q, k, v))
        out, lse = sharded_attention(ql, kl, vl, group=comm, schedule="ring", layout="zigzag", return_lse=True,
                                     cu_seqlens=cu, **kw)
        return tuple(unshard(t, 2, group=comm, layout="zigzag", cu_seqlens=cu) for t in (out, lse))
    err = {}
    for on in (True, False):
        monkeypatch.setattr(configs, "ATTN_FWD_GLUON_ACC", on)
        ran.clear()
        out, lse = LoopbackWorld(3).run(ring)[0]
        assert any(ran) == on, ran
        assert not out.isnan().any() and not lse.isnan().any()
        err[on] = ((out.double() - o64).abs().max().item(), (lse.double() - l64).abs().max().item())
    assert err[True][0] <= 2 * err[False][0] + 1e-6 and err[True][1] <= 2 * err[False][1] + 1e-6, err
