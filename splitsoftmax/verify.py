"""``python -m splitsoftmax verify``: every op, forward and backward, against float64.

Each check computes splitsoftmax's result and gradient, the float64 reference, and the same
quantity through torch in the same dtype; the tolerance is FlashAttention's rule (twice torch's
own error, 4x for gradients) with a floor of a few ulps of the dtype. One table, non-zero exit on
any mismatch.
"""
from __future__ import annotations

import argparse
import math
import os
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
    seconds: Optional[float]  # forward + backward, on the forward's row

    @property
    def ok(self) -> bool:
        return self.err <= self.tol  # NaN fails

    def render(self) -> str:
        status = "ok" if self.ok else "MISMATCH"
        secs = "" if self.seconds is None else f"{self.seconds:.2f}s"
        return (f"{self.op:<46} {self.schedule:<10} {self.layout:<11} {self.err:>10.2e} "
                f"{self.tol:>10.2e} {secs:>8}  {status}")


HEADER = (f"{'operation':<46} {'schedule':<10} {'layout':<11} {'max err':>10} {'tolerance':>10} "
          f"{'fwd+bwd':>8}")


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
    return 4 * torch.finfo(dtype).eps


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
    ``peer`` (torch, one device, inputs' dtype), widened by ``1 + log2(merges)`` for sharded merges."""
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
    fl = floor(inputs[0].dtype)
    tol = widen * max(2 * rel_err(peer_out, want, skip_nan=True), fl)
    tol_g = widen * GRAD_FACTOR * max(max(rel_err(g, w, skip_nan=True) for g, w in zip(peer_grads, grads64)), fl)
    return [Row(f"{name} fwd", schedule, layout, rel_err(out, want), tol, secs),
            Row(f"{name} bwd", schedule, layout, max(rel_err(g, w) for g, w in zip(grads, grads64)), tol_g, None)]


def sdpa(causal: bool, groups: int):
    """torch's SDPA with the kv heads repeated for GQA (the peer in the tolerance rule)."""
    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=causal)
    return f


def single_device_rows(device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[Row]:
    """The single-device table of docs/API.md on odd sizes, with an all ``-inf`` row."""
    x = torch.randn(33, 1000, device=device, dtype=dtype) * 4
    x[3] = float("-inf")
    rows = []
    rows += compare("softmax 33x1000", F.softmax, lambda t: torch.softmax(t, -1), ref.softmax, [x])
    rows += compare("log_softmax 33x1000", F.log_softmax, lambda t: torch.log_softmax(t, -1), ref.log_softmax, [x])
    rows += compare("logsumexp 33x1000", F.logsumexp, lambda t: torch.logsumexp(t, -1), ref.logsumexp, [x])
    for causal in (False, True):
        q = torch.randn(2, 4, 97, 64, device=device, dtype=dtype)
        k = torch.randn(2, 2, 129, 64, device=device, dtype=dtype)
        v = torch.randn(2, 2, 129, 64, device=device, dtype=dtype)
        rows += compare(f"attention GQA 4/2 97x129{' causal' if causal else ''}",
                        lambda q, k, v, c=causal: F.attention(q, k, v, causal=c), sdpa(causal, 2),
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
    parser.add_argument("--nproc", type=int, default=None,
                        help="launch this many local ranks (Gloo on CPU, NCCL with a GPU per rank); default: "
                             "one per GPU when there are several, else 4 CPU ranks")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--deadline", type=float, default=1800.0, help="seconds before --nproc ranks are stopped")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="cpu: CPU ranks (Gloo) even with GPUs; cuda: ranks on GPUs (under mpirun even when "
                             "they share one); default: cuda when every rank has its own GPU, else cpu")
    ns = parser.parse_args(argv)
    if ns.nproc is not None and ns.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {ns.nproc}")
    if ns.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False)")
    from . import launcher
    kind = launcher.launched_by()
    if kind is None:
        device = ["--device", ns.device] if ns.device else []
        return launcher.spawn(ns.nproc or launcher.default_nproc(), ["verify", "--dtype", ns.dtype, *device],
                              ns.deadline)
    return _verify_ranks(kind, getattr(torch, ns.dtype), ns.device)


def _verify_ranks(kind: str, dtype: torch.dtype, device: Optional[str]) -> int:
    """One rank of a job: single-device rows on its device, then the sharded rows; rank 0 prints."""
    from . import launcher
    from .verify_sharded import Job, sharded_rows
    group, device, rank, world = launcher.init_ranks(kind, device)
    job = Job(group, device, rank, world, dtype)
    quiet = open(os.devnull, "w") if rank else sys.stdout
    try:
        return run_table(lambda: single_device_rows(str(device), dtype) + sharded_rows(job), stream=quiet)
    finally:
        launcher.finish_ranks(kind)
