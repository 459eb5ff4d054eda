"""The metadata handshake every sharded call makes before any bulk transfer.

Each rank packs a small int64 vector ``[op, ok, fields...]`` (fixed length, so the exchange itself
can never mismatch) and every rank receives every other rank's vector. Then, identically on all
ranks: a rank whose local arguments were rejected makes every rank raise (its message follows in
a second small exchange, made only then, so every rank's error carries the real reason); a field
that must agree but does not raises ``ValueError`` naming the field and the ranks; per-rank fields
(shard lengths) are returned for the schedules. All transfers complete before anyone raises, so
the group stays usable after a refused call.

Fields read from device tensors (a fingerprint of ``kv_range``, whether ``q_offset`` is zero) are
0-d int64 tensors placed in the same vector on the device: the exchange's one read of the vector
reads them too, so they cost no synchronisation of their own. Every rank sends the same list of
fields (absent arguments as sentinel values), so the vectors line up whatever the arguments.
"""
from __future__ import annotations

import re
import struct
from typing import Callable, Optional

import torch

from ..core import checks as _checks
from .comm import Communicator
from .mesh import Mesh, mesh_order, mesh_shape, post_gather

META_LEN = 32
TAG_META = 11
TAG_REASON = 12
REASON_BYTES = 1024  # the most of a refusing rank's message that reaches its peers
OK = 1
# arguments a rank's refusal can name to the other ranks
ARGS = ("x", "dim", "q", "k", "v", "causal", "scale", "return_lse", "schedule", "layout", "logits", "target",
        "ignore_index", "reduction", "label_smoothing", "temperature", "return_entropy", "logits_p", "logits_q",
        "cu_seqlens", "window_size", "softcap", "sinks", "kv_range", "q_offset", "seed", "offset", "top_k", "top_p",
        "min_p", "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "enable_gqa", "buffers",
        "buffer_seq_dims")

OPS = ("sharded_softmax", "sharded_log_softmax", "sharded_logsumexp", "sharded_attention", "shard", "unshard",
       "sharded_cross_entropy", "sharded_logprobs", "sharded_entropy", "sharded_kl_div",
       "sharded_topk", "sharded_sample", "context_parallel")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def _name_of(names: tuple):
    return lambda c: repr(names[c]) if 0 <= c < len(names) else f"code {c}"


def _float_of(c: int) -> float:
    return struct.unpack("<d", struct.pack("<q", c))[0]


def _dtype_of(c: int):
    return DTYPES[c] if 0 <= c < len(DTYPES) else f"code {c}"


def encode_window(left: int, right: int) -> int:
    return ((left + 1) << 32) | (right + 1)


def encode_sinks(sinks) -> int:
    """0 when absent, else the dtype and the length of ``sinks``."""
    return 0 if sinks is None else ((1 + encode_dtype(sinks.dtype)) << 40) | min(sinks.numel(), (1 << 40) - 1)


def _sinks_of(c: int) -> str:
    return "absent" if c == 0 else f"{_dtype_of((c >> 40) - 1)} of shape ({c & ((1 << 40) - 1)},)"


def _fingerprint_of(c: int) -> str:
    return "absent" if c == -1 else f"fingerprint {c:#x}"


# fields whose integer value is a code, shown back to the user decoded
_DECODE = {"dtype": _dtype_of, "scale": _float_of, "label_smoothing": _float_of, "causal": bool,
           "schedule": _name_of(_checks.SCHEDULES), "layout": _name_of(_checks.LAYOUTS),
           "reduction": _name_of(_checks.REDUCTIONS), "temperature": _float_of, "dtype_q": _dtype_of,
           "softcap": lambda c: _float_of(c) or None,
           "window_size": lambda c: ((c >> 32) - 1, (c & 0xFFFFFFFF) - 1), "sinks": _sinks_of,
           "cu_seqlens": _fingerprint_of, "kv_range": _fingerprint_of, "q_offset": _fingerprint_of,
           "top_p": _float_of, "min_p": _float_of,
           "mesh shape": lambda c: (c >> 32, c & 0xFFFFFFFF) if c else "a 1-d group"}


# fields holding a checksum of a tensor that must be equal on every rank (shown as "differs", not as numbers)
FINGERPRINTS = ("target", "q", "x", "input_ids", "position_ids", "labels")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_M, _A, _C = 2147483629, 48271, 12345  # fingerprint modulus (prime < 2^31) and weights


def fingerprint(t: torch.Tensor):
    """A position-weighted checksum in ``[0, 2^31)`` of the bits of ``t`` (any dtype), to catch ranks
    whose copies of a tensor that must agree differ: a 0-d int64 tensor on ``t``'s device (the
    handshake reads it with its exchange: no synchronisation of its own); 0 for a meta tensor (no
    data to compare)."""
    if t.is_meta:
        return 0
    flat = t.detach().contiguous().reshape(-1)
    if flat.is_floating_point():
        flat = flat.view(_BITS[flat.element_size()])
    v = torch.remainder(flat.to(torch.int64), _M)
    w = torch.remainder(torch.arange(1, v.numel() + 1, device=t.device, dtype=torch.int64) * _A + _C, _M)
    return torch.remainder(torch.remainder(v * w, _M).sum(), _M)


def encode_dtype(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def encode_float(x: float) -> int:
    """The bits of float64 ``x`` as an int64 (exact agreement, not approximate)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _start_gather(comm: Communicator, mine: torch.Tensor, tag: int, step: str) -> Callable[[], list]:
    """Start the all-gather of the small vector ``mine``; ``finish()`` waits and gives the rows in rank
    order (a 2-D mesh: in two stages, mesh rank order)."""
    if isinstance(comm, Mesh):
        return comm.start_gather(mine, tag, step)
    rows, handles = post_gather(comm, mine, tag)

    def finish() -> list:
        comm.wait(handles, step)
        return rows
    return finish


def _status(error: Optional[BaseException]) -> int:
    """The handshake's status code: OK, or the argument this rank's error names (2 + its index in
    ``ARGS``; the library's argument errors start with the argument's name), or 0 for another."""
    if error is None:
        return OK
    word = re.match(r"[A-Za-z_]\w*", str(error))
    return 2 + ARGS.index(word.group()) if word and word.group() in ARGS else 0


def _arg_of(status: int) -> str:
    """What a refusing rank's status names: the argument, else that it gave no reason."""
    return ARGS[status - 2] if 2 <= status < 2 + len(ARGS) else "an error it did not describe"


def _describe(name: str, values: list) -> str:
    decode = _DECODE.get(name, lambda c: c)
    groups: dict = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    if name in FINGERPRINTS:  # a checksum means nothing to the user: say which ranks hold equal copies
        return "; ".join(f"rank(s) {ranks} hold copy {i + 1}" for i, ranks in enumerate(groups.values()))
    return "; ".join(f"rank(s) {ranks}: {decode(v)}" for v, ranks in groups.items())


def handshake(comm: Communicator, op: str, agree: Optional[dict], per_rank: Optional[dict] = None,
              error: Optional[BaseException] = None) -> dict:
    """Exchange ``agree`` (must be equal on every rank) and ``per_rank`` fields (name -> int, or a
    0-d int64 tensor read with the exchange).

    ``error``: this rank's argument error, raised here after the exchange (the others raise a
    ``ValueError`` naming this rank and the argument). Returns ``{name: [value of rank 0, ..., rank P-1]}``.
    """
    return start_handshake(comm, op, agree, per_rank, error)()


LOCAL_ERRORS = (TypeError, ValueError, OverflowError)  # what a rank's own argument checks may raise


def out_of_range(names: list, values: list) -> Optional[ValueError]:
    """A ``ValueError`` naming the first field whose int value does not fit the int64 vector, or None:
    raised by this rank after the exchange (as its argument error), never before it."""
    for name, v in zip(names, values):
        if not isinstance(v, torch.Tensor) and not -(2 ** 63) <= int(v) < 2 ** 63:
            return ValueError(f"{name}={int(v)} is out of range (at most 2^63 - 1 in magnitude)")
    return None


def _vector(comm: Communicator, op: str, error, values: list) -> torch.Tensor:
    """The ``(META_LEN,)`` int64 vector on the metadata device; tensor values are placed on the
    device (no read), ints written from the host (none where ``error``)."""
    if error is not None:
        values = [0] * len(values)
    head = [OPS.index(op), _status(error)]
    ints = [0 if isinstance(v, torch.Tensor) else int(v) for v in values]
    mine = torch.tensor(head + ints + [0] * (META_LEN - len(head) - len(ints)), dtype=torch.int64,
                        device=comm.meta_device)
    if error is None:
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                mine[len(head) + i].copy_(v.reshape(()))
    return mine


def start_handshake(comm: Communicator, op: str, agree: Optional[dict], per_rank: Optional[dict] = None,
                    error: Optional[BaseException] = None) -> Callable[[], dict]:
    """:func:`handshake` in two halves: the exchange starts now; the returned ``finish()`` waits
    for it and checks (raising as :func:`handshake` does), so local work can run in between."""
    agree, per_rank = dict(agree or {}), dict(per_rank or {})
    if isinstance(comm, Mesh) and comm.whole is not None:
        return _on_whole(comm, op, agree, per_rank, error)
    names = list(agree) + list(per_rank)
    if len(names) + 2 > META_LEN:
        raise ValueError(f"{op}: too many handshake fields")
    values = [*agree.values(), *per_rank.values()]
    error = error or out_of_range(names, values)
    mine = _vector(comm, op, error, values)
    gathered = _start_gather(comm, mine, TAG_META, f"{op}: metadata handshake")

    def finish() -> dict:
        table = torch.stack(gathered()).cpu().tolist()
        return _check(op, table, agree, names, error, _reasons(comm, op, table, error))
    return finish


def _on_whole(mesh: Mesh, op: str, agree: dict, per_rank: dict, error) -> Callable[[], dict]:
    """The handshake of a mesh over its ``whole`` communicator (ranks named as its ranks), the mesh
    itself checked alike on every rank; the fields come back in mesh rank order."""
    agree["mesh shape"] = mesh_shape(mesh)
    pending = start_handshake(mesh.whole, op, agree, {**per_rank, **mesh.fields()}, error)

    def finish() -> dict:
        meta = pending()
        order = mesh_order(op, mesh.shape, meta.pop("mesh coordinates"), meta.pop("mesh groups"))
        return {name: [values[r] for r in order] for name, values in meta.items()}
    return finish


def _reasons(comm: Communicator, op: str, rows: list, error: Optional[BaseException]) -> dict:
    """``{rank: message}`` of every rank that refused (none: no transfer). Each refusing rank sends
    its message, UTF-8, cut to ``REASON_BYTES``; the rows tell every rank who sends."""
    bad = [i for i, row in enumerate(rows) if row[1] != OK]
    if not bad:
        return {}
    r = comm.rank
    bufs = {i: torch.zeros(REASON_BYTES, dtype=torch.uint8, device=comm.meta_device) for i in {*bad, r}}
    if r in bad:
        text = str(error).encode()[:REASON_BYTES]
        bufs[r][:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    if isinstance(comm, Mesh):  # no direct sends across a mesh: every rank's buffer travels
        rows = _start_gather(comm, bufs[r], TAG_REASON, f"{op}: refusal reasons")()
        bufs = {i: rows[i] for i in bad}
    else:
        sends = [(bufs[r], q) for q in range(comm.size) if q != r] if r in bad else []
        comm.wait(comm.post(sends, [(bufs[i], i) for i in bad if i != r], TAG_REASON), f"{op}: refusal reasons")
    return {i: bytes(b.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for i, b in bufs.items() if i in bad}


def _check(op: str, rows: list, agree: dict, names: list, error: Optional[BaseException],
           reasons: dict) -> dict:
    """Every rank's vector ``rows (P, META_LEN)``: raise on a refused call (``reasons``: the refusing
    ranks' messages) or a disagreement, else ``{name: [value per rank]}``."""
    ops = [row[0] for row in rows]
    if len(set(ops)) > 1:
        raise ValueError(f"{op}: ranks called different operations: "
                         + "; ".join(f"rank {i}: {OPS[c] if 0 <= c < len(OPS) else c}" for i, c in enumerate(ops)))
    if error is not None:
        raise error
    bad = [i for i, row in enumerate(rows) if row[1] != OK]
    if bad:
        which = "; ".join(f"rank {i}: {reasons.get(i) or _arg_of(rows[i][1])}" for i in bad)
        raise ValueError(f"{op}: rank(s) {bad} rejected their arguments ({which})")
    out = {name: [row[2 + j] for row in rows] for j, name in enumerate(names)}
    for name in agree:
        if len(set(out[name])) > 1:
            raise ValueError(f"{op}: {name} differs across ranks ({_describe(name, out[name])}); "
                             f"it must be the same on every rank")
    return out
