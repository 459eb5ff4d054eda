"""Shared by the sampling tests: the float64 filtered softmax, a chi-square check, small row sets."""
from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


def filtered_probs(x: torch.Tensor, temperature: float = 1.0, top_k=None, top_p=None, min_p=None,
                   drop_crossing: bool = False) -> torch.Tensor:
    """The distribution a draw must follow, float64 ``(V,)``: ``softmax(x / T)`` restricted by
    top-k (ties kept), then top-p on what top-k kept (the smallest set of most probable tokens
    reaching ``top_p``, the crossing token and its ties included), then min-p (``p >= min_p p_max``).

    ``drop_crossing``: the deliberately wrong top-p that stops before the crossing token."""
    x = x.double()
    p = torch.softmax(x / temperature, dim=0)
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_k is not None and top_k < x.numel():
        keep &= x >= torch.sort(x, descending=True).values[top_k - 1]
    if top_p is not None and top_p < 1:
        q = torch.where(keep, p, 0.0)
        q = q / q.sum()
        values = torch.unique(q[keep]).flip(0)  # distinct probabilities, largest first
        for v in values:
            mass = q[q >= v].sum()
            if mass >= top_p - 1e-12:
                keep &= q > v if drop_crossing else q >= v
                break
    if min_p is not None and min_p > 0:
        keep &= p >= min_p * p.max()
    out = torch.where(keep, p, 0.0)
    return out / out.sum()


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, int]:
    """``(statistic, degrees of freedom, draws outside the support)`` of drawn ``tokens`` against ``probs``."""
    counts = torch.bincount(tokens.clamp_min(0), minlength=probs.numel()).double()
    outside = int(counts[probs == 0].sum()) + int((tokens < 0).sum())
    support = probs > 0
    expected = probs[support] * tokens.numel()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1, outside


def chi_square_limit(df: int, z: float = 4.75) -> float:
    """The chi-square value exceeded with probability about ``Phi(-z)`` (Wilson-Hilferty): z = 4.75
    is a one-in-a-million tail."""
    df = max(df, 1)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def edge_rows(v: int = 97, seed: int = 0) -> torch.Tensor:
    """Rows that exercise the cases: random, masked tail, all -inf, NaN, ties, one finite, huge spread."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, v, generator=g, dtype=torch.float64) * 2
    x[1, v // 3:] = NEG_INF
    x[2] = NEG_INF
    x[3, 5] = float("nan")
    x[4] = torch.round(x[4])
    x[5] = NEG_INF
    x[5, v - 1] = 0.5
    x[6] = x[6] * 20
    x[7] = 0.25
    return x.float()
