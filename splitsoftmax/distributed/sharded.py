"""Public sharded ops (docs/API.md, "Across ranks") and their autograd Functions.

Every call: local argument checks, then the metadata handshake (``handshake.py``) so that a
mismatch raises on every rank before any bulk transfer, then the schedule. The gradient of each
rank's local input is that rank's slice of the single-device gradient.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .. import _checks, state
from .. import variants as vs
from ..autograd import backward_stats
from ..functional import _rows, _unrows
from ..local import op
from . import attn_meta, work
from . import layout as lay
from .allgather import allgather_attention_bwd, allgather_attention_fwd, allgather_var
from .comm import as_comm, eager
from .handshake import LOCAL_ERRORS, encode_dtype, handshake
from .heads import heads_attention
from .ring import ring_attention_bwd, ring_attention_fwd
from .tree import allreduce_sum, early_local, merge_lse, tree_attention_bwd, tree_attention_fwd
from .work import AttnSpec

_FWD = {"ring": ring_attention_fwd, "allgather": allgather_attention_fwd, "tree": tree_attention_fwd}
_BWD = {"ring": ring_attention_bwd, "allgather": allgather_attention_bwd, "tree": tree_attention_bwd}


class ShardedSoftmaxFn(torch.autograd.Function):
    """(log-)softmax of row shards ``x (R, n_r)``: global lse by the tree, local normalise."""

    @staticmethod
    def forward(ctx, x: Tensor, log: bool, comm) -> Tensor:
        lse = merge_lse(comm, op("lse_rows", x)(x), "sharded softmax forward")
        y = op("normalize", x)(x, lse, log)
        ctx.save_for_backward(y, lse)
        ctx.log, ctx.comm = log, comm
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        y, lse = ctx.saved_tensors
        dy = dy.contiguous()
        rowsum = allreduce_sum(ctx.comm, op("softmax_rowsum", y)(y, dy, ctx.log), "sharded softmax backward")
        return op("softmax_bwd", y)(y, dy, lse, ctx.log, rowsum), None, None


class ShardedLogSumExpFn(torch.autograd.Function):
    """logsumexp of the full rows from shards ``x (R, n_r)``: ``(R,)`` float32 on every rank."""

    @staticmethod
    def forward(ctx, x: Tensor, comm) -> Tensor:
        lse = merge_lse(comm, op("lse_rows", x)(x), "sharded logsumexp forward")
        ctx.save_for_backward(x, lse)
        return lse.float()

    @staticmethod
    def backward(ctx, g: Tensor):
        x, lse = ctx.saved_tensors
        return op("logsumexp_bwd", x)(x, lse, g.contiguous()), None


def _other_sizes(shape: list, d: int) -> dict:
    """Handshake fields for the sizes of every dim but the sharded ``d`` (the first 12 such)."""
    return dict([(f"x.shape[{i}]", s) for i, s in enumerate(shape) if i != d][:12])


def _row_shards(name: str, x, dim, group, log: Optional[bool]):
    """Checks, handshake and the ``(R, n_r)`` view shared by the softmax family."""
    comm = as_comm(group)
    agree, per, err, d = None, None, None, 0
    try:
        _checks.tensor("x", x)
        d = _checks.dim("dim", dim, x.dim())
        shape = [1] if x.dim() == 0 else list(x.shape)
        rows = 1
        for i, s in enumerate(shape):
            rows *= s if i != d else 1
        agree = {"ndim": x.dim(), "dim": d, "rows": rows, "dtype": encode_dtype(x.dtype), **_other_sizes(shape, d)}
        per = {"length": shape[d]}
    except LOCAL_ERRORS as e:
        err = e
    handshake(comm, name, agree, per, err)
    x2, moved = _rows(x, d)
    return comm, d, x2.contiguous(), moved


def _sharded_softmax(name: str, x, dim, group, log: bool) -> Tensor:
    comm, d, x2, moved = _row_shards(name, x, dim, group, log)
    return _unrows(ShardedSoftmaxFn.apply(x2, log, comm), x, d, moved)


@eager
def sharded_softmax(x: Tensor, dim: int = -1, *, group=None) -> Tensor:
    """This rank's slice of the softmax of rows split across ranks along ``dim`` (rank order,
    any lengths, zero allowed). ``x.dtype`` out; float32 statistics; collective over ``group``."""
    return _sharded_softmax("sharded_softmax", x, dim, group, log=False)


@eager
def sharded_log_softmax(x: Tensor, dim: int = -1, *, group=None) -> Tensor:
    """This rank's slice of the log-softmax of rows split across ranks along ``dim``."""
    return _sharded_softmax("sharded_log_softmax", x, dim, group, log=True)


@eager
def sharded_logsumexp(x: Tensor, dim: int = -1, *, group=None) -> Tensor:
    """logsumexp of the full rows (``dim`` removed), float32, identical on every rank."""
    comm, d, x2, moved = _row_shards("sharded_logsumexp", x, dim, group, None)
    lse = ShardedLogSumExpFn.apply(x2, comm)
    return lse if moved is None else lse.reshape(moved[:-1])


class ShardedAttentionFn(torch.autograd.Function):
    """Attention over a sharded sequence by ``schedule``: ``(out, lse)`` of this rank. ``sinks``
    (``(H,)`` or None) are merged once per row after every key partial."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, comm, spec: AttnSpec, schedule: str, local):
        out, lse = _FWD[schedule](comm, spec, q, k, v, *([local] if local is not None else []))
        if sinks is not None:
            out, lse = state.add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.comm, ctx.spec, ctx.schedule = comm, spec, schedule
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        lse, delta = backward_stats(out, lse, dout, dlse)
        dq, dk, dv = _BWD[ctx.schedule](ctx.comm, ctx.spec, q, k, v, dout, lse, delta)
        dsinks = state.sink_grad(lse, delta, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None


def _spec(comm, q, k, v, s: float, causal: bool, layout: str, schedule: str, kw, lens: tuple) -> AttnSpec:
    """The agreed spec; ring / allgather with their plan (kept for the next calls alike)."""
    (b, h, _, d), hkv, dv = q.shape, k.shape[1], v.shape[-1]
    q_lens, k_lens = lens
    planned = None
    if schedule != "tree":
        planned = work.planned(comm.rank, tuple(q_lens), tuple(k_lens), layout, causal, kw.docs, kw.window)
    return AttnSpec(b, h, hkv, d, dv, s, causal, layout, q_lens, k_lens, comm.rank, kw, planned)


@eager
def sharded_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
                      group=None, schedule: str = "ring", layout: str = "contiguous", return_lse: bool = False,
                      cu_seqlens=None, window_size=None, softcap=None, sinks=None, kv_range=None, q_offset=None):
    """Exact attention over a sequence sharded across the ranks of ``group`` (collective).

    ``"ring"``/``"allgather"``: ``q (B,H,Sq_r,D)``, ``k (B,Hkv,Sk_r,D)``, ``v (B,Hkv,Sk_r,Dv)`` are
    this rank's shards (``layout`` ``"contiguous"``: any lengths; ``"zigzag"``: chunks r, 2P-1-r,
    of every document with ``cu_seqlens``); returns this rank's shard of the output (and
    ``lse (B,H,Sq_r)`` float32). ``"tree"``: ``q`` is the same on every rank, k/v contiguous
    shards; the result is identical on every rank and the queries sit at key positions
    ``q_offset + i`` (default ``Sk - Sq``: ``causal`` is bottom-right). Causal everywhere means a
    query at global position ``i`` sees keys at ``j <= i``. ``"heads"`` takes and returns what the ring
    does: an all-to-all gives each rank the whole sequence of its share of the heads
    (``torch.tensor_split`` of ``H``; the kv heads they read, ``Hkv < P`` too), runs the local op
    there and sends the output back (``heads.py``).

    The variant keywords (docs/API.md, "Attention variants") are in global positions:
    ``cu_seqlens (N+1,)`` packed documents (ring / allgather), ``window_size=(left, right)``,
    ``softcap``, ``sinks (H,)`` (merged once per row; under ring / allgather each rank's gradient
    is its rows' share, under tree the full one), ``kv_range (B, 2)``, ``q_offset`` (0 on ring /
    allgather). All must agree across ranks. Steps with nothing visible transfer and launch
    nothing; under a window only the halo of keys travels.
    """
    comm = as_comm(group)
    keywords = dict(cu_seqlens=cu_seqlens, window_size=window_size, softcap=softcap, sinks=sinks,
                    kv_range=kv_range, q_offset=q_offset)
    finish, s, kw = attn_meta.start(comm, q, k, v, causal, scale, schedule, layout, return_lse, keywords)
    try:
        local = early_local(q, k, v, s, causal, kw) if schedule == "tree" and s is not None else None
    except Exception:  # the handshake's transfers are posted: complete them (bounded) before raising
        _complete(finish)
        raise
    lens = finish()
    if schedule == "heads":
        out, lse = heads_attention(comm, q, k, v, s, causal, layout, kw, lens)
    else:
        spec = _spec(comm, q, k, v, s, causal, layout, schedule, kw, lens)
        out, lse = ShardedAttentionFn.apply(q, k, v, kw.sinks, comm, spec, schedule, local)
    return (out, lse) if return_lse else out


def _complete(finish) -> None:
    """Wait for a started handshake whose call is already failing; its own errors give way to that one."""
    try:
        finish()
    except Exception:
        pass


def _slice_seq(x: Tensor, dim: int, lengths: list, layout: str, rank: int, docs=None) -> Tensor:
    """This rank's segments of the full ``x`` along ``dim``, concatenated."""
    segs = lay.segments(layout, lengths, rank, docs)
    if not segs:
        return x.narrow(dim, 0, 0).contiguous()
    return torch.cat([x.narrow(dim, s.glob, s.n) for s in segs], dim=dim).contiguous()


def _gather_seq(comm, x: Tensor, dim: int, lengths: list, layout: str, step: str, docs=None) -> Tensor:
    """The full tensor along ``dim`` from every rank's shard (lengths in rank order)."""
    xm = x.movedim(dim, 0).contiguous()
    inner = math.prod(xm.shape[1:])
    bufs = allgather_var(comm, xm.reshape(-1), lambda r: lengths[r] * inner, step)
    shards = [b.view(lengths[r], *xm.shape[1:]) for r, b in enumerate(bufs)]
    pieces = [shards[r][loc:loc + n] for r, loc, n in lay.global_pieces(layout, lengths, docs)]
    return (torch.cat(pieces, dim=0) if pieces else xm[:0]).movedim(0, dim)


class ShardFn(torch.autograd.Function):
    """Forward: this rank's slice; backward: the full gradient gathered from every rank's slice."""

    @staticmethod
    def forward(ctx, x, dim, lengths, layout, comm, docs):
        ctx.args = (dim, lengths, layout, comm, docs)
        return _slice_seq(x, dim, lengths, layout, comm.rank, docs)

    @staticmethod
    def backward(ctx, g):
        dim, lengths, layout, comm, docs = ctx.args
        return _gather_seq(comm, g, dim, lengths, layout, "shard backward", docs), None, None, None, None, None


class UnshardFn(torch.autograd.Function):
    """Forward: the full tensor gathered; backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, dim, lengths, layout, comm, docs):
        ctx.args = (dim, lengths, layout, comm, docs)
        return _gather_seq(comm, x, dim, lengths, layout, "unshard", docs)

    @staticmethod
    def backward(ctx, g):
        dim, lengths, layout, comm, docs = ctx.args
        return _slice_seq(g, dim, lengths, layout, comm.rank, docs), None, None, None, None, None


def _seq_meta(name: str, x, dim, group, layout, cu_seqlens, arg: str = "x"):
    """Checks and handshake of shard / unshard: ``(comm, dim, meta, docs)``, ``docs`` the checked
    ``cu_seqlens`` (agreed by every rank). ``shard`` agrees on the full shape and on a fingerprint
    of the values of ``x`` (named ``arg`` in a disagreement), read with the exchange."""
    comm = as_comm(group)
    agree, per, err, d, docs = None, None, None, 0, None
    try:
        _checks.tensor("x", x, floating=False)
        if x.dim() == 0:
            raise ValueError(f"x must have at least one dimension to {name}, got a 0-d tensor")
        d = _checks.dim("dim", dim, x.dim())
        _checks.choice("layout", layout, _checks.LAYOUTS)
        docs = attn_meta.doc_values(cu_seqlens)
        if name == "shard" and docs is not None:
            vs.check_cu_seqlens(docs, x.shape[d], x.shape[d], 0)
        agree = {"ndim": x.dim(), "dim": d, "dtype": encode_dtype(x.dtype), "layout": _checks.LAYOUTS.index(layout),
                 "cu_seqlens": attn_meta.docs_code(docs), **_other_sizes(list(x.shape), d)}
        if name == "shard":
            agree.update({f"x.shape[{d}]": x.shape[d], arg: attn_meta.replica_fingerprint(x)})
        per = {"length": x.shape[d]}
    except LOCAL_ERRORS as e:
        err = e
    return comm, d, handshake(comm, name, agree, per, err), docs


@eager
def shard(x: Tensor, dim: int = 2, *, group=None, layout: str = "contiguous", cu_seqlens=None) -> Tensor:
    """This rank's shard along ``dim`` of ``x``, which every rank holds in full (collective).

    ``"contiguous"`` splits like ``torch.tensor_split``; ``"zigzag"`` cuts ``2P`` chunks the same
    way and keeps chunks ``r`` and ``2P-1-r``; with ``cu_seqlens`` (documents, ``cu[-1]`` the
    length along ``dim``) ``"zigzag"`` does so to every document, in document order (any lengths).
    Backward gathers the full gradient on every rank. Ranks whose ``x`` differ (in shape or values:
    a fingerprint travels with the handshake) raise ``ValueError`` on every rank, naming them.
    """
    return _shard(x, dim, group, layout, cu_seqlens, "x")


def _shard(x: Tensor, dim, group, layout: str, cu_seqlens, arg: str) -> Tensor:
    """:func:`shard`, naming ``x`` as ``arg`` where its values differ across ranks."""
    comm, d, meta, docs = _seq_meta("shard", x, dim, group, layout, cu_seqlens, arg)
    docs = docs if layout == "zigzag" else None  # contiguous slices ignore documents
    lengths = lay.shard_lengths(x.shape[d], comm.size, layout, docs)
    return ShardFn.apply(x, d, lengths, layout, comm, docs)


@eager
def unshard(x: Tensor, dim: int = 2, *, group=None, layout: str = "contiguous", cu_seqlens=None) -> Tensor:
    """The full tensor, on every rank, from each rank's shard along ``dim`` (collective).

    ``"contiguous"``: shards in rank order, any lengths; ``"zigzag"``: as :func:`shard` makes them
    (per document with ``cu_seqlens``, whose last entry is the full length). Backward returns this
    rank's slice of the gradient.
    """
    comm, d, meta, docs = _seq_meta("unshard", x, dim, group, layout, cu_seqlens)
    lengths = meta["length"]
    if docs is not None:
        vs.check_cu_seqlens(docs, sum(lengths), sum(lengths), 0)  # the same on every rank: docs agree
        docs = docs if layout == "zigzag" else None
    bad = lay.zigzag_mismatch(lengths, docs) if layout == "zigzag" else []
    if bad:
        what = "a per-document zigzag split of cu_seqlens" if docs is not None else "a zigzag split"
        raise ValueError(f"unshard: layout='zigzag' but rank(s) {bad} hold lengths not of {what} of "
                         f"{sum(lengths)} (lengths {lengths})")
    return UnshardFn.apply(x, d, lengths, layout, comm, docs)
