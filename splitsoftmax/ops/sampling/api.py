"""Exact top-k and sampling over the vocabulary, on one device or sharded across ranks, never
gathering the logits.

A draw is Gumbel-max with counter-based noise: token ``i`` of row ``r`` gets the key
``x_i / T + Gumbel(key_r, offset_r, i)`` (in base 2, see ``ops.sampling.numerics``) and the row
draws the kept token with the largest key, ties to the lower id. A row's key is its own seed when
the seeds are an ``(N,)`` tensor; an int seed is the batch's, and row ``r``'s key is a hash of the
seed and ``r`` (``sampling_math.row_seeds``), so the rows of one batch draw independently. The
noise of a token depends only on ``(key, offset, global id)``, and every merge (maxima of packed
keys, integer masses, sorted records) is exact, so the token drawn is the same for any number of
ranks, any shard widths and any tile size, on the CPU and on the GPU, and, with per-row seed
tensors, in any batch slot. Filters apply in the order temperature, top-k, top-p (on what top-k
kept), min-p, with ties at each cut-off kept.
"""
from __future__ import annotations

import itertools
import math
import numbers
from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor

from ...core import checks as _checks
from ...distributed import handshake as hs
from ...distributed.comm import as_comm, eager
from ...distributed.session import collective
from .._triton import configs
from . import numerics as sm
from .._registry import use_triton
from .flow import Exchange, draw, large_top_k, top_records
from .rows import Spec


def _logits(logits) -> Tensor:
    _checks.tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (N, V), got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")
    return logits


def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    return int(value)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    return _checks.as_float(name, value)


def _filters(temperature, top_k, top_p, min_p) -> tuple[float, int, float, float]:
    """``(T, top_k or 0, top_p or 1, min_p or 0)`` after checking each (ValueError/TypeError naming it)."""
    t = _real("temperature", temperature)
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0")
    k = 0 if top_k is None else _int("top_k", top_k, 1)
    p = 1.0 if top_p is None else _real("top_p", top_p)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    m = 0.0 if min_p is None else _real("min_p", min_p)
    if not 0.0 <= m <= 1.0:
        raise ValueError(f"min_p={min_p} must be in [0, 1]")
    if t > 0 and not math.isfinite(sm.temperature_scale(t)):
        raise ValueError(f"temperature={temperature} is too small to scale float32 logits")
    return t, k, p, m


def _seed_value(name: str, value, n: int, device):
    """A seed or offset: an int64 int (two's complement of a value up to 64 bits), or an ``(N,)``
    int64 tensor on the logits' device (its values stay on the device)."""
    if isinstance(value, Tensor):
        if value.dtype in (torch.bool,) or value.is_floating_point() or value.is_complex():
            raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
        if tuple(value.shape) != (n,):
            raise ValueError(f"{name} must be an int or an (N,) = ({n},) tensor, got shape {tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but logits is on {device}")
        return value if value.dtype == torch.int64 else value.to(torch.int64)
    v = _int(name, value, -(2 ** 63))
    if v >= 2 ** 64:
        raise ValueError(f"{name}={value} does not fit in 64 bits")
    return v - 2 ** 64 if v >= 2 ** 63 else v


def _per_row(name: str, value, n: int, device) -> tuple[Tensor, int]:
    """``(values (N,) int64, code)`` of a seed or offset: an ``(N,)`` integer tensor on the logits'
    device as it is (code: a marker; its values stay on the device), or an int (code: its int64
    value): an offset broadcast, a seed the batch's, each row's key ``sampling_math.row_seeds`` of
    the seed and the row index (the kernels' ``_row_seed`` is its twin)."""
    v = _seed_value(name, value, n, device)
    if isinstance(v, Tensor):
        return v, -(2 ** 62) + 1
    if name == "seed":
        return sm.row_seeds(v, torch.arange(n, dtype=torch.int64, device=device)), v
    return torch.full((n,), v, dtype=torch.int64, device=device), v


def _spec(t: float, k: int, p: float, m: float, vocab: int) -> tuple[Spec, bool]:
    """The configuration of a draw over ``vocab`` tokens and whether it is plain (no filter)."""
    k = 0 if k >= vocab else k
    greedy = t == 0.0
    cmin = sm.to_f32(math.log2(m)) if m > 0 else sm.NEG_INF
    kr = 1 if greedy else max(configs.SAMPLE_RECORDS_MIN, configs.next_pow2(k + 1) if k else 1)
    if kr > configs.SAMPLE_RECORDS_MAX:
        kr = configs.SAMPLE_RECORDS_MIN
    reach = p if p >= 1.0 else p * (1.0 - configs.SAMPLE_TOP_P_REACH)  # (see configs)
    spec = Spec(greedy=greedy, top_k=k, top_p=reach, cmin=cmin, c=sm.temperature_scale(t) if t else 0.0,
                shift=sm.mass_shift(vocab), kr=kr, bins=configs.SAMPLE_BINS, span=configs.SAMPLE_BIN_SPAN,
                cap=configs.SAMPLE_CAP)
    return spec, not greedy and not k and p >= 1.0 and m <= 0.0


def topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest entries of each row of ``logits (N, V)``: ``(values (N, k) logits.dtype,
    indices (N, k) int64)``, values descending, ties to the lower index (NaN counts as largest,
    like ``torch.topk``). ``k > V`` raises ``ValueError``."""
    _logits(logits)
    k = _int("k", k, 0)
    if k > logits.shape[1]:
        raise ValueError(f"k={k} exceeds the vocabulary V={logits.shape[1]}")
    return _topk(Exchange(None, None, "topk", logits.device), logits, 0, k)


def _topk(ex: Exchange, logits: Tensor, col0: int, k: int) -> tuple[Tensor, Tensor]:
    n = logits.shape[0]
    if k == 0 or n == 0:
        return logits.new_empty((n, k)), torch.empty((n, k), dtype=torch.int64, device=logits.device)
    vals, ids = top_records(ex, logits, col0, k)
    return vals.to(logits.dtype), ids


@eager
def sharded_topk(logits: Tensor, k: int, *, group=None) -> tuple[Tensor, Tensor]:
    """:func:`topk` of vocabulary-sharded ``logits (N, V_r)`` (this rank's slice, slices in rank
    order, any widths, 0 allowed): the global ``(values, indices)`` ``(N, k)`` with global indices,
    identical on every rank, from one exchange of each rank's own top ``k``."""
    comm = as_comm(group)
    agree, err = None, None
    try:
        _logits(logits)
        k = _int("k", k, 0)
        agree = {"N": logits.shape[0], "dtype": hs.encode_dtype(logits.dtype), "k": k}
    except hs.LOCAL_ERRORS as e:
        err = e
    v_local = logits.shape[1] if err is None else 0

    def body(meta: dict, guard):
        widths = meta["V_local"]
        if k > sum(widths):
            raise ValueError(f"k={k} exceeds the vocabulary V={sum(widths)}")
        ex = Exchange(comm, guard, "sharded_topk: records", logits.device)
        return _topk(ex, logits, sum(widths[:comm.rank]), k)
    return collective(comm, group, "sharded_topk", agree, {"V_local": v_local}, err, (), body)


def sample(logits: Tensor, *, seed, offset, temperature: float = 1.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, min_p: Optional[float] = None) -> Tensor:
    """One token per row of ``logits (N, V)``, drawn exactly from ``softmax(logits / temperature)``
    restricted by the filters: ``(N,)`` int64.

    ``temperature=0`` is greedy (argmax, ties to the lower index). Filters, in this order, ties at
    each cut-off kept: ``top_k`` keeps the ``k`` largest logits (``top_k >= V``: all); ``top_p``
    keeps the smallest set of most probable tokens whose mass reaches ``top_p`` (the crossing token
    included; a mass within ``configs.SAMPLE_TOP_P_REACH`` of it, the float32 rounding of the
    scaled logits, counts as reaching it), computed on what top-k kept; ``min_p`` keeps
    ``p >= min_p * p_max``. ``seed`` and ``offset`` are ints or ``(N,)`` integer tensors on the
    logits' device (per request, per position; device tensors keep a CUDA graph valid: on CUDA
    nothing is read back to the host). An int ``seed`` is the batch's: the row index is part of
    each row's key, so rows draw independently of each other, identical rows included; an ``(N,)``
    ``seed`` gives each row its own key, and rows with equal seeds and offsets draw with equal
    noise (equal tokens from equal logits), in any batch and slot. A row of all
    ``-inf``, or holding NaN, gives -1; so does a row whose largest scaled logit is ``+inf``
    (sampling only). The token for a given ``(seed, offset, logits)`` is the same on every device
    and equals :func:`sharded_sample` for every split of the vocabulary.
    """
    _logits(logits)
    n, vocab = logits.shape
    spec, plain, ident = _configuration(temperature, top_k, top_p, min_p, vocab)
    seeds = _seed_value("seed", seed, n, logits.device)
    offsets = _seed_value("offset", offset, n, logits.device)
    if use_triton(logits) and n and 0 < vocab < 2 ** 31:
        from . import device as sampling_device  # (imports Triton, which only this path needs)
        x = logits if logits.stride(1) == 1 else logits.contiguous()
        xk = None if spec.greedy or not spec.top_k or spec.top_k < spec.kr else \
            large_top_k(Exchange(None, None, "sample", x.device), x, 0, spec)
        return sampling_device.draw(x, spec, plain, ident, seeds, offsets, xk)
    seeds, _ = _per_row("seed", seeds, n, logits.device)
    offsets, _ = _per_row("offset", offsets, n, logits.device)
    filters = _filters(temperature, top_k, top_p, min_p)
    return _draw(Exchange(None, None, "sample", logits.device), logits, 0, vocab, filters, seeds, offsets)


_IDS = itertools.count()


@lru_cache(maxsize=256)
def _cached_configuration(key: tuple) -> tuple[Spec, bool, int]:
    _, t, _, k, _, p, _, m, vocab = key[:9]
    spec, plain = _spec(*_filters(t, k, p, m), vocab)
    return spec, plain, next(_IDS)


def _configuration(temperature, top_k, top_p, min_p, vocab: int) -> tuple[Spec, bool, int]:
    """``(spec, plain, ident)`` of checked filters over ``vocab`` tokens, kept per configuration (so a
    decode loop checks and builds them once); ``ident`` names the configuration."""
    key = (type(temperature), temperature, type(top_k), top_k, type(top_p), top_p, type(min_p), min_p, vocab,
           configs.SAMPLE_RECORDS_MIN, configs.SAMPLE_RECORDS_MAX, configs.SAMPLE_BINS, configs.SAMPLE_BIN_SPAN,
           configs.SAMPLE_CAP)
    try:
        hash(key)
    except TypeError:
        _filters(temperature, top_k, top_p, min_p)      # an unhashable argument: the named error
        raise
    return _cached_configuration(key)


def _draw(ex: Exchange, logits: Tensor, col0: int, vocab: int, filters, seeds: Tensor, offsets: Tensor) -> Tensor:
    if vocab >= 2 ** 32 - 1:
        raise ValueError(f"logits: a vocabulary of {vocab} tokens does not fit 32-bit token ids")
    if logits.shape[0] == 0 or vocab == 0:
        return torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
    spec, plain = _spec(*filters, vocab)
    return draw(ex, logits, col0, spec, seeds, offsets, plain)


@eager
def sharded_sample(logits: Tensor, *, seed, offset, temperature: float = 1.0, top_k: Optional[int] = None,
                   top_p: Optional[float] = None, min_p: Optional[float] = None, group=None) -> Tensor:
    """:func:`sample` of vocabulary-sharded ``logits (N, V_r)`` (this rank's slice, slices in rank
    order, any widths, 0 allowed), collective over ``group``: global token ids ``(N,)``, identical on
    every rank and to :func:`sample` on the full logits. ``seed`` and ``offset`` (as in
    :func:`sample`: an int seed keys each row with its index, which is the same on every rank) must
    be the same on every rank.

    The logits are never gathered: each pass exchanges per-row records only (one exchange for
    greedy, plain sampling and top-k; min-p and top-p one or two more). The metadata handshake runs
    once per configuration (``splitsoftmax.distributed.session``; ``SPLITSOFTMAX_HANDSHAKE=always``:
    every call); ranks that disagree on ``N``, dtype, the filters or integer seeds and offsets raise
    ``ValueError`` on every rank, as do all ranks when one rejects its arguments.
    """
    comm = as_comm(group)
    agree, err, codes = None, None, (0, 0)
    try:
        _logits(logits)
        filters = _filters(temperature, top_k, top_p, min_p)
        n = logits.shape[0]
        seeds, s_code = _per_row("seed", seed, n, logits.device)
        offsets, o_code = _per_row("offset", offset, n, logits.device)
        agree = {"N": n, "dtype": hs.encode_dtype(logits.dtype), "temperature": hs.encode_float(filters[0]),
                 "top_k": filters[1], "top_p": hs.encode_float(filters[2]), "min_p": hs.encode_float(filters[3])}
        codes = (s_code, o_code)
    except hs.LOCAL_ERRORS as e:
        err = e
    v_local = logits.shape[1] if err is None else 0

    def body(meta: dict, guard):
        widths = meta["V_local"]
        ex = Exchange(comm, guard, "sharded_sample", logits.device)
        return _draw(ex, logits, sum(widths[:comm.rank]), sum(widths), filters, seeds, offsets)
    return collective(comm, group, "sharded_sample", agree, {"V_local": v_local}, err, codes, body)
