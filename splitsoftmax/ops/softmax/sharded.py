"""Sharded softmax, log-softmax and logsumexp (docs/API.md, "Across ranks") and their autograd
Functions: each rank holds a slice of every row; the slices' states merge with one all-reduce of the
row statistics, and the backward needs one all-reduce of a row sum."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...core import checks as _checks
from ...distributed.comm import as_comm, eager
from ...distributed.handshake import LOCAL_ERRORS, encode_dtype, handshake
from ...distributed.shard import other_sizes
from ...distributed.tree import allreduce_sum, merge_lse
from .._registry import op
from .api import _rows, _unrows


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
        agree = {"ndim": x.dim(), "dim": d, "rows": rows, "dtype": encode_dtype(x.dtype), **other_sizes(shape, d)}
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
