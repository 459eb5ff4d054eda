"""``python -m splitsoftmax verify``: every op, forward and backward, against float64.

Each check computes splitsoftmax's result and gradient, the float64 reference, and the same
quantity through torch in the same dtype; the tolerance is FlashAttention's rule (twice torch's
own error, 4x for gradients) with a floor of a few ulps of the dtype. One table, non-zero exit on
any mismatch.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from . import functional as F
from . import reference as ref

GRAD_FACTOR = 4.0


@dataclass
class Row:
    """One line of the verify table."""

    op: str
    schedule: str
    layout: str
    err: float
    tol: float
    seconds: float

    @property
    def ok(self) -> bool:
        return self.err <= self.tol  # NaN fails

    def render(self) -> str:
        status = "ok" if self.ok else "MISMATCH"
        return (f"{self.op:<34} {self.schedule:<10} {self.layout:<11} {self.err:>10.2e} "
                f"{self.tol:>10.2e} {self.seconds:>7.2f}s  {status}")


HEADER = f"{'operation':<34} {'schedule':<10} {'layout':<11} {'max err':>10} {'tolerance':>10} {'time':>8}"


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


def floor(dtype: torch.dtype) -> float:
    """A few ulps of ``dtype`` at 1: the least tolerance any check gets."""
    return 8 * torch.finfo(dtype).eps


def grad_check(name: str, fn: Callable, torch_fn: Callable, ref_fn: Callable, inputs: Sequence[Tensor],
               schedule: str = "local", layout: str = "-") -> list[Row]:
    """Compare ``fn`` (forward, then gradients of a random projection) with ``ref_fn`` in float64,
    tolerances from ``torch_fn`` in the inputs' dtype."""
    t0 = time.perf_counter()
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    leaves64 = [x.detach().double().requires_grad_(True) for x in inputs]
    leaves_t = [x.detach().requires_grad_(True) for x in inputs]
    out, want, peer = fn(*leaves), ref_fn(*leaves64), torch_fn(*leaves_t)
    proj = torch.randn(want.shape, dtype=torch.float64)
    proj = torch.where(torch.isfinite(want), proj, 0.0)
    grads = torch.autograd.grad((torch.nan_to_num(out.double(), neginf=0.0) * proj).sum(), leaves)
    grads64 = torch.autograd.grad((torch.nan_to_num(want, neginf=0.0) * proj).sum(), leaves64)
    grads_t = torch.autograd.grad((torch.nan_to_num(peer.double(), neginf=0.0) * proj).sum(), leaves_t)
    fl = floor(inputs[0].dtype)
    secs = time.perf_counter() - t0
    rows = [Row(f"{name} fwd", schedule, layout, rel_err(out, want), max(2 * rel_err(peer, want, skip_nan=True), fl), secs)]
    err_g = max(rel_err(g, w) for g, w in zip(grads, grads64))
    tol_g = max(GRAD_FACTOR * max(rel_err(g, w, skip_nan=True) for g, w in zip(grads_t, grads64)), GRAD_FACTOR * fl)
    rows.append(Row(f"{name} bwd", schedule, layout, err_g, tol_g, 0.0))
    return rows


def _sdpa(causal: bool, groups: int):
    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=causal)
    return f


def single_device_rows(device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[Row]:
    """The single-device table of CONTRACT.md on odd sizes, with an all ``-inf`` row."""
    x = torch.randn(33, 1000, device=device, dtype=dtype) * 4
    x[3] = float("-inf")
    rows = []
    rows += grad_check("softmax 33x1000", F.softmax, lambda t: torch.softmax(t, -1),
                       ref.softmax, [x])
    rows += grad_check("log_softmax 33x1000", F.log_softmax, lambda t: torch.log_softmax(t, -1), ref.log_softmax, [x])
    rows += grad_check("logsumexp 33x1000", F.logsumexp, lambda t: torch.logsumexp(t, -1), ref.logsumexp, [x])
    for causal in (False, True):
        q = torch.randn(2, 4, 97, 64, device=device, dtype=dtype)
        k = torch.randn(2, 2, 129, 64, device=device, dtype=dtype)
        v = torch.randn(2, 2, 129, 64, device=device, dtype=dtype)
        rows += grad_check(f"attention GQA 4/2 97x129{' causal' if causal else ''}",
                           lambda q, k, v, c=causal: F.attention(q, k, v, causal=c), _sdpa(causal, 2),
                           lambda q, k, v, c=causal: ref.attention(q, k, v, causal=c)[0], [q, k, v])
    return rows


def run_table(rows_fn: Callable[[], list[Row]], stream=sys.stdout) -> int:
    rows = rows_fn()
    print(HEADER, file=stream)
    for r in rows:
        print(r.render(), file=stream)
    bad = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} checks passed", file=stream)
    return 1 if bad else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="splitsoftmax verify", description=__doc__)
    parser.add_argument("--nproc", type=int, default=None, help="launch this many ranks locally")
    parser.parse_args(argv)
    return run_table(single_device_rows)
