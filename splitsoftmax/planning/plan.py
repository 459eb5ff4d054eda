"""``plan_attention``: every schedule and mesh shape that can run a layer on ``world`` ranks, simulated
on a profile's measured rates, ranked by predicted forward + backward time."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .model import load_profile
from .sim import Candidate, Problem, Result, Simulator

GIB = 2.0 ** 30


@dataclass
class Plan:
    """The planner's answer: the schedule, mesh (heads degree x sequence degree) and layout to use, and
    every candidate considered (best first) with its predicted times, bytes, memory and why it lost.
    Every time here is a prediction of the model, not a measurement."""
    schedule: str
    mesh: tuple
    layout: str
    candidates: list
    one_gpu_s: float
    profile: str
    world: int

    @property
    def best(self) -> Result:
        return self.candidates[0]

    def rank_groups(self) -> tuple[list, list]:
        """``(sequence_groups, heads_groups)``: the ranks of each group of the chosen mesh, as the
        contract lays a 2-D mesh out (dimension 0 sequence, dimension 1 heads: rank ``s * H + j``), so
        that a heads group is contiguous ranks. Build process groups (or a ``DeviceMesh`` of shape
        ``(seq_degree, heads_degree)``) from them."""
        hd, sd = self.mesh
        return ([[s * hd + j for s in range(sd)] for j in range(hd)],
                [[s * hd + j for j in range(hd)] for s in range(sd)])

    def table(self) -> str:
        """The ranking as text, one candidate a line."""
        head = (f"plan for {self.world} GPUs on profile {self.profile} (predictions of the model; one GPU's "
                f"fwd+bwd of the whole layer: {self.one_gpu_s * 1e3:.3f} ms; eff: its time over GPUs x time; "
                f"kshare: TFLOP/s per GPU over one GPU's kernel rate at the plan's per-GPU shapes; "
                f"'>': a lower bound)")
        cols = f"{'schedule':<16}{'mesh':>10} {'layout':<11}{'fwd ms':>10}{'bwd ms':>10}{'eff':>7}{'TF/GPU':>8}" \
               f"{'kshare':>7}{'intra GB':>10}{'inter GB':>10}{'peak GiB':>9}  why it lost"
        lines = [head, cols]
        for r in self.candidates:
            c = r.candidate
            at_least = ">" if r.bound else ""  # a lower bound: not simulated (it cannot win)
            fwd, bwd = (f"{at_least}{t * 1e3:.3f}" for t in (r.fwd_s, r.bwd_s))
            lines.append(f"{c.schedule:<16}{c.heads_degree:>5}x{c.seq_degree:<4} {c.layout:<11}"
                         f"{fwd:>10}{bwd:>10}{r.efficiency:>7.1%}"
                         f"{r.tflops_per_gpu:>8.0f}{r.kernel_share:>7.1%}"
                         f"{r.bytes['intra'] / 1e9:>10.3f}{r.bytes['inter'] / 1e9:>10.3f}{r.peak_bytes / GIB:>9.2f}  {r.why}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        def row(r: Result) -> dict:
            c = r.candidate
            return {"schedule": c.schedule, "mesh": [c.heads_degree, c.seq_degree], "layout": c.layout,
                    "fwd_ms": r.fwd_s * 1e3, "bwd_ms": r.bwd_s * 1e3, "efficiency": r.efficiency,
                    "tflops_per_gpu": r.tflops_per_gpu, "kernel_share": r.kernel_share, "bytes_intra": r.bytes["intra"], "bytes_inter": r.bytes["inter"],
                    "peak_gib": r.peak_bytes / GIB, "tile_efficiency": r.tile_efficiency, "lower_bound": r.bound,
                    "why": r.why}
        return {"world": self.world, "profile": self.profile, "schedule": self.schedule, "mesh": list(self.mesh),
                "layout": self.layout, "one_gpu_ms": self.one_gpu_s * 1e3, "prediction": True,
                "candidates": [row(r) for r in self.candidates]}


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def element_bytes(dtype) -> int:
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int) and size > 0:
        return size
    names = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float8_e4m3fn": 1}
    key = str(dtype).replace("torch.", "")
    if key not in names:
        raise ValueError(f"dtype must be a torch floating dtype, got {dtype!r}")
    return names[key]


def documents(seq_len, cu_seqlens, window_size, causal) -> tuple:
    """``(document lengths, layouts to weigh)`` from ``seq_len`` or ``cu_seqlens``. A window is modelled
    as documents of its reach (``2 * (left + 1)`` causal, ``left + right + 1`` otherwise: the same
    visible pairs a row, kept near the diagonal); on one windowed sequence only the contiguous layout
    is weighed (its slices keep that locality; zigzag under a window is not modelled)."""
    if (seq_len is None) == (cu_seqlens is None):
        raise ValueError(f"give exactly one of seq_len and cu_seqlens, got seq_len={seq_len!r}, "
                         f"cu_seqlens={'None' if cu_seqlens is None else 'given'}")
    if cu_seqlens is not None:
        cu = [int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
        if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] < 1:
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end above 0, got {cu[:8]}...")
        docs = tuple(b - a for a, b in zip(cu, cu[1:]) if b > a)
    else:
        docs = (_positive("seq_len", seq_len),)
    kinds = ["zigzag", "balanced", "contiguous"] if cu_seqlens is not None else \
        (["zigzag", "contiguous"] if causal else ["contiguous"])
    if window_size is None:
        return docs, kinds
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1, got {window_size!r}")
    if left == -1 or (right == -1 and not causal):
        return docs, kinds
    reach = 2 * (left + 1) if causal else left + max(right, 0) + 1
    out = []
    for d in docs:
        out += [reach] * (d // reach) + ([d % reach] if d % reach else [])
    return tuple(out), (kinds if cu_seqlens is not None else ["contiguous"])


def candidates(world: int, heads: int, layouts: list) -> list:
    """Every (schedule, layout, mesh) the planner weighs: 1-D ring and all-gather, 1-D heads, and
    ``heads+ring`` / ``heads+allgather`` for each heads degree dividing ``world`` up to ``heads``."""
    outs = []
    for lay in layouts:
        outs += [Candidate("ring", lay, 1, world), Candidate("allgather", lay, 1, world)]
        for hd in range(2, min(world, heads + 1)):
            if world % hd == 0:
                outs += [Candidate("heads+ring", lay, hd, world // hd), Candidate("heads+allgather", lay, hd, world // hd)]
    if world > 1:
        outs.append(Candidate("heads", "contiguous", world, 1))
    return outs


def _why(r: Result, best: Result, memory: float) -> str:
    if r is best:
        return "chosen"
    if r.peak_bytes > memory:
        return f"does not fit: {r.peak_bytes / GIB:.1f} GiB a rank"
    if r.bound:
        return f"not simulated: its lower bound is {r.total_s / best.total_s:.2f}x the plan's time"
    ratio = r.total_s / best.total_s
    exposed = r.total_s - r.compute_s - r.alltoall_s
    terms = {"all-to-all": r.alltoall_s, "transfers not hidden": exposed,
             "slowest rank's compute" + (f" (tiles {r.tile_efficiency:.0%} used)" if r.tile_efficiency < 0.8 else ""):
             r.compute_s - best.compute_s}
    name, value = max(terms.items(), key=lambda kv: kv[1])
    return f"{ratio:.2f}x the plan's time; most of the gap: {name} {max(value, 0) * 1e3:.2f} ms"


def rank(sim: Simulator, cands: list) -> tuple[list, float]:
    """Simulate ``cands`` and sort them best first (what fits before what does not), filling efficiency,
    TFLOP/s and why each lost. Every candidate is bounded first (no ring simulated); only those whose
    lower bound is below the best upper bound are simulated event by event, the rest stay bounds."""
    one = sim.one_gpu_s()
    memory = sim.prof.memory
    bounds = [sim.run(c, exact=False) for c in cands]
    fits = [b for b in bounds if b.peak_bytes <= memory] or bounds
    ceiling = min(b.upper_s for b in fits)
    results = [sim.run(b.candidate) if b.total_s <= ceiling * (1 + 1e-9) else b for b in bounds]
    for r in results:
        sim.score(r, one)
    results.sort(key=lambda r: (r.peak_bytes > memory, r.total_s, r.bound))
    for r in results:
        r.why = _why(r, results[0], memory)
    return results, one


def plan_attention(world, *, seq_len=None, cu_seqlens=None, heads, kv_heads, head_dim, causal=True,
                   window_size=None, dtype=torch.bfloat16, gpus_per_host=8, profile=None) -> Plan:
    """Choose how to shard one attention layer over ``world`` GPUs, by predicted time.

    ``seq_len`` (one sequence) or ``cu_seqlens`` (packed documents, ``(N+1,)``: a sequence or a
    tensor); ``heads``, ``kv_heads``, ``head_dim`` the layer's shapes (``heads % kv_heads == 0``);
    ``window_size`` as in ``ss.attention``; ``dtype`` of q/k/v; ``gpus_per_host``
    the GPUs joined by NVLink; ``profile`` a shipped name (``"h100"`` default, ``"h200"``), a JSON path
    (``python -m splitsoftmax calibrate --out FILE``), a dict or a :class:`~.model.Profile`.

    Returns a :class:`Plan`: ``schedule``, ``mesh`` ``(heads_degree, seq_degree)``, ``layout``, and
    ``candidates`` (best first), each with its predicted forward and backward time per layer, bytes
    sent per rank inside a host and across hosts, peak memory per rank, and why it lost. Every number
    is a prediction of the cost model (``splitsoftmax.planning``), not a measurement.
    """
    world, heads, kv_heads, head_dim = (_positive(n, v) for n, v in
                                        (("world", world), ("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)))
    gpus_per_host = _positive("gpus_per_host", gpus_per_host)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    docs, kinds = documents(seq_len, cu_seqlens, window_size, bool(causal))
    prof = load_profile(profile)
    pb = Problem(docs, bool(causal), heads, kv_heads, head_dim, element_bytes(dtype))
    sim = Simulator(pb, prof, gpus_per_host)
    results, one = rank(sim, candidates(world, heads, kinds))
    b = results[0].candidate
    return Plan(b.schedule, (b.heads_degree, b.seq_degree), b.layout, results, one, prof.name, world)

