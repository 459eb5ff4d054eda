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

from .. import _checks
from ..autograd import backward_stats
from ..functional import _rows
from ..local import op
from . import layout as lay
from .allgather import allgather_attention_bwd, allgather_attention_fwd, allgather_var
from .comm import as_comm
from .handshake import encode_dtype, encode_float, fingerprint, handshake, start_handshake
from .ring import AttnSpec, ring_attention_bwd, ring_attention_fwd
from .tree import allreduce_sum, early_local, merge_lse, tree_attention_bwd, tree_attention_fwd

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
    except (TypeError, ValueError) as e:
        err = e
    handshake(comm, name, agree, per, err)
    x2, moved = _rows(x, d)
    return comm, d, x2.contiguous(), moved


def _sharded_softmax(name: str, x, dim, group, log: bool) -> Tensor:
    comm, d, x2, moved = _row_shards(name, x, dim, group, log)
    y = ShardedSoftmaxFn.apply(x2, log, comm).reshape(moved)
    return y.reshape(()) if x.dim() == 0 else y.movedim(-1, d)


def sharded_softmax(x: Tensor, dim: int = -1, *, group=None) -> Tensor:
    """This rank's slice of the softmax of rows split across ranks along ``dim`` (rank order,
    any lengths, zero allowed). ``x.dtype`` out; float32 statistics; collective over ``group``."""
    return _sharded_softmax("sharded_softmax", x, dim, group, log=False)


def sharded_log_softmax(x: Tensor, dim: int = -1, *, group=None) -> Tensor:
    """This rank's slice of the log-softmax of rows split across ranks along ``dim``."""
    return _sharded_softmax("sharded_log_softmax", x, dim, group, log=True)


def sharded_logsumexp(x: Tensor, dim: int = -1, *, group=None) -> Tensor:
    """logsumexp of the full rows (``dim`` removed), float32, identical on every rank."""
    comm, d, x2, moved = _row_shards("sharded_logsumexp", x, dim, group, None)
    return ShardedLogSumExpFn.apply(x2, comm).reshape(moved[:-1])


class ShardedAttentionFn(torch.autograd.Function):
    """Attention over a sharded sequence by ``schedule``: ``(out, lse)`` of this rank."""

    @staticmethod
    def forward(ctx, q, k, v, comm, spec: AttnSpec, schedule: str, local):
        out, lse = _FWD[schedule](comm, spec, q, k, v, *([local] if local is not None else []))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.spec, ctx.schedule = comm, spec, schedule
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        lse, delta = backward_stats(out, lse, dout, dlse)
        dq, dk, dv = _BWD[ctx.schedule](ctx.comm, ctx.spec, q, k, v, dout, lse, delta)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _attention_meta(comm, q, k, v, causal, scale, schedule, layout, return_lse):
    """Local checks and the start of the handshake: ``(finish, scale)``; ``finish()`` waits for the
    handshake and returns the agreed :class:`AttnSpec` (raising as the handshake does). ``scale``
    is the resolved softmax scale, None when the local checks failed."""
    agree, per, err, s = None, None, None, None
    try:
        s = _checks.attention_args(q, k, v, scale, causal)
        _checks.flag("return_lse", return_lse)
        _checks.choice("schedule", schedule, _checks.SCHEDULES)
        _checks.choice("layout", layout, _checks.LAYOUTS)
        if schedule == "tree" and layout != "contiguous":
            raise ValueError(f"layout={layout!r}: the tree schedule takes contiguous k/v shards")
        (b, h, sq, d), hkv, dv = q.shape, k.shape[1], v.shape[-1]
        agree = {"B": b, "H": h, "Hkv": hkv, "D": d, "Dv": dv, "dtype": encode_dtype(q.dtype),
                 "causal": int(causal), "scale": encode_float(s), "schedule": _checks.SCHEDULES.index(schedule),
                 "layout": _checks.LAYOUTS.index(layout)}
        if schedule == "tree":  # q is replicated: its shape and its values must agree
            agree["Sq"] = sq
            agree["q"] = fingerprint(q)
        per = {"Sq_local": sq, "Sk_local": k.shape[2]}
    except (TypeError, ValueError) as e:
        err, s = e, None
    pending = start_handshake(comm, "sharded_attention", agree, per, err)

    def finish() -> AttnSpec:
        meta = pending()
        if layout == "zigzag":
            for name in ("Sq_local", "Sk_local"):
                bad = lay.zigzag_mismatch(meta[name])
                if bad:
                    raise ValueError(f"sharded_attention: layout='zigzag' but rank(s) {bad} hold {name} not of a "
                                     f"zigzag split of {sum(meta[name])} positions (lengths {meta[name]})")
        return AttnSpec(b, h, hkv, d, dv, s, causal, layout, meta["Sq_local"], meta["Sk_local"], comm.rank)
    return finish, s


def sharded_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
                      group=None, schedule: str = "ring", layout: str = "contiguous", return_lse: bool = False):
    """Exact attention over a sequence sharded across the ranks of ``group`` (collective).

    ``"ring"``/``"allgather"``: ``q (B,H,Sq_r,D)``, ``k (B,Hkv,Sk_r,D)``, ``v (B,Hkv,Sk_r,Dv)`` are
    this rank's shards (``layout`` ``"contiguous"``: any lengths; ``"zigzag"``: chunks r, 2P-1-r);
    returns this rank's shard of the output (and ``lse (B,H,Sq_r)`` float32). ``"tree"``: ``q``
    is the same on every rank, k/v contiguous shards; the result is identical on every rank and
    ``causal`` aligns the queries with the last ``Sq`` global keys. Causal everywhere means a
    query at global position ``i`` sees keys at ``j <= i``.
    """
    comm = as_comm(group)
    finish, s = _attention_meta(comm, q, k, v, causal, scale, schedule, layout, return_lse)
    local = early_local(q, k, v, s, causal) if schedule == "tree" and s is not None else None
    spec = finish()
    out, lse = ShardedAttentionFn.apply(q, k, v, comm, spec, schedule, local)
    return (out, lse) if return_lse else out


def _slice_seq(x: Tensor, dim: int, lengths: list, layout: str, rank: int) -> Tensor:
    """This rank's segments of the full ``x`` along ``dim``, concatenated."""
    segs = lay.segments(layout, lengths, rank)
    return torch.cat([x.narrow(dim, s.glob, s.n) for s in segs], dim=dim).contiguous()


def _gather_seq(comm, x: Tensor, dim: int, lengths: list, layout: str, step: str) -> Tensor:
    """The full tensor along ``dim`` from every rank's shard (lengths in rank order)."""
    xm = x.movedim(dim, 0).contiguous()
    inner = math.prod(xm.shape[1:])
    bufs = allgather_var(comm, xm.reshape(-1), lambda r: lengths[r] * inner, step)
    shards = [b.view(lengths[r], *xm.shape[1:]) for r, b in enumerate(bufs)]
    pieces = [shards[r][loc:loc + n] for r, loc, n in lay.global_pieces(layout, lengths)]
    return torch.cat(pieces, dim=0).movedim(0, dim)


class ShardFn(torch.autograd.Function):
    """Forward: this rank's slice; backward: the full gradient gathered from every rank's slice."""

    @staticmethod
    def forward(ctx, x, dim, lengths, layout, comm):
        ctx.args = (dim, lengths, layout, comm)
        return _slice_seq(x, dim, lengths, layout, comm.rank)

    @staticmethod
    def backward(ctx, g):
        dim, lengths, layout, comm = ctx.args
        return _gather_seq(comm, g, dim, lengths, layout, "shard backward"), None, None, None, None


class UnshardFn(torch.autograd.Function):
    """Forward: the full tensor gathered; backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, dim, lengths, layout, comm):
        ctx.args = (dim, lengths, layout, comm)
        return _gather_seq(comm, x, dim, lengths, layout, "unshard")

    @staticmethod
    def backward(ctx, g):
        dim, lengths, layout, comm = ctx.args
        return _slice_seq(g, dim, lengths, layout, comm.rank), None, None, None, None


def _seq_meta(name: str, x, dim, group, layout):
    comm = as_comm(group)
    agree, per, err, d = None, None, None, 0
    try:
        _checks.tensor("x", x, floating=False)
        if x.dim() == 0:
            raise ValueError(f"x must have at least one dimension to {name}, got a 0-d tensor")
        d = _checks.dim("dim", dim, x.dim())
        _checks.choice("layout", layout, _checks.LAYOUTS)
        agree = {"ndim": x.dim(), "dim": d, "dtype": encode_dtype(x.dtype), "layout": _checks.LAYOUTS.index(layout),
                 **_other_sizes(list(x.shape), d)}
        per = {"length": x.shape[d]}
    except (TypeError, ValueError) as e:
        err = e
    return comm, d, handshake(comm, name, agree, per, err)


def shard(x: Tensor, dim: int = 2, *, group=None, layout: str = "contiguous") -> Tensor:
    """This rank's shard along ``dim`` of ``x``, which every rank holds in full (collective).

    ``"contiguous"`` splits like ``torch.tensor_split``; ``"zigzag"`` cuts ``2P`` chunks the same
    way and keeps chunks ``r`` and ``2P-1-r``. Backward gathers the full gradient on every rank.
    """
    comm, d, meta = _seq_meta("shard", x, dim, group, layout)
    if len(set(meta["length"])) > 1:
        raise ValueError(f"shard: the full length along dim differs across ranks (per rank: {meta['length']})")
    lengths = lay.shard_lengths(x.shape[d], comm.size, layout)
    return ShardFn.apply(x, d, lengths, layout, comm)


def unshard(x: Tensor, dim: int = 2, *, group=None, layout: str = "contiguous") -> Tensor:
    """The full tensor, on every rank, from each rank's shard along ``dim`` (collective).

    ``"contiguous"``: shards in rank order, any lengths; ``"zigzag"``: as :func:`shard` makes them.
    Backward returns this rank's slice of the gradient.
    """
    comm, d, meta = _seq_meta("unshard", x, dim, group, layout)
    lengths = meta["length"]
    if layout == "zigzag" and lay.zigzag_mismatch(lengths):
        raise ValueError(f"unshard: layout='zigzag' but rank(s) {lay.zigzag_mismatch(lengths)} hold lengths "
                         f"not of a zigzag split of {sum(lengths)} (lengths {lengths})")
    return UnshardFn.apply(x, d, lengths, layout, comm)
