"""The tree schedule of sharded attention (split-KV: ``q`` replicated, K/V contiguous shards, causal
bottom-right aligned over the global key sequence): each rank attends its keys, and the partial
states are merged in rank order after the fixed-order all-gather of ``distributed/tree.py``. Under the
variant keywords (all but ``cu_seqlens``) the queries sit at key positions ``q_offset + i`` (default
``Sk - Sq``); with an int offset a rank whose keys no query sees launches nothing (its partial is the
empty state), with a device tensor the offset travels in the local op's mask."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ....core import state
from ....distributed import plan as pl
from ....distributed.comm import Communicator
from ....distributed.tree import allgather, allreduce_sum
from ....distributed.work import AttnSpec, Call, make_mask
from ..._registry import masked_op, op
from ..op import bwd_call, sink_total


def tree_call(spec: AttnSpec, sq: int) -> Optional[Call]:
    """This rank's call over its keys (None: no query sees them); the queries sit at key positions
    ``q_offset + i`` (default ``Sk - Sq``: bottom-right)."""
    kw, off, n = spec.kw, sum(spec.k_lens[:spec.rank]), spec.k_lens[spec.rank]
    qoff = sum(spec.k_lens) - sq if kw.q_offset is None else kw.q_offset
    b = pl.band(spec.causal, kw.window)
    on_device = isinstance(qoff, Tensor)
    piece = pl.tree_piece(sq, off, n, b, None if on_device else qoff)
    if piece is None:
        return None
    kv = None if kw.kv_range is None else kw.kv_range - (off + piece.k)
    banded = b.lo is not None or b.hi is not None
    mask = make_mask(kw.softcap, piece.lo, kv, (qoff - off) if on_device and banded else None)
    return Call(piece.q, piece.nq, piece.k, piece.nk, piece.causal, piece.diag, mask)


def _empty(q: Tensor, dv: int) -> tuple[Tensor, Tensor]:
    return state.to_out_lse(state.empty_state(q.shape[:3], dv, dtype=state.stat_dtype(q.dtype), device=q.device))


def local_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, call: Optional[Call]) -> tuple[Tensor, Tensor]:
    """This rank's partial ``(out (B,H,Sq,Dv), lse (B,H,Sq))`` of ``call`` (None: the empty state)."""
    if call is None:
        return _empty(q, v.shape[-1])
    ks = slice(call.k, call.k + call.nk)
    if call.q == 0 and call.nq == q.shape[2]:
        return masked_op("attn_fwd", q, call.mask)(q, k[:, :, ks], v[:, :, ks], scale, call.causal, call.diag)
    out, lse = _empty(q, v.shape[-1])
    qs = slice(call.q, call.q + call.nq)
    masked_op("attn_fwd_acc", q, call.mask)(q[:, :, qs], k[:, :, ks], v[:, :, ks], scale, call.causal, call.diag,
                                            out[:, :, qs], lse[:, :, qs])
    return out, lse


def early_local(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, kw) -> Optional[tuple[Tensor, Tensor]]:
    """The partial state when it needs nothing from the peers (no band, no kv_range), else None:
    started before the handshake completes, it hides the handshake's round trip."""
    if causal or kw.window is not None or kw.kv_range is not None:
        return None
    with torch.no_grad():
        mask = make_mask(kw.softcap)
        return local_attention(q, k, v, scale, Call(0, q.shape[2], 0, k.shape[2], False, 0, mask))


def tree_attention_fwd(comm: Communicator, spec: AttnSpec, q: Tensor, k: Tensor, v: Tensor,
                       local: Optional[tuple[Tensor, Tensor]] = None):
    """``(out (B,H,Sq,Dv), lse (B,H,Sq))`` in the accumulation dtype, identical on every rank.

    ``local``: this rank's partial state when already computed (:func:`early_local`)."""
    out, lse = local if local is not None else local_attention(q, k, v, spec.scale, tree_call(spec, q.shape[2]))
    dt = state.stat_dtype(q.dtype)
    packed = torch.cat((out.to(dt), lse.to(dt).unsqueeze(-1)), dim=-1)  # [B, H, Sq, Dv+1]
    parts = allgather(comm, packed.reshape(-1), "tree forward").view(comm.size, *packed.shape)
    return op("merge_out_lse", parts)(parts[..., :-1], parts[..., -1])  # fixed order: same on every rank


def tree_attention_bwd(comm: Communicator, spec: AttnSpec, q, k, v, dout, lse, delta, sink: Optional[list] = None):
    """``(dq summed over ranks, dk, dv local)``, float32; ``sink``: the sums for the sinks' gradient
    (``op.bwd_call``) over every rank's keys, summed over the ranks (zeros where none ran)."""
    call = tree_call(spec, q.shape[2])
    dt = state.stat_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    dk = torch.zeros(k.shape, dtype=dt, device=q.device)
    dv = torch.zeros(v.shape, dtype=dt, device=q.device)
    if call is not None:
        qs, ks = slice(call.q, call.q + call.nq), slice(call.k, call.k + call.nk)
        dqp, dkp, dvp = bwd_call(masked_op("attn_bwd", q, call.mask),
                                 (q[:, :, qs], k[:, :, ks], v[:, :, ks], dout[:, :, qs].contiguous(), lse[:, :, qs],
                                  delta[:, :, qs], spec.scale, call.causal, call.diag), sink)
        dq[:, :, qs], dk[:, :, ks], dv[:, :, ks] = dqp, dkp, dvp
    if sink is not None:
        sink[1] = allreduce_sum(comm, sink_total(sink, q), "tree backward: sum of the sinks' sums")
    return allreduce_sum(comm, dq, "tree backward: sum of dq"), dk, dv
