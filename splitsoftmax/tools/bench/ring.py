"""``python -m splitsoftmax bench ring``: attention over a sequence sharded across ranks, against peers.

Launch: ``torchrun --nproc_per_node=P -m splitsoftmax bench ring --out DIR`` (or ``--nproc P``,
which starts the ranks itself; mpirun works too, splitsoftmax methods only). On GPUs (NCCL):
B=1, H=32 query heads over Hkv = 32 and 8 key/value heads (``--kv-heads``), D=128, bf16; per S and
Hkv, causal and not, forward and forward+backward, it times

- ``ss-ring``, ``ss-allgather``: ``sharded_attention`` on zigzag shards;
- ``ss-ring-nocomm``: the same public call with a communicator that drops the K/V and dK/dV
  messages (compute only; the gap to ``ss-ring`` is the communication the overlap did not hide);
- ``ss-heads``: head parallelism (all-to-all) on the same shards;
  ``ss-heads+ring-<s>x<h>``, ``ss-heads+allgather-<s>x<h>``: the 2-D schedules on every
  ``s x h`` mesh of the ranks with both degrees above 1 (on one rank the ``1 x 1`` mesh: the
  single-rank paths), zigzag over the sequence dimension, split over the heads dimension;
- ``torch-cp-<backend>-allgather``, ``torch-cp-<backend>-alltoall``: torch's ``context_parallel``
  over a 1-d DeviceMesh with SDPA's ``flash`` or ``cudnn`` backend inside (``enable_gqa`` where
  Hkv < H), one per rotate method; the fastest of them is the peer. Non-causal under torch's
  default head-tail balancer is refused by torch (recorded); ``-nolb`` runs it with balancing off;
- ``1gpu-ss``, ``1gpu-sdpa-flash``, ``1gpu-sdpa-cudnn``: one GPU (rank 0's) on the full sequence;
  scaling efficiency is ``T_1gpu / (P * T_P)`` (on CPU ranks the single-device row is ``1cpu-ss``);

Then the variants across the ranks (``--variants``; causal, every S and Hkv): ``documents``
(``--docs`` equal packed documents, per-document zigzag shards) and ``window`` (``--window`` keys),
splitsoftmax's schedules against ``torch-cp-flex`` (torch's context parallelism over compiled
FlexAttention: its attention module wrapper and sharded block mask, no load balancing) and
``1gpu-ss`` / ``1gpu-flex`` on the full sequence; their TFLOP/s count the visible pairs. The
documents also run as ``ss-ring-balanced``: the ring on ``layout="balanced"`` shards (short
documents whole on one rank, long ones zigzagged).
Then split-KV decode across ranks (``schedule="tree"``, GQA 32/8, one query) against one GPU.
A correctness gate (sharded vs single-device output and gradients, float64 oracle) runs first.

Times: CUDA events (``perf_counter`` on CPU), warm-up, then a rep count agreed by all ranks
(``triton.testing.do_bench`` picks its own count on each rank, which would pair collectives of
different reps); the median per rank, the slowest rank reported. Peak memory per rank is
``torch.cuda.max_memory_allocated`` (reset before each method, inputs are this rank's shards).
TFLOP/s per GPU: forward ``4*B*H*D`` per visible (query, key) pair (``S*S``, about half of it
causal) ``/ P``, forward+backward 3.5x.
Rank 0 writes ``ring_p<P>.json`` and PNG plots to ``--out`` and prints a table; the JSON is also
written after every shape, its ``complete`` false until the end, and each shape's rows are printed
as measured, so a run stopped at ``--deadline`` keeps what it measured. Without GPUs it runs the
same harness at toy sizes on Gloo with the torch peers skipped, with the reason.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch

import splitsoftmax as ss
from splitsoftmax.tools import launcher
from splitsoftmax.core import reference as ref
from splitsoftmax.tools.verify.compare import Sharding, compare, sdpa, table

GIB = float(1 << 30)


class World:
    """This rank's view of the job: barriers and max-reductions over torch.distributed or MPI."""

    def __init__(self, kind: str):
        self.kind = kind
        self.group, self.device, self.rank, self.size = launcher.init_ranks(kind)
        self.cuda = self.device.type == "cuda"
        self.nccl = kind == "torchrun" and self.cuda
        self.mesh = None  # torch CP's 1-d DeviceMesh, made on first use
        self.meshes: dict = {}  # splitsoftmax's 2-D groups by (seq, heads), made on first use
        if not self.cuda:  # ranks share the cores: oversubscribed threads make CPU timings meaningless
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.size))

    def barrier(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        if self.kind == "mpi":
            self.group.Barrier()
        else:
            torch.distributed.barrier()

    def max(self, x: float) -> float:
        """The largest ``x`` over the ranks (the same value on every rank)."""
        if self.kind == "mpi":
            from mpi4py import MPI
            return self.group.allreduce(float(x), op=MPI.MAX)
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.item()

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    def mesh_shapes(self) -> list:
        """The 2-D meshes ``(seq, heads)`` the 2-D schedules run on: every one with both degrees
        above 1; on one rank the ``1 x 1`` mesh (the 2-D schedules' single-rank path)."""
        if self.size == 1:
            return [(1, 1)]
        return [(self.size // h, h) for h in range(2, self.size) if self.size % h == 0]

    def mesh_group(self, seq: int, heads: int):
        """splitsoftmax's ``group`` of the ``seq x heads`` mesh (made once; every rank asks for the
        same shapes in the same order)."""
        if (seq, heads) not in self.meshes:
            self.meshes[seq, heads] = (self.group, self.group) if self.size == 1 else \
                launcher.mesh_groups(self.group, self.rank, seq, heads)
        return self.meshes[seq, heads]


def single_ss(w: World) -> str:
    """The name of splitsoftmax's single-device row: ``1gpu-ss`` on GPUs, ``1cpu-ss`` on CPU ranks."""
    return "1gpu-ss" if w.cuda else "1cpu-ss"


SINGLE_SS = ("1gpu-ss", "1cpu-ss")


class Skip(Exception):
    """A method that cannot run here; the message is the reason recorded."""


def call_ms(fn: Callable[[], object], cuda: bool) -> float:
    """Milliseconds of one ``fn()`` (CUDA events on GPUs)."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_method(w: World, fn: Callable[[], object], opts, collective: bool) -> dict:
    """Warm-up (the last one timed as a probe), then a rep count every rank agrees on; median ms."""
    probe = 0.0
    for _ in range(opts.warmup):
        probe = call_ms(fn, w.cuda)
    if collective:
        probe = w.max(probe)
    reps = int(min(opts.reps, max(opts.min_reps, math.ceil(opts.budget * 1e3 / max(probe, 1e-3)))))
    times = [call_ms(fn, w.cuda) for _ in range(reps)]
    med = statistics.median(times)
    return {"ms": w.max(med) if collective else med, "ms_rank": med, "reps": reps}


def step(f: Callable, inputs: Sequence[torch.Tensor], backward: bool) -> Callable[[], object]:
    """One forward (under no_grad), or forward and backward of ``<f(*inputs), dout>``."""
    if not backward:
        def fwd():
            with torch.no_grad():
                return f(*inputs)
        return fwd
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    dout = torch.randn_like(inputs[0])

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        f(*leaves).backward(dout)
    return fwd_bwd


def run_method(w: World, name: str, make, opts, collective: bool = True) -> dict:
    """Time the function that the context manager ``make()`` yields; record a skip or an error."""
    rec = {"method": name}
    if not collective and w.rank != 0:
        return rec
    if collective:
        w.barrier()
    if w.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        with make() as fn:
            rec.update(time_method(w, fn, opts, collective))
    except Skip as e:
        rec["skipped"] = str(e)
    except Exception as e:  # a peer's refusal (torch CP non-causal) or an OOM: recorded, not fatal
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if w.cuda:
        peak = torch.cuda.max_memory_allocated() / GIB
        rec["peak_gib"] = w.max(peak) if collective else peak
    if collective and w.max(float("ms" not in rec)) and "ms" in rec:
        rec = {"method": name, "error": "failed on another rank"}
    return rec


class NoBulkTransfers(ss.distributed.Communicator):
    """``inner`` without the ring's K/V and dK/dV messages (the handshake still runs): passed as
    ``group``, ``ss.sharded_attention`` times the ring's compute alone."""

    def __init__(self, inner: ss.distributed.Communicator):
        self.inner, self.rank, self.size, self.meta_device = inner, inner.rank, inner.size, inner.meta_device

    def post(self, sends, recvs, tag):
        from splitsoftmax.ops.attention.schedules.ring import TAG_DKV, TAG_KV
        return [] if tag in (TAG_KV, TAG_DKV) else self.inner.post(sends, recvs, tag)

    def wait(self, handles, step):
        self.inner.wait(handles, step)


def ss_methods(w: World, local: list, causal: bool, backward: bool, opts, kw: Optional[dict] = None) -> list:
    """(name, context manager factory) of splitsoftmax's sharded methods on zigzag shards; ``kw``: a
    variant's keywords."""
    def sharded_call(schedule, group):
        f = lambda q, k, v: ss.sharded_attention(q, k, v, causal=causal, group=group,  # noqa: E731
                                                 schedule=schedule, layout="zigzag", **(kw or {}))
        return contextlib.nullcontext(step(f, local, backward))

    return [("ss-ring", lambda: sharded_call("ring", w.group)),
            ("ss-allgather", lambda: sharded_call("allgather", w.group)),
            ("ss-ring-nocomm", lambda: sharded_call("ring", NoBulkTransfers(ss.distributed.as_comm(w.group)))),
            ("ss-heads", lambda: sharded_call("heads", w.group))]


MESH_SCHEDULES = ("heads+ring", "heads+allgather")


def ss_mesh(w: World, full: Callable, causal: bool, backward: bool, schedule: str, shape: tuple, kw: dict):
    """splitsoftmax's 2-D ``schedule`` on the ``seq x heads`` mesh ``shape``: zigzag shards (per
    document with ``cu_seqlens``) over the sequence dimension, each split over the heads dimension."""
    @contextlib.contextmanager
    def make():
        mesh = w.mesh_group(*shape)
        local = [ss.shard(t, 2, group=mesh, layout="zigzag", cu_seqlens=kw.get("cu_seqlens")) for t in full()]
        f = lambda q, k, v: ss.sharded_attention(q, k, v, causal=causal, group=mesh,  # noqa: E731
                                                 schedule=schedule, layout="zigzag", **kw)
        yield step(f, local, backward)
    return make


def ss_balanced(w: World, full: Callable, backward: bool, kw: dict):
    """splitsoftmax's causal ring on ``layout="balanced"`` shards of the documents ``kw["cu_seqlens"]``."""
    @contextlib.contextmanager
    def make():
        local = [ss.shard(t, 2, group=w.group, layout="balanced", cu_seqlens=kw["cu_seqlens"]) for t in full()]
        f = lambda q, k, v: ss.sharded_attention(q, k, v, causal=True, group=w.group,  # noqa: E731
                                                 layout="balanced", **kw)
        yield step(f, local, backward)
    return make


SDPA_BACKENDS = ("flash", "cudnn")


@contextlib.contextmanager
def sdpa_under(backend: str, causal: bool):
    """SDPA restricted to ``backend`` (one of ``SDPA_BACKENDS``), as ``attn(q, k, v)``; GQA (fewer
    key/value heads) through ``enable_gqa``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel(kind):
        yield lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


def torch_cp(w: World, full: Callable, causal: bool, backward: bool, rotate: str, balance: bool, backend: str):
    """torch's context_parallel on this rank's shards, SDPA's ``backend`` inside; the full inputs are
    freed once sharded."""
    @contextlib.contextmanager
    def make():
        if not w.nccl:
            raise Skip(f"torch context parallel needs CUDA SDPA ({backend}) kernels and an NCCL group")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
        set_rotate_method(rotate)
        if w.mesh is None:
            w.mesh = init_device_mesh("cuda", (w.size,))
        old = _cp_options.enable_load_balance
        _cp_options.enable_load_balance = balance
        q, k, v = full()
        try:
            with context_parallel(w.mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
                local = [t.clone() for t in (q, k, v)]
                for t in (q, k, v):
                    t.untyped_storage().resize_(0)  # resize_ keeps the full storage; free it
                with sdpa_under(backend, causal) as attn:
                    yield step(attn, local, backward)
        finally:
            _cp_options.enable_load_balance = old
    return make


def one_gpu(w: World, full: Callable, causal: bool, backward: bool, backend: Optional[str],
            kw: Optional[dict] = None):
    """Single-device attention on the full sequence (run on rank 0): splitsoftmax's (with a
    variant's keywords ``kw``), or SDPA under ``backend``."""
    @contextlib.contextmanager
    def make():
        if backend and not w.cuda:
            raise Skip(f"the SDPA {backend} backend needs CUDA")
        inputs = full()
        if backend:
            with sdpa_under(backend, causal) as attn:
                yield step(attn, inputs, backward)
        else:
            yield step(lambda q, k, v: ss.attention(q, k, v, causal=causal, **(kw or {})), inputs, backward)
    return make


class Variant:
    """A causal variant of the bench: its keywords for splitsoftmax, its rule as a FlexAttention
    ``mask_mod``, and its visible (query, key) pairs."""

    def __init__(self, name: str, s: int, opts):
        self.name = name
        if name == "documents":  # the last document takes the remainder of S
            n, doc = opts.docs, max(1, s // opts.docs)
            self.kw = {"cu_seqlens": [min(d * doc, s) for d in range(n)] + [s]}
            self.mask_mod = lambda b, h, i, j: (i >= j) & ((i // doc).clamp(max=n - 1) == (j // doc).clamp(max=n - 1))
            lens = [e - a for a, e in zip(self.kw["cu_seqlens"], self.kw["cu_seqlens"][1:])]
            self.pairs = sum(m * (m + 1) // 2 for m in lens)
        else:  # "window" (defaults() checks the names)
            win = opts.window
            self.kw = {"window_size": (win - 1, 0)}
            self.mask_mod = lambda b, h, i, j: (i >= j) & (i - j < win)
            self.pairs = sum(min(i + 1, win) for i in range(s))

    def shard(self, w: World, t: torch.Tensor) -> torch.Tensor:
        """This rank's zigzag shard of ``t`` (per document for ``documents``)."""
        return ss.shard(t, 2, group=w.group, layout="zigzag", cu_seqlens=self.kw.get("cu_seqlens"))


def torch_cp_flex(w: World, full: Callable, backward: bool, s: int, variant: Variant):
    """torch's context parallelism over FlexAttention with ``variant``'s mask on this rank's shards:
    the attention module parallelized with ``_ContextParallel`` (it all-gathers K and V), the
    inputs and the block mask sharded by ``_context_parallel_shard`` (no load balancing)."""
    @contextlib.contextmanager
    def make():
        if not w.nccl:
            raise Skip("torch context parallel over FlexAttention needs CUDA and an NCCL group")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
        from torch.distributed.tensor.parallel import parallelize_module
        from torch.nn.attention.flex_attention import create_block_mask
        if w.mesh is None:
            w.mesh = init_device_mesh("cuda", (w.size,))
        # _context_parallel_shard switches torch's module-wide CP settings: restored for the SDPA peers
        mode, balance = cp._dispatch_mode, cp._cp_options.enable_load_balance
        try:
            block = create_block_mask(variant.mask_mod, None, None, s, s, device=w.device)
            attn = parallelize_module(_Flex(), w.mesh, cp._ContextParallel(
                seq_dim=2, attention_type=cp._ContextParallel.AttentionType.FLEX))
            *local, local_block = cp._context_parallel_shard(w.mesh, [*full(), block], [2, 2, 2, 2])
            yield step(lambda q, k, v: attn(q, k, v, None, local_block), local, backward)
        finally:
            cp._dispatch_mode, cp._cp_options.enable_load_balance = mode, balance
    return make


class _Flex(torch.nn.Module):
    """Compiled FlexAttention as a module (what torch's context parallelism wraps), its arguments in
    the order its input hook reads them; GQA through ``enable_gqa``."""

    def __init__(self):
        super().__init__()
        from torch.nn.attention.flex_attention import flex_attention
        self.flex = torch.compile(flex_attention, dynamic=False)

    def forward(self, query, key, value, score_mod, block_mask):
        return self.flex(query, key, value, score_mod=score_mod, block_mask=block_mask,
                         enable_gqa=key.shape[1] != query.shape[1])


def one_gpu_flex(w: World, full: Callable, backward: bool, s: int, variant: Variant):
    """Compiled FlexAttention with ``variant``'s mask on the full sequence (run on rank 0)."""
    @contextlib.contextmanager
    def make():
        if not w.cuda:
            raise Skip("FlexAttention is timed on CUDA only")
        from torch.nn.attention.flex_attention import create_block_mask
        inputs = full()
        block = create_block_mask(variant.mask_mod, None, None, s, s, device=w.device)
        flex = _Flex()
        yield step(lambda q, k, v: flex(q, k, v, None, block), inputs, backward)
    return make


def tflops(pairs: int, backward: bool, opts, parts: int, ms: float) -> float:
    """TFLOP/s per GPU of ``pairs`` visible (query, key) pairs per head over ``parts`` GPUs."""
    flops = 4 * opts.batch * opts.heads * pairs * opts.dim * (3.5 if backward else 1.0)
    return flops / parts / (ms * 1e-3) / 1e12


def full_inputs(w: World, s: int, hkv: int, opts, seed: int) -> Callable:
    """A function making the full ``q (B, H, S, D)``, ``k, v (B, Hkv, S, D)``, identical on every rank."""
    def make():
        gen = torch.Generator(device=w.device).manual_seed(seed)
        return [torch.randn(opts.batch, n, s, opts.dim, generator=gen, device=w.device, dtype=opts.dtype)
                for n in (opts.heads, hkv, hkv)]
    return make


def bench_shape(w: World, s: int, hkv: int, causal: bool, backward: bool, opts,
                variant: Optional[Variant] = None) -> list:
    """Every method at one (S, Hkv, causal, mode), plain or (causal) under ``variant``; rows with
    derived TFLOP/s."""
    full = full_inputs(w, s, hkv, opts, seed=s)
    kw = variant.kw if variant else None
    local = [variant.shard(w, t) if variant else ss.shard(t, 2, group=w.group, layout="zigzag") for t in full()]
    methods = ss_methods(w, local, causal, backward, opts, kw)
    methods += [(f"ss-{sched}-{a}x{b}", ss_mesh(w, full, causal, backward, sched, (a, b), kw or {}))
                for sched in MESH_SCHEDULES for a, b in w.mesh_shapes()]
    if variant and "cu_seqlens" in kw:
        methods.append(("ss-ring-balanced", ss_balanced(w, full, backward, kw)))
    if variant:
        methods.append(("torch-cp-flex", torch_cp_flex(w, full, backward, s, variant)))
    for backend in () if variant else SDPA_BACKENDS:
        for rot in ("allgather", "alltoall"):
            name = f"torch-cp-{backend}-{rot}"
            methods.append((name, torch_cp(w, full, causal, backward, rot, True, backend)))
            if not causal:
                methods.append((f"{name}-nolb", torch_cp(w, full, causal, backward, rot, False, backend)))
    rows = []
    for name, make in methods:
        w.say(f"  {name}")
        rows.append(run_method(w, name, make, opts) | {"P": w.size})
    del local
    ones = [(single_ss(w), one_gpu(w, full, causal, backward, None, kw))]
    if variant:
        ones.append(("1gpu-flex", one_gpu_flex(w, full, backward, s, variant)))
    else:
        ones += [(f"1gpu-sdpa-{b}", one_gpu(w, full, causal, backward, b)) for b in SDPA_BACKENDS]
    for name, make in ones:
        w.say(f"  {name}")
        rows.append(run_method(w, name, make, opts, collective=False) | {"P": 1})
    w.barrier()
    pairs = variant.pairs if variant else s * s * (0.5 if causal else 1.0)
    for r in rows:
        r.update({"S": s, "Hkv": hkv, "variant": variant.name if variant else "plain", "causal": causal,
                  "mode": "fwd+bwd" if backward else "fwd"})
        if "ms" in r:
            r["tflops_per_gpu"] = tflops(pairs, backward, opts, r["P"], r["ms"])
    return rows


def derived(rows: list, world: int) -> list:
    """Per shape: ring vs torch CP's best (over backends and rotate methods), scaling efficiency,
    the ring's communication overhead."""
    out = []
    def shape(r):
        return r["S"], r["Hkv"], r["variant"], r["causal"], r["mode"]
    for key in sorted({shape(r) for r in rows}):
        here = [r for r in rows if shape(r) == key and "ms" in r]
        ms = {r["method"]: r["ms"] for r in here}
        d = dict(zip(("S", "Hkv", "variant", "causal", "mode"), key))
        cp = [r for r in here if r["method"].startswith("torch-cp")]
        if "ss-ring" in ms:
            ring = ms["ss-ring"]
            if cp:
                d["ring_over_torch_cp_best"] = ring / min(r["ms"] for r in cp)
                peak = next(r.get("peak_gib") for r in here if r["method"] == "ss-ring")
                if peak is not None and all("peak_gib" in r for r in cp):
                    d["ring_peak_over_torch_cp_least"] = peak / min(r["peak_gib"] for r in cp)
            for base in (*SINGLE_SS, "1gpu-flex", *(f"1gpu-sdpa-{b}" for b in SDPA_BACKENDS)):
                if base in ms:
                    d[f"efficiency_vs_{base}"] = ms[base] / (world * ring)
            if "ss-ring-nocomm" in ms:
                d["ring_over_nocomm"] = ring / ms["ss-ring-nocomm"]
            for m in sorted(ms):
                if m.startswith("ss-heads"):
                    d[f"{m}_over_ring"] = ms[m] / ring
        out.append(d)
    return out


def decode(w: World, opts) -> dict:
    """Split-KV decode across ranks (tree) vs one device on all keys; + one small all-reduce."""
    h, hkv, d, sk = opts.heads, max(1, opts.heads // 4), opts.dim, opts.decode_keys
    gen = torch.Generator(device=w.device).manual_seed(7)
    q = torch.randn(1, h, 1, d, generator=gen, device=w.device, dtype=opts.dtype)
    lengths = [sk // w.size + (r < sk % w.size) for r in range(w.size)]
    gen.manual_seed(100 + w.rank)
    kl, vl = [torch.randn(1, hkv, lengths[w.rank], d, generator=gen, device=w.device, dtype=opts.dtype)
              for _ in range(2)]
    out = {"keys": sk, "H": h, "Hkv": hkv, "D": d, "rows": []}
    tree = lambda: ss.sharded_attention(q, kl, vl, group=w.group, schedule="tree")  # noqa: E731
    got = tree()
    kf, vf = ss.unshard(kl, 2, group=w.group), ss.unshard(vl, 2, group=w.group)
    want = ss.attention(q, kf, vf)
    out["max_abs_diff_vs_1gpu"] = w.max((got.float() - want.float()).abs().max().item())
    del want

    def small_allreduce():
        if w.kind != "torchrun":
            raise Skip("the all-reduce reference is timed over torch.distributed only")
        t = torch.zeros(1, h, 1, d + 1, device=w.device)
        yield lambda: torch.distributed.all_reduce(t)
    cases = [("tree", lambda: contextlib.nullcontext(tree), True),
             ("local-split-kv", lambda: contextlib.nullcontext(lambda: ss.attention(q, kl, vl)), True),
             ("small-allreduce", contextlib.contextmanager(small_allreduce), True),
             (single_ss(w), lambda: contextlib.nullcontext(lambda: ss.attention(q, kf, vf)), False)]
    with torch.no_grad():
        for name, make, coll in cases:
            w.say(f"  decode {name}")
            out["rows"].append(run_method(w, name, make, opts, collective=coll))
    w.barrier()
    ms = {r["method"]: r["ms"] for r in out["rows"] if "ms" in r}
    if {"tree", "local-split-kv", "small-allreduce"} <= ms.keys():
        out["tree_over_local_plus_allreduce"] = ms["tree"] / (ms["local-split-kv"] + ms["small-allreduce"])
    return out


def gate(w: World, opts) -> list:
    """Sharded forward and gradients vs the single-device result (float64 oracle, torch tolerance)."""
    s, h, d = opts.check_seq, max(2, opts.heads // 4), opts.dim
    gen = torch.Generator().manual_seed(3)
    q, k, v = [torch.randn(1, h, s, d, generator=gen).to(w.device, opts.dtype) for _ in range(3)]
    zz = Sharding([lambda t: ss.shard(t, 2, group=w.group, layout="zigzag")] * 3,
                  [lambda t: ss.unshard(t, 2, group=w.group, layout="zigzag")] * 3,
                  lambda t: ss.shard(t, 2, group=w.group, layout="zigzag"),
                  lambda t: ss.unshard(t, 2, group=w.group, layout="zigzag"))
    rows = []
    for schedule in ("ring", "allgather", "heads"):
        for causal in opts.causal:
            f = lambda q, k, v, c=causal, sc=schedule: ss.sharded_attention(  # noqa: E731
                q, k, v, causal=c, group=w.group, schedule=sc, layout="zigzag")
            rows += compare(f"attention S={s} H={h} D={d}{' causal' if causal else ''}", f, sdpa(causal, 1),
                            lambda q, k, v, c=causal: ref.attention(q, k, v, causal=c)[0], [q, k, v],
                            sharding=zz, schedule=schedule, layout="zigzag", merges=w.size)
    sk = opts.check_seq * 2
    kd, vd = [torch.randn(1, h // 2, sk, d, generator=gen).to(w.device, opts.dtype) for _ in range(2)]
    qd = torch.randn(1, h, 1, d, generator=gen).to(w.device, opts.dtype)
    lengths = [sk // w.size + (r < sk % w.size) for r in range(w.size)]
    split = lambda t: t.narrow(2, sum(lengths[:w.rank]), lengths[w.rank])  # noqa: E731
    same = lambda t: t  # noqa: E731
    gather = lambda t: ss.unshard(t, 2, group=w.group)  # noqa: E731
    rows += compare(f"decode GQA {h}/{h // 2} Sk={sk}",
                    lambda q, k, v: ss.sharded_attention(q, k, v, group=w.group, schedule="tree"), sdpa(False, 2),
                    lambda q, k, v: ref.attention(q, k, v)[0], [qd, kd, vd],
                    sharding=Sharding([same, split, split], [same, gather, gather], same, same),
                    schedule="tree", layout="contiguous", merges=w.size)
    return rows


def meta(w: World, opts, argv: Sequence[str]) -> dict:
    import triton
    return {"command": "python -m splitsoftmax bench ring " + " ".join(argv), "launched_by": w.kind,
            "world": w.size, "backend": "mpi" if w.kind == "mpi" else torch.distributed.get_backend(),
            "device": torch.cuda.get_device_name(w.device) if w.cuda else "cpu", "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "splitsoftmax": ss.__version__,
            "dtype": str(opts.dtype).replace("torch.", ""), "B": opts.batch, "H": opts.heads, "Hkv": opts.kv_heads,
            "variants": opts.variants, "docs": opts.docs, "window": opts.window, "D": opts.dim,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def run(w: World, opts, argv: Sequence[str]) -> int:
    """Gate, every shape, decode; rank 0 writes JSON and plots and prints the table. The JSON is
    written again after every shape (``"complete": false`` until the end) and each shape's rows are
    printed as measured, so a run stopped at its deadline keeps what it measured."""
    w.say(f"bench ring: {w.size} ranks on {w.device.type} ({w.kind}); correctness gate first")
    checks = gate(w, opts)
    result = {"meta": meta(w, opts, argv), "gate": [vars(r) | {"ok": r.ok} for r in checks], "results": [],
              "complete": False}
    if w.rank == 0:
        print(table(checks), flush=True)

    def measured(rows: list) -> None:
        result["results"] += rows
        if w.rank == 0:
            print("\n".join(row_lines(rows)), flush=True)
            write(opts.out, w.size, result)
    if all(r.ok for r in checks):
        for s in opts.seqs:
            for hkv in opts.kv_heads:
                for causal in opts.causal:
                    for backward in opts.modes:
                        w.say(f"S={s} Hkv={hkv} {'causal' if causal else 'non-causal'} "
                              f"{'fwd+bwd' if backward else 'fwd'}")
                        measured(bench_shape(w, s, hkv, causal, backward, opts))
                for name in opts.variants:
                    for backward in opts.modes:
                        w.say(f"S={s} Hkv={hkv} causal, {name} {'fwd+bwd' if backward else 'fwd'}")
                        measured(bench_shape(w, s, hkv, True, backward, opts, Variant(name, s, opts)))
        result["derived"] = derived(result["results"], w.size)
        if opts.decode_keys:
            result["decode"] = decode(w, opts)
    result["complete"] = True
    if w.rank == 0:
        path = write(opts.out, w.size, result)
        result["plots"] = plots(opts.out)
        print(render(result))
        print(f"wrote {path} and {', '.join(result['plots']) or 'no plots (matplotlib missing)'}")
    w.barrier()
    return 0 if all(r.ok for r in checks) else 1


def write(out_dir: str, world: int, result: dict) -> str:
    """Write ``result`` to ``out_dir/ring_p<world>.json`` (replacing it); its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"ring_p{world}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def row_lines(rows: list) -> list:
    """One table line per row of ``rows`` (:func:`render`'s); the note (a skip's or an error's
    reason) whole, last on the line."""
    lines = []
    for r in rows:
        note = r.get("skipped") or r.get("error") or ""
        ms = f"{r['ms']:9.3f}" if "ms" in r else f"{'-':>9}"
        tf = f"{r['tflops_per_gpu']:11.1f}" if "ms" in r else f"{'-':>11}"
        peak = f"{r['peak_gib']:8.2f}" if "peak_gib" in r else f"{'-':>8}"
        lines.append(f"{r['S']:>7} {r['Hkv']:>4} {r['variant']:>9} {str(r['causal']):>6} {r['mode']:>7} "
                     f"{r['method']:<28} {ms} {tf} {peak}  {note}".rstrip())
    return lines


def render(result: dict) -> str:
    """The short table: one line per method and shape, then the derived ratios and the decode."""
    lines = [f"{'S':>7} {'Hkv':>4} {'variant':>9} {'causal':>6} {'mode':>7} {'method':<28} {'ms':>9} "
             f"{'TFLOP/s/GPU':>11} {'peak GiB':>8}  note", *row_lines(result["results"])]
    for d in result.get("derived", []):
        vals = ", ".join(f"{k} {v:.3f}" for k, v in d.items() if isinstance(v, float))
        lines.append(f"S={d['S']} Hkv={d['Hkv']} {d['variant']} {'causal' if d['causal'] else 'non-causal'} "
                     f"{d['mode']}: {vals}")
    dec = result.get("decode")
    if dec:
        parts = [f"{r['method']} " + (f"{r['ms']:.3f} ms" if "ms" in r else str(r.get("skipped") or r.get("error")))
                 for r in dec["rows"]]
        lines.append(f"decode {dec['keys']} keys: " + "; ".join(parts))
    return "\n".join(lines)


def plots(out_dir: str) -> list:
    """Time and TFLOP/s per GPU vs S (this run), efficiency vs world size (every ring_p*.json)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    runs = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("ring_p") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                data = json.load(f)
            runs[data["meta"]["world"]] = data
    files = []
    for world, data in runs.items():
        for key, label in (("ms", "time (ms)"), ("tflops_per_gpu", "TFLOP/s per GPU")):
            fig, axes = plt.subplots(2, 2, figsize=(12, 8), squeeze=False)
            for i, mode in enumerate(("fwd", "fwd+bwd")):
                for j, causal in enumerate((True, False)):
                    ax, pts = axes[i][j], [r for r in data["results"]
                                           if (r["mode"], r["causal"], r["variant"]) == (mode, causal, "plain")]
                    for m, hkv in sorted({(r["method"], r["Hkv"]) for r in pts if key in r}):
                        xy = sorted((r["S"], r[key]) for r in pts if (r["method"], r["Hkv"]) == (m, hkv) and key in r)
                        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=f"{m} Hkv={hkv}")
                    ax.set(xscale="log", yscale="log" if key == "ms" else "linear", xlabel="S", ylabel=label,
                           title=f"{mode}, {'causal' if causal else 'non-causal'}, P={world}")
                    ax.legend(fontsize=7)
            files.append(os.path.join(out_dir, f"ring_p{world}_{'time' if key == 'ms' else 'tflops'}.png"))
            fig.tight_layout()
            fig.savefig(files[-1], dpi=110)
            plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 5))
    series = {}
    for world, data in runs.items():
        for d in data.get("derived", []):
            for key in (f"efficiency_vs_{base}" for base in SINGLE_SS if f"efficiency_vs_{base}" in d):
                label = (f"S={d['S']} Hkv={d['Hkv']} {d['variant']} {'causal' if d['causal'] else 'full'} "
                         f"{d['mode']}")
                series.setdefault(label, []).append((world, d[key]))
    for label, xy in sorted(series.items()):
        xy.sort()
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=label)
    ax.set(xlabel="world size (ranks)", ylabel="T_1 / (P * T_P)",
           title="ss-ring scaling efficiency vs splitsoftmax on one device")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.legend(fontsize=7)
    files.append(os.path.join(out_dir, "ring_scaling.png"))
    fig.tight_layout()
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def defaults(opts, cuda: bool):
    """the reference GPU shapes or toy CPU shapes for whatever the user left unset."""
    gpu = dict(seqs="32768,131072", heads=32, kv_heads="32,8", variants="documents,window", docs=16, window=4096,
               dim=128, dtype="bfloat16", decode_keys=1 << 20, check_seq=2048, warmup=2, reps=10, min_reps=3,
               budget=1.5)
    cpu = dict(seqs="64,128", heads=4, kv_heads="4,2", variants="documents,window", docs=4, window=16, dim=32,
               dtype="float32", decode_keys=4096, check_seq=40, warmup=1, reps=3, min_reps=2, budget=0.05)
    for key, value in (gpu if cuda else cpu).items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    opts.seqs = [int(x) for x in str(opts.seqs).split(",") if x]
    opts.kv_heads = [int(x) for x in str(opts.kv_heads).split(",") if x]
    bad = [h for h in opts.kv_heads if h < 1 or opts.heads % h]
    if bad:
        raise ValueError(f"--kv-heads must divide --heads ({opts.heads}), got {bad}")
    opts.variants = [x for x in str(opts.variants).split(",") if x]
    unknown = sorted(set(opts.variants) - {"documents", "window"})
    if unknown or opts.docs < 1 or opts.window < 1:
        raise ValueError(f"--variants takes documents and window, --docs and --window >= 1; got {unknown}, "
                         f"{opts.docs}, {opts.window}")
    opts.causal = [True, False] if opts.causal is None else [opts.causal]
    opts.modes = [False] if opts.fwd_only else [False, True]
    opts.dtype = getattr(torch, opts.dtype)
    return opts


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitsoftmax bench ring", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="start this many local ranks (NCCL/Gloo)")
    p.add_argument("--out", default="bench_out", help="directory for ring_p<P>.json and the plots")
    p.add_argument("--seqs", default=None, help="comma-separated global sequence lengths (GPU: 32768,131072)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None, help="only causal / non-causal")
    p.add_argument("--fwd-only", action="store_true", help="skip forward+backward")
    p.add_argument("--decode-keys", type=int, default=None, help="keys of the split-KV decode (GPU: 1M; 0: skip)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", default=None, help="comma-separated key/value head counts (GPU: 32,8; GQA below H)")
    p.add_argument("--variants", default=None, help="comma-separated causal variants across the ranks: documents, "
                   "window (default both; empty: none)")
    p.add_argument("--docs", type=int, default=None, help="equal packed documents of the documents variant (GPU: 16)")
    p.add_argument("--window", type=int, default=None, help="keys of the window variant (GPU: 4096)")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"))
    p.add_argument("--check-seq", type=int, default=None, help="sequence length of the correctness gate")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--reps", type=int, default=None, help="most timed reps per method")
    p.add_argument("--min-reps", type=int, default=None)
    p.add_argument("--budget", type=float, default=None, help="seconds of timed reps aimed at per method")
    p.add_argument("--deadline", type=float, default=1800.0, help="seconds before --nproc ranks are stopped")
    return p


def without_nproc(argv: Sequence[str]) -> list:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parser().parse_args(argv)
    kind = launcher.launched_by()
    if kind is None:
        n = opts.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
        return launcher.spawn(n, ["bench", "ring", *without_nproc(argv)], opts.deadline)
    w = World(kind)
    try:
        return run(w, defaults(opts, w.cuda), argv)
    finally:
        launcher.finish_ranks(kind)
