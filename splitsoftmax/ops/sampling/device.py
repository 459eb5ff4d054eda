"""Host side of a draw on one device: the launches of ``ops.sampling.fused``.

Greedy is one launch (records), plain sampling one (the draw), top-k two (records, draw), min-p
alone two (one record: the row's largest logit, which places the cut-off; then the draw above it),
top-p alone two (``sampling_nucleus``: the row's best keys, then the masses above them), top-p with
top-k two (the records hold every token top-k keeps, so they settle top-p), top-p with min-p alone
three (records, approximate pivot rounds, the draw); passes with no row to serve
return at once, and nothing is read back, so a CUDA graph can hold a draw. The
per-row buffers (plan, partials, counters, bracket lists) are kept per device, stream and batch
size: a decode loop allocates only its output. Seeds and offsets given as ints travel as kernel
arguments (two int32 halves, so every value runs the same compiled kernel).
"""
from __future__ import annotations

import statistics
from functools import lru_cache

import torch
from torch import Tensor

from ...core.runtime import interpreting
from .rows import Spec
from .._triton import configs
from . import config as sc
from .._triton.launch import Launcher
from .fused import _draw_kernel, _pivot_kernel, _records_kernel
from .jit import LAUNCH, PIVOTS, PLAN_F, THRESH
from .nucleus import _nucleus_keys_kernel, _nucleus_mass_kernel

_RECORDS, _PIVOTS, _DRAW, _KEYS, _MASSES = (Launcher(k) for k in (_records_kernel, _pivot_kernel, _draw_kernel,
                                                                   _nucleus_keys_kernel, _nucleus_mass_kernel))
_CACHE: dict = {}


@lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    return sc.INTERPRET_SMS if interpreting() else _device_sms(device.index or 0)


def _tile() -> int:
    return sc.TILE_INTERPRET if interpreting() else sc.TILE


def _max_splits(device: torch.device) -> int:
    """Partials per row a pass may write (a power of two): the most programs one row is spread over."""
    return configs.next_pow2(sc.PROGRAMS_PER_SM * _sms(device))


def _splits(n: int, width: int, tile: int, most: int, device: torch.device) -> tuple[int, int]:
    """``(Q, tiles)``: programs per row (at most ``most``) and whole tiles each covers."""
    total = configs.cdiv(max(width, 1), tile)
    want = min(most, configs.cdiv(sc.PROGRAMS_PER_SM * _sms(device), max(n, 1)), total)
    tiles = configs.cdiv(total, max(1, want))
    return configs.cdiv(total, tiles), tiles


def row_splits(n: int, device: torch.device) -> int:
    """The most programs a pass spreads one of ``n`` rows over, as a power of two."""
    return min(_max_splits(device), configs.next_pow2(configs.cdiv(sc.PROGRAMS_PER_SM * _sms(device), max(n, 1))))


def records_splits(kr: int, device: torch.device, n: int = 1, merge: int = 0) -> int:
    """Partials per row of the records pass (a power of two): at most ``merge`` (default
    ``MERGE_MAX``) records in all."""
    return min(row_splits(n, device), max(1, (merge or sc.MERGE_MAX) // kr))


def _records_sizes(n: int) -> tuple[int, int]:
    """``(tile, records merged per row)`` of the one-device records pass over ``n`` rows: few rows
    take small tiles and fewer partials (their programs' selection and the row's merge are the
    pass's time), more rows ``TILE`` and ``MERGE_MAX``."""
    if n <= sc.FEW_ROWS and not interpreting():
        return sc.FEW_ROWS_TILE, sc.FEW_ROWS_MERGE
    return _tile(), sc.MERGE_MAX


def nucleus_candidates(top_p: float) -> int:
    """Candidates ``M`` per row of a top-p-alone draw: the fewest of 4, 8, 16 whose miss bound
    ``(1 - top_p)^M`` is at most ``NUCLEUS_MISS`` (0: none is, the row takes the pivot rounds)."""
    return next((m for m in (4, 8, 16) if (1.0 - top_p) ** m <= sc.NUCLEUS_MISS), 0)


class _Work:
    """The per-row buffers of one ``(device, stream, N, V, records)``: counters (zero between launches),
    the plan, the partials of each pass and the bracket lists. Kept per stream: draws on two streams
    at once do not share them."""

    def __init__(self, n: int, v: int, kr: int, device: torch.device):
        i32, i64, f32 = (dict(dtype=t, device=device) for t in (torch.int32, torch.int64, torch.float32))
        self.q = row_splits(n, device)
        self.qr = records_splits(kr, device, n, _records_sizes(n)[1])
        self.cap = max(1, min(sc.CAP, v))
        self.cnt = torch.zeros(n, **i32)
        self.ccount = torch.zeros(n, **i32)
        self.mode = torch.empty(n, **i64)
        self.planf = torch.empty((n, PLAN_F), **f32)
        self.part_r = torch.empty((n, self.qr, kr), **i64)
        self.ties = torch.empty((n, self.qr), **i64)
        self.mom = torch.empty((n, self.qr, 4), **f32)
        self.part_p = torch.empty((n, self.q, 17), **f32)
        self.part_d = torch.empty((n, self.q, 4), **i64)
        self.cand = torch.empty((n, self.cap), **i64)
        self.part_n = torch.empty((n, self.q, PIVOTS + 1), **i64)      # top-p alone: the keys' partials
        self.nuc = torch.empty((n, PIVOTS), **i64)                     # and a row's candidates
        # the plan of plain sampling (every row THRESH, nothing filtered), read only; made by device
        # operations only, so that a first draw inside a CUDA-graph capture records them
        self.plain_mode = torch.full((n,), int(THRESH.value), **i64)
        self.plain_planf = torch.zeros((n, PLAN_F), **f32)
        self.plain_planf[:, 0] = float("-inf")          # XTHR
        self.plain_planf[:, 2] = float("-inf")          # DTHR


def _work(n: int, v: int, kr: int, device: torch.device, stream: int) -> _Work:
    key = (str(device), stream, n, v, kr, _config_key())
    w = _CACHE.get(key)
    if w is None:
        if len(_CACHE) >= 16:
            _CACHE.clear()
        w = _CACHE[key] = _Work(n, v, kr, device)
    return w


def _slots() -> int:
    """Candidate slots of the draw's finisher: ``SLOTS`` (the interpreter: only ``CAP``'s, its sort is slow)."""
    if interpreting():
        return configs.next_pow2(sc.CAP)
    if sc.CAP > sc.SLOTS:
        raise ValueError(f"sampling_config.CAP={sc.CAP} exceeds SLOTS={sc.SLOTS}")
    return configs.next_pow2(sc.SLOTS)


def _seed_args(value, dummy: Tensor) -> tuple:
    """``(tensor, is_tensor, low int32 half, high int32 half)`` of a seed or offset."""
    if isinstance(value, Tensor):
        return value, 1, 0, 0
    v = value & 0xFFFFFFFFFFFFFFFF
    lo, hi = v & 0xFFFFFFFF, v >> 32
    return dummy, 0, lo - (1 << 32) if lo >= 1 << 31 else lo, hi - (1 << 32) if hi >= 1 << 31 else hi


def _int_key(v: int) -> tuple:
    return v == 1, v % 16 == 0, -2 ** 31 <= v < 2 ** 31


@lru_cache(maxsize=64)
def _probit(top_p: float) -> float:
    return statistics.NormalDist().inv_cdf(min(max(top_p, 1e-6), 1 - 1e-6))


def _bits(x: float) -> int:
    import struct
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _config_key() -> tuple:
    """The sizes a test may change (a launch plan is kept per their values)."""
    return (sc.TILE, sc.TILE_INTERPRET, sc.TILE_EXACT, sc.WARPS, sc.STAGES, sc.PROGRAMS_PER_SM, sc.MERGE_MAX, sc.CAP,
            sc.SLOTS, sc.PIVOT_ROUNDS, sc.EXACT_ROUNDS, sc.SLACK, sc.SPREAD, sc.GROWTH, sc.INTERPRET_SMS, sc.FEW_ROWS,
            sc.FEW_ROWS_TILE, sc.FEW_ROWS_MERGE, sc.NUCLEUS_MISS, sc.NUCLEUS_TILE, sc.NUCLEUS_STAGES,
            sc.NUCLEUS_SLACK)


_PLANS: dict = {}


def draw(x: Tensor, spec: Spec, plain: bool, ident: int, seed, offset, xk_large=None) -> Tensor:
    """The tokens ``(N,)`` int64 of ``x (N, V)`` (rows contiguous) under ``spec`` (configuration
    ``ident``); ``seed``, ``offset``: ints or ``(N,)`` int64 tensors on ``x``'s device; ``xk_large``: a
    top-k threshold ``(N,)`` found outside the records. The launches are planned once per
    configuration, shape, dtype, alignment, device and stream."""
    n = x.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    stream = torch._C._cuda_getCurrentRawStream(x.get_device()) if x.is_cuda else 0   # (as Triton reads it)
    seed_t, offset_t = isinstance(seed, Tensor), isinstance(offset, Tensor)
    key = (ident, x.shape, x.stride(0), x.dtype, x.data_ptr() % 16, x.device, stream, seed_t and seed.data_ptr() % 16,
           offset_t and offset.data_ptr() % 16, seed_t, offset_t, None if xk_large is None else xk_large.dtype,
           _config_key())
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 64:
            _PLANS.clear()
        plan = _PLANS[key] = _plan(x, spec, plain, stream, seed, offset, xk_large)
    seeds = (*_seed_args(seed, plan[0]), *_seed_args(offset, plan[0]))
    for launcher, grid, launch_key, build, consts in plan[1]:
        launcher(grid, launch_key, build(x, out, seeds, xk_large), consts)
    return out


def _plan(x: Tensor, spec: Spec, plain: bool, stream: int, seed, offset, xk_large) -> tuple:
    """``(dummy tensor, launches)``: each launch ``(launcher, grid, key, build(x, out, seeds, xk), consts)``."""
    n, v = x.shape
    kr = 1 if spec.greedy or _max_only(spec, xk_large) else spec.kr
    w = _work(n, v, kr, x.device, stream)
    seeds = (*_seed_args(seed, w.mode), *_seed_args(offset, w.mode))
    base = (x.dtype, x.data_ptr() % 16 == 0, _int_key(v), _int_key(x.stride(0)), seeds[0].data_ptr() % 16 == 0,
            seeds[4].data_ptr() % 16 == 0)
    tile = _tile()
    steps = []
    m = nucleus_candidates(spec.top_p) if _nucleus_alone(spec, plain, xk_large) else 0
    if m:
        return w.mode, [_nucleus_keys(x, w, spec, base, tile, m), _nucleus_masses(x, w, spec, base, m)]
    if plain:
        mode, planf = w.plain_mode, w.plain_planf
    else:
        mode, planf = w.mode, w.planf
        steps.append(_records(x, w, spec, kr, base, xk_large))
        if not spec.greedy and spec.top_p < 1.0 and sc.PIVOT_ROUNDS and not _records_settle(spec, xk_large):
            steps.append(_pivots(x, w, spec, base, tile))
    if not spec.greedy:
        steps.append(_draw(x, w, mode, planf, spec, base, tile, not plain and spec.top_p < 1.0))
    return w.mode, steps


def _max_only(spec: Spec, xk_large) -> bool:
    """Whether min-p is the draw's only filter: its cut-off needs only the row's largest logit (one
    record), and the draw takes every token above it (more records would settle only rows whose
    kept tokens they all hold)."""
    return not spec.greedy and not spec.top_k and xk_large is None and spec.top_p >= 1.0 and \
        spec.cmin > float("-inf")


def _records_settle(spec: Spec, xk_large) -> bool:
    """Whether the records settle a top-p: a top-k inside them keeps only records and the ties of
    its cut-off, which each span counts, so no row needs the pivot rounds (a row left to them all
    the same would take the draw's exact rounds)."""
    return 0 < spec.top_k < spec.kr and xk_large is None


def _nucleus_alone(spec: Spec, plain: bool, xk_large) -> bool:
    """Whether top-p is the draw's only filter (no top-k, no min-p)."""
    return not plain and not spec.greedy and spec.top_p < 1.0 and not spec.top_k and xk_large is None and \
        spec.cmin == float("-inf")


def _nucleus_keys(x, w: _Work, spec: Spec, base: tuple, tile: int, m: int) -> tuple:
    n, v = x.shape
    q, tiles = _splits(n, v, tile, w.q, x.device)
    head = (w.part_n, w.cnt, w.mode, w.planf, w.nuc)
    tail = (v, tiles, x.stride(0), q, spec.c)
    consts = dict(M=m, TILE=tile, QP=configs.next_pow2(q), STAGES=sc.STAGES, num_warps=sc.WARPS, **LAUNCH)
    return _KEYS, (n, q), base, lambda x, out, seeds, xk: (x, *head, out, *seeds, *tail), consts


def _nucleus_masses(x, w: _Work, spec: Spec, base: tuple, m: int) -> tuple:
    n, v = x.shape
    tile = sc.TILE_INTERPRET if interpreting() else sc.NUCLEUS_TILE
    q, tiles = _splits(n, v, tile, w.q, x.device)
    head = (w.part_p, w.cnt, w.mode, w.planf, w.nuc)
    tail = (v, tiles, x.stride(0), q, spec.c, spec.shift, _bits(spec.top_p), w.cap, nucleus_slack(v, tile))
    small = sc.TILE_INTERPRET if interpreting() else sc.TILE_EXACT
    consts = dict(M=m, TILE=tile, STAGES=sc.NUCLEUS_STAGES, ROUNDS=sc.EXACT_ROUNDS, DTILE=_tile(), XTILE=small,
                  ETILE=small if interpreting() else sc.NUCLEUS_TILE // 4, CP=_slots(), num_warps=sc.WARPS, **LAUNCH)
    return _MASSES, (n, q), base, lambda x, out, seeds, xk: (x, *head, out, w.cand, w.ccount, *seeds, *tail), consts


def nucleus_slack(v: int, tile: int) -> float:
    """The relative error bound of the mass pass's float32 sums over ``v`` columns in tiles of
    ``tile`` (each position adds up to ``v / tile`` terms, the reductions about 64 levels more),
    four times the first-order bound ``terms * 2^-24``, times ``NUCLEUS_SLACK``."""
    return sc.NUCLEUS_SLACK * (configs.cdiv(v, tile) + 64) * 2.0 ** -22


def _records(x, w: _Work, spec: Spec, kr: int, base: tuple, xk_large) -> tuple:
    n, v = x.shape
    rtile = max(_records_sizes(n)[0], kr // 4)
    q, tiles = _splits(n, v, rtile, w.qr, x.device)
    qp = configs.next_pow2(q)       # the row's partials as the finisher merges them (sorting qp * kr keys)
    top_p = spec.top_p < 1.0
    k_tie = spec.top_k if 0 < spec.top_k < kr else 0
    head = (w.part_r, w.ties, w.mom, w.cnt, v, 0, tiles, x.stride(0), q, k_tie)   # rows of qp partials
    mid = (w.mode, w.planf)
    tail = (spec.c, spec.shift, _bits(spec.top_p), spec.cmin, k_tie, _probit(spec.top_p) if top_p else 0.0, sc.SLACK,
            sc.SPREAD, sc.GROWTH)
    dummy = w.planf

    def build(x, out, seeds, xk):
        return (x, *head, *seeds, dummy if xk is None else xk, *mid, out, *tail)
    moments = top_p and xk_large is None and not _records_settle(spec, xk_large)
    consts = dict(KR=kr, QP=qp, TILE=rtile, STAGES=sc.STAGES, MOMENTS=moments, FUSED=True,
                  LARGE_K=xk_large is not None, GREEDY=spec.greedy, TOP_P=top_p, num_warps=sc.WARPS, **LAUNCH)
    return _RECORDS, (n, q), base + (n, (xk_large if xk_large is not None else dummy).dtype), build, consts


def _pivots(x, w: _Work, spec: Spec, base: tuple, tile: int) -> tuple:
    n, v = x.shape
    q, tiles = _splits(n, v, tile, w.q, x.device)
    rest = (w.part_p, w.cnt, w.mode, w.planf, v, tiles, x.stride(0), q, spec.c, spec.shift, spec.top_p, sc.SLACK,
            w.cap)
    consts = dict(TILE=tile, QP=_max_splits(x.device), STAGES=sc.STAGES, MORE=sc.PIVOT_ROUNDS - 1, num_warps=sc.WARPS,
                  enable_fp_fusion=True)
    return _PIVOTS, (n, q), base, lambda x, out, seeds, xk: (x, *rest), consts


def _draw(x, w: _Work, mode: Tensor, planf: Tensor, spec: Spec, base: tuple, tile: int, exact_rows: bool) -> tuple:
    n, v = x.shape
    q, tiles = _splits(n, v, tile, w.q, x.device)
    head = (w.part_d, w.cand, w.ccount, w.cnt, mode, planf)
    tail = (v, 0, tiles, x.stride(0), q, spec.c, spec.shift, _bits(spec.top_p), w.cap)
    consts = dict(SHIFT4=0, TILE=tile, QP=_max_splits(x.device), CP=_slots(), STAGES=sc.STAGES, EXACT_ROWS=exact_rows,
                  ROUNDS=sc.EXACT_ROUNDS, XTILE=sc.TILE_INTERPRET if interpreting() else sc.TILE_EXACT,
                  num_warps=sc.WARPS, **LAUNCH)
    return _DRAW, (n, q), base, lambda x, out, seeds, xk: (x, *head, out, *seeds, *tail), consts
