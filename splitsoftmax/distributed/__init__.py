"""Communication across ranks, knowing states and tensors but no op (torch.distributed, MPI, or
in-process): communicators, the handshake, layouts, plans, the tree reductions, ``shard`` and
``unshard`` (docs/API.md, "Across ranks"); for tests and tools: :class:`LoopbackWorld` (P ranks as
threads of one process, counting transfers). The sharded ops are the families' (``ops/<family>/``).
"""
from .comm import Communicator, LoopbackWorld, as_comm, timeout_s
from .shard import shard, unshard

__all__ = ["shard", "unshard", "Communicator", "LoopbackWorld", "as_comm", "timeout_s"]
