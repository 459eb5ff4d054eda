"""Statistics of softmax distributions over a vocabulary: the log-probability of a target, the
entropy and the KL divergence per row, on one device or with the vocabulary sharded across ranks.

Each row is reduced in one read of its logits to a small float32 record (``ops/vocab/torch.py``):
the softmax state ``(m, l)`` with the value ``z`` (entropy; ``p - q`` for KL) and the target logit.
Shards of the vocabulary exchange their records in one packed all-gather and merge them locally
in rank order with the state algebra, so every rank gets identical results; the backward needs no
communication (each rank computes its slice of the gradient from the merged statistics). No
float32 copy of the logits is made and the logits are never written.

Temperature divides the logits (``z = logits / T``); ``T`` must be positive (``T = 0``, greedy
decoding, has no finite statistics: ``ValueError``). Rows with no finite logit give
``logp = -inf``, entropy 0, KL 0 and zero gradients; a NaN logit makes its row's statistics NaN.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable

import torch
from torch import Tensor

from ...core import checks as _checks
from ...distributed import handshake as hs
from ...distributed.comm import as_comm, eager
from ...distributed.tree import allgather
from .torch import kl_coef, merge_kl_records, merge_records, stats_coefs
from ...distributed.handshake import fingerprint
from .._registry import call
from .op import impl


def _temperature(t) -> float:
    """``1 / T`` for a temperature ``T > 0`` (finite, with a finite float32 reciprocal)."""
    if isinstance(t, bool) or not isinstance(t, numbers.Real):
        raise TypeError(f"temperature must be a float, got {type(t).__name__} {t!r}")
    t = _checks.as_float("temperature", t)
    if t == 0:
        raise ValueError("temperature=0 (greedy decoding) has no finite statistics; they need temperature > 0")
    if not t > 0 or not math.isfinite(t) or 1.0 / t > 3.0e38:
        raise ValueError(f"temperature={t} must be a finite number > 0 (with a finite reciprocal)")
    return 1.0 / t


def _logits(name: str, x) -> Tensor:
    _checks.tensor(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (N, V), got shape {tuple(x.shape)}")
    return x


def _logprob_args(logits, target, temperature, return_entropy, ignore_index) -> float:
    _logits("logits", logits)
    _checks.class_targets(target, logits, ignore_index)
    _checks.flag("return_entropy", return_entropy)
    return _temperature(temperature)


def _kl_args(logits_p, logits_q, temperature) -> float:
    _logits("logits_p", logits_p)
    _logits("logits_q", logits_q)
    if logits_q.shape != logits_p.shape:
        raise ValueError(f"logits_q shape {tuple(logits_q.shape)} must equal logits_p shape {tuple(logits_p.shape)}")
    if logits_q.device != logits_p.device:
        raise ValueError(f"logits_q is on {logits_q.device} but logits_p is on {logits_p.device}")
    if logits_q.dtype != logits_p.dtype:
        raise TypeError(f"logits_q dtype {logits_q.dtype} must equal logits_p dtype {logits_p.dtype} (no mixed dtypes)")
    return _temperature(temperature)


def logprobs(logits: Tensor, target: Tensor, *, temperature: float = 1.0, return_entropy: bool = False,
             ignore_index: int = -100):
    """``log softmax(logits / T)[target]`` per row, and with ``return_entropy`` the entropy of
    ``softmax(logits / T)``.

    Args:
        logits: ``(N, V)``, any float dtype (float32 statistics; never copied to float32).
        target: ``(N,)`` integer class ids in ``[0, V)`` or ``ignore_index``.
        temperature: ``T > 0``.
        return_entropy: also return the entropy.
        ignore_index: rows with this target give 0 (log-probability and entropy) and no gradient.

    Returns ``logp (N,)`` float32, or ``(logp, entropy)``; differentiable w.r.t. ``logits``. A row
    of all ``-inf`` gives ``logp = -inf``, entropy 0 and zero gradient. A target outside ``[0, V)``
    raises ``ValueError`` on the CPU and fails a device-side assertion on a GPU (as cross-entropy).
    """
    inv_t = _logprob_args(logits, target, temperature, return_entropy, ignore_index)
    _checks.target_values(target, int(ignore_index), logits.shape[1])
    logp, ent, _ = call("vocab_fwd", logits, target, inv_t, int(ignore_index), return_entropy)
    return (logp.float(), ent.float()) if return_entropy else logp.float()


def entropy(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / T)`` per row of ``logits (N, V)``: ``(N,)`` float32 (natural
    log), differentiable; 0 for a row of all ``-inf``."""
    _logits("logits", logits)
    inv_t = _temperature(temperature)
    return call("vocab_fwd", logits, None, inv_t, -100, True)[1].float()


def kl_div(logits_p: Tensor, logits_q: Tensor, *, temperature: float = 1.0) -> Tensor:
    """``KL(softmax(p / T) || softmax(q / T))`` per row of ``logits_p, logits_q (N, V)``: ``(N,)``
    float32, differentiable in both. A row where ``p`` has no finite logit gives 0 (zero
    gradients); mass in ``p`` where ``q`` is ``-inf`` gives ``+inf``. (Mind the order:
    ``torch.nn.functional.kl_div(log_q, log_p, log_target=True)`` is the same divergence.)"""
    inv_t = _kl_args(logits_p, logits_q, temperature)
    return call("kl_fwd", logits_p, logits_q, inv_t)[0].float()


def _merged(comm, rec: Tensor, merge: Callable[[Tensor], Tensor], step: str) -> Tensor:
    """Records of the full rows: this rank's ``rec (N, k)`` all-gathered, merged in rank order."""
    if comm.size == 1:
        return rec
    n, k = rec.shape
    parts = allgather(comm, rec.reshape(-1).contiguous(), step)
    return merge(parts.view(comm.size, n, k))


class ShardedStatsFn(torch.autograd.Function):
    """``(logp, entropy)`` ``(N,)`` of vocabulary-sharded ``logits (N, V_r)`` starting at column ``col0``."""

    @staticmethod
    def forward(ctx, logits, target, comm, col0: int, inv_t: float, ignore_index: int, entropy: bool, op: str):
        rec = impl("vocab_records", logits)(logits, target, col0, inv_t, entropy)
        rec = _merged(comm, rec, merge_records, f"{op}: row statistics")
        logp, ent, rows = impl("vocab_finish", rec)(rec, target, ignore_index)
        ctx.save_for_backward(logits, target, rows)
        ctx.args = (col0, inv_t, ignore_index, entropy)
        return logp.float(), ent.float()

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, target, rows = ctx.saved_tensors
        col0, inv_t, ignore_index, entropy = ctx.args
        gl, gh = stats_coefs(rows, target, ignore_index, g_logp if target is not None else None,
                             g_ent if entropy else None)
        dx = impl("vocab_bwd", logits)(logits, target, rows, gl, gh, inv_t, col0)
        return dx, None, None, None, None, None, None, None


class ShardedKLFn(torch.autograd.Function):
    """KL per row ``(N,)`` of alike-sharded ``p, q (N, V_r)``."""

    @staticmethod
    def forward(ctx, p, q, comm, inv_t: float):
        rec = _merged(comm, impl("kl_records", p, q)(p, q, inv_t), merge_kl_records, "sharded_kl_div: row statistics")
        kl, rows = impl("kl_finish", rec)(rec)
        ctx.save_for_backward(p, q, rows)
        ctx.inv_t = inv_t
        return kl.float()

    @staticmethod
    def backward(ctx, g):
        p, q, rows = ctx.saved_tensors
        dp, dq = impl("kl_bwd", p, q)(p, q, rows, kl_coef(rows, g), ctx.inv_t)
        return dp, dq, None, None


def _fields(logits: Tensor, temperature) -> dict:
    """Handshake fields every rank must agree on: the row count, the dtype, the temperature."""
    return {"N": logits.shape[0], "dtype": hs.encode_dtype(logits.dtype), "temperature": hs.encode_float(temperature)}


def _agree(comm, op: str, local: Callable[[], tuple]):
    """Local checks (``local()`` returns ``(agreed fields, per-rank fields, result)``), then the
    handshake: a refusal or disagreement raises on every rank. Returns ``(result, {field: per rank})``."""
    agree, per, result, err = None, None, None, None
    try:
        agree, per, result = local()
    except hs.LOCAL_ERRORS as e:
        err = e
    return result, hs.handshake(comm, op, agree, per, err)


@eager
def sharded_logprobs(logits: Tensor, target: Tensor, *, temperature: float = 1.0, return_entropy: bool = False,
                     ignore_index: int = -100, group=None):
    """:func:`logprobs` of vocabulary-sharded logits (collective over ``group``).

    ``logits (N, V_r)`` is this rank's slice of the vocabulary (slices in rank order, any widths,
    0 allowed); ``target (N,)`` holds global class ids and is the same on every rank. Returns the
    statistics of the full rows, identical on every rank: ``logp (N,)`` float32, or
    ``(logp, entropy)``. One packed exchange of 4 floats per row; each rank's gradient is its
    slice of the full gradient (no communication in the backward). Ranks that disagree on ``N``,
    the dtype, ``temperature``, ``ignore_index``, ``return_entropy`` or ``target`` raise
    ``ValueError`` on every rank.
    """
    comm = as_comm(group)

    def local():
        inv_t = _logprob_args(logits, target, temperature, return_entropy, ignore_index)
        agree = {**_fields(logits, temperature), "ignore_index": int(ignore_index),
                 "return_entropy": int(return_entropy), "target": fingerprint(target)}
        return agree, {"V_local": logits.shape[1]}, inv_t
    inv_t, meta = _agree(comm, "sharded_logprobs", local)
    widths = meta["V_local"]
    _checks.target_values(target, int(ignore_index), sum(widths))
    logp, ent = ShardedStatsFn.apply(logits, target, comm, sum(widths[:comm.rank]), inv_t, int(ignore_index),
                                     return_entropy, "sharded_logprobs")
    return (logp, ent) if return_entropy else logp


@eager
def sharded_entropy(logits: Tensor, *, temperature: float = 1.0, group=None) -> Tensor:
    """:func:`entropy` of vocabulary-sharded ``logits (N, V_r)`` (collective over ``group``):
    ``(N,)`` float32, identical on every rank, differentiable (each rank's gradient is its slice)."""
    comm = as_comm(group)

    def local():
        _logits("logits", logits)
        inv_t = _temperature(temperature)
        return _fields(logits, temperature), None, inv_t
    inv_t, _ = _agree(comm, "sharded_entropy", local)
    return ShardedStatsFn.apply(logits, None, comm, 0, inv_t, -100, True, "sharded_entropy")[1]


@eager
def sharded_kl_div(logits_p: Tensor, logits_q: Tensor, *, temperature: float = 1.0, group=None) -> Tensor:
    """:func:`kl_div` of two alike-sharded logits ``(N, V_r)`` (the same slice of the vocabulary
    on each rank; collective over ``group``): ``(N,)`` float32, identical on every rank,
    differentiable in both (each rank's gradients are its slices)."""
    comm = as_comm(group)

    def local():
        inv_t = _kl_args(logits_p, logits_q, temperature)
        agree = {**_fields(logits_p, temperature), "dtype_q": hs.encode_dtype(logits_q.dtype)}
        return agree, None, inv_t
    inv_t, _ = _agree(comm, "sharded_kl_div", local)
    return ShardedKLFn.apply(logits_p, logits_q, comm, inv_t)
