"""The heads schedule (all-to-all; DeepSpeed calls it Ulysses): whole sequences for a subset of heads.

``q``, ``k``, ``v`` arrive as this rank's sequence shards with every head, in any layout the ring
takes. Query heads are split over the ranks as ``torch.tensor_split`` splits them (uneven, zero
heads allowed); a rank receives the kv heads its query heads read (a kv head read by several ranks
goes to each of them). Four all-to-alls per call, two each way (:mod:`.alltoall`), the first in
pieces:

1. k and v, then q in up to ``CHUNKS`` chunks of heads (:func:`q_chunks`): sequence shards -> heads;
   the receiver assembles the full sequence of its heads in the order of :class:`Placement` (1-D:
   global positions, the layout undone);
2. ``(out, lse)`` of the local op: heads -> sequence shards;
3. backward: ``dout`` and the rows' ``(lse, delta)``, in up to ``CHUNKS`` chunks of whole kv groups:
   sequence shards -> heads;
4. ``(dq, dk, dv)`` (with sinks, and each row's float32 ``rowsum(dout * out)``): heads -> sequence
   shards; the dK/dV of a kv head that several ranks read travel in float32 and are summed in rank
   order, then cast once.

Two hops for shared kv heads. Where the group spans machines (the handshake gathers each rank's
``Communicator.host``), every rank reads at most one kv head and each kv head's readers share a
machine (:func:`relay_groups`; Llama-3-8B's 32 / 8 heads over 16 or 32 ranks of 8-GPU hosts), a
rank's shard of kv head ``j`` goes to one of ``j``'s readers (:meth:`HeadsSpec.via`), which pass the
shards on among themselves inside the machine (:func:`_relay_kv`, its own tag); backward, each reader
sums in float32 the readers' dK/dV of the shards that came through it (every reader's share, in
rank order: the one-hop sum, bit for bit), casts once and sends them home with dq
(:func:`_relay_grads`). A shard of a kv head crosses machines once instead of once per reader, its
gradient once in the inputs' dtype instead of once per reader in float32.

Between the exchanges runs the inner op on the heads' tensors, a pair ``(fwd, bwd)`` with the
ring's signatures (:func:`sequence_op`). In one dimension it is the ring's visit of a one-rank plan
over the whole sequence: the single-device op, every keyword in its global meaning. On a 2-D mesh
(:func:`mesh_attention`, ``"heads+ring"`` / ``"heads+allgather"``) the all-to-all runs within the
heads group, ``Placement`` being the contiguous split of the group's sequence shard over its ranks,
and the ring (or all-gather) runs over the sequence group on the heads' sequence shards: the ranks
of a sequence group hold the same heads, so they skip or run it together. ``sinks`` follow their heads: each
rank merges the sinks of its heads into its final rows before rounding; the sinks' gradient is each
rank's rows' share (as under ``"ring"``), from the ``lse`` of its sequence shard and the rows'
``rowsum(dout * out)`` taken on the heads' side from the output before rounding (kept for the
backward in the accumulation dtype where there are sinks), which travels back with the gradients:
the rounded ``out`` would carry its rounding into the sinks' gradient.

Overlap. Every piece of the first exchange is started at once (k and v first), and the inner op
takes q still arriving (:class:`~splitsoftmax.distributed.alltoall.Arriving`): once k and v are
there the ring posts its first K/V send (the all-gather its gather, the one-rank plan nothing), and
its first visit computes each chunk of q as it lands, its heads against the kv heads they read; the
whole q (one copy, joined) serves the later visits and the backward. The backward alike: every
chunk of ``dout`` started at once, the inner op posting its first transfers before its first visit
takes the chunks as they land. Why chunks of heads, not of rows or of the whole schedule: each
head's attention is independent, so a chunk is the same computation as the whole call (to the
local op's rounding: the torch path's batched products round with the number of heads they batch,
the Triton kernels may split fewer heads' keys over more programs), every variant keyword and plan
is unchanged, and the ring still moves each K/V buffer once. Chunks are whole kv groups (each local
kv head with its query heads) where the local op reads several kv heads, so no kv head is split;
where it reads one (the usual GQA case at a large heads degree) q's chunks are runs of query heads
over that one kv head, and ``dout`` comes in one piece (its dK/dV would be summed over chunks in
another order than the kernel's). Exchanges started one after another are matched in that order
on every transport (NCCL and MPI collectives in issue order, Gloo's and the loopback's per-tag
order); an error while pieces are in flight gives them up as a timeout does (their buffers kept).
A call sends k and v in one message per pair, q and ``dout`` in one per chunk. Where the heads
degree is 1 (one rank; a ``seq x 1`` mesh) ``sharded_attention`` runs the sequence schedule instead
(the ring's one-rank path on one rank): nothing to exchange, and no copy into heads order.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Optional

import torch
from torch import Tensor

from ....core import state
from ....distributed import layout as lay
from ....distributed.alltoall import Arriving, Started, exchange, start_exchange
from ....distributed.attn_meta import Keywords
from ....distributed.comm import Communicator
from ....distributed.layout import Heads, head_split, kv_shared, relay_groups
from ....distributed.mesh import seq_lengths
from ....distributed.work import AttnSpec
from ..op import backward_stats
from .allgather import allgather_attention_bwd, allgather_attention_fwd
from .ring import plan_of, ring_attention_bwd, ring_attention_fwd

TAG_QKV, TAG_OUT, TAG_DOUT, TAG_GRAD, TAG_RELAY = 51, 52, 53, 54, 55
CHUNKS = 2  # the query-head chunks q arrives in (the first visit starts on the first)
_SEQUENCE = {"ring": (ring_attention_fwd, ring_attention_bwd),
             "allgather": (allgather_attention_fwd, allgather_attention_bwd)}


def kv_count(hd: Heads, g: int) -> int:
    """The kv heads the local op of ``hd`` reads: its own, or one per query head where the local
    grouping is uneven (:func:`kv_runs`, the kv heads expanded)."""
    return hd.nkv if kv_runs(hd, g) is None else hd.nq


@lru_cache(maxsize=64)
def q_chunks(split: tuple, g: int, groups: bool = False) -> tuple:
    """Every rank's local query-head bounds ``(0, ..., nq)`` of the chunks its q arrives in, as many
    on every rank (padded with empty chunks): up to ``CHUNKS`` runs of whole kv groups (each local kv
    head with the query heads that read it), of query heads where the local op reads one kv head
    (with ``groups``, as ``dout`` arrives: one chunk there, a kv head's dK/dV never split)."""
    each = []
    for hd in split:
        nkv = kv_count(hd, g)
        units = nkv if nkv > 1 or groups else hd.nq
        per = hd.nq // units if units else 0
        each.append(tuple(per * a for a in lay.starts(lay.split_sizes(units, max(1, min(CHUNKS, units))))) + (hd.nq,))
    n = max(len(b) for b in each)
    return tuple(b + (b[-1],) * (n - len(b)) for b in each)


def kv_runs(hd: Heads, g: int) -> Optional[tuple]:
    """``((start, end), ...)``: the local query heads of each local kv head, None where the local
    op's own grouping (query head ``i`` reads kv head ``i // (nq // nkv)``) already says so."""
    runs = tuple((max(hd.q0, j * g) - hd.q0, min(hd.q1, (j + 1) * g) - hd.q0) for j in range(hd.k0, hd.k1))
    return None if len({e - s for s, e in runs}) <= 1 else runs


class Placement:
    """Where each rank's rows go when the heads' tensors are assembled along dim 2: rank ``r``'s
    local row ``i`` at ``positions[r][i]`` (None: rank order, shards back to back)."""

    def __init__(self, lens: tuple, positions: Optional[tuple]):
        self.lens, self.positions = lens, positions
        self.total = sum(lens)
        self._index: dict = {}

    def index(self, r: int, device) -> Tensor:
        key = (r, str(device))
        if key not in self._index:
            self._index[key] = torch.tensor(self.positions[r], dtype=torch.long, device=device)
        return self._index[key]

    def assemble(self, parts: list) -> Tensor:
        """``(B, n, total, ...)`` from every rank's ``(B, n, lens[r], ...)``."""
        if self.positions is None:
            return torch.cat(parts, 2)
        p0 = parts[0]
        full = p0.new_empty((*p0.shape[:2], self.total, *p0.shape[3:]))
        for r, part in enumerate(parts):
            if self.lens[r]:
                full.index_copy_(2, self.index(r, full.device), part)
        return full

    def split(self, full: Tensor) -> list:
        """Inverse of :meth:`assemble`: each rank's rows of ``full``."""
        if self.positions is None:
            return list(full.split(list(self.lens), 2))
        return [full.index_select(2, self.index(r, full.device)) for r in range(len(self.lens))]


@lru_cache(maxsize=32)
def sequence_placement(layout: str, lens: tuple, docs: Optional[tuple]) -> Placement:
    """The global order of a sequence sharded by ``layout`` (per document with ``docs``)."""
    if layout == "contiguous":
        return Placement(lens, None)
    segs = [lay.segments(layout, list(lens), r, docs) for r in range(len(lens))]
    return Placement(lens, tuple(tuple(i for s in ss for i in range(s.glob, s.glob + s.n)) for ss in segs))


class _Solo(Communicator):
    """The communicator of a one-rank plan: nothing is ever sent."""

    rank, size = 0, 1


@dataclass
class HeadsSpec:
    """What the ranks agreed on, as the heads schedule uses it."""

    comm: Communicator
    b: int
    h: int
    hkv: int
    d: int
    dv: int
    split: tuple
    q_place: Placement
    k_place: Placement
    inner: tuple  # (fwd(q, k, v) -> (out, lse), bwd(q, k, v, dout, lse, delta) -> (dq, dk, dv)), accumulation dtype
    relay: Optional[tuple] = None  # relay_groups: each kv head's readers, where K/V take two hops

    @property
    def mine(self) -> Heads:
        return self.split[self.comm.rank]

    def chunks(self, groups: bool = False) -> tuple:
        """Every rank's :func:`q_chunks`."""
        return q_chunks(self.split, self.h // self.hkv, groups)

    def kv_heads(self, r: int) -> tuple:
        """The kv heads ``(k0, k1)`` rank ``r`` receives."""
        return self.split[r].k0, self.split[r].k1

    def chunk(self, bounds: tuple, c: int, r: int) -> tuple:
        """The query heads ``(a, b)`` of rank ``r``'s chunk ``c`` of ``bounds`` (:meth:`chunks`)."""
        return self.split[r].q0 + bounds[r][c], self.split[r].q0 + bounds[r][c + 1]

    def via(self, o: int, j: int) -> int:
        """Under :attr:`relay`: the reader of kv head ``j`` that rank ``o``'s shard of it goes through."""
        g = self.relay[j]
        return g[o % len(g)]


def sequence_op(comm: Communicator, schedule: str, b: int, hd: Heads, d: int, dv: int, scale: float,
                causal: bool, layout: str, kw: Keywords, q_lens: tuple, k_lens: tuple, local_kv: int) -> tuple:
    """The inner op for ``hd``'s heads (``local_kv`` kv heads after any expansion): ``schedule``
    (``"ring"`` or ``"allgather"``) over the sequence group ``comm``, whose ranks hold the shards
    ``q_lens`` / ``k_lens`` of ``layout``; every keyword in its global meaning (``sinks`` apart). On a
    one-rank group it is the single-device op over the whole sequence."""
    inner_kw = kw._replace(sinks=None, q_offset=None)
    planned = plan_of(comm.rank, q_lens, k_lens, layout, causal, kw.docs, kw.window)
    spec = AttnSpec(b, hd.nq, local_kv, d, dv, scale, causal, layout, list(q_lens), list(k_lens), comm.rank,
                    inner_kw, planned)
    fwd, bwd = _SEQUENCE[schedule]
    return (lambda q, k, v: fwd(comm, spec, q, k, v),
            lambda q, k, v, dout, lse, delta: bwd(comm, spec, q, k, v, dout, lse, delta))


def _expand(kh: Tensor, runs: Optional[tuple]) -> Tensor:
    """``kh (B, nkv, S, D)`` with one kv head per local query head where ``runs`` say so."""
    if runs is None:
        return kh
    return torch.cat([kh[:, j:j + 1].expand(-1, e - s, -1, -1) for j, (s, e) in enumerate(runs)], 1)


def _fold(dk: Tensor, runs: Optional[tuple]) -> Tensor:
    """Inverse of :func:`_expand` for gradients: each kv head's query heads summed (accumulation dtype)."""
    if runs is None:
        return dk
    return torch.stack([dk[:, s:e].sum(1) for s, e in runs], 1)


def _to_heads(hs: HeadsSpec, tensors: list, places: list, step: str, tag: int) -> Started:
    """Sequence shards -> heads, started: each ``(tensor, heads)`` of ``tensors`` (dims ``(B, H, S_r,
    ...)``; ``heads(r)``: the heads ``(a, b)`` rank ``r`` receives) assembled along dim 2 by ``places``
    once waited for."""
    p, r = hs.comm.size, hs.comm.rank
    sends = [[t[:, slice(*heads(o))] for t, heads in tensors] for o in range(p)]
    mine = [heads(r) for _, heads in tensors]
    specs = [[((t.shape[0], b - a, pl.lens[o], *t.shape[3:]), t.dtype)
              for (t, _), (a, b), pl in zip(tensors, mine, places)] for o in range(p)]
    started = start_exchange(hs.comm, sends, specs, step, tag, tensors[0][0].device)
    return started.then(lambda got: [pl.assemble([g[i] for g in got]) for i, pl in enumerate(places)])


def _arriving(hs: HeadsSpec, tensors: list, bounds: tuple, step: str, tag: int) -> Arriving:
    """``tensors`` (by query heads, dims ``(B, H, S_r, ...)``) to heads, started chunk by chunk of
    ``bounds`` (:meth:`HeadsSpec.chunks`), each chunk its own exchange."""
    n = len(bounds[0]) - 1
    return Arriving(bounds[hs.comm.rank], [_to_heads(hs, [(t, partial(hs.chunk, bounds, c)) for t in tensors],
                                                     [hs.q_place] * len(tensors), f"{step}, chunk {c}", tag)
                                           for c in range(n)])


def _to_seq(hs: HeadsSpec, tensors: list, places: list, step: str, tag: int, relayed: Optional[tuple] = None) -> list:
    """Heads -> sequence shards: ``tensors`` ``(t, kv?, dtype)`` of this rank's heads, split along
    dim 2 by ``places``; returns, per tensor, every rank's part ``[from rank 0, ...]``. With
    ``relayed`` (``(per_rank, kdt, vdt)``: :func:`_relay_grads`' lists and their dtypes) those travel
    too, and a last result is ``[dk, dv]`` ``(B, Hkv, S_r, D)``, each kv head's from the reader its
    shard went through."""
    p, r = hs.comm.size, hs.comm.rank
    parts = [pl.split(t.to(dt)) for (t, kv, dt), pl in zip(tensors, places)]
    sends = [[pt[o] for pt in parts] + (relayed[0][o] if relayed else []) for o in range(p)]
    specs = [[((t.shape[0], hs.split[o].nkv if kv else hs.split[o].nq, pl.lens[r], *t.shape[3:]), dt)
              for (t, kv, dt), pl in zip(tensors, places)] for o in range(p)]
    if relayed:
        for j in range(hs.hkv):
            specs[hs.via(r, j)] += [((hs.b, 1, hs.k_place.lens[r], d), dt) for d, dt in ((hs.d, relayed[1]),
                                                                                       (hs.dv, relayed[2]))]
    got = exchange(hs.comm, sends, specs, step, tag, tensors[0][0].device)
    out = [[g[i] for g in got] for i in range(len(tensors))]
    if relayed:
        n = len(tensors)
        out.append([torch.cat(ts, 1) for ts in zip(*(got[hs.via(r, j)][n:n + 2] for j in range(hs.hkv)))])
    return out


def _summed(parts: list, split: tuple, hkv: int, shared: bool, dtype: torch.dtype) -> Tensor:
    """dK or dV ``(B, Hkv, S_r, D)`` from each rank's kv heads: summed in rank order in the
    accumulation dtype where heads are shared (then cast once), else concatenated."""
    if not shared:
        return torch.cat(parts, 1).to(dtype)
    p0 = parts[0]
    total = p0.new_zeros((p0.shape[0], hkv, *p0.shape[2:]))
    for s, part in zip(split, parts):
        total[:, s.k0:s.k1] += part
    return total.to(dtype)


def _relay_kv(hs: HeadsSpec, k: Tensor, v: Tensor) -> Started:
    """``k``, ``v`` ``(B, Hkv, S_r, D)`` to the readers of each kv head in two hops (``hs.relay``):
    each rank's shard of kv head ``j`` to one of its readers (:meth:`HeadsSpec.via`), then among the
    readers, each passing on the shards it got (inside one machine). The first hop is waited for, the
    second started: its ``wait()`` gives ``[kh, vh]`` ``(B, nkv, S, D)`` as one hop assembles them."""
    p, r, me, lens = hs.comm.size, hs.comm.rank, hs.mine, hs.k_place.lens
    sends: list = [[] for _ in range(p)]
    for j in range(hs.hkv):
        sends[hs.via(r, j)] += [k[:, j:j + 1], v[:, j:j + 1]]

    def specs(o: int) -> list:
        return [((k.shape[0], 1, lens[o], k.shape[3]), k.dtype), ((v.shape[0], 1, lens[o], v.shape[3]), v.dtype)]
    if not me.nkv:
        exchange(hs.comm, sends, [[]] * p, "heads forward: k, v to a reader", TAG_QKV, k.device)
        return start_exchange(hs.comm, [[]] * p, [[]] * p, "heads forward: k, v among readers", TAG_RELAY, k.device
                              ).then(lambda _: [k.new_empty((k.shape[0], 0, hs.k_place.total, k.shape[3])),
                                                v.new_empty((v.shape[0], 0, hs.k_place.total, v.shape[3]))])
    group = hs.relay[me.k0]
    via = [hs.via(o, me.k0) for o in range(p)]
    got = exchange(hs.comm, sends, [specs(o) if via[o] == r else [] for o in range(p)],
                   "heads forward: k, v to a reader", TAG_QKV, k.device)
    fellows = [x for x in group if x != r]
    mine = [t for o in range(p) if via[o] == r for t in got[o]]
    passed = start_exchange(hs.comm, [mine if x in fellows else [] for x in range(p)],
                            [[sp for o in range(p) if via[o] == x for sp in specs(o)] if x in fellows else []
                             for x in range(p)], "heads forward: k, v among readers", TAG_RELAY, k.device)

    def assemble(got2: list) -> list:
        parts = {o: got[o] for o in range(p) if via[o] == r}
        for x in fellows:
            shards = [o for o in range(p) if via[o] == x]
            parts.update({o: got2[x][2 * i:2 * i + 2] for i, o in enumerate(shards)})
        return [hs.k_place.assemble([parts[o][i] for o in range(p)]) for i in range(2)]
    return passed.then(assemble)


def _relay_grads(hs: HeadsSpec, dkh: Tensor, dvh: Tensor, kdt: torch.dtype, vdt: torch.dtype) -> list:
    """The first hop back of :func:`_relay_kv`: this reader's ``dkh``, ``dvh`` ``(B, nkv, S, D)`` (the
    accumulation dtype) summed among the kv head's readers, each reader summing the shards that came
    through it (every reader's share in rank order, as one hop sums them, then cast to ``kdt``,
    ``vdt``). Returns, per rank ``o``, ``[dk, dv]`` of its shard where ``o``'s shard came through
    this rank, else ``[]``."""
    p, r, me = hs.comm.size, hs.comm.rank, hs.mine
    if not me.nkv:
        exchange(hs.comm, [[]] * p, [[]] * p, "heads backward: dk, dv among readers", TAG_RELAY, dkh.device)
        return [[] for _ in range(p)]
    group = hs.relay[me.k0]
    via = [hs.via(o, me.k0) for o in range(p)]
    dk_parts, dv_parts = hs.k_place.split(dkh), hs.k_place.split(dvh)
    fellows = [x for x in group if x != r]
    mine = [o for o in range(p) if via[o] == r]
    got = exchange(hs.comm, [[t for o in range(p) if via[o] == x for t in (dk_parts[o], dv_parts[o])]
                             if x in fellows else [] for x in range(p)],
                   [[((t.shape[0], 1, hs.k_place.lens[o], t.shape[3]), t.dtype) for o in mine for t in (dkh, dvh)]
                    if x in fellows else [] for x in range(p)], "heads backward: dk, dv among readers", TAG_RELAY,
                   dkh.device)
    out: list = [[] for _ in range(p)]
    for i, o in enumerate(mine):
        sums = []
        for a, own in enumerate((dk_parts[o], dv_parts[o])):
            total = torch.zeros_like(own)
            for x in group:
                total += own if x == r else got[x][2 * i + a]
            sums.append(total)
        out[o] = [sums[0].to(kdt), sums[1].to(vdt)]
    return out


class HeadsAttentionFn(torch.autograd.Function):
    """``(out (B,H,Sq_r,Dv), lse (B,H,Sq_r))`` of this rank's sequence shard; saves the heads'
    q, k, v for the backward (its exchanges carry only gradients and row statistics)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, hs: HeadsSpec):
        me, acc = hs.mine, state.stat_dtype(q.dtype)
        kv = (_to_heads(hs, [(k, hs.kv_heads), (v, hs.kv_heads)], [hs.k_place, hs.k_place],
                        "heads forward: k, v to heads", TAG_QKV) if hs.relay is None else _relay_kv(hs, k, v))
        qa = _arriving(hs, [q], hs.chunks(), "heads forward: q to heads", TAG_QKV)
        runs = kv_runs(me, hs.h // hs.hkv)
        try:
            kh, vh = kv.wait()
            if me.nq:  # (the sequence schedule starts its transfers, then takes q chunk by chunk)
                outh, lseh = hs.inner[0](qa, _expand(kh, runs), _expand(vh, runs))
            (qh,) = qa.whole()
        except BaseException:
            qa.abandon()
            raise
        if not me.nq:
            outh, lseh = qh.new_empty((hs.b, 0, hs.q_place.total, hs.dv)), qh.new_empty((hs.b, 0, hs.q_place.total))
        elif sinks is not None:
            outh, lseh = state.add_sinks(outh, lseh, sinks[me.q0:me.q1])
        outs, lses = _to_seq(hs, [(outh, False, q.dtype), (lseh, False, acc)], [hs.q_place, hs.q_place],
                             "heads forward: out to sequence shards", TAG_OUT)
        out, lse = torch.cat(outs, 1), torch.cat(lses, 1)
        exact = outh.to(acc) if sinks is not None else None  # (for the sinks' gradient: every rank alike)
        ctx.save_for_backward(qh, kh, vh, out, lse, sinks, exact)
        ctx.hs, ctx.dtypes = hs, (q.dtype, k.dtype, v.dtype)
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        qh, kh, vh, out, lse, sinks, exact = ctx.saved_tensors
        hs, me = ctx.hs, ctx.hs.mine
        lse, delta = backward_stats(out, lse, dout.contiguous(), dlse)
        rows = _arriving(hs, [dout, lse, delta], hs.chunks(groups=True), "heads backward: dout to heads", TAG_DOUT)
        runs, shared = kv_runs(me, hs.h // hs.hkv), kv_shared(hs.split, hs.hkv)
        try:
            if me.nq:  # (the sequence schedule starts its transfers, then takes dout chunk by chunk)
                dqh, dkh, dvh = hs.inner[1](qh, _expand(kh, runs), _expand(vh, runs), rows, None, None)
                dkh, dvh = _fold(dkh, runs), _fold(dvh, runs)
            else:
                dqh, dkh, dvh = qh, kh, vh  # (empty)
            douth = rows.whole()[0]
        except BaseException:
            rows.abandon()
            raise
        qdt, kdt, vdt = ctx.dtypes
        acc = state.stat_dtype(qdt)
        grads, places, relayed = [(dqh, False, qdt)], [hs.q_place], None
        if hs.relay is None:
            grads += [(dkh, True, acc if shared else kdt), (dvh, True, acc if shared else vdt)]
            places += [hs.k_place, hs.k_place]
        else:
            relayed = (_relay_grads(hs, dkh, dvh, kdt, vdt), kdt, vdt)
        if exact is not None:  # each row's rowsum(dout * out) of the output before rounding, with the gradients
            grads.append(((douth.to(acc) * exact).sum(-1), False, acc))
            places.append(hs.q_place)
        back = _to_seq(hs, grads, places, "heads backward: gradients to sequence shards", TAG_GRAD, relayed)
        if relayed is None:
            dk, dv = (_summed(parts, hs.split, hs.hkv, shared, dt) for parts, dt in ((back[1], kdt), (back[2], vdt)))
        else:
            dk, dv = back[-1]
        dsinks = None
        if exact is not None and ctx.needs_input_grad[3]:
            rowsum = torch.cat(back[len(grads) - 1], 1)
            dsinks = state.sink_grad(lse, rowsum if dlse is None else rowsum - dlse.to(rowsum.dtype), sinks)
        return torch.cat(back[0], 1), dk, dv, dsinks, None


def heads_attention(comm: Communicator, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, layout: str,
                    kw: Keywords, lens: tuple) -> tuple[Tensor, Tensor]:
    """``schedule="heads"`` after the handshake: ``(out (B,H,Sq_r,Dv) in q.dtype, lse (B,H,Sq_r)
    float32)`` of this rank's sequence shard. ``lens``: every rank's ``(q lengths, k lengths, machines)``."""
    (b, h, _, d), hkv, dv = q.shape, k.shape[1], v.shape[-1]
    docs = kw.docs if layout != "contiguous" else None
    q_lens, k_lens = tuple(lens[0]), tuple(lens[1])
    split = head_split(h, hkv, comm.size)
    me = split[comm.rank]
    inner = sequence_op(_Solo(), "ring", b, me, d, dv, scale, causal, "contiguous", kw, (sum(q_lens),),
                        (sum(k_lens),), kv_count(me, h // hkv))
    hs = HeadsSpec(comm, b, h, hkv, d, dv, split, sequence_placement(layout, q_lens, docs),
                   sequence_placement(layout, k_lens, docs), inner, relay_groups(split, hkv, tuple(lens[2])))
    return HeadsAttentionFn.apply(q, k, v, kw.sinks, hs)


def mesh_attention(mesh, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, layout: str, kw: Keywords,
                   lens: tuple, schedule: str) -> tuple[Tensor, Tensor]:
    """``schedule="heads+ring"`` / ``"heads+allgather"`` on a :class:`~splitsoftmax.distributed.mesh.Mesh`
    after the handshake: ``(out (B,H,n,Dv), lse (B,H,n) float32)`` of this rank's rows, ``n`` its piece of
    its sequence shard. ``lens``: every mesh rank's ``(q lengths, k lengths, machines)``, mesh rank order."""
    (b, h, _, d), hkv, dv = q.shape, k.shape[1], v.shape[-1]
    (ps, ph), s = mesh.shape, mesh.seq.rank
    q_mine, k_mine, hosts = (tuple(x[s * ph:(s + 1) * ph]) for x in lens)
    q_seq, k_seq = (tuple(seq_lengths(x, mesh.shape)) for x in lens[:2])
    split = head_split(h, hkv, ph)
    me = split[mesh.heads.rank]
    inner = sequence_op(mesh.seq, schedule.split("+")[1], b, me, d, dv, scale, causal, layout, kw, q_seq, k_seq,
                        kv_count(me, h // hkv))
    hs = HeadsSpec(mesh.heads, b, h, hkv, d, dv, split, Placement(q_mine, None), Placement(k_mine, None), inner,
                   relay_groups(split, hkv, hosts))
    return HeadsAttentionFn.apply(q, k, v, kw.sinks, hs)
