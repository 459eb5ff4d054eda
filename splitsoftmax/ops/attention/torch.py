"""Torch path of the attention local ops, blockwise, with the same signatures as the Triton launchers.

Runs on any device (it is what CPU tensors use). The math is the state algebra of
``splitsoftmax.core.state``: each block of keys gives a tile state that is merged into the
running one, so no ``Sq x Sk`` matrix is ever formed (memory ``O(rows * block + Sk * D)``).

The ops take ``q (B, H, Sq, D)``,
``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)``. Causal masking is by offset: query ``i`` sees
key ``j`` iff ``j <= i + diag`` (``diag = 0``: SDPA's top-left alignment); the ``mask`` keyword
adds the variants (windows, documents, key ranges, query offsets, softcap) as per-row key
intervals, and key blocks that no row sees are skipped. Attention tiles are computed in float64
(torch's float32 attention is the accuracy bar, and blockwise float32 math misses it by up to 3x in
the gradients); outputs are float32 (float64 for float64 inputs).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...core.state import (NEG_INF, add_sinks, empty_state, merge, merge_out_lse, safe_max, stat_dtype, tile_state,
                           to_out_lse, weighted_sum)
from ...core.mask import NO_MASK, Mask
from .._triton.configs import CPU_BLOCK_KEYS


def _grouped(q: Tensor, hkv: int) -> Tensor:
    """``q (B, H, Sq, D)`` as ``(B, Hkv, G*Sq, D)``: query head ``h`` reads kv head ``h // G``."""
    b, h, sq, d = q.shape
    return q.reshape(b, hkv, (h // hkv) * sq, d)


def _row_bounds(mask: Mask, causal: bool, diag: int, q: Tensor, sk: int, g: int) -> Optional[tuple]:
    """Each row's visible keys ``[lo, hi)`` (the rule of :mod:`splitsoftmax.core.mask`) as two
    ``(B, 1, G*Sq, 1)`` long tensors for the grouped rows of ``q (B, H, Sq, D)``, or ``None`` when
    every row sees every key."""
    if not causal and mask.lo is None and mask.kv_range is None and mask.rows is None:
        return None
    b, sq, dev = q.shape[0], q.shape[2], q.device
    pos = torch.arange(sq, device=dev).view(1, sq)
    if mask.q_offset is not None:
        pos = pos + mask.q_offset.to(torch.long).view(b, 1)
    lo = torch.zeros(b, sq, dtype=torch.long, device=dev)
    hi = torch.full((b, sq), sk, dtype=torch.long, device=dev)
    if causal:
        hi = torch.minimum(hi, pos + diag + 1)
    if mask.lo is not None:
        lo = torch.maximum(lo, pos + mask.lo)
    if mask.kv_range is not None:
        kv = mask.kv_range.to(torch.long)
        lo, hi = torch.maximum(lo, kv[:, :1]), torch.minimum(hi, kv[:, 1:])
    if mask.rows is not None:
        rows = mask.rows.to(torch.long)
        lo, hi = torch.maximum(lo, rows[:1]), torch.minimum(hi, rows[1:])
    return tuple(t.repeat(1, g).view(b, 1, g * sq, 1) for t in (lo, hi))


def _key_blocks(bounds: Optional[tuple], mask: Mask, sq: int, sk: int, causal: bool, diag: int) -> list[int]:
    """Starts of the key blocks some row sees (the others are never read). Read on the host only for
    CPU bounds; elsewhere the causal edge alone prunes (no synchronisation), when no tensor offset moves it."""
    starts = range(0, sk, CPU_BLOCK_KEYS)
    if bounds is None or bounds[0].device.type != "cpu":
        end = max(0, min(sk, sq + diag)) if causal and mask.q_offset is None else sk
        return [j for j in starts if j < end]
    lo, hi = (t.flatten() for t in bounds)
    lo, hi = lo[lo < hi], hi[lo < hi]
    if lo.numel() == 0:
        return []
    j = torch.tensor(list(starts), dtype=torch.long)
    seen = ((lo.view(1, -1) < (j + CPU_BLOCK_KEYS).view(-1, 1)) & (hi.view(1, -1) > j.view(-1, 1))).any(1)
    return j[seen].tolist()


def _block_scores(qg: Tensor, kb: Tensor, scale: float, j0: int, bounds: Optional[tuple],
                  softcap: float) -> tuple[Tensor, Optional[Tensor]]:
    """Scaled (and capped) scores ``(B, Hkv, G*Sq, n)`` of the key block starting at ``j0``, hidden
    keys ``-inf``; and ``tanh(s / softcap)`` of the visible scores for the cap's derivative (or ``None``)."""
    s = (qg @ kb.transpose(-1, -2)) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if bounds is not None:
        kpos = j0 + torch.arange(kb.shape[2], device=qg.device)
        s = s.masked_fill((kpos < bounds[0]) | (kpos >= bounds[1]), NEG_INF)
    return s, t


def attn_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, diag: int = 0,
             out_dtype: Optional[torch.dtype] = None, *, mask: Mask = NO_MASK,
             sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Partial attention: ``(out (B, H, Sq, Dv), lse (B, H, Sq))``, empty rows ``(0, -inf)``.

    ``lse`` and ``out`` are float32 (float64 for float64 inputs); ``out_dtype`` overrides ``out``.
    ``mask``: the variants' visibility and softcap (see :mod:`splitsoftmax.core.mask`). The tiles and the
    state are float64 whatever the inputs, so ``lse`` is exact to its last rounding (the backward's
    ``exp(S - lse)`` would otherwise carry the float32 scores' error of this pass). ``sinks (H,)``:
    merged into the float64 result (:func:`splitsoftmax.core.state.add_sinks`): the row is final.
    """
    b, h, sq, _ = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    dt, acc = stat_dtype(q.dtype), torch.float64
    qg = _grouped(q, hkv).to(acc)
    bounds = _row_bounds(mask, causal, diag, q, sk, h // hkv)
    s = empty_state(qg.shape[:3], dv, dtype=acc, device=q.device)
    for j in _key_blocks(bounds, mask, sq, sk, causal, diag):
        kb, vb = k[:, :, j:j + CPU_BLOCK_KEYS].to(acc), v[:, :, j:j + CPU_BLOCK_KEYS].to(acc)
        s = merge(s, tile_state(_block_scores(qg, kb, scale, j, bounds, mask.softcap)[0], vb))
    out, lse = to_out_lse(s)
    out, lse = out.reshape(b, h, sq, dv), lse.reshape(b, h, sq)  # (sizes spelled out: any may be 0)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(out_dtype or dt), lse.to(dt)


def attn_runner(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> None:
    """The torch path keeps no runner of a plain forward (the Triton forward's ``attn_runner``)."""
    return None


def attn_bwd_runner(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, scale: float,
                    causal: bool, diag: int) -> None:
    """The torch path keeps no runner of a plain backward (the Triton backward's ``attn_bwd_runner``)."""
    return None


def attn_fwd_acc(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, diag: int,
                 acc_out: Tensor, acc_lse: Tensor, *, mask: Mask = NO_MASK) -> None:
    """Merge this block's attention into the running state ``acc_out (B, H, Sq, Dv)``,
    ``acc_lse (B, H, Sq)`` in place (any strides): a ring step with no separate merge pass."""
    out, lse = attn_fwd(q, k, v, scale, causal, diag, mask=mask)
    merged, merged_lse = merge_out_lse(torch.stack((acc_out, out.to(acc_out.dtype))),
                                       torch.stack((acc_lse, lse.to(acc_lse.dtype))))
    acc_out.copy_(merged)
    acc_lse.copy_(merged_lse)


def attn_bwd_prep(out: Tensor, lse: Tensor, dout: Tensor, dlse: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(lse, delta)`` rows ``(B, H, Sq)`` for :func:`attn_bwd` from ``out, dout (B, H, Sq, Dv)``.

    ``delta = rowsum(dout * out) - dlse`` (a gradient through ``lse`` enters as ``-dlse``, since
    ``d lse / d s = p``), summed in float64: the backward subtracts it from ``dout . v_j``, and in a
    row of few keys the two nearly cancel. A row whose cotangents are all zero contributes nothing:
    its ``lse`` becomes ``-inf`` (the empty row), so a NaN in that row's ``out`` (a visible NaN
    input) cannot reach other rows' gradients through ``0 * NaN``.
    """
    nz = dout != 0
    delta = torch.where(nz, dout.to(torch.float64) * out.to(torch.float64), 0.0).sum(-1)
    active = nz.any(-1)
    if dlse is not None:
        delta = delta - dlse.to(torch.float64)
        active = active | (dlse != 0)
    return torch.where(active, lse, NEG_INF).contiguous(), delta.to(lse.dtype).contiguous()


def attn_bwd(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor,
             scale: float, causal: bool, diag: int = 0, out_dtype: Optional[torch.dtype] = None, *,
             mask: Mask = NO_MASK, rowsum: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` (float32, float64 for float64 inputs; else ``out_dtype``) of one
    Q/K/V block pair.

    ``lse (B, H, Sq)`` and ``delta = rowsum(dout * out) (B, H, Sq)`` are the global statistics of
    each query row, so a shard's contribution needs only its own keys. GQA gradients are summed
    over the query heads of each kv head. The tiles are computed in float64 whatever the inputs:
    in float32, ``P = exp(S - lse)`` and ``dS = P (dout . v_j - delta)`` lose up to a few ulps of
    ``lse`` and of the difference (which cancels in rows whose weight sits on few keys), twice the
    error of torch's float32 attention; in float64 only the final rounding remains. ``rowsum``: a
    float64 ``(2, B, H, Sq)`` buffer that receives ``sum_j P_ij dout_i . v_j`` and ``sum_j P_ij`` over
    these keys (``dout . out`` without the rounding of ``out``, and the row's mass under the given
    ``lse``: what an exact sinks' gradient needs).
    """
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = h // hkv
    dt, acc = stat_dtype(q.dtype), torch.float64
    qg, dog = _grouped(q, hkv).to(acc), _grouped(dout, hkv).to(acc)
    lse_g = safe_max(lse.reshape(b, hkv, g * sq).to(acc)).unsqueeze(-1)
    empty = (lse.reshape(b, hkv, g * sq) == NEG_INF).unsqueeze(-1)
    delta_g = delta.reshape(b, hkv, g * sq, 1).to(acc)
    bounds = _row_bounds(mask, causal, diag, q, sk, h // hkv)
    dq = torch.zeros_like(qg)
    dk = torch.zeros(k.shape, dtype=dt, device=k.device)
    dv = torch.zeros(v.shape, dtype=dt, device=v.device)
    for j in _key_blocks(bounds, mask, sq, sk, causal, diag):
        kb, vb = k[:, :, j:j + CPU_BLOCK_KEYS].to(acc), v[:, :, j:j + CPU_BLOCK_KEYS].to(acc)
        s, t = _block_scores(qg, kb, scale, j, bounds, mask.softcap)
        p = torch.exp(s - lse_g).masked_fill(empty, 0.0)  # [B, Hkv, G*Sq, n]
        dv[:, :, j:j + CPU_BLOCK_KEYS] = weighted_sum(p.transpose(-1, -2), dog)
        dp = torch.where(p != 0, dog @ vb.transpose(-1, -2), 0.0)
        if rowsum is not None:
            rowsum.view(2, b, hkv, g * sq).add_(torch.stack(((p * dp).sum(-1), p.sum(-1))))
        ds = torch.where(p != 0, p * (dp - delta_g), 0.0)
        if t is not None:
            ds = torch.where(p != 0, ds * (1.0 - t * t), 0.0)  # d(c tanh(s / c)) / ds
        dq += weighted_sum(ds, kb) * scale
        dk[:, :, j:j + CPU_BLOCK_KEYS] = weighted_sum(ds.transpose(-1, -2), qg) * scale
    return tuple(t.to(out_dtype or dt) for t in (dq.reshape(b, h, sq, d), dk, dv))
