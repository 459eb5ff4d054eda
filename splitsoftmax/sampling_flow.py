"""The sequence of passes of one draw and of one top-k, local or across the ranks of a group.

A pass runs on this rank's slice (``kernels.sampling`` Triton kernels, or the torch twin
``kernels.sampling_cpu``), its small per-row records are exchanged in one all-gather (with the
configuration's fingerprint, so ranks that disagree fail together) and merged identically on every
rank by ``sampling_rows``. On one device (``comm`` None) nothing is exchanged and, for CUDA tensors,
nothing is read back to the host: passes with no row to serve return at once on the device, so a
draw can be captured in a CUDA graph.

Passes and exchanges: greedy and top-k (no tie at the cut-off beyond the records) one each; plain
sampling one; min-p and top-p one more each while the records do not hold every kept token, and
top-p one per refinement of a crowded bracket.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import sampling_rows as rows
from .distributed.comm import Communicator
from .distributed.session import Guard
from .distributed.tree import allgather
from .kernels import configs, sampling_cpu
from .local import use_triton
from .sampling_rows import COLLECT, MASS, REFINE, THRESH, Spec


def ops_for(x: Tensor):
    """The passes for tensors like ``x``: Triton kernels or the torch twin."""
    if use_triton(x):
        from .kernels import sampling
        return sampling
    return sampling_cpu


class Exchange:
    """All-gathers of per-row int64 records over ``comm`` (None: one device, no exchange), each
    carrying ``guard``'s fingerprint; ``sync``: whether mode tests may read the device (not on one
    CUDA device)."""

    def __init__(self, comm: Optional[Communicator], guard: Optional[Guard], step: str, device: torch.device):
        self.comm, self.guard, self.step = comm, guard, step
        self.sync = comm is not None or device.type == "cpu"

    def gather(self, *parts: Tensor) -> list[Tensor]:
        """``parts`` ``(N, F_i)`` int64 of this rank: the same of every rank, ``(N, P, F_i)``."""
        if self.comm is None:
            return [p.unsqueeze(1) for p in parts]
        n = parts[0].shape[0]
        widths = [p.shape[1] for p in parts]
        flat = torch.cat([p.reshape(-1) for p in parts] + [parts[0].new_tensor([self.guard.fingerprint])])
        got = allgather(self.comm, flat, self.step)  # [P, total + 1]
        self.guard.check(got[:, -1].tolist(), flat.numel(), flat.device)
        out, start = [], 0
        for w in widths:
            out.append(got[:, start:start + n * w].reshape(got.shape[0], n, w).transpose(0, 1))
            start += n * w
        return out

    def any(self, plan_mode: Tensor, *modes: int) -> bool:
        """Whether a row is in one of ``modes`` (True without looking when reading would sync)."""
        if not self.sync:
            return True
        return bool(torch.isin(plan_mode, torch.tensor(modes, device=plan_mode.device)).any())


def _f64(t: Tensor) -> Tensor:
    return t.view(torch.int64)


def gathered_records(ex: Exchange, x: Tensor, col0: int, kr: int, k_tie: int, large: bool):
    """Every rank's records ``(N, P, kr)`` (values float64, ids) and tie counts ``(N, P)``."""
    ops = sampling_cpu if large else ops_for(x)
    vals, ids, ties = ops.records(x, col0, kr, k_tie)
    gv, gi, gt = ex.gather(_f64(vals.contiguous()), ids, ties.unsqueeze(1))
    return gv.view(torch.float64), gi, gt[:, :, 0]


def top_records(ex: Exchange, x: Tensor, col0: int, k: int) -> tuple[Tensor, Tensor]:
    """The global top-``k`` ``(values float64, ids)`` ``(N, k)``."""
    large = configs.next_pow2(k) > configs.SAMPLE_RECORDS_MAX
    kr = k if large else configs.next_pow2(k)
    vals, ids, _ = gathered_records(ex, x, col0, kr, 0, large)
    n = x.shape[0]
    return rows.merge_records(vals.reshape(n, -1), ids.reshape(n, -1), k)


def _large_top_k(ex: Exchange, x: Tensor, col0: int, spec: Spec) -> Optional[Tensor]:
    """The threshold of a top-k too large for the records, ``(N,)`` float64, or None."""
    if not spec.top_k or spec.top_k < spec.kr:
        return None
    vals, _ = top_records(ex, x, col0, spec.top_k)
    return vals[:, -1]


def _mass_rounds(ex: Exchange, ops, x: Tensor, col0: int, plan, spec: Spec, vals, ids, seed, offset):
    """MASS and REFINE rows: the first histogram, then refinements until each bracket is listable."""
    if not ex.any(plan.mode, MASS):
        return plan
    consts = (spec.c, spec.shift, spec.bins, spec.span)
    z, hist = ops.mass(x, col0, plan, *consts)
    gz, gh = ex.gather(z.unsqueeze(1), hist)
    plan = rows.after_mass(plan, gz.sum(dim=1)[:, 0], gh.sum(dim=1), vals, ids, spec, seed, offset)
    rounds = configs.sample_refine_rounds(spec.bins)
    for _ in range(rounds):
        if not ex.any(plan.mode, REFINE):
            break
        above, hist, hmass = ops.refine(x, col0, plan, *consts)
        ga, gh, gm = ex.gather(above.unsqueeze(1), hist, hmass)
        plan = rows.after_refine(plan, ga.sum(dim=1)[:, 0], gh.sum(dim=1), gm.sum(dim=1), spec)
    if ex.sync and bool((plan.mode == REFINE).any()):
        raise RuntimeError(f"sharded_sample: a top-p bracket did not narrow within {rounds} refinements")
    return plan


def draw(ex: Exchange, x: Tensor, col0: int, spec: Spec, seed: Tensor, offset: Tensor, plain: bool) -> Tensor:
    """The tokens ``(N,)`` int64 (global ids, -1 for rows with nothing to draw) of one draw."""
    ops = ops_for(x)
    n = x.shape[0]
    if plain:
        plan = rows.plain_plan(n, x.device)
    else:
        xk = _large_top_k(ex, x, col0, spec)
        vq, iq, tq = gathered_records(ex, x, col0, spec.kr, spec.top_k, False)
        plan, vals, ids = rows.after_records(vq, iq, tq, spec, xk, seed, offset)
        if spec.greedy:
            return plan.token
        plan = _mass_rounds(ex, ops, x, col0, plan, spec, vals, ids, seed, offset)
    if not ex.any(plan.mode, THRESH, COLLECT):
        return plan.token
    cap = _cap(ex, plan, spec)
    best, above, cd, ck, _ = ops.sample(x, col0, plan, seed, offset, spec.c, spec.shift, spec.bins, spec.span, cap)
    gb, ga, gd, gk = ex.gather(best.unsqueeze(1), above.unsqueeze(1), _f64(cd.double()), ck)
    return rows.after_sample(plan, gb.amax(dim=1)[:, 0], ga.sum(dim=1)[:, 0], gd.view(torch.float64).reshape(n, -1)
                             .float(), gk.reshape(n, -1), spec)


def _cap(ex: Exchange, plan, spec: Spec) -> int:
    """Candidate slots per row: ``cap`` on one CUDA device, else as many as the fullest bracket needs."""
    if not ex.sync:
        return spec.cap
    counts = plan.count[plan.mode == COLLECT]
    return int(counts.max()) if counts.numel() else 0
