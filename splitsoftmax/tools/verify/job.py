"""This rank's view of a ``verify`` job, shared by the sharded rows and the variants' rows."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor


def uneven_lengths(total: int, world: int) -> list[int]:
    """Unequal per-rank lengths summing to ``total``, with rank 1 empty when there are 3+ ranks."""
    weights = [0 if (r == 1 and world > 2) else r + 1 for r in range(world)]
    lengths = [total * w // sum(weights) for w in weights]
    lengths[-1] += total - sum(lengths)
    return lengths


class Job:
    """This rank's view of the job: group, device, rank, world size, dtype."""

    def __init__(self, group, device: torch.device, rank: int, world: int, dtype: torch.dtype):
        self.group, self.device, self.rank, self.world, self.dtype = group, device, rank, world, dtype

    def randn(self, *shape, seed: int, scale: float = 1.0) -> Tensor:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(*shape, generator=gen) * scale).to(self.device, self.dtype)

    def narrow(self, lengths: Sequence[int], dim: int) -> Callable[[Tensor], Tensor]:
        start = sum(lengths[:self.rank])
        return lambda t: t.narrow(dim, start, lengths[self.rank])

    def contiguous(self, lengths: Sequence[int], dim: int) -> tuple[Callable, Callable]:
        import splitsoftmax as ss
        return self.narrow(lengths, dim), lambda t: ss.unshard(t, dim, group=self.group)

    def zigzag(self, dim: int) -> tuple[Callable, Callable]:
        import splitsoftmax as ss
        return (lambda t: ss.shard(t, dim, group=self.group, layout="zigzag"),
                lambda t: ss.unshard(t, dim, group=self.group, layout="zigzag"))
