"""The communicator: point-to-point transfers with bounded waits, over three transports.

Every schedule is written against one tiny interface, :class:`Communicator`:

- ``rank``, ``size`` and ``meta_device`` (where small metadata tensors live);
- ``post(sends, recvs, tag)``: start non-blocking transfers of flat contiguous tensors,
  ``sends``/``recvs`` being lists of ``(tensor, peer)``; returns one :class:`Handle` per transfer;
- ``wait(handles, step)``: poll them against a deadline of ``SPLITSOFTMAX_TIMEOUT`` seconds
  (default 300, read at call time). A transfer that fails (a peer that exited) or does not
  complete in time raises ``RuntimeError`` naming the peer rank and the step.

Collectives (all-gather, reduce-scatter, all-reduce) are built on top in the schedules, in a
fixed order, so the three transports behave alike and results are reproducible. One exception:
``allgather(buf, step)`` returns the transport's own all-gather where it has one (NCCL's, one
launch instead of Bruck rounds of ``post``; the blocks still arrive in rank order), else None.

Transports: :class:`TorchComm` (``torch.distributed``: Gloo, NCCL), :class:`MpiComm` (mpi4py;
CUDA tensors are staged through the host) and :class:`LoopbackWorld` (P ranks as threads of one
process, counting every transfer, for tests).
"""
from __future__ import annotations

import functools
import hashlib
import os
import queue
import socket
import sys
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

DEFAULT_TIMEOUT = 300.0


def eager(fn: Callable) -> Callable:
    """A public collective op, run eagerly under ``torch.compile``: Dynamo breaks the graph around
    it (``fullgraph=True`` refuses it, naming this reason). Its handshakes, bounded waits and
    host-side plans read clocks and agreed values on the host, which a traced graph cannot.

    Dynamo is imported by ``torch.compile``, not by this package (it doubles the import time of
    every process): the mark that makes Dynamo break the graph at the op is set here, and the op
    goes through ``torch.compiler.disable`` (made at its first call with Dynamo loaded) only where
    Dynamo is loaded; without it nothing can be tracing, and the op runs as it is."""
    reason = f"splitsoftmax.{fn.__name__} is a collective across ranks: it runs eagerly, outside the compiled graph"
    disabled = []

    @functools.wraps(fn)
    def op(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn, reason=reason))
        return disabled[0](*args, **kwargs)

    op._torchdynamo_disable = True
    op._torchdynamo_disable_msg = reason
    return op


def host_code() -> int:
    """This process's machine as a non-negative int63: a hash of ``SPLITSOFTMAX_HOST`` where set (ranks
    that should count as one machine, or as several on one), else of the host name. The heads
    schedule reads every rank's (``Communicator.host``) to know which ranks share a host."""
    return _name_code(os.environ.get("SPLITSOFTMAX_HOST") or socket.gethostname())


@functools.lru_cache(maxsize=8)
def _name_code(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1


def timeout_s() -> float:
    """``SPLITSOFTMAX_TIMEOUT`` in seconds (default 300), read at every call."""
    raw = os.environ.get("SPLITSOFTMAX_TIMEOUT", "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"SPLITSOFTMAX_TIMEOUT={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"SPLITSOFTMAX_TIMEOUT={raw!r} must be positive")
    return value


class Handle:
    """One started transfer with ``peer``; ``done()`` polls it (raising if it failed).

    ``block(seconds)``, where given, waits instead of polling (Gloo's point-to-point work only
    completes inside ``wait``); it returns whether the transfer completed in time.
    """

    def __init__(self, peer: int, poll: Callable[[], bool], finish: Optional[Callable[[], None]] = None,
                 block: Optional[Callable[[float], bool]] = None):
        self.peer = peer
        self._poll = poll
        self._finish = finish
        self.block = block
        self.completed = False

    def done(self, seconds: Optional[float] = None) -> bool:
        if not self.completed and (self._poll() if self.block is None or seconds is None else self.block(seconds)):
            self.completed = True
            if self._finish is not None:
                self._finish()
        return self.completed


def _failed(error: Exception) -> Callable[[], bool]:
    def poll() -> bool:
        raise error
    return poll


def _guard(start: Callable, t: Tensor, peer: int, tag: int) -> Handle:
    """Start a transfer; a transport that refuses at once (a closed peer) gives a failed handle,
    reported by ``wait`` with the peer and the step."""
    try:
        return start(t, peer, tag)
    except Exception as e:
        return Handle(peer, _failed(e))


class Communicator:
    """Base class: ``rank``, ``size``, ``meta_device``; subclasses implement ``_send``/``_recv``."""

    rank: int
    size: int
    meta_device: torch.device = torch.device("cpu")

    @property
    def host(self) -> int:
        """This rank's machine (:func:`host_code`)."""
        return host_code()

    def _send(self, t: Tensor, peer: int, tag: int) -> Handle:
        raise NotImplementedError

    def _recv(self, t: Tensor, peer: int, tag: int) -> Handle:
        raise NotImplementedError

    def post(self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]], tag: int) -> list[Handle]:
        """Start the transfers (flat contiguous tensors; empty ones are skipped by the callers)."""
        return [_guard(self._send, t, p, tag) for t, p in sends] + [_guard(self._recv, t, p, tag) for t, p in recvs]

    def allgather(self, buf: Tensor, step: str) -> Optional[Tensor]:
        """The transport's own all-gather of equal flat ``buf``: ``(P, n)`` in rank order, or None
        where there is none (the schedules then run their Bruck rounds of ``post``)."""
        return None

    def wait(self, handles: Sequence[Handle], step: str) -> None:
        """Block until every handle is done, at most ``SPLITSOFTMAX_TIMEOUT`` seconds."""
        limit = timeout_s()
        start = time.monotonic()
        deadline = start + limit
        while True:
            pending = []
            for h in handles:
                try:
                    if not h.done(max(0.2, deadline - time.monotonic())):
                        pending.append(h)
                except Exception as e:  # the transport reports a broken peer
                    raise RuntimeError(f"{step}: rank {self.rank}: transfer with peer rank {h.peer} "
                                       f"failed ({type(e).__name__}: {e})") from e
            if not pending:
                return
            if time.monotonic() > deadline:
                peers = sorted({h.peer for h in pending})
                self.abandon(pending, step)
                raise RuntimeError(f"{step}: rank {self.rank}: peer rank(s) {peers} did not answer within "
                                   f"{limit:g} s (SPLITSOFTMAX_TIMEOUT)")
            time.sleep(_poll_pause(time.monotonic() - start))

    def abandon(self, pending: Sequence[Handle], step: str) -> None:
        """A timeout gave up on ``pending`` in ``step``: their transfers may still land, so their
        buffers are kept for the life of the process (the transport writes into them)."""
        _ABANDONED.extend(pending)


_ABANDONED: list = []  # handles a timeout gave up on, with the buffers they reference


def _poll_pause(waited: float) -> float:
    """Seconds to sleep between polls after ``waited`` seconds: none for the first 20 ms (a ring
    step's transfer usually lands within a block's compute, and a sleep would overshoot it), then
    1% of the time waited so far (so a late transfer is overshot by about 1%), from 50 us to 2 ms."""
    return 0.0 if waited < 0.02 else min(2e-3, max(5e-5, 0.01 * waited))


class TorchComm(Communicator):
    """``torch.distributed`` point-to-point over a process group (NCCL: batched, on its own stream)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group=None needs an initialised torch.distributed default group "
                             "(call torch.distributed.init_process_group first)")
        self.dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.nccl = dist.get_backend(self.group) == "nccl"
        if self.nccl:
            self.meta_device = torch.device("cuda", torch.cuda.current_device())

    def _global(self, peer: int) -> int:
        return self.dist.get_global_rank(self.group, peer)

    def _handle(self, work, peer: int) -> Handle:
        if self.nccl:  # the work's event can be polled; wait() then orders the current stream after it
            return Handle(peer, work.is_completed, work.wait)
        return Handle(peer, lambda: False, block=lambda seconds: self._block(work, seconds))

    @staticmethod
    def _block(work, seconds: float) -> bool:
        """Wait for Gloo work at most ``seconds``; False when it timed out (other errors raise)."""
        start = time.monotonic()
        try:
            work.wait(timedelta(seconds=max(seconds, 1e-3)))
        except RuntimeError as e:  # Gloo's own timeout closes the pair: later waits report that
            msg = str(e).lower()
            if time.monotonic() - start >= seconds * 0.99 or "timed out" in msg or "timeout" in msg:
                return False
            raise
        return True

    def post(self, sends, recvs, tag):
        ops = [(self.dist.isend, t, p) for t, p in sends] + [(self.dist.irecv, t, p) for t, p in recvs]
        if not ops:
            return []
        if not self.nccl:
            return super().post(sends, recvs, tag)
        # NCCL matches by order: one batch per call, identical order on every rank
        p2p = [self.dist.P2POp(f, t, self._global(p), self.group, tag) for f, t, p in ops]
        kinds = {(self.group.group_name, f is self.dist.isend, self._global(p), _log2_bytes(t)) for f, t, p in ops}
        return self._start(kinds, lambda: self._batch(p2p, len(ops)), [p for _, _, p in ops])

    def allgather(self, buf: Tensor, step: str) -> Optional[Tensor]:
        """NCCL: one ``all_gather_into_tensor`` (bounded wait), ``(P, n)`` in rank order."""
        if not self.nccl:
            return None
        out = buf.new_empty((self.size, buf.numel()))
        peers = [q for q in range(self.size) if q != self.rank]
        kinds = {(self.group.group_name, "allgather", _log2_bytes(buf))}

        def gather() -> list:
            return [self.dist.all_gather_into_tensor(out, buf, group=self.group, async_op=True)] * len(peers)
        self.wait(self._start(kinds, gather, peers), step)
        return out

    def _start(self, kinds: set, start: Callable[[], list], peers: list) -> list[Handle]:
        """Handles of ``start()``'s works (one per entry of ``peers``). Once transfers of these
        ``kinds`` have completed, ``start`` runs here (after any start still queued on the poster, so
        that transfers keep the order they were started in). The first time it runs on the poster thread:
        NCCL connects to the peers inside that call, on the host, and waits there without end if one
        is gone -- the handles (polled against the deadline by ``wait``) report it instead."""
        if kinds <= _NCCL_WARM and _nccl_poster().idle():
            return [self._handle(w, p) for w, p in zip(start(), peers)]
        started = _nccl_poster().submit(_on_stream, torch.cuda.current_stream(), start)

        def poll(i: int) -> bool:
            return started.done() and started.result()[i].is_completed()

        def finish(i: int) -> None:
            started.result()[i].wait()
            _NCCL_WARM.update(kinds)
        return [Handle(p, lambda i=i: poll(i), lambda i=i: finish(i)) for i, p in enumerate(peers)]

    def _batch(self, p2p: list, n: int) -> list:
        """Start one NCCL batch; one work per op."""
        works = [w for w in self.dist.batch_isend_irecv(p2p) if w is not None]
        if len(works) != n:  # one coalesced work for the batch: every transfer waits on it
            works = works[-1:] * n if works else []
        return works

    def _send(self, t, peer, tag):
        return self._handle(self.dist.isend(t, self._global(peer), self.group, tag), peer)

    def _recv(self, t, peer, tag):
        return self._handle(self.dist.irecv(t, self._global(peer), self.group, tag), peer)


# kinds of NCCL transfers that have completed once (connected): (group, send?, peer, log2 bytes)
# for point-to-point, (group, "allgather", log2 bytes) for the all-gather
_NCCL_WARM: set = set()
_POSTER: list = []


def _log2_bytes(t: Tensor) -> int:
    return (t.numel() * t.element_size()).bit_length()


def _on_stream(stream, fn: Callable):
    """``fn()`` with ``stream`` (and its device) current: another thread's stream, on the poster."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        return fn()


class _Poster:
    """One daemon thread running calls that may block the host (a daemon: never holds up exit)."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # jobs submitted and not yet run (a later start that skipped them would overtake them)
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name="splitsoftmax-nccl-post").start()

    def _run(self) -> None:
        while True:
            fn, args, fut = self.jobs.get()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # reported through the future to the waiting handles
                fut.set_exception(e)
            with self.lock:
                self.pending -= 1

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        with self.lock:
            self.pending += 1
        self.jobs.put((fn, args, fut))
        return fut

    def idle(self) -> bool:
        """Whether every job submitted has run (transfers started now come after theirs)."""
        with self.lock:
            return self.pending == 0


def _nccl_poster() -> _Poster:
    if not _POSTER:
        _POSTER.append(_Poster())
    return _POSTER[0]


class MpiComm(Communicator):
    """mpi4py ``Isend``/``Irecv`` on byte views of CPU tensors; CUDA tensors staged via the host."""

    def __init__(self, comm):
        gave_up = mpi_attrs(comm).get("timed out")
        if gave_up is not None:
            raise RuntimeError(f"an earlier transfer on this MPI communicator timed out ({gave_up}): its messages "
                               "may still arrive and would be taken for later ones, so the communicator cannot be "
                               "used again; call on a new one (comm.Dup())")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def abandon(self, pending: Sequence[Handle], step: str) -> None:
        super().abandon(pending, step)
        mpi_attrs(self.comm)["timed out"] = step

    @staticmethod
    def _bytes(t: Tensor):
        return t.reshape(-1).view(torch.uint8).numpy()

    def _send(self, t, peer, tag):
        if t.is_cuda:  # MPI knows nothing of streams: finish the producer, then copy out
            torch.cuda.current_stream(t.device).synchronize()
            t = t.cpu()
        req = self.comm.Isend(self._bytes(t), dest=peer, tag=tag)
        return Handle(peer, req.Test, lambda keep=t: None)

    def _recv(self, t, peer, tag):
        host = torch.empty(t.shape, dtype=t.dtype) if t.is_cuda else t
        req = self.comm.Irecv(self._bytes(host), source=peer, tag=tag)
        finish = (lambda: t.copy_(host)) if t.is_cuda else None
        return Handle(peer, req.Test, finish)


class LoopbackWorld:
    """``size`` ranks in one process (threads): mailboxes keyed by (src, dst, tag), counted sends;
    ``hosts`` (one int per rank) says which machine each rank counts as on (default: this one).

    A rank whose function has returned or raised counts as exited: receives from it then fail.
    Ranks take turns: one computes while the others wait for transfers.

    ``sends[tag]`` counts the transfers started per tag, over all ranks, ``bytes[tag]`` their bytes
    and ``across[tag]`` those between ranks of different ``hosts``; ``run(fn)`` calls
    ``fn(comm)`` on every rank concurrently and returns the results in rank order.
    """

    def __init__(self, size: int, hosts: Optional[Sequence[int]] = None):
        self.size = size
        self.hosts = None if hosts is None else tuple(int(h) for h in hosts)
        if self.hosts is not None and len(self.hosts) != size:
            raise ValueError(f"hosts: {len(self.hosts)} values for {size} ranks")
        self.lock = threading.Lock()
        self.boxes: dict = defaultdict(deque)
        self.sends: dict = defaultdict(int)
        self.bytes: dict = defaultdict(int)
        self.across: dict = defaultdict(int)
        self.gone: set = set()
        self.turn = threading.Lock()  # one rank computes at a time (the Triton interpreter is not thread-safe)

    def comm(self, rank: int, members: Optional[Sequence[int]] = None) -> "LoopbackComm":
        """World rank ``rank``'s communicator over ``members`` (world ranks, their order the group's
        rank order; default the whole world)."""
        return LoopbackComm(self, rank, members)

    def reset_counts(self) -> None:
        with self.lock:
            self.sends.clear()
            self.bytes.clear()
            self.across.clear()

    def run(self, fn: Callable, timeout: float = 120.0) -> list:
        """Run ``fn(comm)`` on every rank in its own thread; re-raise the first failure."""
        results, errors = [None] * self.size, [None] * self.size
        self.gone.clear()

        def body(r):
            self.turn.acquire()
            try:
                results[r] = fn(self.comm(r))
            except BaseException as e:  # reported to the caller below
                errors[r] = e
            finally:
                self.turn.release()
            with self.lock:  # like a process that exits: its peers' receives now fail
                self.gone.add(r)

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
            if t.is_alive():
                done = {r: repr(e) for r, e in enumerate(errors) if e is not None}
                raise RuntimeError(f"loopback world: a rank did not finish within {timeout} s; failed ranks: {done}")
        first = [e for e in errors if e is not None]
        if first:  # the root cause rather than a peer's report of it
            raise next((e for e in first if "has exited" not in str(e)), first[0])
        return results


class LoopbackComm(Communicator):
    """One rank of a :class:`LoopbackWorld`, or of a group of its ranks (``members``, world ranks in
    the group's rank order); a send copies the tensor into the peer's mailbox."""

    def __init__(self, world: LoopbackWorld, rank: int, members: Optional[Sequence[int]] = None):
        self.world = world
        self.members = tuple(range(world.size)) if members is None else tuple(members)
        if rank not in self.members:
            raise ValueError(f"members: world rank {rank} is not one of {self.members}")
        self.rank = self.members.index(rank)
        self.size = len(self.members)

    @property
    def host(self) -> int:
        """The world's ``hosts[rank]`` where it was given them, else this process's machine."""
        return host_code() if self.world.hosts is None else self.world.hosts[self.members[self.rank]]

    def mesh(self, seq: int, heads: int) -> tuple:
        """``(seq_group, heads_group)`` of this world rank in a ``seq x heads`` mesh of the world
        (world rank ``s * heads + h`` at sequence rank ``s``, heads rank ``h``: heads groups are
        contiguous ranks, as a 2-D DeviceMesh's last dimension)."""
        if seq * heads != self.world.size:
            raise ValueError(f"mesh shape ({seq}, {heads}) does not cover the {self.world.size} ranks")
        r = self.members[self.rank]
        s, h = divmod(r, heads)
        return (self.world.comm(r, [i * heads + h for i in range(seq)]),
                self.world.comm(r, [s * heads + j for j in range(heads)]))

    def _key(self, src: int, dst: int, tag: int) -> tuple:
        """The mailbox of group ranks ``src`` -> ``dst``; the whole world's keys are ``(src, dst, tag)``."""
        if self.members == tuple(range(self.world.size)):
            return (src, dst, tag)
        return (self.members, self.members[src], self.members[dst], tag)

    def wait(self, handles, step):
        """Wait with the world's turn released, so that the other ranks run meanwhile."""
        self.world.turn.release()
        try:
            super().wait(handles, step)
        finally:
            self.world.turn.acquire()

    def _send(self, t, peer, tag):
        w = self.world
        with w.lock:
            w.boxes[self._key(self.rank, peer, tag)].append(t.detach().clone())
            w.sends[tag] += 1
            w.bytes[tag] += t.numel() * t.element_size()
            if w.hosts is not None and w.hosts[self.members[self.rank]] != w.hosts[self.members[peer]]:
                w.across[tag] += t.numel() * t.element_size()
        return Handle(peer, lambda: True)

    def _recv(self, t, peer, tag):
        box = self.world.boxes[self._key(peer, self.rank, tag)]

        def poll() -> bool:
            with self.world.lock:
                if not box:
                    if self.members[peer] in self.world.gone:
                        raise RuntimeError(f"rank {peer} has exited")
                    return False
                msg = box.popleft()
            if msg.shape != t.shape or msg.dtype != t.dtype:
                raise RuntimeError(f"message {tuple(msg.shape)} {msg.dtype} does not fit the receive "
                                   f"buffer {tuple(t.shape)} {t.dtype}")
            t.copy_(msg)
            return True

        return Handle(peer, poll)


_MPI_KEYVAL: list = []


def mpi_attrs(comm) -> dict:
    """This process's state kept on the MPI communicator ``comm`` itself (an attribute: shared by
    every mpi4py object of that communicator, dropped when it is freed, not copied by ``Dup``)."""
    if not _MPI_KEYVAL:
        _MPI_KEYVAL.append(type(comm).Create_keyval())
    state = comm.Get_attr(_MPI_KEYVAL[0])
    if state is None:
        state = {}
        comm.Set_attr(_MPI_KEYVAL[0], state)
    return state


def is_mpi(group) -> bool:
    """Whether ``group`` is an ``mpi4py`` communicator."""
    return type(group).__module__.startswith("mpi4py.")


def as_comm(group) -> Communicator:
    """The communicator of ``group``: None (default group), a ProcessGroup, a 1-d DeviceMesh,
    an ``mpi4py.MPI.Comm``, or a :class:`Communicator` (e.g. a loopback rank)."""
    if isinstance(group, Communicator):
        return group
    if group is None:
        return TorchComm(None)
    if is_mpi(group):
        return MpiComm(group)
    if type(group).__name__ == "DeviceMesh":
        if group.ndim != 1:
            raise ValueError(f"group: a DeviceMesh must be 1-d (pick a dim with mesh[name]), got {group.ndim}-d")
        return TorchComm(group.get_group())
    import torch.distributed as dist
    if isinstance(group, dist.ProcessGroup):
        return TorchComm(group)
    raise TypeError(f"group must be None, a ProcessGroup, a 1-d DeviceMesh or an mpi4py communicator, "
                    f"got {type(group).__module__}.{type(group).__name__}")
