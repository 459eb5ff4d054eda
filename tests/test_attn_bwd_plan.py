"""CPU tests of the attention backward's host-side plan: document row ranges per key block, the
split of a key block's work on 132 SMs, gradient layouts and what TMA can address."""
from __future__ import annotations

import pytest
import torch

from splitsoftmax.ops.attention import bwd as AB
from splitsoftmax.ops._triton import configs
from splitsoftmax.core.mask import Mask, visible


def _docs(cu, s):
    cu = torch.tensor(cu)
    doc = torch.searchsorted(cu, torch.arange(s), right=True) - 1
    return torch.stack((cu[doc], cu[doc + 1])).to(torch.int32)


@pytest.mark.parametrize("cu,bn", [([0, 5, 38, 39, 97], 16), ([0, 97], 32), ([0, 0, 1, 2, 60, 60, 97], 16),
                                   ([0, 40, 97], 128)])
def test_row_blocks_match_the_rule(cu, bn):
    """For every key block: rows [r0, r1) are exactly those that see one of its keys, rows [f0, f1)
    exactly those that see all of them (the rule of splitsoftmax.core.mask, documents only)."""
    s = cu[-1]
    rows = _docs(cu, s)
    rb = AB.row_blocks(rows, s, bn)
    vis = visible(Mask(rows=rows), False, 0, 1, s, s)[0]  # [Sq, Sk]
    for n, (r0, r1, f0, f1) in enumerate(rb.tolist()):
        keys = vis[:, n * bn:(n + 1) * bn]
        some = keys.any(1).nonzero().flatten().tolist()
        every = (keys.all(1) & (n * bn + bn <= s)).nonzero().flatten().tolist()
        assert list(range(r0, r1)) == some, (n, r0, r1)
        if n * bn + bn <= s:
            assert list(range(max(f0, 0), max(f1, f0))) == every, (n, f0, f1)


@pytest.mark.parametrize("b,h,hkv,s,want", [
    (1, 16, 4, 8192, (1, 1)),     # 4 x 128 key blocks of 64: 512 programs, two per SM
    (1, 32, 8, 8192, (1, 1)),
    (4, 16, 4, 2048, (1, 1)),
    (1, 16, 16, 32768, (1, 1)),
    (1, 4, 1, 8192, (3, 1)),      # MQA: 128 programs, the 4 query heads split 3 ways
    (1, 1, 1, 8192, (1, 3)),      # one head: split by query range
    (1, 8, 1, 2048, (8, 2)),      # 32 programs: by heads, then by query range
])
def test_splits_on_132_sms(b, h, hkv, s, want, monkeypatch):
    monkeypatch.setattr(AB, "sm_count", lambda t: 132)
    q, k = torch.empty(b, h, s, 128, device="meta"), torch.empty(b, hkv, s, 128, device="meta")
    tile = configs.ATTN_TILES[("bwd_kv", 2, 128)]
    nh, nq = AB.splits(q, k, tile)
    assert (nh, nq) == want
    programs = b * hkv * configs.cdiv(s, tile[1]) * nh * nq
    assert nh * nq == 1 or programs >= configs.ATTN_BWD_PROGRAMS_PER_SM * 132


def test_dense_strides_and_tma():
    base = torch.empty(2, 37, 8, 128, dtype=torch.bfloat16)
    view = base.transpose(1, 2)  # (B, H, S, D) view of (B, S, H, D)
    assert AB._dense_strides(view) == view.stride() and AB._tma_ok(view)
    fused = torch.empty(2, 37, 12, 128, dtype=torch.bfloat16).transpose(1, 2)[:, :8]  # a fused-QKV slice
    assert AB._dense_strides(fused) == (8 * 37 * 128, 37 * 128, 128, 1) and AB._tma_ok(fused)
    assert not AB._tma_ok(torch.empty(2, 8, 37, 80, dtype=torch.bfloat16))  # padded head dim
    assert not AB._tma_ok(torch.ones(1, 1, 1, 128).expand(2, 8, 37, 128))  # zero strides
    desc = AB._descriptor(torch.empty(1, 8, 37, 128, dtype=torch.bfloat16), 32)
    assert desc.strides[0] == 8 * 37 * 128 and desc.block_shape == [1, 1, 32, 128]
