"""Probe: attention backward tiles on one GPU, forward+backward TFLOP/s beside SDPA flash, one run.

    PYTHONPATH=. python3 benchmarks/probes/attention_bwd_tiles.py

One tile changes at a time (dK/dV, then dQ) from the defaults in ``ops/_triton/configs.py``, at
S = 1k, 2k, 8k (B*S = 32k, H=16, D=128, bf16), causal and not. Backs
``configs.ATTN_TILES[("bwd_kv", 2, 128)]`` (32x64, 4 warps, 3 stages) and
``ATTN_TILES[("bwd_q", 2, 128)]`` (128x64, 8 warps, 4 stages); numbers in docs/benchmarks/attention-forward.md,
earlier history.
"""

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import splitsoftmax as ss
from splitsoftmax.ops._triton import configs

KV = [(32, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 4), (64, 64, 8, 3), (16, 64, 4, 3), (32, 32, 4, 3), (32, 128, 8, 3),
      (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (16, 128, 8, 3), (64, 64, 4, 3)]
Q = [(128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 3), (128, 32, 8, 4)]
base_kv, base_q = configs.ATTN_TILES[("bwd_kv", 2, 128)], configs.ATTN_TILES[("bwd_q", 2, 128)]
for S in (1024, 2048, 8192):
    B = 32768 // S
    q, k, v = (torch.randn(B, 16, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    for causal in (False, True):
        flops = 3.5 * 4 * B * 16 * S * S * 128 / (2 if causal else 1)

        def fb(fn):
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(do)

        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            ms = do_bench(lambda: fb(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal)),
                          warmup=25, rep=150, return_mode="median")
        print(f"S{S} c{int(causal)} flash {flops / ms / 1e9:6.0f}", flush=True)
        for kind, tiles in (("bwd_kv", KV), ("bwd_q", Q)):
            for t in tiles:
                configs.ATTN_TILES[("bwd_kv", 2, 128)] = t if kind == "bwd_kv" else base_kv
                configs.ATTN_TILES[("bwd_q", 2, 128)] = t if kind == "bwd_q" else base_q
                try:
                    ms = do_bench(lambda: fb(lambda a, b, c: ss.attention(a, b, c, causal=causal)),
                                  warmup=25, rep=150, return_mode="median")
                    print(f"S{S} c{int(causal)} {kind} {str(t):18s} {flops / ms / 1e9:6.0f}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"S{S} c{int(causal)} {kind} {str(t):18s} failed {type(e).__name__}", flush=True)
        configs.ATTN_TILES[("bwd_kv", 2, 128)], configs.ATTN_TILES[("bwd_q", 2, 128)] = base_kv, base_q
    del q, k, v, do
