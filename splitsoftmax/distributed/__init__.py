"""Sharded softmax, logsumexp and attention across ranks (torch.distributed, MPI, or in-process).

Public: ``sharded_softmax``, ``sharded_log_softmax``, ``sharded_logsumexp``,
``sharded_attention``, ``shard``, ``unshard`` (docs/API.md, "Across ranks"); for tests and
tools: :class:`LoopbackWorld` (P ranks as threads of one process, counting transfers).
"""
from .comm import Communicator, LoopbackWorld, as_comm, timeout_s
from .sharded import (shard, sharded_attention, sharded_log_softmax, sharded_logsumexp, sharded_softmax,
                      unshard)

__all__ = ["sharded_softmax", "sharded_log_softmax", "sharded_logsumexp", "sharded_attention", "shard",
           "unshard", "Communicator", "LoopbackWorld", "as_comm", "timeout_s"]
