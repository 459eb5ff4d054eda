"""Probe: TMA reads in the plain attention backward pair, and its tiles, at a Llama-shaped layer.

    PYTHONPATH=. python3 benchmarks/probes/attention_bwd_tma.py OUTDIR

GQA 16/4, D=128, bf16, causal, q/k/v as ``(B, H, S, D)`` views of ``(B, S, H, D)`` tensors (the way
Hugging Face passes them), B=1 S=8k and B=4 S=2k: ``ss.attention`` forward+backward TFLOP/s (3.5x
the forward's products) with ``configs.ATTN_BWD_TMA`` off and on, one tile changed at a time
(dK/dV, then dQ) from the defaults, beside SDPA cuDNN in the same run; then the forward's tiles.
Backs ``configs.ATTN_BWD_TMA`` (docs/benchmarks/attention-backward.md). Rows go to OUTDIR/probe.json.
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import splitsoftmax as ss
from splitsoftmax.ops._triton import configs

KV = [(32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2)]
Q = [(128, 64, 8, 4), (64, 64, 4, 3)]
FWD = [(128, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3)]
TILES = configs.ATTN_TILES
BASE = {key: TILES[key] for key in [("bwd_kv", 2, 128), ("bwd_q", 2, 128), ("fwd", 2, 128),
                                    ("fwd_causal_short", 2, 128)]}
ROWS = []


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def record(row: dict) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def with_tile(kind: str, tile: tuple, fn) -> float:
    """``ms(fn)`` with ``ATTN_TILES[(kind, 2, 128)] = tile``, the other tiles at their defaults."""
    TILES.update(BASE)
    TILES[(kind, 2, 128)] = tile
    try:
        return ms(fn)
    finally:
        TILES.update(BASE)


def layer(b: int, s: int) -> None:
    def bshd_view(heads):
        return torch.randn(b, s, heads, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    q, k, v = bshd_view(16), bshd_view(4), bshd_view(4)
    dout = torch.randn_like(q)
    fwd_flops = 4 * b * 16 * s * s * 128 / 2

    def step(attn):
        q.grad = k.grad = v.grad = None
        attn().backward(dout)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        record({"B": b, "S": s, "impl": "cudnn", "fb_tflops": 3.5 * fwd_flops / ms(lambda: step(cudnn)) / 1e9})
        with torch.no_grad():
            record({"B": b, "S": s, "impl": "cudnn", "fwd_tflops": fwd_flops / ms(cudnn) / 1e9})
    mine = lambda: ss.attention(q, k, v, causal=True)  # noqa: E731
    for tma in (False, True):
        configs.ATTN_BWD_TMA = tma
        for kind, tiles in (("bwd_kv", KV), ("bwd_q", Q)):
            for tile in tiles:
                t = with_tile(kind, tile, lambda: step(mine))
                record({"B": b, "S": s, "tma": tma, kind: tile, "fb_tflops": 3.5 * fwd_flops / t / 1e9})
    configs.ATTN_BWD_TMA = BWD_TMA
    kind = "fwd_causal_short" if s <= configs.ATTN_SHORT_CAUSAL_SQ else "fwd"
    for tile in FWD:
        with torch.no_grad():
            try:
                t = with_tile(kind, tile, mine)
            except Exception as e:  # noqa: BLE001 (a tile may not fit in shared memory)
                record({"B": b, "S": s, kind: tile, "error": repr(e)[:200]})
                continue
        record({"B": b, "S": s, kind: tile, "fwd_tflops": fwd_flops / t / 1e9})


BWD_TMA = configs.ATTN_BWD_TMA
if __name__ == "__main__":
    for b, s in ((1, 8192), (4, 2048)):
        layer(b, s)
        with open(f"{sys.argv[1]}/probe.json", "w") as f:
            json.dump(ROWS, f, indent=1)
