"""Cross-entropy over the vocabulary: single device, and vocabulary-sharded across ranks.

Both reduce each row of logits to four float32 statistics ``(m, l, x_t, sum_j x_j)`` in one
pass (``ce_stats``): the softmax state, the target logit and the row sum (label smoothing).
Shards of the vocabulary merge their statistics with the state algebra after one packed
exchange. One more kernel (``ce_loss``) turns the statistics into the loss: each row's, or their
float32 sum or mean over the rows not ignored, in the logits' dtype. The backward is one kernel
and needs no communication (``dlogits = g (softmax - (1-eps) onehot - eps/V)`` uses only the
global ``lse``; ``g`` over the count for the mean, 0 in ignored rows). The loss is one autograd
node; no float32 copy of the logits is ever made.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...core import checks as _checks
from ...distributed import handshake as hs
from ...distributed.comm import as_comm, eager
from ...distributed.tree import allgather
from .._registry import op, use_triton
from .._registry import call
from .op import ce_kernels
from ...core.state import stat_dtype


def _args(logits, target, ignore_index, reduction, label_smoothing) -> float:
    """Check ``logits (N, V)`` floating, ``target (N,)`` integer class ids; return the smoothing."""
    _checks.tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (N, V), got shape {tuple(logits.shape)}")
    _checks.class_targets(target, logits, ignore_index)
    _checks.choice("reduction", reduction, _checks.REDUCTIONS)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing must be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    return float(label_smoothing)


def cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """Cross-entropy of ``logits (N, V)`` against class ids ``target (N,)``, like
    ``torch.nn.functional.cross_entropy``.

    Rows with ``target == ignore_index`` add 0 and leave the ``mean`` denominator. Label smoothing
    mixes in the uniform distribution over the ``V`` classes. Statistics, the sum and the mean are
    float32 (one pass over the logits, no float32 copy); the loss has ``logits.dtype``; the gradient
    is written in ``logits.dtype``. ``reduction``: ``"mean"``, ``"sum"`` (scalars) or ``"none"``
    (``(N,)``). One autograd node; on the GPU two launches forward (three for the sum or mean
    of more than 16384 rows), one backward.
    """
    eps, ignore_index = _args(logits, target, ignore_index, reduction, label_smoothing), int(ignore_index)
    _checks.target_values(target, ignore_index, logits.shape[1], on_device=use_triton(logits))
    return call("ce_fwd", logits, target, ignore_index, eps, reduction)[0]


class ShardedCrossEntropyFn(torch.autograd.Function):
    """The loss (``reduction``) of vocabulary-sharded ``logits (N, V_r)``; this slice starts at ``col0``."""

    @staticmethod
    def forward(ctx, logits, target, comm, col0: int, vocab: int, ignore_index: int, eps: float, reduction: str):
        n = logits.shape[0]
        stats = op("ce_stats", logits)(logits, target, col0, eps > 0).to(stat_dtype(logits.dtype))  # [N, 4]
        parts = allgather(comm, stats.reshape(-1).contiguous(), "sharded_cross_entropy: row statistics")
        loss, lse, count = ce_kernels(logits).ce_loss(parts.view(comm.size, n, 4), target, ignore_index, eps, vocab,
                                                      reduction, logits.dtype)
        ctx.save_for_backward(logits, target, lse, count)
        ctx.args = (col0, vocab, ignore_index, eps, reduction)
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):
        logits, target, lse, count = ctx.saved_tensors
        col0, vocab, ignore_index, eps, reduction = ctx.args
        dx = ce_kernels(logits).ce_grad(logits, target, lse, g, count, col0, ignore_index, eps, vocab, reduction)
        return dx, None, None, None, None, None, None, None


@eager
def sharded_cross_entropy(logits: Tensor, target: Tensor, *, group=None, ignore_index: int = -100,
                          reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """Cross-entropy of vocabulary-sharded logits (collective over ``group``).

    ``logits (N, V_r)`` is this rank's slice of the classes (slices in rank order, any lengths, 0
    allowed); ``target (N,)`` holds global class ids and is the same on every rank. Returns the
    loss of the full ``(N, V)`` logits, identical on every rank, in ``logits.dtype``; label
    smoothing spreads over the global ``V``. One packed exchange of the per-row statistics; each
    rank's logits gradient is its slice of the full gradient (no communication in backward).
    """
    comm = as_comm(group)
    agree, per, err = None, None, None
    try:
        eps, ignore_index = _args(logits, target, ignore_index, reduction, label_smoothing), int(ignore_index)
        agree = {"N": logits.shape[0], "dtype": hs.encode_dtype(logits.dtype), "ignore_index": ignore_index,
                 "reduction": _checks.REDUCTIONS.index(reduction), "label_smoothing": hs.encode_float(eps),
                 "target": hs.fingerprint(target)}
        per = {"V_local": logits.shape[1]}
    except hs.LOCAL_ERRORS as e:
        err = e
    meta = hs.handshake(comm, "sharded_cross_entropy", agree, per, err)
    widths = meta["V_local"]
    vocab, col0 = sum(widths), sum(widths[:comm.rank])
    _checks.target_values(target, ignore_index, vocab, on_device=use_triton(logits))
    return ShardedCrossEntropyFn.apply(logits, target, comm, col0, vocab, ignore_index, eps, reduction)
