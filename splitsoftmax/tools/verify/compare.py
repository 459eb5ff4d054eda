"""One check of an op against float64, the rule ``verify`` and ``bench ring`` share.

:func:`compare` computes splitsoftmax's result and gradient, the float64 reference, and the same
quantity through torch in the same dtype (the peer); the tolerance is FlashAttention's rule: twice
the peer's own error (4x for gradients) plus a floor relative to the result's size (:func:`floor`:
twice the rounding of the float64 truth to the result's dtype and a few ulps of the float32
statistics), widened for sharded merges. Each check gives :class:`Row` lines of the verify table
(:func:`table`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ...core.state import stat_dtype

GRAD_FACTOR = 4.0


@dataclass
class Row:
    """One line of the verify table."""

    op: str
    schedule: str
    layout: str
    err: float
    tol: float
    seconds: Optional[float]  # forward + backward, on the forward's row

    @property
    def ok(self) -> bool:
        return self.err <= self.tol  # NaN fails

    def render(self, width: int = 46) -> str:
        """The table line, the operation padded to ``width`` characters."""
        status = "ok" if self.ok else "MISMATCH"
        secs = "" if self.seconds is None else f"{self.seconds:.2f}s"
        return (f"{self.op:<{width}} {self.schedule:<10} {self.layout:<11} {self.err:>10.2e} "
                f"{self.tol:>10.2e} {secs:>8}  {status}")


def table(rows: Sequence[Row]) -> str:
    """The header and one line per row, the operation column as wide as the longest name."""
    width = max([len("operation"), *(len(r.op) for r in rows)])
    header = (f"{'operation':<{width}} {'schedule':<10} {'layout':<11} {'max err':>10} {'tolerance':>10} "
              f"{'fwd+bwd':>8}")
    return "\n".join([header, *(r.render(width) for r in rows)])


def rel_err(x: Tensor, want: Tensor, *, skip_nan: bool = False) -> float:
    """max |x - want| / max(1, max |want|); equal infinities count as exact.

    NaN in ``x`` gives NaN (a failure) unless ``skip_nan`` (used for the peer's error only,
    e.g. torch's NaN on an all ``-inf`` row, which splitsoftmax defines as 0).
    """
    x, want = x.double(), want.double()
    both_inf = torch.isinf(want) & (x == want)
    d = torch.where(both_inf, 0.0, (x - want).abs())
    if skip_nan:
        d = torch.nan_to_num(d, nan=0.0)
    scale = max(1.0, want[torch.isfinite(want)].abs().max().item()) if torch.isfinite(want).any() else 1.0
    return (d.max().item() if d.numel() else 0.0) / scale


def floor(want: Tensor, dtype: torch.dtype) -> float:
    """The least tolerance of a result in ``dtype`` against the float64 ``want``, as :func:`rel_err`
    measures it: twice the error of rounding ``want`` once to ``dtype`` (FlashAttention's ``atol``),
    plus 4 ulps, at ``want``'s largest finite entries, of the statistics' dtype (float32 below
    float64: the row maxima, sums and merges the result passes through). Both scale with the result."""
    finite = want[torch.isfinite(want)].abs()
    size = finite.max().item() if finite.numel() else 0.0
    return 2 * rel_err(want.to(dtype), want) + 4 * torch.finfo(stat_dtype(dtype)).eps * min(1.0, size)


@dataclass
class Sharding:
    """How each input becomes this rank's leaf, and how local results become full tensors again."""

    split_in: Sequence[Callable[[Tensor], Tensor]]
    gather_in: Sequence[Callable[[Tensor], Tensor]]
    split_out: Callable[[Tensor], Tensor]
    gather_out: Callable[[Tensor], Tensor]


def unsharded(n: int) -> Sharding:
    ident = [lambda t: t] * n
    return Sharding(ident, ident, lambda t: t, lambda t: t)


def evaluate(fn: Callable, inputs: Sequence[Tensor], proj: Tensor, sh: Sharding) -> tuple[Tensor, list[Tensor]]:
    """Forward ``fn`` on the leaves, backward of ``<out, proj>``; full output and full gradients."""
    leaves = [split(x).detach().requires_grad_(True) for split, x in zip(sh.split_in, inputs)]
    out = fn(*leaves)
    loss = (torch.nan_to_num(out.double(), neginf=0.0, posinf=0.0) * sh.split_out(proj)).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    return sh.gather_out(out.detach()), [gather(g) for gather, g in zip(sh.gather_in, grads)]


def compare(name: str, fn: Callable, peer: Callable, oracle: Callable, inputs: Sequence[Tensor], *,
            sharding: Optional[Sharding] = None, schedule: str = "local", layout: str = "-",
            seed: int = 0, merges: int = 1) -> list[Row]:
    """Rows for ``fn`` forward and backward against ``oracle`` in float64; the tolerance is from
    ``peer`` (torch, one device, inputs' dtype) and :func:`floor`, widened by ``1 + log2(merges)``
    for sharded merges."""
    want = oracle(*[x.double() for x in inputs])
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(want.shape, generator=gen, dtype=torch.float64).to(want.device)
    proj = torch.where(torch.isfinite(want), proj, 0.0)
    t0 = time.perf_counter()
    out, grads = evaluate(fn, inputs, proj, sharding or unsharded(len(inputs)))
    secs = time.perf_counter() - t0
    want, grads64 = evaluate(oracle, [x.double() for x in inputs], proj, unsharded(len(inputs)))
    peer_out, peer_grads = evaluate(peer, inputs, proj, unsharded(len(inputs)))
    widen = 1.0 + math.log2(max(merges, 1))
    tol = widen * (2 * rel_err(peer_out, want, skip_nan=True) + floor(want, out.dtype))
    tol_g = widen * max(GRAD_FACTOR * rel_err(p, w, skip_nan=True) + floor(w, g.dtype)
                        for p, g, w in zip(peer_grads, grads, grads64))
    return [Row(f"{name} fwd", schedule, layout, rel_err(out, want), tol, secs),
            Row(f"{name} bwd", schedule, layout, max(rel_err(g, w) for g, w in zip(grads, grads64)), tol_g, None)]


def sdpa(causal: bool, groups: int):
    """torch's SDPA with the kv heads repeated for GQA (the peer in the tolerance rule)."""
    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=causal)
    return f
