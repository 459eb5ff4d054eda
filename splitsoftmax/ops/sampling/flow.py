"""The sequence of passes of one draw and of one top-k, across the ranks of a group or on the torch path.

A pass runs on this rank's slice (``ops.sampling.kernel`` Triton kernels, or the torch twin
``ops.sampling.torch``), its small per-row records are exchanged in one all-gather (with the
configuration's fingerprint, so ranks that disagree fail together) and merged identically on every
rank by ``sampling_rows``. On one device (``comm`` None) nothing is exchanged; a Triton draw on one
device is ``ops.sampling.device``'s (fused passes, nothing read back), a top-k reads nothing
back either.

Passes and exchanges: greedy and top-k (no tie at the cut-off beyond the records) one each; plain
sampling one; min-p and top-p one more each while the records do not hold every kept token, and
top-p one per refinement of a crowded bracket.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...distributed.comm import Communicator
from ...distributed.session import Guard
from ...distributed.tree import allgather
from .._triton import configs
from . import torch as sampling_cpu
from .._registry import use_triton
from .rows import COLLECT, MASS, REFINE, THRESH, Spec


def ops_for(x: Tensor):
    """The passes for tensors like ``x``: Triton kernels or the torch twin."""
    if use_triton(x):
        from . import kernel as sampling
        return sampling
    return sampling_cpu


class Exchange:
    """All-gathers of per-row partial records over ``comm`` (None: one device, no exchange), each
    carrying ``guard``'s fingerprint; ``sync``: whether mode tests may read the device (not on one
    CUDA device)."""

    def __init__(self, comm: Optional[Communicator], guard: Optional[Guard], step: str, device: torch.device):
        self.comm, self.guard, self.step = comm, guard, step
        self.sync = comm is not None or device.type == "cpu"

    def gather(self, parts: tuple) -> tuple:
        """Partials ``(N, Q, *rest)`` (int64, float64, int32 or float32) of this rank: those of every
        rank, concatenated along ``Q`` in rank order ``(N, P * Q, *rest)``."""
        if self.comm is None:
            return parts
        words = [_as_words(p) for p in parts]
        flat = torch.cat([w.reshape(-1) for w in words] + [words[0].new_tensor([self.guard.fingerprint])])
        got = allgather(self.comm, flat, self.step)  # [P, total + 1]
        self.guard.check(got[:, -1].tolist(), flat.numel(), flat.device)
        out, start = [], 0
        for p, w in zip(parts, words):
            block = got[:, start:start + w.numel()].reshape(got.shape[0], *w.shape).transpose(0, 1)
            out.append(_from_words(block.flatten(1, 2), p.dtype))
            start += w.numel()
        return tuple(out)

    def any(self, plan_mode: Tensor, *modes: int) -> bool:
        """Whether a row is in one of ``modes`` (True without looking when reading would sync)."""
        if not self.sync:
            return True
        return bool(torch.isin(plan_mode, torch.tensor(modes, device=plan_mode.device)).any())


def local(ex: Exchange, ops, kind: str, parts: tuple) -> tuple:
    """Before an exchange, this rank's partials reduced to one per row (records merged, counts and
    masses summed, best keys maxed), so that an exchange carries per-rank records only."""
    if ex.comm is None:
        return parts
    if kind == "records":
        return ops.local_merge(parts)
    if kind == "sample":
        best, above, *candidates = parts
        return (best.amax(dim=1, keepdim=True), above.sum(dim=1, keepdim=True), *candidates)
    return tuple(p.sum(dim=1, keepdim=True, dtype=torch.int64) for p in parts)


def _as_words(t: Tensor) -> Tensor:
    if t.dtype in (torch.float64, torch.int64):
        return t.contiguous().view(torch.int64)
    return (t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t).to(torch.int64)


def _from_words(t: Tensor, dtype: torch.dtype) -> Tensor:
    if dtype in (torch.float64, torch.int64):
        return t.contiguous().view(dtype)
    t = t.to(torch.int32)
    return t.view(torch.float32) if dtype == torch.float32 else t


def top_records(ex: Exchange, x: Tensor, col0: int, k: int) -> tuple[Tensor, Tensor]:
    """The global top-``k`` ``(values float64, ids)`` ``(N, k)``; a ``k`` above the records' limit
    takes the torch path's sort."""
    large = configs.next_pow2(k) > configs.SAMPLE_RECORDS_MAX
    ops = sampling_cpu if large else ops_for(x)
    kr = k if large else configs.next_pow2(k)
    return ops.merge_top(ex.gather(local(ex, ops, "records", ops.records(x, col0, kr, 0))), k)


def large_top_k(ex: Exchange, x: Tensor, col0: int, spec: Spec) -> Optional[Tensor]:
    """The threshold of a top-k too large for the records, ``(N,)`` float64, or None."""
    if not spec.top_k or spec.top_k < spec.kr:
        return None
    vals, _ = top_records(ex, x, col0, spec.top_k)
    return vals[:, -1].contiguous()


def _mass_rounds(ex: Exchange, ops, x: Tensor, col0: int, plan, recs, spec: Spec, seed, offset):
    """MASS and REFINE rows: the first histogram, then refinements until each bracket is listable.
    Needed only by top-p without a top-k the records hold."""
    if spec.top_p >= 1.0 or (spec.top_k and spec.top_k < spec.kr) or not ex.any(plan.mode, MASS):
        return plan
    consts = (spec.c, spec.shift, spec.bins, spec.span)
    plan = ops.after_mass(plan, ex.gather(local(ex, ops, "mass", ops.mass(x, col0, plan, *consts))), recs, spec,
                          seed, offset)
    rounds = configs.sample_refine_rounds(spec.bins)
    for _ in range(rounds):
        if not ex.any(plan.mode, REFINE):
            break
        plan = ops.after_refine(plan, ex.gather(local(ex, ops, "refine", ops.refine(x, col0, plan, *consts))), spec)
    if bool((plan.mode == REFINE).any()):
        raise RuntimeError(f"sharded_sample: a top-p bracket did not narrow within {rounds} refinements")
    return plan


def draw(ex: Exchange, x: Tensor, col0: int, spec: Spec, seed: Tensor, offset: Tensor, plain: bool) -> Tensor:
    """The tokens ``(N,)`` int64 (global ids, -1 for rows with nothing to draw) of one draw."""
    ops = ops_for(x)
    ex.sync = ex.sync or ops is sampling_cpu     # the torch path (float64 on CUDA too) may read the device
    if plain:
        plan = ops.plain_plan(x.shape[0], x.device)
    else:
        xk = large_top_k(ex, x, col0, spec)
        parts = ex.gather(local(ex, ops, "records", ops.records(x, col0, spec.kr, spec.top_k)))
        plan, recs = ops.after_records(parts, spec, xk, seed, offset)
        if spec.greedy:
            return plan.token
        plan = _mass_rounds(ex, ops, x, col0, plan, recs, spec, seed, offset)
    if not ex.any(plan.mode, THRESH, COLLECT):
        return plan.token
    parts = ops.sample(x, col0, plan, seed, offset, spec.c, spec.shift, spec.bins, spec.span, _cap(ex, plan, spec))
    return ops.after_sample(plan, ex.gather(local(ex, ops, "sample", parts)), spec)


def _cap(ex: Exchange, plan, spec: Spec) -> int:
    """Candidate slots per row: none unless top-p brackets can occur, ``cap`` on one CUDA device,
    else as many as the fullest bracket needs."""
    if spec.top_p >= 1.0 or (spec.top_k and spec.top_k < spec.kr):
        return 0
    if not ex.sync:
        return spec.cap
    counts = plan.count[plan.mode == COLLECT]
    return int(counts.max()) if counts.numel() else 0
