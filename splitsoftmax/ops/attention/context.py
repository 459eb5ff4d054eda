"""``context_parallel``: a block in which buffers are sharded along their sequence dims and every
``torch.nn.functional.scaled_dot_product_attention`` call runs as ``sharded_attention``
(docs/API.md, "Context parallelism for torch models").

Entering the block: local checks of the arguments, one handshake (so that a rank's refusal, or
ranks that disagree on the layout, the schedule, the number of buffers or the sequence length,
raise ``ValueError`` on every rank), then ``shard`` of each buffer with the block's layout, put in
place with ``Tensor.set_`` (the buffer object keeps its identity: module buffers and inputs held
elsewhere see the shard). Leaving it, normally or by an exception, each buffer is ``set_`` back
to its original storage, sizes and strides: nothing is copied and no rank communicates, so a
rank that raised inside the block restores as well as the others.

Inside, a ``TorchFunctionMode`` catches the SDPA calls of any module. Each call is translated to
``sharded_attention`` keywords; what has no exact translation is refused through the attention
handshake, so every rank raises together (the refusing rank with its own message).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ...core import checks as _checks
from ...core.autocast import like_sdpa
from ...distributed import layout as lay
from ...distributed.comm import Communicator, as_comm
from ...distributed.handshake import LOCAL_ERRORS, handshake
from ...distributed.shard import shard
from .sharded import sharded_attention

SEQ_SCHEDULES = tuple(s for s in _checks.SCHEDULES if s != "tree" and s not in _checks.MESH_SCHEDULES)  # 1-d, q like k
_SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_active = threading.local()  # the block open on this thread (ranks of a loopback world are threads)
_attention = like_sdpa(sharded_attention)


def _refuse(comm: Communicator, op: str, error: BaseException):
    """Raise ``error`` here and a ``ValueError`` naming this rank on the others (in ``op``'s handshake)."""
    handshake(comm, op, None, None, error)
    raise error


def bind_sdpa(args: tuple, kwargs: dict) -> dict:
    """SDPA's arguments by name, its defaults filled in (torch's argument parser has already refused
    unknown, missing and repeated ones before the mode sees the call)."""
    return {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args)), **kwargs}


def _hidden(mask: Tensor) -> Tensor:
    """Where an additive mask hides a key: ``-inf`` or the dtype's lowest finite value."""
    return (mask == float("-inf")) | (mask <= torch.finfo(mask.dtype).min)


def mask_is_causal(mask: Tensor, batch: int, heads: int, sizes: tuple) -> bool:
    """What ``attn_mask`` reduces to: False (every key visible), True (causal: the lower triangle of
    its last two dims, diagonal included, for every leading index), else ``ValueError``.

    A boolean mask keeps ``True``; an additive one keeps ``0`` and hides ``-inf`` (or the lowest
    finite value of its dtype). Leading dims broadcast to ``(B, H)``; each of the last two is 1 or
    one of ``sizes`` (this rank's sequence length, and the full one when the block knows it).
    One host read per call.
    """
    if not isinstance(mask, Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise ValueError(f"attn_mask must be a boolean or floating tensor, got {getattr(mask, 'dtype', type(mask))}")
    shape = tuple(mask.shape)
    lead_ok = len(shape) >= 2 and len(shape) <= 4 and all(
        n in (1, want) for n, want in zip(reversed(shape[:-2]), (heads, batch)))
    if not lead_ok or any(n not in (1, *sizes) for n in shape[-2:]):
        raise ValueError(f"attn_mask of shape {shape} does not broadcast to (B, H, S, S) = ({batch}, {heads}, S, S) "
                         f"with S one of {sorted(set(sizes))}")
    mask = mask.detach()
    if mask.dtype == torch.bool:
        visible, clean = mask, torch.ones((), dtype=torch.bool, device=mask.device)
    else:
        visible, hidden = mask == 0, _hidden(mask)
        clean = (visible | hidden).all()
    n = shape[-1]
    tri = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    causal = (visible == tri).all() if shape[-2] == n > 1 else torch.zeros((), dtype=torch.bool, device=mask.device)
    clean, everything, causal = torch.stack([clean, visible.all(), causal]).tolist()
    if not clean:
        raise ValueError("attn_mask: an additive mask must hold only 0 (visible) and -inf (hidden); other values "
                         "change the scores, which ss.context_parallel cannot express")
    if everything or causal:
        return bool(causal and not everything)
    raise ValueError(f"attn_mask of shape {shape} is neither all visible nor causal (the lower triangle): "
                     f"ss.context_parallel runs only masks that reduce to is_causal; pass is_causal=True, or call "
                     f"ss.sharded_attention with the variant keywords (cu_seqlens, window_size, kv_range)")


class _SdpaMode(TorchFunctionMode):
    """Every ``scaled_dot_product_attention`` call as ``sharded_attention`` over ``comm``; other calls
    unchanged. ``full`` is the sequence length of the block's buffers (None without buffers)."""

    def __init__(self, comm: Communicator, layout: str, schedule: str, full: Optional[int]):
        super().__init__()
        self.comm, self.layout, self.schedule, self.full = comm, layout, schedule, full
        self.local = None if full is None else lay.shard_lengths(full, comm.size, layout)[comm.rank]
        self.seen: tuple = (None, -1, False)  # the last mask checked, its version and what it meant

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not _SDPA:
            return func(*args, **(kwargs or {}))
        try:
            a = bind_sdpa(args, kwargs or {})
            causal = self.translate(a)
        except LOCAL_ERRORS as e:
            _refuse(self.comm, "sharded_attention", e)
        return _attention(a["query"], a["key"], a["value"], causal=causal, scale=a["scale"], group=self.comm,
                          schedule=self.schedule, layout=self.layout)

    def translate(self, a: dict) -> bool:
        """Check one call's SDPA arguments; return the ``causal`` it means."""
        q, k, v = a["query"], a["key"], a["value"]
        for name, t in (("query", q), ("key", k), ("value", v)):
            _checks.tensor(name, t)
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D (B, H, S, D) under ss.context_parallel, got {tuple(t.shape)}")
            self.check_length(name, t)
        if a["dropout_p"] != 0:
            raise ValueError(f"dropout_p={a['dropout_p']!r}: ss.context_parallel runs attention without dropout "
                             f"(pass dropout_p=0.0, e.g. in eval mode or a model without attention dropout)")
        causal, gqa = _checks.flag("is_causal", a["is_causal"]), _checks.flag("enable_gqa", a["enable_gqa"])
        if not gqa and k.shape[1] != q.shape[1]:
            raise ValueError(f"enable_gqa=False but query has {q.shape[1]} heads and key {k.shape[1]}: pass "
                             f"enable_gqa=True for grouped-query attention, as scaled_dot_product_attention requires")
        if a["attn_mask"] is None:
            return causal
        if causal:
            raise ValueError("attn_mask must be None when is_causal=True (as in scaled_dot_product_attention)")
        return self.mask_causal(a["attn_mask"], q)

    def check_length(self, name: str, t: Tensor) -> None:
        """The layout mistake: dim 2 of ``t`` must be this rank's share of the buffers' sequence."""
        if self.local is None or t.shape[2] == self.local:
            return
        hint = " it looks like (B, S, H, D): pass x.transpose(1, 2)" if t.shape[1] == self.local else ""
        raise ValueError(f"{name} of shape {tuple(t.shape)} has {t.shape[2]} positions at dim 2, but this rank holds "
                         f"{self.local} of the {self.full} the buffers were sharded from: q, k, v must be "
                         f"(B, H, S, D) with S this rank's shard;{hint}")

    def mask_causal(self, mask, q: Tensor) -> bool:
        """:func:`mask_is_causal`, remembered for the last mask while it is unmodified (the layers
        of one step usually share one mask)."""
        last, version, causal = self.seen
        if mask is last and mask._version == version:
            return causal
        sizes = (q.shape[2],) if self.full is None else (q.shape[2], self.full)
        causal = mask_is_causal(mask, q.shape[0], q.shape[1], sizes)
        self.seen = (mask, mask._version, causal)
        return causal


def _check_block(buffers, dims, layout: str, schedule: str) -> tuple[list, list, Optional[int]]:
    """The block's local checks: ``(buffers, seq dims, full sequence length or None)``."""
    if getattr(_active, "open", False):
        raise ValueError("context_parallel: this thread is already inside an ss.context_parallel block; blocks do "
                         "not nest (shard every buffer in one block)")
    _checks.choice("layout", layout, _checks.LAYOUTS)
    if layout == "balanced":
        raise ValueError("context_parallel: layout='balanced' places packed documents (cu_seqlens), which "
                         "scaled_dot_product_attention calls do not carry; use layout='zigzag' or 'contiguous'")
    _checks.choice("schedule", schedule, SEQ_SCHEDULES)
    buffers, dims = list(buffers), list(dims)
    if len(buffers) != len(dims):
        raise ValueError(f"buffer_seq_dims must give one dim per buffer: {len(buffers)} buffers, {len(dims)} dims")
    lengths = []
    for i, (b, d) in enumerate(zip(buffers, dims)):
        _checks.tensor(f"buffers[{i}]", b, floating=False)
        if b.requires_grad or isinstance(b, torch.nn.Parameter):
            raise ValueError(f"buffers[{i}] requires grad: buffers are sharded in place, outside autograd; pass "
                             f"inputs, labels and position buffers, and shard differentiable tensors with ss.shard")
        if any(b is c for c in buffers[:i]):
            raise ValueError(f"buffers[{i}] is the same tensor as an earlier buffer (it would be sharded twice)")
        if b.dim() == 0:
            raise ValueError(f"buffers[{i}] is 0-d: it has no sequence dim to shard")
        dims[i] = _checks.dim(f"buffer_seq_dims[{i}]", d, b.dim())
        lengths.append(b.shape[dims[i]])
    if len(set(lengths)) > 1:
        raise ValueError(f"buffers have different lengths along their sequence dims ({lengths}): positions agree "
                         f"only between buffers of one sequence length")
    return buffers, dims, (lengths[0] if lengths else None)


def _enter(comm: Communicator, buffers, dims, layout: str, schedule: str) -> tuple[list, list, Optional[int]]:
    """Local checks, then the handshake: every rank raises if one refused or they disagree."""
    try:
        buffers, dims, full = _check_block(buffers, dims, layout, schedule)
    except LOCAL_ERRORS as e:
        _refuse(comm, "context_parallel", e)
    agree = {"buffers": len(buffers), "layout": _checks.LAYOUTS.index(layout),
             "schedule": _checks.SCHEDULES.index(schedule), "sequence length": -1 if full is None else full}
    handshake(comm, "context_parallel", agree)
    return buffers, dims, full


@contextlib.contextmanager
def context_parallel(mesh_or_group=None, *, buffers=(), buffer_seq_dims=(), layout: str = "zigzag",
                     schedule: str = "ring"):
    """A block in which a plain torch model runs context-parallel over ``mesh_or_group`` (collective).

    ``mesh_or_group``: a 1-D ``DeviceMesh``, a ``ProcessGroup``, an ``mpi4py`` communicator or None
    (the default group). ``buffers``: tensors every rank holds in full (token ids ``(B, S)``, labels,
    position tables ``(S, ...)``), each sharded in place along ``buffer_seq_dims[i]`` by
    ``ss.shard(..., layout=layout)`` for the block and restored after it (also on an exception);
    all have one sequence length ``S``, and must not require grad. Inside, every
    ``torch.nn.functional.scaled_dot_product_attention(q, k, v, ...)`` with ``q (B, H, S_r, D)``,
    ``k, v (B, Hkv, S_r, D)`` (``S_r`` this rank's shard of ``S``) runs as
    ``ss.sharded_attention(q, k, v, causal=..., scale=scale, layout=layout, schedule=schedule)``
    and returns this rank's shard of the output ``(B, H, S_r, Dv)``. ``is_causal``, ``scale``,
    ``enable_gqa`` and an ``attn_mask`` that is all visible or causal translate exactly; dropout,
    other masks, a wrong layout (dim 2 not ``S_r``) and heads that differ without ``enable_gqa``
    raise ``ValueError`` on every rank. Run backward inside the block. Blocks do not nest.
    """
    comm = as_comm(mesh_or_group)
    buffers, dims, full = _enter(comm, buffers, buffer_seq_dims, layout, schedule)
    originals = []
    _active.open = True
    try:
        with torch.no_grad():
            for b, d in zip(buffers, dims):
                piece = shard(b, d, group=comm, layout=layout)
                originals.append((b, b.detach()))
                b.set_(piece)
        with _SdpaMode(comm, layout, schedule, full):
            yield
    finally:
        _active.open = False
        with torch.no_grad():
            for b, original in originals:
                b.set_(original)
