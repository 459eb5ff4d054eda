"""All-to-all: every rank sends each peer its own list of tensors, with bounded waits.

Op-agnostic: it moves tensors of any shapes and dtypes, not attention. :func:`exchange` packs the
tensors each peer gets into one byte message (pieces at 16-byte offsets, so every piece is read back
as a view of its own dtype), and :func:`alltoall_bytes` moves the messages, any sizes per pair
(zero included), over the transport's own collective where it has one:

- ``torch.distributed``: ``all_to_all_single`` with split sizes on the backends of
  ``NATIVE_BACKENDS`` (NCCL; where one lacks it, the exchange falls back to point-to-point pairs
  from then on). Gloo runs the pairs: its own all-to-all is pairwise too, and a timeout of one
  collective can only name every peer, where the pairs name the one that did not answer;
- MPI: ``Ialltoallv`` on host byte buffers (CUDA tensors are staged through the host);
- any other :class:`~splitsoftmax.distributed.comm.Communicator` (the loopback world): one
  non-blocking send and receive per pair with a non-empty message, tagged ``tag``.

:func:`start_exchange` starts an exchange and returns at once (:class:`Started`: ``wait`` later), so
that compute, or other transfers, run while it is in flight. Every wait is the communicator's
``wait``: at most ``SPLITSOFTMAX_TIMEOUT`` seconds, then a ``RuntimeError`` naming the peers and
``step``. Every rank calls each exchange collectively, in the
same order; the sizes are a function of metadata the ranks agreed on, so both ends of every
message know its size.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from ..core.log import LOG
from .comm import Communicator, Handle, MpiComm, TorchComm, _log2_bytes

ALIGN = 16
NATIVE_BACKENDS = {"nccl"}  # torch.distributed backends whose all_to_all_single the exchange uses
_NO_NATIVE: set = set()  # those found to lack it


class Piece(NamedTuple):
    """One tensor of a message: ``shape`` and ``dtype``, stored from byte ``offset``."""

    shape: tuple
    dtype: torch.dtype
    offset: int


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def message(specs: Sequence[tuple]) -> tuple[list, int]:
    """The pieces of a message of ``specs`` (``(shape, dtype)`` each) and its size in bytes."""
    pieces, at = [], 0
    for shape, dtype in specs:
        pieces.append(Piece(tuple(shape), dtype, at))
        at += -(-_nbytes(tuple(shape), dtype) // ALIGN) * ALIGN
    return pieces, at


def _view(buf: Tensor, p: Piece) -> Tensor:
    return buf[p.offset:p.offset + _nbytes(p.shape, p.dtype)].view(p.dtype).view(p.shape)


class Started:
    """An all-to-all in flight: ``wait()`` waits for it (bounded, naming ``step``) and returns what
    ``finish`` makes of it; ``abandon()`` gives it up (an error elsewhere: its buffers are kept, as a
    timeout keeps them, for the transport may still write into them)."""

    def __init__(self, comm: Communicator, handles: list, finish: Callable[[], object], step: str):
        self.comm, self.handles, self.finish, self.step = comm, handles, finish, step
        self._result, self._done = None, False

    def wait(self):
        if not self._done:
            self.comm.wait(self.handles, self.step)
            self._result, self._done = self.finish(), True
        return self._result

    def abandon(self) -> None:
        pending = [h for h in self.handles if not h.completed]
        if not self._done and pending:
            self.comm.abandon(pending, self.step)

    def then(self, fn: Callable) -> "Started":
        """The same transfers, ``wait()`` returning ``fn`` of this one's result."""
        return Started(self.comm, self.handles, lambda: fn(self.finish()), self.step)


class Arriving:
    """Tensors ``(B, n, ...)`` arriving in chunks of dim 1 (heads): ``parts[i].wait()`` returns every
    tensor's heads ``[bounds[i], bounds[i + 1])`` (a list, the same tensors in each chunk)."""

    def __init__(self, bounds: Sequence[int], parts: Sequence[Started]):
        self.bounds, self.parts, self._whole = tuple(bounds), list(parts), None

    def chunks(self):
        """``(lo, hi, tensors)`` of each chunk in order, as each arrives (chunks without heads are
        waited for and skipped)."""
        for lo, hi, part in zip(self.bounds, self.bounds[1:], self.parts):
            got = part.wait()
            if hi > lo:
                yield lo, hi, got

    def whole(self) -> list:
        """Every tensor, all chunks waited for and joined along dim 1."""
        if self._whole is None:
            got = [part.wait() for part in self.parts]
            full = [g for g, lo, hi in zip(got, self.bounds, self.bounds[1:]) if hi > lo] or got[:1]
            self._whole = full[0] if len(full) == 1 else [torch.cat(ts, 1) for ts in zip(*full)]
        return self._whole

    def abandon(self) -> None:
        """Give up every chunk not yet waited for (:meth:`Started.abandon`)."""
        for part in self.parts:
            part.abandon()


def exchange(comm: Communicator, sends: Sequence[Sequence[Tensor]], recv_specs: Sequence[Sequence[tuple]],
             step: str, tag: int, device) -> list:
    """``sends[q]``: the tensors for rank ``q`` (any shapes, dtypes, strides); ``recv_specs[q]``:
    ``(shape, dtype)`` of each tensor rank ``q`` sends here. Returns ``got[q]``, the tensors from
    rank ``q`` (views of one receive buffer); ``got[rank]`` is ``sends[rank]`` itself, not copied."""
    return start_exchange(comm, sends, recv_specs, step, tag, device).wait()


def start_exchange(comm: Communicator, sends: Sequence[Sequence[Tensor]], recv_specs: Sequence[Sequence[tuple]],
                   step: str, tag: int, device) -> Started:
    """:func:`exchange` started, not waited for: its :meth:`Started.wait` returns ``got``. Exchanges
    started one after another on a communicator are matched in that order on every transport."""
    p, r = comm.size, comm.rank
    out_msgs = [message([(t.shape, t.dtype) for t in sends[q]]) if q != r else ([], 0) for q in range(p)]
    in_msgs = [message(recv_specs[q]) if q != r else ([], 0) for q in range(p)]
    send = torch.empty(sum(n for _, n in out_msgs), dtype=torch.uint8, device=device)
    at = 0
    for q, (pieces, n) in enumerate(out_msgs):
        for t, pc in zip(sends[q], pieces):
            _view(send[at:at + n], pc).copy_(t)
        at += n
    moving = start_alltoall_bytes(comm, send, [n for _, n in out_msgs], [n for _, n in in_msgs], step, tag)

    def finish() -> list:
        got = moving.finish()
        out, at = [], 0
        for q, (pieces, n) in enumerate(in_msgs):
            out.append(list(sends[q]) if q == r else [_view(got[at:at + n], pc) for pc in pieces])
            at += n
        return out
    return Started(comm, moving.handles, finish, step)


def alltoall_bytes(comm: Communicator, send: Tensor, send_sizes: list, recv_sizes: list, step: str,
                   tag: int) -> Tensor:
    """Flat uint8 ``send`` holds the messages for ranks ``0..P-1`` back to back (``send_sizes``
    bytes each, this rank's own 0); returns the messages received, back to back in rank order
    (``recv_sizes`` bytes each)."""
    return start_alltoall_bytes(comm, send, send_sizes, recv_sizes, step, tag).wait()


def start_alltoall_bytes(comm: Communicator, send: Tensor, send_sizes: list, recv_sizes: list, step: str,
                         tag: int) -> Started:
    """:func:`alltoall_bytes` started, not waited for (its :meth:`Started.wait` returns the bytes)."""
    LOG.debug("%s: rank %d all-to-all, sends %s bytes, receives %s bytes", step, comm.rank, send_sizes, recv_sizes)
    if comm.size == 1:
        return Started(comm, [], lambda: send.new_empty(0), step)
    if isinstance(comm, TorchComm) and _native(comm):
        native = _torch_alltoall(comm, send, send_sizes, recv_sizes, step)
        if native is not None:
            return native
    if isinstance(comm, MpiComm) and max(send_sizes + recv_sizes) < 2 ** 31:
        return _mpi_alltoall(comm, send, send_sizes, recv_sizes, step)
    return _pairs(comm, send, send_sizes, recv_sizes, step, tag)


def _offsets(sizes: list) -> list:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def _pairs(comm: Communicator, send: Tensor, send_sizes: list, recv_sizes: list, step: str, tag: int) -> Started:
    """Point-to-point: one send and one receive per peer whose message is not empty (messages of one
    tag between two ranks are matched in the order they were posted, on every transport)."""
    got = send.new_empty(sum(recv_sizes))
    so, ro = _offsets(send_sizes), _offsets(recv_sizes)
    peers = [q for q in range(comm.size) if q != comm.rank]
    handles = comm.post([(send[so[q]:so[q] + send_sizes[q]], q) for q in peers if send_sizes[q]],
                        [(got[ro[q]:ro[q] + recv_sizes[q]], q) for q in peers if recv_sizes[q]], tag)
    return Started(comm, handles, lambda: got, step)


def _native(comm: TorchComm) -> bool:
    backend = comm.dist.get_backend(comm.group)
    return backend in NATIVE_BACKENDS and backend not in _NO_NATIVE


def _torch_alltoall(comm: TorchComm, send: Tensor, send_sizes: list, recv_sizes: list, step: str):
    """``all_to_all_single`` with split sizes, started (NCCL's first call on the poster thread, as
    every first NCCL transfer); None where the backend has no all-to-all."""
    got = send.new_empty(sum(recv_sizes))
    peers = [q for q in range(comm.size) if q != comm.rank]

    def start() -> list:
        work = comm.dist.all_to_all_single(got, send, recv_sizes, send_sizes, group=comm.group, async_op=True)
        return [work] * len(peers)
    if comm.nccl:
        kinds = {(comm.group.group_name, "alltoall", _log2_bytes(send), _log2_bytes(got))}
        return Started(comm, comm._start(kinds, start, peers), lambda: got, step)
    try:
        works = start()
    except (RuntimeError, NotImplementedError) as e:  # raised alike on every rank, before any transfer
        if "support" not in str(e).lower() and not isinstance(e, NotImplementedError):
            raise
        _NO_NATIVE.add(comm.dist.get_backend(comm.group))
        return None
    return Started(comm, [comm._handle(w, q) for w, q in zip(works, peers)], lambda: got, step)


def _mpi_alltoall(comm: MpiComm, send: Tensor, send_sizes: list, recv_sizes: list, step: str) -> Started:
    """``Ialltoallv`` of bytes, polled against the deadline; CUDA buffers staged through the host."""
    from mpi4py import MPI
    if send.is_cuda:  # MPI knows nothing of streams: finish the producer, then copy out
        torch.cuda.current_stream(send.device).synchronize()
    host_send = send.cpu()
    host_got = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    req = comm.comm.Ialltoallv([host_send.numpy(), (send_sizes, _offsets(send_sizes)), MPI.BYTE],
                               [host_got.numpy(), (recv_sizes, _offsets(recv_sizes)), MPI.BYTE])
    keep = (host_send, host_got)  # alive until the request completes (an abandoned one: for good)
    peers = [q for q in range(comm.size) if q != comm.rank]
    handles = [Handle(q, req.Test, lambda keep=keep: None) for q in peers]
    return Started(comm, handles, lambda: host_got.to(send.device) if send.is_cuda else host_got, step)
