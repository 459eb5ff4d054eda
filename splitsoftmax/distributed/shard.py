"""``shard`` and ``unshard`` (docs/API.md, "Across ranks"): a tensor every rank holds in full, cut into
each rank's shard along a dim by a layout, and back; each is the other's backward."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core import checks as _checks
from ..core import keywords as vs
from . import attn_meta
from . import layout as lay
from .comm import eager
from .handshake import LOCAL_ERRORS, encode_dtype, fingerprint, handshake
from .mesh import Mesh, as_group, mesh_shape, seq_lengths
from .tree import allgather_var


def other_sizes(shape: list, d: int) -> dict:
    """Handshake fields for the sizes of every dim but the sharded ``d`` (the first 12 such)."""
    return dict([(f"x.shape[{i}]", s) for i, s in enumerate(shape) if i != d][:12])


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


def _slice(x: Tensor, dim: int, lengths: list, layout: str, comm, docs, heads_lens) -> Tensor:
    """This rank's shard; on a mesh (``heads_lens``: its heads group's pieces of its sequence shard)
    the heads rank's piece of the sequence shard."""
    if heads_lens is None:
        return _slice_seq(x, dim, lengths, layout, comm.rank, docs)
    part = _slice_seq(x, dim, lengths, layout, comm.seq.rank, docs)
    return part.split(list(heads_lens), dim)[comm.heads.rank].contiguous()


def _gather(comm, x: Tensor, dim: int, lengths: list, layout: str, step: str, docs, heads_lens) -> Tensor:
    """Inverse of :func:`_slice`, on every rank: on a mesh the heads group's pieces first, then the
    sequence shards."""
    if heads_lens is None:
        return _gather_seq(comm, x, dim, lengths, layout, step, docs)
    part = _gather_seq(comm.heads, x, dim, list(heads_lens), "contiguous", f"{step} (heads group)")
    return _gather_seq(comm.seq, part, dim, lengths, layout, f"{step} (sequence group)", docs)


class ShardFn(torch.autograd.Function):
    """Forward: this rank's slice; backward: the full gradient gathered from every rank's slice."""

    @staticmethod
    def forward(ctx, x, dim, lengths, layout, comm, docs, heads_lens=None):
        ctx.args = (dim, lengths, layout, comm, docs, heads_lens)
        return _slice(x, dim, lengths, layout, comm, docs, heads_lens)

    @staticmethod
    def backward(ctx, g):
        dim, lengths, layout, comm, docs, heads_lens = ctx.args
        return (_gather(comm, g, dim, lengths, layout, "shard backward", docs, heads_lens),
                None, None, None, None, None, None)


class UnshardFn(torch.autograd.Function):
    """Forward: the full tensor gathered; backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, dim, lengths, layout, comm, docs, heads_lens=None):
        ctx.args = (dim, lengths, layout, comm, docs, heads_lens)
        return _gather(comm, x, dim, lengths, layout, "unshard", docs, heads_lens)

    @staticmethod
    def backward(ctx, g):
        dim, lengths, layout, comm, docs, heads_lens = ctx.args
        return _slice(g, dim, lengths, layout, comm, docs, heads_lens), None, None, None, None, None, None


def _seq_meta(name: str, x, dim, group, layout, cu_seqlens, arg: str = "x"):
    """Checks and handshake of shard / unshard: ``(comm, dim, meta, docs)``, ``docs`` the checked
    ``cu_seqlens`` (agreed by every rank). ``shard`` agrees on the full shape and on a fingerprint
    of the values of ``x`` (named ``arg`` in a disagreement), read with the exchange."""
    comm = as_group(group)
    agree, per, err, d, docs = None, None, None, 0, None
    try:
        _checks.tensor("x", x, floating=False)
        if x.dim() == 0:
            raise ValueError(f"x must have at least one dimension to {name}, got a 0-d tensor")
        d = _checks.dim("dim", dim, x.dim())
        _checks.layout(layout, cu_seqlens)
        docs = attn_meta.doc_values(cu_seqlens)
        if name == "shard" and docs is not None:
            vs.check_cu_seqlens(docs, x.shape[d], x.shape[d], 0)
        agree = {"ndim": x.dim(), "dim": d, "dtype": encode_dtype(x.dtype), "layout": _checks.LAYOUTS.index(layout),
                 "cu_seqlens": attn_meta.docs_code(docs), "mesh shape": mesh_shape(comm),
                 **other_sizes(list(x.shape), d)}
        if name == "shard":
            agree.update({f"x.shape[{d}]": x.shape[d], arg: fingerprint(x)})
        per = {"length": x.shape[d]}
    except LOCAL_ERRORS as e:
        err = e
    return comm, d, handshake(comm, name, agree, per, err), docs


@eager
def shard(x: Tensor, dim: int = 2, *, group=None, layout: str = "contiguous", cu_seqlens=None) -> Tensor:
    """This rank's shard along ``dim`` of ``x``, which every rank holds in full (collective).

    ``"contiguous"`` splits like ``torch.tensor_split``; ``"zigzag"`` cuts ``2P`` chunks the same
    way and keeps chunks ``r`` and ``2P-1-r``; with ``cu_seqlens`` (documents, ``cu[-1]`` the
    length along ``dim``) ``"zigzag"`` does so to every document, in document order (any lengths),
    and ``"balanced"`` (which needs them) keeps short documents whole on one rank each and zigzags
    the long ones (``distributed.layout.balanced``), a rank's positions in global order.
    On a 2-D mesh (a 2-D DeviceMesh or a tuple ``(seq_group, heads_group)``) that is the sequence
    shard over the sequence group, split again like ``torch.tensor_split`` over the heads group:
    this rank gets its heads rank's piece. Backward gathers the full gradient on every rank. Ranks
    whose ``x`` differ (in shape or values:
    a fingerprint travels with the handshake) raise ``ValueError`` on every rank, naming them.
    """
    return shard_as(x, dim, group, layout, cu_seqlens, "x")


def shard_as(x: Tensor, dim, group, layout: str, cu_seqlens, arg: str) -> Tensor:
    """:func:`shard`, naming ``x`` as ``arg`` where its values differ across ranks."""
    comm, d, meta, docs = _seq_meta("shard", x, dim, group, layout, cu_seqlens, arg)
    docs = docs if layout != "contiguous" else None  # contiguous slices ignore documents
    seq = comm.seq if isinstance(comm, Mesh) else comm
    lengths = lay.shard_lengths(x.shape[d], seq.size, layout, docs)
    heads_lens = lay.split_sizes(lengths[seq.rank], comm.shape[1]) if isinstance(comm, Mesh) else None
    return ShardFn.apply(x, d, lengths, layout, comm, docs, heads_lens)


@eager
def unshard(x: Tensor, dim: int = 2, *, group=None, layout: str = "contiguous", cu_seqlens=None) -> Tensor:
    """The full tensor, on every rank, from each rank's shard along ``dim`` (collective).

    ``"contiguous"``: shards in rank order, any lengths; ``"zigzag"`` and ``"balanced"``: as
    :func:`shard` makes them (per document with ``cu_seqlens``, whose last entry is the full length;
    ``"balanced"`` needs it); on a 2-D mesh, the pieces of every sequence shard in heads-rank order
    (any lengths). Backward returns this rank's slice of the gradient.
    """
    comm, d, meta, docs = _seq_meta("unshard", x, dim, group, layout, cu_seqlens)
    lengths, heads_lens = meta["length"], None
    if isinstance(comm, Mesh):
        ph, s = comm.shape[1], comm.seq.rank
        lengths, heads_lens = seq_lengths(lengths, comm.shape), lengths[s * ph:(s + 1) * ph]
    if docs is not None:
        vs.check_cu_seqlens(docs, sum(lengths), sum(lengths), 0)  # the same on every rank: docs agree
        docs = docs if layout != "contiguous" else None
    bad = lay.layout_mismatch(layout, lengths, docs)
    if bad:
        who = "sequence shard(s)" if heads_lens is not None else "rank(s)"
        raise ValueError(f"unshard: layout={layout!r} but {who} {bad} hold lengths not of "
                         f"{lay.split_name(layout, docs)} of {sum(lengths)} (lengths {lengths})")
    return UnshardFn.apply(x, d, lengths, layout, comm, docs, heads_lens)
