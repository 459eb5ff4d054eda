"""The metadata handshake once per configuration, with every later call checked inside its data.

A decode loop calls the same sharded operation with the same configuration at every step; the
handshake (``handshake.py``, one small all-gather) is then run on the first call only. Later calls
check agreement for free: every exchange of a call carries a fingerprint of the configuration
(:class:`Guard`), and the ranks compare fingerprints after it. A rank whose configuration changed
(or whose arguments are bad) cannot skip the handshake while its peers do, so it first joins their
expected first exchange with a *poison* buffer of the size that exchange had on the previous call:
the peers see the poison, and every rank runs the handshake, which raises the usual ``ValueError``
naming the field and the ranks (or accepts the new configuration, and the call runs again).

``SPLITSOFTMAX_HANDSHAKE=always`` runs the handshake on every call (the per-call check).

The sessions are kept per group, one per operation: the ranks of a group make the same calls on it
in the same order, so whether a call finds its session is the same on every rank. Nothing is
evicted but with its group (the tables hold the groups weakly; an MPI communicator holds its own
table as an attribute), so a rank in more groups than its peers, or many groups in one process,
cannot drop a session its peers keep.
"""
from __future__ import annotations

import os
import weakref
from typing import Callable, Optional

import torch

from . import handshake as hs
from .comm import Communicator, is_mpi, mpi_attrs
from .mesh import value_code
from .tree import allgather

POISON = -1                    # the fingerprint word of a poison buffer (real fingerprints are >= 0)
_TABLES = weakref.WeakKeyDictionary()  # group -> {(op, rank, size): Session}
_HELD: dict = {}                       # id(group) -> (group, its table): groups no weak reference takes (None)


class ConfigMismatch(ValueError):
    """Ranks exchanged data under different configurations."""


class _Poisoned(Exception):
    """A peer's configuration changed: the handshake must run (then the call again)."""


class Guard:
    """Handed to a call's exchanges: ``fingerprint`` to append, ``check`` for the words received."""

    def __init__(self, session: "Session", fingerprint_: int):
        self.session, self.fingerprint = session, fingerprint_
        self.first = True

    def check(self, words: list, size: int, device: torch.device) -> None:
        """``words``: every rank's fingerprint word; ``size``: this exchange's length on this rank."""
        if self.first:
            self.first = False
            if self.session.first_size is None:
                self.session.first_size, self.session.device = size, device
        if POISON in words:
            raise _Poisoned
        if len(set(words)) > 1:
            raise ConfigMismatch(f"{self.session.op}: ranks called with different configurations "
                                 f"(fingerprints by rank: {words}); seeds and offsets given as ints "
                                 f"must be the same on every rank")


class Session:
    """The last configuration of an operation handshaken on a group by this rank, the handshake's
    result, and the length and device of that configuration's first exchange (None before one ran)."""

    def __init__(self, op: str, config, meta: dict):
        self.op, self.config, self.meta = op, config, meta
        self.first_size: Optional[int] = None
        self.device = torch.device("cpu")


def _table(group) -> dict:
    """This process's sessions on ``group`` (an MPI communicator's on the communicator itself, so
    that every mpi4py object of it finds them)."""
    if is_mpi(group):
        return mpi_attrs(group).setdefault("sessions", {})
    try:
        return _TABLES.setdefault(group, {})
    except TypeError:  # (None, the default group, and objects that take no weak reference)
        held = _HELD.get(id(group))
        if held is None or held[0] is not group:
            held = _HELD[id(group)] = (group, {})
        return held[1]


def collective(comm: Communicator, group, op: str, agree: Optional[dict], per_rank: Optional[dict],
               error: Optional[BaseException], extra: tuple, body: Callable[[dict, Guard], object]):
    """``body(meta, guard)``, ``meta`` the handshake's ``{field: [value per rank]}``, under the
    once-per-configuration protocol above. ``extra``: values outside the handshake that must agree
    too (integer seeds), folded into the fingerprint."""
    sessions, key = _table(group), (op, comm.rank, comm.size)
    s = sessions.get(key)
    config = None if error is not None else (tuple((agree or {}).items()), tuple((per_rank or {}).items()))
    cached = s is not None and s.first_size is not None and os.environ.get("SPLITSOFTMAX_HANDSHAKE") != "always"
    if cached and config == s.config:
        try:
            return _run(s, body, extra)
        except _Poisoned:
            pass
        except ConfigMismatch:
            sessions.pop(key, None)
            hs.handshake(comm, op, agree, per_rank, None)   # names a field that differs, if one does
            raise
    elif cached:
        poison = torch.full((s.first_size,), POISON, dtype=torch.int64, device=s.device)
        allgather(comm, poison, f"{op}: configuration change")
    meta = hs.handshake(comm, op, agree, per_rank, error)
    s = sessions[key] = Session(op, config, meta)
    try:
        return _run(s, body, extra)
    except ConfigMismatch:
        sessions.pop(key, None)
        raise


def _run(s: Session, body, extra: tuple):
    values = [*(v for _, v in s.config[0]), *(x for vals in s.meta.values() for x in vals), *extra]
    return body(s.meta, Guard(s, value_code(tuple(int(v) for v in values))))
