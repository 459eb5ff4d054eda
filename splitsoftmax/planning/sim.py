"""An event simulator of one attention layer's forward and backward under a schedule and placement.

The mesh is ``heads_degree x seq_degree`` ranks; a heads group is ``heads_degree`` contiguous ranks
(inside a host when it fits), a sequence group the ranks ``s * heads_degree + j``. Each rank has a
compute stream and a transfer stream:

- all-to-all (heads groups): q, k, v from sequence shards to head subsets before, the output (with
  its lse) back after; backward dO (with the rows' lse and delta) before, dq and dk/dv after (dk/dv in
  float32 where a kv head is read by several ranks: their sums). Query heads are split like
  ``torch.tensor_split``, a rank receiving the kv heads its query heads read. Where the group spans
  hosts and each kv head's readers share one (:func:`relay_readers`), K/V take two hops as the
  schedule sends them: each shard to one reader, passed on among the readers inside the host; their
  float32 dK/dV summed there, then sent home once in the inputs' dtype. The all-to-alls do not
  overlap the ring (an implementation that starts the first ring step before the whole all-to-all
  is done is faster than predicted).
- ring (sequence groups): step 0 computes a rank's own keys; a step's K/V block travels to the next
  rank while the step computes (two receive buffers: a block may arrive only once the step two
  before has finished); backward, K/V travel the same way and each block's dK/dV sums (the profile's
  ``grad_bytes`` an element: float32 here, the inputs' dtype in other rings) follow it
  once the sender has added its share, and go home after the last step. Steps empty on every rank
  are skipped. Every rank of a sequence group is simulated (numpy over ranks); the heads group's
  rank with the most heads stands for the others (they wait for it at the all-to-all).
- all-gather: K/V gathered (ring all-gather over the group's slowest link), then the ring's steps'
  launches back to back, one rank's keys at a time (the schedule visits the gathered buffers as the
  ring does, ``ops/attention/schedules/allgather.py``); backward: K/V gathered again (the forward
  keeps none of them), the steps, then a reduce-scatter of float32 dK/dV. Nothing overlaps.

Launches of a sequence group of more than one rank merge into a running state: they run at the
profile's ``step_rate`` (``model.py``).

Times are seconds. The slowest rank sets a pass's time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..distributed.layout import head_split as rank_heads, kv_shared, relay_groups
from .model import Profile, Work
from .work import full_sequence, split

SCHEDULES = ("ring", "allgather", "heads", "heads+ring", "heads+allgather")


@dataclass(frozen=True)
class Problem:
    """One attention layer: ``docs`` (document lengths; one when nothing is packed), heads, dtype bytes."""
    docs: tuple
    causal: bool
    heads: int
    kv_heads: int
    head_dim: int
    elem: int = 2

    @property
    def seq(self) -> int:
        return sum(self.docs)

    def flops(self) -> float:
        """Forward FLOPs of the visible pairs, ``4 * D * pairs * H``."""
        pairs = sum(d * (d + 1) / 2 if self.causal else d * d for d in self.docs)
        return 4.0 * self.head_dim * self.heads * pairs


@dataclass(frozen=True)
class Candidate:
    schedule: str
    layout: str
    heads_degree: int
    seq_degree: int

    @property
    def world(self) -> int:
        return self.heads_degree * self.seq_degree

    def label(self) -> str:
        return f"{self.schedule} {self.heads_degree}x{self.seq_degree} {self.layout}"


@dataclass
class Result:
    """Predicted times (s), bytes sent per rank by link class, peak memory per rank (bytes)."""
    candidate: Candidate
    fwd_s: float
    bwd_s: float
    bytes: dict
    peak_bytes: float
    compute_s: float
    alltoall_s: float
    tile_efficiency: float
    efficiency: float = 0.0
    tflops_per_gpu: float = 0.0
    why: str = ""
    bound: bool = False
    upper_s: float = 0.0
    rank_flops: float = 0.0
    parts: dict = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def kernel_share(self) -> float:
        """TFLOP/s per GPU over one GPU's kernel rate at this plan's per-GPU shapes (the busiest rank's
        pieces, its launches back to back): what transfers, imbalance and idle ranks leave of it."""
        return self.tflops_per_gpu * 1e12 * self.compute_s / (3.5 * self.rank_flops) if self.rank_flops else 0.0


def head_split(heads: int, kv_heads: int, degree: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Query heads and kv heads per rank of a heads group (the heads schedule's split,
    ``layout.head_split``), and whether some kv head is read by more than one rank."""
    split = rank_heads(heads, kv_heads, degree)
    return np.array([s.nq for s in split]), np.array([s.nkv for s in split]), kv_shared(split, kv_heads)


def relay_readers(heads: int, kv_heads: int, degree: int, gpus_per_host: int) -> int:
    """The readers of a kv head where the heads schedule sends K/V in two hops (its
    ``relay_groups``, for a heads group of ``degree`` ranks from a host's first), else 0."""
    groups = relay_groups(rank_heads(heads, kv_heads, degree), kv_heads,
                          tuple(r // gpus_per_host for r in range(degree)))
    return max(len(g) for g in groups) if groups else 0


def _hop_inter(cand: Candidate, gpus_per_host: int) -> np.ndarray:
    """Per sequence rank: whether the ring hop into it crosses hosts (heads rank 0's group)."""
    s = np.arange(cand.seq_degree)
    host = s * cand.heads_degree // gpus_per_host
    return host != np.roll(host, 1)


def _ring(c0: np.ndarray, steps: list, at, x: np.ndarray, dx=None, log=None) -> np.ndarray:
    """Finish time per rank of a ring: own step ``c0``, then for each ``t`` of ``steps`` the step time
    ``at(t)`` (arrays over ranks), a block reaching rank ``r`` in ``x[r]``. With ``dx`` (backward) each
    block's float32 dK/dV follow it on the same link once the sender's step is done, and go home
    after the last step. ``log`` (a list) receives ``(t, block arrives, step starts, step ends, dK/dV
    arrive)`` per step, arrays over ranks."""
    cend, cend2 = c0.copy(), np.zeros_like(c0)
    recv, avail, drecv = np.zeros_like(c0), np.zeros_like(c0), np.zeros_like(c0)
    for t in steps:
        recv = np.maximum(np.maximum(np.roll(avail, 1), cend2), np.maximum(recv, drecv)) + x
        start = np.maximum(cend, recv)
        done = start + at(t)
        if dx is not None:
            drecv = np.maximum(np.roll(cend, 1), recv) + dx
            done = np.maximum(done, drecv)
        if log is not None:
            log.append((t, recv, start, done, drecv if dx is not None else None))
        cend2, cend, avail = cend, done, recv
    if dx is not None and steps:
        cend = np.maximum(np.roll(cend, 1) + dx, cend)
    return cend


def _event(events: list, pas: str, what: str, step, start: float, end: float) -> float:
    events.append({"pass": pas, "event": what, "step": step, "start_ms": 1e3 * float(start), "end_ms": 1e3 * float(end)})
    return float(end)


class Simulator:
    """Simulates candidates of one problem on one profile (work splits are cached per layout and degree).
    ``relay``: K/V take two hops where they can, as this package's heads schedule sends them (off: one
    copy to each reader, as DeepSpeed's Ulysses and USP send them)."""

    def __init__(self, problem: Problem, profile: Profile, gpus_per_host: int = 8, relay: bool = True):
        self.pb, self.prof, self.g, self.relay = problem, profile, int(gpus_per_host), bool(relay)
        self._splits: dict = {}
        self._costs: dict = {}

    def split(self, layout: str, p: int):
        key = (layout, p)
        if key not in self._splits:
            self._splits[key] = split(layout, p, self.pb.docs, self.pb.causal, self.prof.tiles)
        return self._splits[key]

    def one_gpu_parts(self) -> tuple[float, float]:
        """One GPU's (forward, backward) seconds of the whole layer, host time of a call included."""
        w = full_sequence(self.pb.docs, self.pb.causal, self.prof.tiles)
        k, pb = self.prof, self.pb
        return (float(k.kernel_s(w, pb.heads, pb.head_dim, "fwd")) + k.overhead_s("call_us", "fwd"),
                float(k.kernel_s(w, pb.heads, pb.head_dim, "bwd")) + k.overhead_s("call_us", "bwd"))

    def one_gpu_s(self) -> float:
        """One GPU's forward + backward of the whole layer (the reference of the efficiency)."""
        return sum(self.one_gpu_parts())

    def score(self, r: Result, one_gpu_s: float) -> Result:
        """Fill ``r``'s efficiency (one GPU's time over ``world`` x its time) and TFLOP/s per GPU."""
        world = r.candidate.world
        r.efficiency = one_gpu_s / (world * r.total_s)
        r.tflops_per_gpu = 3.5 * self.pb.flops() / (world * r.total_s) / 1e12
        return r

    def run(self, cand: Candidate, exact: bool = True) -> Result:
        """Simulate ``cand``. With ``exact=False`` the ring is bounded instead of simulated: the Result's
        times are lower bounds (``bound`` set) and ``upper_s`` an upper bound of their sum."""
        pb, prof = self.pb, self.prof
        sizes, kv, replicated = head_split(pb.heads, pb.kv_heads, cand.heads_degree)
        h, k = float(sizes.max()), float(kv.max())
        sp = self.split(cand.layout, cand.seq_degree)
        kv_row = 2 * k * pb.head_dim
        a2a, a2a_bytes = self._alltoall(cand, sp, sizes, kv, replicated)
        bound = not exact and cand.schedule in ("ring", "heads+ring")
        if cand.schedule in ("ring", "heads+ring", "heads"):
            fwd, bwd, comp, seq_bytes = self._ring_pass(cand, sp, h, kv_row, not bound)
        else:
            fwd, bwd, comp, seq_bytes = self._allgather_pass(cand, sp, h, kv_row)
        (fl, fu), (bl, bu) = (fwd, bwd) if bound else ((fwd, fwd), (bwd, bwd))
        call = prof.overhead_s("call_us", "fwd"), prof.overhead_s("call_us", "bwd")
        nbytes = {c: a2a_bytes[c] + seq_bytes[c] for c in ("intra", "inter")}
        _, _, vis, tiles = self._costed(cand.layout, cand.seq_degree, h, k)
        eff = float((vis.c0 + vis.total).sum() / max((tiles.c0 + tiles.total).sum() * prof.tile ** 2, 1e-9))
        fixed = a2a[0] + a2a[1] + call[0] + call[1]
        return Result(cand, a2a[0] + fl + call[0], a2a[1] + bl + call[1], nbytes,
                      self._memory(cand, sp, h, k), comp, a2a[0] + a2a[1], eff, bound=bound, upper_s=fixed + fu + bu,
                      rank_flops=4.0 * pb.head_dim * h * float((vis.c0 + vis.total).max()),
                      parts={"alltoall_fwd_s": a2a[0], "alltoall_bwd_s": a2a[1], "seq_fwd_s": fl, "seq_bwd_s": bl})

    def timeline(self, cand: Candidate) -> list:
        """The events of one layer (forward, then backward) on its slowest rank, as dicts of ``pass``,
        ``event`` (``host``: a call's host time, ``alltoall``, ``compute``, ``kv block``, ``dK/dV``,
        ``dK/dV home``, ``gather`` (K/V, forward and backward), ``reduce-scatter``),
        ``step`` and ``start_ms`` / ``end_ms``: where the transfers hide behind compute and where not."""
        sizes, kv, replicated = head_split(self.pb.heads, self.pb.kv_heads, cand.heads_degree)
        h, k = float(sizes.max()), float(kv.max())
        sp = self.split(cand.layout, cand.seq_degree)
        a2a = self._alltoall_parts(cand, sp, sizes, kv, replicated)
        events, clock = [], 0.0
        for pas, (first, last) in zip(("fwd", "bwd"), a2a):
            clock = _event(events, pas, "host", None, clock, clock + self.prof.overhead_s("call_us", pas))
            clock = _event(events, pas, "alltoall", None, clock, clock + first) if first else clock
            clock = self._seq_events(events, pas, cand, sp, h, 2 * k * self.pb.head_dim, clock)
            clock = _event(events, pas, "alltoall", None, clock, clock + last) if last else clock
        return events

    def _seq_events(self, events, pas, cand, sp, h, kv_row, clock) -> float:
        """The sequence group's events of one pass from ``clock``; returns when its slowest rank ends."""
        cf, cb, _, _ = self._costed(cand.layout, cand.seq_degree, h, kv_row / (2 * self.pb.head_dim))
        c = cf if pas == "fwd" else cb
        if cand.schedule in ("allgather", "heads+allgather") and cand.seq_degree > 1:
            (gather, scatter), _ = self._gather_s(cand, sp, kv_row)
            clock = _event(events, pas, "gather", None, clock, clock + gather)
            clock = _event(events, pas, "compute", None, clock, clock + float((c.c0 + c.total).max()))
            return _event(events, pas, "reduce-scatter", None, clock, clock + scatter) if pas == "bwd" else clock
        xf, xd, _ = self._links(cand, sp, kv_row)
        log: list = []
        end = _ring(c.c0, c.steps, c.at, xf, xd if pas == "bwd" else None, log)
        r = int(np.argmax(end))
        _event(events, pas, "compute", 0, clock, clock + c.c0[r])
        for t, recv, start, done, drecv in log:
            _event(events, pas, "kv block", t, clock + recv[r] - xf[r], clock + recv[r])
            if drecv is not None:
                _event(events, pas, "dK/dV", t, clock + drecv[r] - xd[r], clock + drecv[r])
            _event(events, pas, "compute", t, clock + start[r], clock + done[r])
        if log and pas == "bwd" and end[r] > log[-1][3][r]:
            _event(events, pas, "dK/dV home", None, clock + end[r] - xd[r], clock + end[r])
        return clock + float(end.max())

    def _kernel(self, w: Work, h: float, pas: str, step: bool = False) -> np.ndarray:
        return self.prof.kernel_s(w, h, self.pb.head_dim, pas, step)

    def _costed(self, layout: str, p: int, h: float, kv: float = None) -> tuple:
        """:class:`~.work.Costed` forward and backward seconds (step overheads included), visible pairs and
        tiles touched of a split for ``h`` heads (``kv`` kv heads, default the problem's share), in one
        walk over its steps (cached: the schedules of one split share them)."""
        kv = self.pb.kv_heads * h / self.pb.heads if kv is None else kv
        key = (layout, p, h, kv)
        if key not in self._costs:
            sp = self.split(layout, p)
            costs = []
            rows = float(sp.rows.max())
            pb = self.pb
            for pas in ("fwd", "bwd"):
                # one rank: the local op alone; more: on the device, the step's kernels, its merge passes
                # and the running state its launches move; on the host, the step's work. The host issues
                # a step while the device runs the one before: a step takes the longer of the two.
                merge = float(self.prof.step_bytes_s(rows, h, pas)) if p > 1 else 0.0
                host = self.prof.overhead_s("step_us", pas) if p > 1 else 0.0
                costs.append(lambda w, pas=pas, merge=merge, host=host: np.maximum(
                    self._kernel(w, h, pas, p > 1) + merge * (np.asarray(w.launches) > 0)
                    + (self.prof.state_s(w, h, kv, pb.head_dim, pb.elem, pas) if p > 1 else 0.0),
                    host * (np.asarray(w.launches) > 0)))
            costs += [lambda w: np.asarray(w.visible, dtype=float), lambda w: np.asarray(w.touched, dtype=float)]
            self._costs[key] = sp.costed_many(costs)
        return self._costs[key]

    def _links(self, cand, sp, kv_row):
        """Per rank: seconds of a K/V block and of its float32 dK/dV on the hop into it, and whether it crosses hosts."""
        inter = _hop_inter(cand, self.g)
        sent = np.roll(sp.send_rows, 1) * kv_row
        prof = self.prof

        def hop(nbytes):
            return np.where(inter, prof.transfer_s(nbytes, "inter", "p2p"), prof.transfer_s(nbytes, "intra", "p2p"))
        return hop(sent * self.pb.elem), hop(sent * prof.grad_bytes), inter

    def _ring_pass(self, cand, sp, h, kv_row, exact=True):
        cf, cb, _, _ = self._costed(cand.layout, cand.seq_degree, h, kv_row / (2 * self.pb.head_dim))
        xf, xd, inter = self._links(cand, sp, kv_row)
        comp = float((cf.c0 + cf.total).max() + (cb.c0 + cb.total).max())
        if exact:
            fwd = float(_ring(cf.c0, cf.steps, cf.at, xf).max())
            bwd = float(_ring(cb.c0, cb.steps, cb.at, xf, xd).max())
        else:
            fwd, bwd = self._ring_bounds(cf, cb, xf, xd)
        hops = len(cf.steps)
        g = self.prof.grad_bytes
        per_rank = float(sp.send_rows.max()) * kv_row * ((2 * self.pb.elem + g) * hops + g * (hops > 0))
        cls = "inter" if inter.any() else "intra"
        return fwd, bwd, comp, {"intra": per_rank * (cls == "intra"), "inter": per_rank * (cls == "inter")}

    @staticmethod
    def _ring_bounds(cf, cb, xf, xd):
        """(lower, upper) bounds of the forward and backward rings: no rank finishes before its own
        compute or its own transfers; none after the steps run in lockstep (a barrier a step)."""
        n = len(cf.steps)
        low_f = max(float((cf.c0 + cf.total).max()), n * float(xf.max()))
        low_b = max(float((cb.c0 + cb.total).max()), n * float((xf + xd).max()))
        # lockstep: the first step starts once the own step is done and the first block has come
        up_f = max(float(cf.c0.max()), float(xf.max()) * (n > 0)) + float(np.maximum(cf.step_max, xf.max()).sum())
        up_b = (max(float(cb.c0.max()), float((xf + xd).max()) * (n > 0))
                + float(np.maximum(cb.step_max, (xf + xd).max()).sum()) + float(xd.max()) * (n > 0))
        return (low_f, up_f), (low_b, up_b)

    def _allgather_pass(self, cand, sp, h, kv_row):
        """Forward: gather, then the steps; backward: gather again, the steps, reduce-scatter."""
        (gather, scatter), cls = self._gather_s(cand, sp, kv_row)
        cf, cb, _, _ = self._costed(cand.layout, cand.seq_degree, h, kv_row / (2 * self.pb.head_dim))
        f, b = float((cf.c0 + cf.total).max()), float((cb.c0 + cb.total).max())
        per_rank = (cand.seq_degree - 1) * float(sp.send_rows.max()) * kv_row * (2 * self.pb.elem + self.prof.grad_bytes)
        return gather + f, gather + b + scatter, f + b, {"intra": per_rank * (cls == "intra"), "inter": per_rank * (cls == "inter")}

    def _gather_s(self, cand, sp, kv_row) -> tuple:
        """((all-gather of K/V s, reduce-scatter of float32 dK/dV s), link class): ring collectives
        over the sequence group's slowest link."""
        p = cand.seq_degree
        cls = "inter" if _hop_inter(cand, self.g).any() else "intra"
        shard = float(sp.send_rows.max()) * kv_row
        bw, lat = self.prof.link(cls, "allgather")
        return tuple((p - 1) * (lat + shard * b / bw) if p > 1 else 0.0
                     for b in (self.pb.elem, self.prof.grad_bytes)), cls

    def _alltoall(self, cand, sp, sizes, kv, replicated):
        """(forward s, backward s) of the heads group's all-to-alls and the bytes a rank sends by class."""
        (fwd_in, fwd_out), (bwd_in, bwd_out) = self._alltoall_parts(cand, sp, sizes, kv, replicated)
        hd = cand.heads_degree
        if hd == 1:
            return (0.0, 0.0), {"intra": 0.0, "inter": 0.0}
        share_intra = (min(hd, self.g) - 1) / (hd - 1)
        fwd, bwd = self._alltoall_messages(float(sp.rows.max()), hd, sizes, kv, replicated)
        sent = sum(send for send, _, _ in fwd + bwd)
        passed = sum(inside for _, _, inside in fwd + bwd)
        return (fwd_in + fwd_out, bwd_in + bwd_out), {"intra": sent * share_intra + passed,
                                                      "inter": sent * (1 - share_intra)}

    def _alltoall_parts(self, cand, sp, sizes, kv, replicated) -> tuple:
        """Seconds of ((forward in, forward out), (backward in, backward out)) all-to-alls."""
        hd = cand.heads_degree
        if hd == 1:
            return (0.0, 0.0), (0.0, 0.0)
        share_intra = (min(hd, self.g) - 1) / (hd - 1)  # of a rank's peers, those in its host

        def seconds(send, recv, inside):
            b = max(send, recv)
            return float(max(self.prof.transfer_s(b * share_intra, "intra", "alltoall"),
                             self.prof.transfer_s(b * (1 - share_intra), "inter", "alltoall"))
                         + self.prof.transfer_s(inside, "intra", "alltoall"))
        return tuple(tuple(seconds(*m) for m in msgs)
                     for msgs in self._alltoall_messages(float(sp.rows.max()), hd, sizes, kv, replicated))

    def _alltoall_messages(self, n: float, hd: int, sizes, kv, replicated) -> tuple:
        """(bytes sent, bytes received, bytes passed among a kv head's readers inside a host) by the
        heads rank with the most heads, for each all-to-all: forward q/k/v in and out (with lse) back;
        backward dO (with lse and delta) in, dq/dk/dv back. One hop: dk/dv in float32 where a kv head
        has several readers. Two hops (``relay_readers``: K/V reach one reader of each kv head, which
        pass them on; dK/dV summed among the readers in float32, then sent home once in the inputs'
        dtype). ``n``: rows of the sequence shard the group shares."""
        d, e = self.pb.head_dim, self.pb.elem
        j = int(np.argmax(sizes))
        h, k = float(sizes[j]), float(kv[j])
        others_h, others_kv = float(sizes.sum()) - h, float(kv.sum()) - k
        mine, rest = n / hd, n - n / hd
        c = relay_readers(self.pb.heads, self.pb.kv_heads, hd, self.g) if self.relay else 0
        if c:  # each rank reads one kv head, its own shard of it kept (it is that head's reader for itself)
            kv_out, kv_in = mine * 2 * (self.pb.kv_heads - 1) * d * e, (n / c - mine) * 2 * d * e
            passed = n * (c - 1) / c * 2 * d
            return ([(mine * others_h * d * e + kv_out, rest * h * d * e + kv_in, passed * e),
                     (rest * h * (d * e + 4), mine * others_h * (d * e + 4), 0.0)],
                    [(mine * others_h * (d * e + 8), rest * h * (d * e + 8), 0.0),
                     (rest * h * d * e + kv_in, mine * others_h * d * e + kv_out, passed * 4)])
        g = 4 if replicated else e
        return ([(mine * (others_h + 2 * others_kv) * d * e, rest * (h + 2 * k) * d * e, 0.0),
                 (rest * h * (d * e + 4), mine * others_h * (d * e + 4), 0.0)],
                [(mine * others_h * (d * e + 8), rest * h * (d * e + 8), 0.0),
                 (rest * (h * d * e + 2 * k * d * g), mine * (others_h * d * e + 2 * others_kv * d * g), 0.0)])

    def _memory(self, cand, sp, h, k) -> float:
        """Peak bytes per rank: the layer's inputs, outputs and saved tensors, plus the larger of the
        forward's and the backward's working buffers."""
        pb, e, d = self.pb, self.pb.elem, self.pb.head_dim
        n = float(sp.rows.max())
        n_in = n / cand.heads_degree
        base = n_in * (3 * pb.heads + 2 * pb.kv_heads) * d * e + n_in * pb.heads * 4
        if cand.heads_degree > 1:
            base += n * (2 * h + 2 * k) * d * e + n * h * 4
        kvb = n * 2 * k * d
        if cand.schedule in ("allgather", "heads+allgather") and cand.seq_degree > 1:
            fwd = cand.seq_degree * kvb * e
            bwd = cand.seq_degree * kvb * (e + 4) + n * h * d * 4
        else:
            fwd = 2 * kvb * e + n * h * d * 4 * (cand.seq_degree > 1)
            bwd = 2 * kvb * (e + 4) + n * h * d * (4 + e)
        return base + max(fwd, bwd)
