"""Public sharded attention (docs/API.md, "Across ranks") and its autograd Function.

Every call: local argument checks, then the metadata handshake (``distributed/handshake.py``) so
that a mismatch raises on every rank before any bulk transfer, then the schedule
(``schedules/``). The gradient of each rank's local input is that rank's slice of the
single-device gradient.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...core import state
from ...distributed import attn_meta
from ...core.checks import MESH_SCHEDULES
from ...distributed.comm import eager
from ...distributed.mesh import as_group
from ...distributed.work import AttnSpec
from .op import backward_stats, sink_total
from .schedules.allgather import allgather_attention_bwd, allgather_attention_fwd
from .schedules.heads import heads_attention, mesh_attention
from .schedules.ring import plan_of, ring_attention_bwd, ring_attention_fwd
from .schedules.tree import early_local, tree_attention_bwd, tree_attention_fwd

_FWD = {"ring": ring_attention_fwd, "allgather": allgather_attention_fwd, "tree": tree_attention_fwd}
_BWD = {"ring": ring_attention_bwd, "allgather": allgather_attention_bwd, "tree": tree_attention_bwd}


class ShardedAttentionFn(torch.autograd.Function):
    """Attention over a sharded sequence by ``schedule``: ``(out, lse)`` of this rank. ``sinks``
    (``(H,)`` or None) are merged once per row after every key partial."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, comm, spec: AttnSpec, schedule: str, local):
        out, lse = _FWD[schedule](comm, spec, q, k, v, *([local] if local is not None else []))
        if sinks is not None:
            out, lse = state.add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.comm, ctx.spec, ctx.schedule = comm, spec, schedule
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        lse, delta = backward_stats(out, lse, dout, dlse)
        # with sinks the local backwards also sum rowsum(dout * out) from their own P and dP (op.bwd_call;
        # whether or not this rank's sinks want a gradient: the tree sums them over every rank)
        sink = [sinks, None] if sinks is not None else None
        dq, dk, dv = _BWD[ctx.schedule](ctx.comm, ctx.spec, q, k, v, dout, lse, delta, sink)
        dsinks = None
        if sink is not None and ctx.needs_input_grad[3]:
            dsinks = state.sink_grad(lse, None if dlse is None else -dlse, sinks, sink_total(sink, q))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None


def _spec(comm, q, k, v, s: float, causal: bool, layout: str, schedule: str, kw, lens: tuple) -> AttnSpec:
    """The agreed spec; ring / allgather with their plan (kept for the next calls alike)."""
    (b, h, _, d), hkv, dv = q.shape, k.shape[1], v.shape[-1]
    q_lens, k_lens = lens[:2]
    planned = None
    if schedule != "tree":
        planned = plan_of(comm.rank, q_lens, k_lens, layout, causal, kw.docs, kw.window)
    return AttnSpec(b, h, hkv, d, dv, s, causal, layout, q_lens, k_lens, comm.rank, kw, planned)


@eager
def sharded_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
                      group=None, schedule: str = "ring", layout: str = "contiguous", return_lse: bool = False,
                      cu_seqlens=None, window_size=None, softcap=None, sinks=None, kv_range=None, q_offset=None):
    """Exact attention over a sequence sharded across the ranks of ``group`` (collective).

    ``"ring"``/``"allgather"``: ``q (B,H,Sq_r,D)``, ``k (B,Hkv,Sk_r,D)``, ``v (B,Hkv,Sk_r,Dv)`` are
    this rank's shards (``layout`` ``"contiguous"``: any lengths; ``"zigzag"``: chunks r, 2P-1-r,
    of every document with ``cu_seqlens``; ``"balanced"``, which needs ``cu_seqlens``: short
    documents whole on one rank each, long ones zigzagged, ``distributed.layout.balanced``); returns
    this rank's shard of the output (and ``lse (B,H,Sq_r)`` float32). ``"tree"``: ``q`` is the same on every rank, k/v contiguous
    shards; the result is identical on every rank and the queries sit at key positions
    ``q_offset + i`` (default ``Sk - Sq``: ``causal`` is bottom-right). Causal everywhere means a
    query at global position ``i`` sees keys at ``j <= i``. ``"heads"`` takes and returns what the ring
    does: an all-to-all gives each rank the whole sequence of its share of the heads
    (``torch.tensor_split`` of ``H``; the kv heads they read, ``Hkv < P`` too), runs the local op
    there and sends the output back (``schedules/heads.py``).

    ``group`` may be a 2-D mesh: a 2-D ``DeviceMesh`` (dim 0 sequence, dim 1 heads) or a tuple
    ``(seq_group, heads_group)``, with ``schedule="heads+ring"`` or ``"heads+allgather"`` (and only
    those). The sequence is sharded over the sequence dim by ``layout``, each shard split like
    ``torch.tensor_split`` over the heads dim (``ss.shard(x, 2, group=mesh, ...)`` makes exactly this);
    ``q (B,H,n,D)`` is this rank's piece, all heads. The all-to-all runs in the heads group, the ring (or
    all-gather) over the sequence group on its heads; the result is this rank's piece of the output.

    The variant keywords (docs/API.md, "Attention variants") are in global positions:
    ``cu_seqlens (N+1,)`` packed documents (ring / allgather), ``window_size=(left, right)``,
    ``softcap``, ``sinks (H,)`` (merged once per row; under ring / allgather each rank's gradient
    is its rows' share, under tree the full one), ``kv_range (B, 2)``, ``q_offset`` (0 on ring /
    allgather). All must agree across ranks. Steps with nothing visible transfer and launch
    nothing; under a window only the halo of keys travels.
    """
    comm = as_group(group)
    keywords = dict(cu_seqlens=cu_seqlens, window_size=window_size, softcap=softcap, sinks=sinks,
                    kv_range=kv_range, q_offset=q_offset)
    finish, s, kw = attn_meta.start(comm, q, k, v, causal, scale, schedule, layout, return_lse, keywords)
    try:
        local = early_local(q, k, v, s, causal, kw) if schedule == "tree" and s is not None else None
    except Exception:  # the handshake's transfers are posted: complete them (bounded) before raising
        _complete(finish)
        raise
    lens = finish()
    if schedule == "heads" and comm.size == 1:  # every head is this rank's: the ring's one-rank path
        schedule = "ring"
    elif schedule in MESH_SCHEDULES and comm.shape[1] == 1:  # heads degree 1: the sequence schedule
        comm, schedule = comm.seq, schedule.split("+")[1]
    if schedule == "heads":
        out, lse = heads_attention(comm, q, k, v, s, causal, layout, kw, lens)
    elif schedule in MESH_SCHEDULES:
        out, lse = mesh_attention(comm, q, k, v, s, causal, layout, kw, lens, schedule)
    else:
        spec = _spec(comm, q, k, v, s, causal, layout, schedule, kw, lens)
        out, lse = ShardedAttentionFn.apply(q, k, v, kw.sinks, comm, spec, schedule, local)
    return (out, lse) if return_lse else out


def _complete(finish) -> None:
    """Wait for a started handshake whose call is already failing; its own errors give way to that one."""
    try:
        finish()
    except Exception:
        pass
