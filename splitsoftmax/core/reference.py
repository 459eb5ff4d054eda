"""Float64 oracles and the teaching versions of online softmax.

Oracles (used by the tests, ``verify`` and the benchmarks' correctness gate) materialise whole
rows in float64 and follow the contract's conventions: empty rows give ``out = 0``,
``lse = -inf``. The teaching versions follow the online-softmax lesson: a scalar and a
vectorised online softmax that log their running state, and the deliberately wrong variant
that does not rescale when the maximum changes.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from . import state

NEG_INF = float("-inf")


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Stable two-pass softmax in float64; all-``-inf`` rows give 0."""
    return torch.exp(log_softmax(x, dim))


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``x - logsumexp(x)`` in float64; all-``-inf`` rows give ``-inf``."""
    x = x.double()
    lse = logsumexp(x, dim).unsqueeze(dim if x.dim() else 0)
    return torch.where(lse == NEG_INF, NEG_INF, x - torch.where(lse == NEG_INF, 0.0, lse))


def logsumexp(x: Tensor, dim: int = -1) -> Tensor:
    """Two-pass logsumexp in float64 (max, then sum of shifted exponentials)."""
    x = x.double()
    if x.dim() == 0:
        x = x.reshape(1)
    m = x.amax(dim, keepdim=True) if x.shape[dim] else x.sum(dim, keepdim=True) + NEG_INF
    ms = torch.where(m == NEG_INF, 0.0, m)
    s = torch.exp(x - ms).sum(dim, keepdim=True)
    return torch.where(s > 0, ms + torch.log(torch.where(s > 0, s, 1.0)), NEG_INF).squeeze(dim)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
              diag: int = 0) -> tuple[Tensor, Tensor]:
    """Float64 attention with the full score matrix: ``(out (B,H,Sq,Dv), lse (B,H,Sq))``.

    ``causal``: query ``i`` sees key ``j`` iff ``j <= i + diag`` (``diag = 0``: top-left).
    """
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(q.shape[2], device=q.device).unsqueeze(1)
        j = torch.arange(k.shape[2], device=q.device).unsqueeze(0)
        s = s.masked_fill(j > i + diag, NEG_INF)
    lse = logsumexp(s, -1)
    return softmax(s, -1) @ v, lse


def split_then_merge(q: Tensor, k: Tensor, v: Tensor, splits: Sequence[int], *, scale: Optional[float] = None):
    """Non-causal attention computed per key split with :func:`attention`, merged by the state algebra."""
    parts = [attention(q, kb, vb, scale=scale) for kb, vb in zip(k.split(list(splits), 2), v.split(list(splits), 2))]
    return state.merge_out_lse(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]))


def _log_softmax_kept(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(log softmax(z) with 0 at -inf entries, kept entries, lse (N, 1))`` of float64 ``z (N, V)``;
    autograd through it carries no NaN from ``-inf`` entries or all ``-inf`` rows (``lse = -inf``)."""
    kept = (z > NEG_INF) | torch.isnan(z)
    empty = ~kept.any(-1, keepdim=True)
    lse = torch.logsumexp(z.masked_fill(empty, 0.0), -1, keepdim=True)
    return torch.where(kept, z - lse, 0.0), kept, lse.masked_fill(empty, NEG_INF)


def vocab_stats(logits: Tensor, target: Tensor, *, temperature: float = 1.0,
                ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """float64 ``(logp, entropy)`` ``(N,)`` of ``softmax(logits / T)``, differentiable without NaN:
    ``-inf`` entries have probability 0; an all ``-inf`` row gives ``(-inf, 0)``; rows with
    ``target == ignore_index`` give ``(0, 0)``."""
    z = logits.double() / temperature
    ls, kept, lse = _log_softmax_kept(z)
    ent = -(torch.where(kept, torch.exp(ls), 0.0) * ls).sum(-1)
    skip = target == ignore_index
    if not z.shape[1]:
        return torch.where(skip, 0.0, ent + NEG_INF), ent
    logp = z.gather(1, torch.where(skip, 0, target).unsqueeze(1)) - lse.masked_fill(lse == NEG_INF, 0.0)
    logp = torch.where(lse == NEG_INF, NEG_INF, logp).squeeze(1)
    return torch.where(skip, 0.0, logp), torch.where(skip, 0.0, ent)


def kl_div(logits_p: Tensor, logits_q: Tensor, *, temperature: float = 1.0) -> Tensor:
    """float64 ``KL(softmax(p / T) || softmax(q / T))`` ``(N,)``: 0 where ``p`` has no mass, ``+inf``
    where ``p`` has mass on a ``-inf`` entry of ``q``; differentiable without NaN elsewhere."""
    lp, kp, _ = _log_softmax_kept(logits_p.double() / temperature)
    lq, kq, _ = _log_softmax_kept(logits_q.double() / temperature)
    kl = (torch.where(kp, torch.exp(lp), 0.0) * (lp - lq)).sum(-1)
    return torch.where((kp & ~kq).any(-1), float("inf"), kl)


class TraceStep(NamedTuple):
    """Running state after one element: the element, the running max, the running sum."""

    x: float
    m: float
    l: float


def online_softmax_scalar(row: Sequence[float], *, rescale: bool = True) -> tuple[list[float], list[TraceStep]]:
    """Element-by-element online softmax: ``(probabilities, trace)``.

    ``rescale=False`` is the deliberately wrong variant: when the maximum grows, the old sum is
    kept in the old maximum's frame instead of being multiplied by ``exp(m_old - m_new)``.
    """
    m, l, trace = NEG_INF, 0.0, []
    for x in row:
        m_new = max(m, x)
        if rescale:
            l = l * math.exp(m - m_new) + math.exp(x - m_new)
        else:
            l = l + math.exp(x - m_new)
        m = m_new
        trace.append(TraceStep(float(x), m, l))
    return [math.exp(x - m) / l for x in row], trace


def online_softmax_vectorised(rows: np.ndarray, *, rescale: bool = True, block: int = 1):
    """Online softmax over many rows at once, ``block`` columns per step.

    Returns ``(probabilities (R, N), trace)`` where ``trace`` holds the running ``(m, l)``
    arrays (each ``(R,)``) after every step.
    """
    rows = np.asarray(rows, dtype=np.float64)
    m = np.full(rows.shape[0], -np.inf)
    l = np.zeros(rows.shape[0])
    trace = []
    for j in range(0, rows.shape[1], block):
        xb = rows[:, j:j + block]
        m_new = np.maximum(m, xb.max(axis=1))
        alpha = np.exp(m - m_new) if rescale else np.ones_like(m)
        l = l * alpha + np.exp(xb - m_new[:, None]).sum(axis=1)
        m = m_new
        trace.append((m.copy(), l.copy()))
    return np.exp(rows - m[:, None]) / l[:, None], trace


def two_pass_softmax_np(rows: np.ndarray) -> np.ndarray:
    """The stable two-pass softmax in float64 numpy: max, then normalised exponentials."""
    rows = np.asarray(rows, dtype=np.float64)
    e = np.exp(rows - rows.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def variant_visible(batch: int, sq: int, sk: int, *, causal: bool = False, cu_seqlens=None, window_size=None,
                    kv_range: Optional[Tensor] = None, q_offset=0) -> Tensor:
    """The contract's visibility rule of the attention keywords as a dense ``(B, Sq, Sk)`` bool
    tensor (CPU): ``[b, i, j]`` is whether query ``i`` of element ``b`` sees key ``j``."""
    from .mask import Mask, visible
    left, right = (-1, -1) if window_size is None else window_size
    off = q_offset if isinstance(q_offset, Tensor) else torch.full((batch,), int(q_offset))
    band = Mask(q_offset=off.cpu(), kv_range=None if kv_range is None else kv_range.cpu())
    ok = visible(band, causal, 0, batch, sq, sk)
    pos = torch.arange(sq).view(1, sq, 1) + off.cpu().long().view(batch, 1, 1)
    j = torch.arange(sk).view(1, 1, sk)
    if left >= 0:
        ok &= j >= pos - left
    if right >= 0:
        ok &= j <= pos + right
    if cu_seqlens is not None:
        cu = torch.as_tensor(list(cu_seqlens) if not isinstance(cu_seqlens, Tensor) else cu_seqlens.cpu())
        doc = torch.bucketize(torch.arange(sq), cu[1:].long(), right=True)  # document id of each position
        ok &= doc.view(1, sq, 1) == doc[:sk].view(1, 1, sk)
    return ok


def attention_variants(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
                       cu_seqlens=None, window_size=None, softcap=None, sinks: Optional[Tensor] = None,
                       kv_range: Optional[Tensor] = None, q_offset=0) -> tuple[Tensor, Tensor]:
    """Float64 attention under the variant keywords with the full score matrix (differentiable):
    ``(out (B,H,Sq,Dv), lse (B,H,Sq))``. Hidden scores are replaced by ``-inf`` and hidden values
    weigh exactly 0, so NaN/Inf in hidden keys or values changes the output nothing; an empty row
    gives ``out = 0`` and ``lse = -inf`` (``sinks[h]`` with sinks)."""
    q, k, v = q.double(), k.double(), v.double()
    b, h, sq, d = q.shape
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    ok = variant_visible(b, sq, k.shape[2], causal=causal, cu_seqlens=cu_seqlens, window_size=window_size,
                         kv_range=kv_range, q_offset=q_offset).to(q.device).unsqueeze(1)  # (B, 1, Sq, Sk)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d) if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~ok, NEG_INF)
    if sinks is not None:
        s = torch.cat((s, sinks.double().view(1, h, 1, 1).expand(b, h, sq, 1)), -1)
    lse = logsumexp(s, -1)
    p = torch.exp(s - state.safe_max(lse).unsqueeze(-1))[..., :k.shape[2]]  # [B, H, Sq, Sk]
    return state.weighted_sum(torch.where(ok, p, 0.0), v), lse
