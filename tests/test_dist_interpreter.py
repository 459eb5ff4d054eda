"""The sharded ops over the Triton kernels (TRITON_INTERPRET=1) on a loopback world: tiny shapes."""
from __future__ import annotations

import pytest
import torch

from splitsoftmax.distributed import LoopbackWorld
from test_dist_cases import F32, _check_sharded, case_nan_key, case_softmax, case_tree, uneven_lengths

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("size", [2, 3])
def test_softmax_family(size):
    LoopbackWorld(size).run(case_softmax)


@pytest.mark.parametrize("size", [2, 3])
def test_tree(size):
    LoopbackWorld(size).run(case_tree)


@pytest.mark.parametrize("schedule,layout,causal", [("ring", "zigzag", True), ("ring", "contiguous", False),
                                                    ("allgather", "contiguous", True)])
def test_attention(schedule, layout, causal):
    lens = None if layout == "zigzag" else uneven_lengths(3, 4)
    LoopbackWorld(3).run(lambda g: _check_sharded(g, schedule, layout, causal, lens, torch.float32, F32))


@pytest.mark.parametrize("size", [2, 3])
def test_nan_key(size):
    LoopbackWorld(size).run(case_nan_key)


@pytest.mark.parametrize("size", [2, 3])
def test_attention_variants(size):
    """Documents + window + softcap + sinks (ring, per-document zigzag), kv_range (allgather,
    contiguous) and the tree's window + sinks, over the Triton kernels' masks."""
    from test_dist_variants import check, documents, sinks_of

    def case(g):
        s = 4 * size + 3
        check(g, "ring", "zigzag", True, dict(cu_seqlens=documents(size, s), window_size=(2, 0), softcap=1.5,
                                              sinks=sinks_of().float()), s=s, dtype=torch.float32, tol=F32)
        kv = torch.tensor([[2, s], [0, s - 3]], dtype=torch.int32)
        lens = uneven_lengths(size, 4)
        lens[-1] += s - sum(lens)
        check(g, "allgather", "contiguous", True, dict(kv_range=kv, window_size=(5, 0)), lens=lens,
              dtype=torch.float32, tol=F32)
    LoopbackWorld(size).run(case)
