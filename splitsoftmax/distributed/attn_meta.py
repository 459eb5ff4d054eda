"""What ``sharded_attention`` checks: its arguments on each rank, their agreement across ranks in
the handshake, and what only the global lengths decide (after the handshake, on every rank alike).

Every rank sends the same list of fields whatever it was given (an absent keyword is a sentinel):
the variant keywords as host integers (``cu_seqlens`` as a fingerprint of its values, the window,
the softcap's bits, the sinks' dtype and length) and, for the device tensors ``kv_range`` and
``q_offset``, fingerprints and checks computed on the device and read with the exchange.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from ..core import checks as _checks
from ..core import keywords as vs
from . import layout as lay
from .mesh import Mesh, mesh_shape, seq_lengths, value_code
from .handshake import (LOCAL_ERRORS, encode_dtype, encode_float, encode_sinks, encode_window, fingerprint,
                        start_handshake)


class Keywords(NamedTuple):
    """This rank's checked variant keywords (before the global lengths are known)."""

    docs: Optional[tuple] = None
    window: Optional[tuple] = None
    softcap: float = 0.0
    sinks: Optional[Tensor] = None
    kv_range: Optional[Tensor] = None
    q_offset: Union[None, int, Tensor] = None


def doc_values(cu_seqlens) -> Optional[tuple]:
    """``cu_seqlens`` as host ints with the checks that need no global length (1-D integers,
    ``cu[0] = 0``, non-decreasing); ``cu[-1]`` is checked once the global length is known."""
    if cu_seqlens is None:
        return None
    values = vs._cu_values(cu_seqlens)
    end = values[-1] if values else 0
    return vs.check_cu_seqlens(values, end, end, 0)


def docs_code(docs: Optional[tuple]) -> int:
    """The handshake field of ``cu_seqlens``: -1 when absent, else a fingerprint of its values."""
    return -1 if docs is None else value_code(docs)


def _kv_shape(kv_range, b: int, device) -> Optional[Tensor]:
    if kv_range is None:
        return None
    if not isinstance(kv_range, Tensor) or kv_range.dtype not in vs._INT_DTYPES:
        raise ValueError(f"kv_range must be an integer tensor (B, 2), got {getattr(kv_range, 'dtype', type(kv_range).__name__)}")
    if tuple(kv_range.shape) != (b, 2):
        raise ValueError(f"kv_range must have shape (B, 2) = ({b}, 2), got {tuple(kv_range.shape)}")
    if kv_range.device != device:
        raise ValueError(f"kv_range is on {kv_range.device} but q is on {device}")
    return kv_range.to(torch.int32)


def check_keywords(q: Tensor, schedule: str, cu_seqlens, window_size, softcap, sinks, kv_range,
                   q_offset) -> Keywords:
    """The keywords' local checks (``ValueError`` naming the argument); the rest needs the peers."""
    b, h = q.shape[:2]
    off = None if q_offset is None else vs.check_q_offset(q_offset, b, q.device)
    if schedule != "tree" and isinstance(off, int) and off != 0:
        raise ValueError(f"q_offset must be 0 with schedule={schedule!r} (queries and keys are one sharded "
                         f"sequence), got {q_offset}")
    docs = None
    if cu_seqlens is not None:
        if schedule == "tree":
            raise ValueError("cu_seqlens is not taken by schedule='tree' (split-KV queries are not one packed "
                             "sequence with the keys); use 'ring' or 'allgather'")
        vs.documents_need_no_offset(q_offset)
        docs = doc_values(cu_seqlens)
    left, right = vs.check_window(window_size)
    return Keywords(docs, None if (left, right) == (-1, -1) else (left, right), vs.check_softcap(softcap),
                    vs.check_sinks(sinks, h, q.device), _kv_shape(kv_range, b, q.device), off)


def _fields(kw: Keywords, b: int) -> tuple[dict, dict]:
    """``(agree, per_rank)`` handshake fields of the keywords (ints, or 0-d device tensors)."""
    kv, off = kw.kv_range, kw.q_offset
    agree = {"cu_seqlens": docs_code(kw.docs), "window_size": encode_window(*(kw.window or (-1, -1))),
             "softcap": encode_float(kw.softcap), "sinks": encode_sinks(kw.sinks),
             "kv_range": -1 if kv is None else fingerprint(kv),
             "q_offset": -1 if off is None else fingerprint(off if isinstance(off, Tensor) else torch.full((b,), off))}
    if isinstance(agree["q_offset"], Tensor) and not isinstance(off, Tensor):
        agree["q_offset"] = int(agree["q_offset"])
    per = {"kv_range ok": 1, "kv_range max": 0, "q_offset nonzero": 0}
    if kv is not None and kv.numel():
        lo, hi = kv[:, 0], kv[:, 1]
        per["kv_range ok"], per["kv_range max"] = ((lo <= hi) & (lo >= 0)).all(), hi.max()
    if isinstance(off, Tensor):
        per["q_offset nonzero"] = (off != 0).any()
    return agree, per


def _ranks(values: list, bad) -> list:
    return [r for r, v in enumerate(values) if bad(v)]


def check_group(comm, schedule: str) -> None:
    """A 2-D mesh takes the 2-D schedules, a 1-d group the others (``ValueError`` naming ``schedule``)."""
    if isinstance(comm, Mesh) and schedule not in _checks.MESH_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} runs over a 1-d group, but group is a {comm.shape[0]} x "
                         f"{comm.shape[1]} mesh (sequence x heads); use one of {_checks.MESH_SCHEDULES}")
    if not isinstance(comm, Mesh) and schedule in _checks.MESH_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} needs a 2-D group (a 2-D DeviceMesh, or a tuple (seq_group, "
                         f"heads_group)), got a 1-d group of {comm.size} ranks")


def check_global(meta: dict, kw: Keywords, layout: str, schedule: str, shape: Optional[tuple] = None) -> None:
    """The checks that need every rank's lengths; identical on every rank (the fields agree). On a mesh
    of ``shape`` the layout's checks are of the sequence shards (each the sum of its heads group's)."""
    q_lens, k_lens = meta["Sq_local"], meta["Sk_local"]
    if shape is not None:
        q_lens, k_lens = seq_lengths(q_lens, shape), seq_lengths(k_lens, shape)
    if kw.docs is not None:
        if list(q_lens) != list(k_lens):
            raise ValueError(f"cu_seqlens needs q and k sharded alike (self-attention), got q lengths {q_lens}, "
                             f"k lengths {k_lens}")
        vs.check_cu_seqlens(kw.docs, sum(q_lens), sum(k_lens), 0)
    for name, lens in (("Sq_local", q_lens), ("Sk_local", k_lens)):
        bad = lay.layout_mismatch(layout, lens, kw.docs)
        if bad:
            who = "sequence shard(s)" if shape is not None else "rank(s)"
            raise ValueError(f"sharded_attention: layout={layout!r} but {who} {bad} hold {name} not of "
                             f"{lay.split_name(layout, kw.docs)} of {sum(lens)} positions (lengths {lens})")
    sk = sum(k_lens)
    bad = sorted(set(_ranks(meta["kv_range ok"], lambda v: v != 1) + _ranks(meta["kv_range max"], lambda v: v > sk)))
    if bad:
        raise ValueError(f"kv_range must satisfy 0 <= kv_range[b, 0] <= kv_range[b, 1] <= Sk = {sk} (the global key "
                         f"length); rank(s) {bad} do not")
    bad = _ranks(meta["q_offset nonzero"], bool)
    if bad and schedule != "tree":
        raise ValueError(f"q_offset must be 0 with schedule={schedule!r}; rank(s) {bad} hold non-zero values")


def start(comm, q, k, v, causal, scale, schedule, layout, return_lse, keywords: dict):
    """Local checks and the start of the handshake: ``(finish, scale, kw)``. ``finish()`` waits for
    the handshake and returns every rank's lengths and machine ``(q_lens, k_lens, hosts)`` (raising as
    the handshake and :func:`check_global` do). ``scale`` and ``kw`` are None when the local checks failed."""
    agree, per, err, s, kw = None, None, None, None, None
    try:
        s = _checks.attention_args(q, k, v, scale, causal)
        _checks.flag("return_lse", return_lse)
        _checks.choice("schedule", schedule, _checks.SCHEDULES)
        check_group(comm, schedule)
        _checks.layout(layout, keywords["cu_seqlens"])
        if schedule == "tree" and layout != "contiguous":
            raise ValueError(f"layout={layout!r}: the tree schedule takes contiguous k/v shards")
        kw = check_keywords(q, schedule, **keywords)
        (b, h, sq, d), hkv, dv = q.shape, k.shape[1], v.shape[-1]
        agree = {"B": b, "H": h, "Hkv": hkv, "D": d, "Dv": dv, "dtype": encode_dtype(q.dtype),
                 "causal": int(causal), "scale": encode_float(s), "schedule": _checks.SCHEDULES.index(schedule),
                 "layout": _checks.LAYOUTS.index(layout), "Sq": sq if schedule == "tree" else 0,
                 "q": fingerprint(q) if schedule == "tree" else 0, "mesh shape": mesh_shape(comm)}
        extra_agree, extra_per = _fields(kw, b)
        agree.update(extra_agree)
        per = {"Sq_local": sq, "Sk_local": k.shape[2], "host": comm.host, **extra_per}
    except LOCAL_ERRORS as e:
        err, s, kw = e, None, None
    pending = start_handshake(comm, "sharded_attention", agree, per, err)

    def finish() -> tuple[list, list, list]:
        meta = pending()
        check_global(meta, kw, layout, schedule, comm.shape if isinstance(comm, Mesh) else None)
        return meta["Sq_local"], meta["Sk_local"], meta["host"]
    return finish, s, kw
