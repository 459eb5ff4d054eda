"""``schedule="heads+ring"`` / ``"heads+allgather"`` on 2-D meshes against the float64 single-device oracle.

Each ``case_*(mesh)`` takes a mesh (a tuple ``(seq_group, heads_group)`` or a 2-D DeviceMesh), builds
the full inputs from a fixed seed on every rank, places them as ``ss.shard(..., group=mesh)`` does
(or by explicit per-rank lengths) and asserts forward and backward (q, k, v and the sinks' share of
this rank's rows) against ``reference.attention_variants``: head splits uneven over the heads
group, ``Hkv`` below the heads degree, ranks without heads, uneven and empty pieces, zigzag (per
document), every variant keyword. Here they run on loopback meshes 2x2, 2x3, 3x2, 2x4 and 4x2 (the
sequence degree first) and degenerate ones (1x3, 3x1, 1x8, 8x1); test_mesh_gloo.py runs them on Gloo
process groups.
"""
from __future__ import annotations

import pytest
import torch

from splitsoftmax import sharded_attention
from splitsoftmax.distributed import LoopbackWorld, shard, unshard
from splitsoftmax.distributed.mesh import as_group
from test_dist_cases import DEVICE, F32, F64
from test_dist_variants import _loss, _oracle, documents
from test_heads_cases import B, DV, _inputs, sinks_of

SHAPES = [(2, 2), (2, 3), (3, 2), (2, 4), (4, 2)]


def head_shapes(ph: int) -> list:
    """``(H, Hkv)`` over a heads degree ``ph``: MHA with ``H = ph + 1`` (uneven); GQA with ``Hkv < ph``
    where ``ph > 2``; fewer query heads than heads ranks (ranks with none); a split whose local
    grouping is uneven (6 over 3 kv heads on 2 ranks: 2 + 1 and 1 + 2 query heads per kv head)."""
    return [(ph + 1, ph + 1), (6, 2), (1, 1), (6, 3)]


def mesh_lengths(shape: tuple, s: int, seed: int) -> list:
    """Per mesh rank lengths summing to ``s``, uneven, with an empty piece and an empty heads group."""
    g = torch.Generator().manual_seed(seed)
    n = shape[0] * shape[1]
    lens = torch.randint(0, 4, (n,), generator=g).tolist()
    lens[seed % n] = 0
    lens[n - shape[1]:] = [0] * shape[1]  # the last sequence shard empty
    lens[0] += s - sum(lens)
    return lens


def placer(group, layout: str, lens, docs):
    """This rank's piece of a full tensor along dim 2: ``shard`` over the mesh, or the mesh rank's
    piece of a contiguous split by ``lens`` (mesh rank order)."""
    rank = as_group(group).rank
    if lens is not None:
        return lambda t: t.split(lens, 2)[rank]
    return lambda t: shard(t, 2, group=group, layout=layout, cu_seqlens=docs)


def check(group, schedule, layout, causal, kw, h, hkv, s=None, lens=None, dtype=torch.float64, tol=F64, seed=3):
    """One mesh call against the oracle: out, lse, dq, dk, dv and this rank's rows' sinks share."""
    m = as_group(group)
    s = sum(lens) if lens is not None else s
    q, k, v, wo, wl = _inputs(seed, s, h, hkv, dtype)
    mine = placer(group, layout, lens, kw.get("cu_seqlens"))
    rows = mine(torch.arange(s, device=DEVICE).view(1, 1, s)).view(-1).cpu()
    want = _oracle(q, k, v, wo, wl, kw, causal, rows)
    ql, kl, vl = (mine(t).detach().clone().requires_grad_() for t in (q, k, v))
    sl = None if kw.get("sinks") is None else kw["sinks"].detach().clone().requires_grad_()
    out, lse = sharded_attention(ql, kl, vl, causal=causal, group=group, schedule=schedule, layout=layout,
                                 return_lse=True, **{**kw, "sinks": sl})
    what = (f"{schedule} {m.shape} {layout} causal={causal} {sorted(kw)} H={h} Hkv={hkv} S={s} lens={lens} "
            f"mesh rank {m.rank}")
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (B, h, len(rows), DV), what
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), what
    torch.testing.assert_close(out.double(), mine(want[0]), **tol, msg=lambda msg: f"{what} out: {msg}")
    torch.testing.assert_close(lse.double(), mine(want[1]), **F32, msg=lambda msg: f"{what} lse: {msg}")
    _loss(out, lse, mine(wo).to(dtype), mine(wl).float()).backward()
    for name, got, exp in (("dq", ql.grad, mine(want[2])), ("dk", kl.grad, mine(want[3])),
                           ("dv", vl.grad, mine(want[4])), ("dsinks", None if sl is None else sl.grad, want[5])):
        if exp is not None:
            assert got.dtype == (dtype if name != "dsinks" else sl.dtype), (what, name, got.dtype)
            torch.testing.assert_close(got.double(), exp, **tol, msg=lambda msg: f"{what} {name}: {msg}")


def case_shapes(group):
    """Every head split, contiguous (uneven pieces, an empty one, an empty sequence shard) and
    zigzag, causal and not, both schedules; one float32 call."""
    shape = as_group(group).shape
    s = 3 * shape[0] * shape[1] + 2
    for i, (h, hkv) in enumerate(head_shapes(shape[1])):
        schedule = ("heads+ring", "heads+allgather")[i % 2]
        check(group, schedule, "contiguous", i % 2 == 0, {}, h, hkv, lens=mesh_lengths(shape, s, i))
        check(group, schedule, "zigzag", i % 2 == 1, {}, h, hkv, s=s, seed=i)
    check(group, "heads+ring", "zigzag", True, {}, 6, 2, s=s, dtype=torch.float32, tol=F32)


def configs(ps: int, s: int, h: int) -> list:
    """``(causal, keywords)``: documents (zigzag per document), windows longer than a sequence shard
    and short, softcap, sinks (one -inf), kv_range padding on either side, and mixes."""
    docs = documents(ps, s)
    kv = torch.tensor([[3, s], [0, s - 4]], dtype=torch.int32, device=DEVICE)
    return [(True, dict(cu_seqlens=docs)), (True, dict(window_size=(s // ps + 2, 0))),
            (False, dict(window_size=(2, 3), softcap=1.5)),
            (True, dict(cu_seqlens=docs, window_size=(2, 0), softcap=1.5, sinks=sinks_of(h))),
            (True, dict(kv_range=kv, sinks=sinks_of(h))), (False, dict(kv_range=kv, softcap=0.8))]


def case_variants(group):
    """Every keyword in its global meaning, zigzag (per document), balanced (documents) and
    contiguous, both schedules, over head splits that share kv heads and leave ranks without heads."""
    shape = as_group(group).shape
    s = 3 * shape[0] * shape[1] + 1
    hs = head_shapes(shape[1])
    for i, (causal, kw) in enumerate(configs(shape[0], s, 6)):
        h, hkv = hs[(i + 1) % len(hs)]
        kw = {**kw, "sinks": sinks_of(h)} if "sinks" in kw else kw
        schedule = ("heads+ring", "heads+allgather")[i % 2]
        check(group, schedule, "zigzag", causal, kw, h, hkv, s=s, seed=i)
        if "cu_seqlens" not in kw:
            check(group, schedule, "contiguous", causal, kw, h, hkv, lens=mesh_lengths(shape, s, i), seed=i)
        else:
            check(group, schedule, "balanced", causal, kw, h, hkv, s=s, seed=i)


def case_shard_roundtrip(group):
    """``shard`` over a mesh gives the layout's sequence shard split by ``tensor_split`` in heads-rank
    order; ``unshard`` inverts it on every rank; each is the other's backward."""
    m = as_group(group)
    (ps, ph), (si, hi) = m.shape, (m.seq.rank, m.heads.rank)
    for s, layout, docs in ((11, "contiguous", None), (13, "zigzag", None), (17, "zigzag", (0, 2, 2, 9, 17))):
        x = torch.arange(3 * s, dtype=torch.float64, device=DEVICE).view(1, 3, s).requires_grad_()
        if layout == "contiguous":
            seq_shard = x.tensor_split(ps, 2)[si]
        else:
            bounds = docs or (0, s)
            chunks = [x[:, :, a:b].tensor_split(2 * ps, 2) for a, b in zip(bounds[:-1], bounds[1:])]
            seq_shard = torch.cat([c for ch in chunks for c in (ch[si], ch[2 * ps - 1 - si])], 2)
        piece = shard(x, 2, group=group, layout=layout, cu_seqlens=docs)
        assert torch.equal(piece, seq_shard.tensor_split(ph, 2)[hi]), (layout, docs, m.rank)
        full = unshard(piece, 2, group=group, layout=layout, cu_seqlens=docs)
        assert torch.equal(full, x), (layout, docs, m.rank)
        (full * torch.arange(3 * s, dtype=torch.float64, device=DEVICE).view(1, 3, s)).sum().backward()
        assert torch.equal(x.grad, torch.arange(3 * s, dtype=torch.float64, device=DEVICE).view(1, 3, s)), layout
        x.grad = None


def case_all(group):
    """Every case above, in one worker start (process groups are slow to start)."""
    for case in (case_shapes, case_variants, case_shard_roundtrip):
        case(group)


def on_mesh(shape: tuple, case) -> None:
    LoopbackWorld(shape[0] * shape[1]).run(lambda c: case(c.mesh(*shape)))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("case", [case_shapes, case_variants, case_shard_roundtrip], ids=lambda f: f.__name__)
def test_loopback(shape, case):
    on_mesh(shape, case)


TAG_KV, TAG_QKV, TAG_GATHER = 21, 51, 31


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_transfer_count(shape):
    """A forward call: the all-to-all of k, v then of q within each heads group (k and v in one
    message per pair of its ranks whose receiver holds heads, q in one more per query-head chunk of
    the receiver), the ring's ``Ps - 1`` K/V transfers per rank over each sequence group whose heads
    rank holds heads, and nothing on the all-gather's tag; ``heads+allgather`` sends nothing on the
    ring's. ``H = Ph - 1``: the last heads rank holds no head, the others one (one chunk); ``H = 2 Ph``
    over one kv head: two query heads on every rank, in two chunks."""
    ps, ph = shape
    s = 4 * ps * ph
    for h, holders, chunks in ((ph - 1, ph - 1, 1), (2 * ph, ph, 2)):
        q, k, v, _, _ = _inputs(1, s, h, 1)
        for schedule in ("heads+ring", "heads+allgather"):
            world = LoopbackWorld(ps * ph)

            def run(c):
                m = c.mesh(*shape)
                sharded_attention(*(shard(t, 2, group=m) for t in (q, k, v)), causal=True, group=m,
                                  schedule=schedule)
            world.run(run)
            what = (schedule, h, dict(world.sends))
            assert world.sends[TAG_QKV] == ps * holders * (ph - 1) * (1 + chunks), what
            ring = holders * ps * (ps - 1)
            assert world.sends[TAG_KV] == (ring if schedule == "heads+ring" else 0), what
            assert (world.sends[TAG_GATHER] > 0) == (schedule == "heads+allgather"), what


@pytest.mark.parametrize("shape", [(1, 3), (3, 1), (1, 8), (8, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_degenerate_meshes(shape):
    """A mesh of one sequence rank (the all-to-all alone) or one heads rank (the ring alone)."""
    on_mesh(shape, lambda m: (check(m, "heads+ring", "zigzag", True, dict(window_size=(4, 0)), 4, 2, s=10),
                              check(m, "heads+allgather", "contiguous", False, {}, 5, 1,
                                    lens=mesh_lengths(shape, 7, 1))))
