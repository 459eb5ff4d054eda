"""CPU lane: the split-KV plan (``ops.attention.decode.plan``) on an H200's 132 SMs, from shapes alone.

Invariants: the splits cover exactly the visible keys in whole tiles; they fill at most one wave
of ``ATTN_SPLIT_PROGRAMS_PER_SM`` programs per SM (a partial second wave ran batch-4 decode at 0.8x
cuDNN, docs/benchmarks/decode-merge.md, earlier history); short splits pipeline fewer stages. And the
causal grids' launch order (``decode.head_group``) at the shapes it was timed at.
"""
from __future__ import annotations

import pytest
import torch

from splitsoftmax.ops._triton import configs
from splitsoftmax.ops.attention import decode

SMS = 132


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    monkeypatch.setattr(decode, "sm_count", lambda t: SMS)


def _plan(b, h, hkv, sq, sk, causal=False, diag=0, dtype=torch.bfloat16):
    q = torch.empty(b, h, sq, 128, dtype=dtype, device="meta")
    k = torch.empty(b, hkv, sk, 128, dtype=dtype, device="meta")
    return decode.plan(q, k, k, causal, diag)


CASES = [(b, 32, 8, 1, sk) for b in (1, 2, 3, 4, 5, 7, 16, 40) for sk in (1000, 5000, 40000, 131072, 1 << 20)]
CASES += [(1, 8, 8, 1, 131072), (2, 32, 32, 4, 65536), (1, 16, 2, 16, 300000), (1, 16, 16, 64, 200000)]


@pytest.mark.parametrize("b,h,hkv,sq,sk", CASES)
def test_splits_cover_the_keys_in_at_most_one_wave(b, h, hkv, sq, sk):
    p = _plan(b, h, hkv, sq, sk)
    bm, bn = p.tile[:2]
    rows = (h // hkv) * sq if p.pack else sq
    programs = -(-rows // bm) * b * (hkv if p.pack else h)
    assert p.chunk % bn == 0
    assert (p.nsplit - 1) * p.chunk < sk <= p.nsplit * p.chunk
    if p.nsplit > 1:
        assert programs * p.nsplit <= configs.ATTN_SPLIT_PROGRAMS_PER_SM * SMS
        assert p.chunk >= bn * configs.ATTN_SPLIT_MIN_TILES


def test_causal_splits_cover_only_the_visible_keys():
    p = _plan(1, 32, 8, 1, 131072, causal=True, diag=50000)
    assert (p.nsplit - 1) * p.chunk < 50001 <= p.nsplit * p.chunk


@pytest.mark.parametrize("sk,short", [(131072, True), (1 << 20, False)])
def test_short_splits_pipeline_fewer_stages(sk, short):
    """128k keys over 33 splits is 63 tiles each; 1M keys, 504."""
    p = _plan(1, 32, 8, 1, sk)
    assert p.nsplit == 33
    stages = configs.ATTN_TILES[("decode", 2, 128)][3]
    assert p.tile[3] == (min(stages, configs.ATTN_SHORT_SPLIT_STAGES) if short else stages)


def test_batch_four_fills_one_wave():
    """32 (batch, kv head) programs: 8 splits (256 programs), not 9 (288 on 264 slots)."""
    assert _plan(4, 32, 8, 1, 131072).nsplit == 8


def _programs(p, b, h, hkv, sq):
    rows = (h // hkv) * sq if p.pack else sq
    return -(-rows // p.tile[0]) * b * (hkv if p.pack else h) * p.nsplit


@pytest.mark.parametrize("h,hkv", [(16, 4), (32, 8)])
@pytest.mark.parametrize("sq,sk", [(1, 32768), (1, 131072), (16, 32768), (64, 32768), (128, 8192), (512, 512),
                                   (1024, 1024), (512, 32768), (8192, 8192)])
def test_gqa_at_batch_one_fills_the_sms(h, hkv, sq, sk):
    """Batch 1 with 4 or 8 kv heads: at least one program per SM (queries or keys split), causal and
    bottom-right aligned as decode and chunked prefill run."""
    p = _plan(1, h, hkv, sq, sk, causal=True, diag=sk - sq)
    assert _programs(p, 1, h, hkv, sq) >= SMS, p


def test_window_splits_cover_only_the_window():
    """Decode with a window of 8192 at 1M keys: the splits start at the window's first tile."""
    from splitsoftmax.core.mask import Mask
    sk = 1 << 20
    q = torch.empty(1, 32, 1, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8, sk, 128, dtype=torch.bfloat16, device="meta")
    p = decode.plan(q, k, k, True, sk - 1, Mask(lo=sk - 8192))
    bn = p.tile[1]
    assert p.start == ((sk - 8192) // bn) * bn and p.start % bn == 0
    assert p.start + (p.nsplit - 1) * p.chunk < sk <= p.start + p.nsplit * p.chunk
    assert p.nsplit * p.chunk < 8192 + 2 * bn * p.nsplit


# (blocks, heads, warps) of causal grids -> heads per group (docs/benchmarks/attention-backward.md:
# the first three shapes gained, the last keeps its order); the forward's and dQ's grids coincide
# at 1 x 8k 16/4
ORDER_CASES = {"1x8k 16/4 fwd, dQ": ((64, 16, 8), 8), "1x8k 16/4 dK/dV": ((128, 4, 4), 4),
               "4x2k 16/4 fwd": ((32, 64, 4), 32), "4x2k 16/4 dK/dV": ((32, 16, 4), 16),
               "4x2k 16/4 dQ": ((16, 64, 8), 32), "1x8k 32/8 fwd, dQ": ((64, 32, 8), 8),
               "1x8k 32/8 dK/dV": ((128, 8, 4), 8), "4x8k 16 dK/dV": ((128, 64, 4), 1),
               "4x8k 16 fwd, dQ": ((64, 64, 8), 1)}


@pytest.mark.parametrize("grid,group", list(ORDER_CASES.values()), ids=list(ORDER_CASES))
def test_launch_order_groups_heads_of_short_causal_grids(grid, group):
    """Causal grids of fewer than ``ATTN_ORDER_MAX_WAVES`` waves take heads in groups of about
    ``ATTN_ORDER_WAVES`` waves, evened out (equal groups here); longer grids and non-causal ones
    keep the grid's order (groups of one head)."""
    blocks, heads, warps = grid
    t = torch.empty(1, device="meta")
    assert decode.head_group(blocks, heads, t, True, warps) == group
    assert decode.head_group(blocks, heads, t, False, warps) == 1
    slots = SMS * (8 // warps)
    assert (group > 1) == (blocks * heads < configs.ATTN_ORDER_MAX_WAVES * slots)
    assert heads % group == 0
