"""Host-side choices of the attention kernels: tiles per head dim, GQA packing, split-KV plan.

Split-KV (flash-decoding): when the forward would launch fewer than
``ATTN_SPLIT_PROGRAMS_PER_SM`` programs per SM (few query rows, long keys), the visible keys
are cut into ``nsplit`` chunks of whole ``BLOCK_N`` tiles, one program per (rows, chunk); each
writes a float32 partial ``(out, lse)`` and the fused merge kernel combines them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ...core.runtime import interpreting
from ...core.mask import NO_MASK, Mask
from .._triton import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)
from .._triton import configs
from .kernel_mask import key_range
from .._triton.device import sm_count
from .._triton.configs import ATTN_PACK_MAX_SQ, ATTN_TILE_DEFAULT, ATTN_TILE_INTERPRET, ATTN_TILES


class Plan(NamedTuple):
    """How one forward runs: ``tile (BLOCK_M, BLOCK_N, warps, stages)``, packing, key split: split
    ``s`` covers keys ``start + s * chunk ..`` (``start`` a multiple of ``BLOCK_N``)."""

    tile: tuple
    pack: bool
    nsplit: int
    chunk: int
    start: int = 0


def pad_dim(d: int) -> int:
    """Head dim padded to the power of two a tile holds (at least 16, for ``tl.dot``)."""
    return max(16, configs.next_pow2(d))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision: full IEEE for float32/64 inputs (no tf32 rounding), native otherwise."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def attn_tile(kind: str, dtype: torch.dtype, d: int, dv: int, fallback: Optional[str] = None) -> tuple:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of ``kind`` for these inputs (configs.ATTN_TILES),
    else of ``fallback`` if given, else ATTN_TILE_DEFAULT."""
    if interpreting():
        return ATTN_TILE_INTERPRET
    size = 2 if dtype.itemsize <= 2 else 4
    want = pad_dim(max(d, dv))
    if (kind, size, want) in ATTN_TILES:
        return ATTN_TILES[(kind, size, want)]
    dims = sorted(hd for (kd, sz, hd) in ATTN_TILES if kd == kind and sz == size and hd >= want)
    if dims:
        return ATTN_TILES[(kind, size, dims[0])]
    return attn_tile(fallback, dtype, d, dv) if fallback else ATTN_TILE_DEFAULT


def head_group(blocks: int, heads: int, t: Tensor, causal: bool, warps: int) -> int:
    """Heads per group of a ``(blocks, heads)`` grid's launch order (``attention._program_order``)
    for programs of ``warps`` warps (taken as ``8 // warps`` per SM): 1 unless ``causal`` and the
    grid fills fewer than ``configs.ATTN_ORDER_MAX_WAVES`` waves, else the fewest heads whose blocks
    fill ``configs.ATTN_ORDER_WAVES`` waves, evened out over the groups."""
    slots = sm_count(t) * max(1, 8 // warps)
    if (not causal or configs.ATTN_ORDER_WAVES <= 0 or heads <= 1
            or blocks * heads >= configs.ATTN_ORDER_MAX_WAVES * slots):
        return 1
    want = min(heads, configs.cdiv(configs.ATTN_ORDER_WAVES * slots, max(blocks, 1)))
    return configs.cdiv(heads, configs.cdiv(heads, want))


def visible_keys(sq: int, sk: int, causal: bool, diag: int) -> int:
    """How many leading keys any query may see."""
    return max(0, min(sk, sq - 1 + diag + 1)) if causal else sk


# plans of the plain mask by shapes, dtype, device and the settings they read: a repeated call is one
# lookup (``configs.ATTN_TILES`` is read once per shape: an entry changed in place reaches new shapes)
_PLANS: dict = {}


def plan_settings(q: Tensor) -> tuple:
    """What a plain plan reads besides its shapes (part of the keys it is kept under: tests change the
    settings): the settings, and the SMs of ``q``'s device."""
    return (configs.ATTN_SHORT_CAUSAL_SQ, configs.ATTN_SPLIT_PROGRAMS_PER_SM, configs.ATTN_SPLIT_MIN_TILES,
            configs.ATTN_SHORT_SPLIT_TILES, configs.ATTN_SHORT_SPLIT_STAGES, id(configs.ATTN_TILES), sm_count(q))


def plan(q: Tensor, k: Tensor, v: Tensor, causal: bool, diag: int, mask: Mask = NO_MASK) -> Plan:
    """Tiles, packing and split for ``q (B, H, Sq, D)`` over ``k (B, Hkv, Sk, D)``, ``v``; the splits
    cover the keys some row may see (``attn_mask.key_range``)."""
    if mask is not NO_MASK:
        return _plan(q, k, v, causal, diag, mask)
    key = (q.shape, k.shape, v.shape[-1], q.dtype, q.get_device(), causal, diag, plan_settings(q))
    p = _PLANS.get(key)
    if p is None:
        if len(_PLANS) >= 1024:
            _PLANS.clear()
        p = _PLANS[key] = _plan(q, k, v, causal, diag, mask)
    return p


def _plan(q: Tensor, k: Tensor, v: Tensor, causal: bool, diag: int, mask: Mask) -> Plan:
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    pack = sq <= ATTN_PACK_MAX_SQ
    rows = (h // hkv) * sq if pack else sq
    if pack:
        bm, bn, warps, stages = attn_tile("decode", q.dtype, d, dv)
    elif causal and sq <= configs.ATTN_SHORT_CAUSAL_SQ:
        bm, bn, warps, stages = attn_tile("fwd_causal_short", q.dtype, d, dv, fallback="fwd")
    else:
        bm, bn, warps, stages = attn_tile("fwd", q.dtype, d, dv)
    if pack and not interpreting():
        bm = min(64, max(16, configs.next_pow2(rows)))
    tile = (bm, bn, warps, stages)
    programs = configs.cdiv(rows, bm) * b * (hkv if pack else h)
    target = configs.ATTN_SPLIT_PROGRAMS_PER_SM * sm_count(q)
    k0, k1 = key_range(sq, sk, causal, diag, mask)
    start = (k0 // bn) * bn
    keys = k1 - start
    nsplit = 1
    if programs < target:  # whole splits up to the target, never a second, partial wave
        nsplit = max(1, min(target // programs, keys // (bn * configs.ATTN_SPLIT_MIN_TILES)))
    chunk = configs.cdiv(max(sk - start, 1), bn) * bn
    if nsplit > 1:
        chunk = configs.cdiv(configs.cdiv(keys, nsplit), bn) * bn
        nsplit = configs.cdiv(keys, chunk)
        if pack and chunk // bn <= configs.ATTN_SHORT_SPLIT_TILES:
            tile = (bm, bn, warps, min(stages, configs.ATTN_SHORT_SPLIT_STAGES))
    return Plan(tile, pack, nsplit, chunk, start)
