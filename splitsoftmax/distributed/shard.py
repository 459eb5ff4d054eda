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
from .comm import as_comm, eager
from .handshake import LOCAL_ERRORS, encode_dtype, handshake
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
        _checks.layout(layout, cu_seqlens)
        docs = attn_meta.doc_values(cu_seqlens)
        if name == "shard" and docs is not None:
            vs.check_cu_seqlens(docs, x.shape[d], x.shape[d], 0)
        agree = {"ndim": x.dim(), "dim": d, "dtype": encode_dtype(x.dtype), "layout": _checks.LAYOUTS.index(layout),
                 "cu_seqlens": attn_meta.docs_code(docs), **other_sizes(list(x.shape), d)}
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
    length along ``dim``) ``"zigzag"`` does so to every document, in document order (any lengths),
    and ``"balanced"`` (which needs them) keeps short documents whole on one rank each and zigzags
    the long ones (``distributed.layout.balanced``), a rank's positions in global order.
    Backward gathers the full gradient on every rank. Ranks whose ``x`` differ (in shape or values:
    a fingerprint travels with the handshake) raise ``ValueError`` on every rank, naming them.
    """
    return shard_as(x, dim, group, layout, cu_seqlens, "x")


def shard_as(x: Tensor, dim, group, layout: str, cu_seqlens, arg: str) -> Tensor:
    """:func:`shard`, naming ``x`` as ``arg`` where its values differ across ranks."""
    comm, d, meta, docs = _seq_meta("shard", x, dim, group, layout, cu_seqlens, arg)
    docs = docs if layout != "contiguous" else None  # contiguous slices ignore documents
    lengths = lay.shard_lengths(x.shape[d], comm.size, layout, docs)
    return ShardFn.apply(x, d, lengths, layout, comm, docs)


@eager
def unshard(x: Tensor, dim: int = 2, *, group=None, layout: str = "contiguous", cu_seqlens=None) -> Tensor:
    """The full tensor, on every rank, from each rank's shard along ``dim`` (collective).

    ``"contiguous"``: shards in rank order, any lengths; ``"zigzag"`` and ``"balanced"``: as
    :func:`shard` makes them (per document with ``cu_seqlens``, whose last entry is the full length;
    ``"balanced"`` needs it). Backward returns this rank's slice of the gradient.
    """
    comm, d, meta, docs = _seq_meta("unshard", x, dim, group, layout, cu_seqlens)
    lengths = meta["length"]
    if docs is not None:
        vs.check_cu_seqlens(docs, sum(lengths), sum(lengths), 0)  # the same on every rank: docs agree
        docs = docs if layout != "contiguous" else None
    bad = lay.layout_mismatch(layout, lengths, docs)
    if bad:
        raise ValueError(f"unshard: layout={layout!r} but rank(s) {bad} hold lengths not of "
                         f"{lay.split_name(layout, docs)} of {sum(lengths)} (lengths {lengths})")
    return UnshardFn.apply(x, d, lengths, layout, comm, docs)
