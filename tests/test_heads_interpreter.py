"""``schedule="heads"`` over the Triton kernels (TRITON_INTERPRET=1) on a loopback world: tiny shapes,
float32; head splits that share kv heads and leave a rank's grouping uneven."""
from __future__ import annotations

import pytest
import torch

from splitsoftmax.distributed import LoopbackWorld
from test_dist_cases import F32
from test_dist_variants import documents
from test_heads_cases import _lens, check, sinks_of, uneven_grouping

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("size", [3, 4])
def test_heads_variants(size):
    """Documents + window + softcap + sinks (zigzag per document), kv_range (contiguous, uneven)."""
    def case(g):
        s = 3 * size + 2
        check(g, "zigzag", True, dict(cu_seqlens=documents(size, s), window_size=(2, 0), softcap=1.5,
                                      sinks=sinks_of(6).float()), 6, 2, s=s, dtype=torch.float32, tol=F32)
        kv = torch.tensor([[2, s], [0, s - 3]], dtype=torch.int32)
        h, hkv = uneven_grouping(size)
        check(g, "contiguous", False, dict(kv_range=kv), h, hkv, lens=_lens(size, s, 4), dtype=torch.float32, tol=F32)
    LoopbackWorld(size).run(case)
