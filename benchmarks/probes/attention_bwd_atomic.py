"""Probe: the five-product backward (``configs.ATTN_BWD_ATOMIC``) against the plain pair.

    PYTHONPATH=. python3 benchmarks/probes/attention_bwd_atomic.py

bf16, D=128, causal, GQA 16/4, q/k/v as ``(B, H, S, D)`` views of ``(B, S, H, D)`` tensors, 1 x 8192
and 4 x 2048: ``ss.attention`` forward+backward TFLOP/s (3.5x the forward's products) with the
five-product kernel off and on, each timed twice in alternation, the better kept
(docs/benchmarks/attention-backward.md).
"""
import torch
from triton.testing import do_bench

import splitsoftmax as ss
from splitsoftmax.ops._triton import configs

for b, s in ((1, 8192), (4, 2048)):
    def view(heads):
        return torch.randn(b, s, heads, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    q, k, v = view(16), view(4), view(4)
    dout = torch.randn_like(q)
    flops = 3.5 * 4 * b * 16 * s * s * 128 / 2

    def step():
        q.grad = k.grad = v.grad = None
        ss.attention(q, k, v, causal=True).backward(dout)
    best = {}
    for atomic in (False, True, False, True):
        configs.ATTN_BWD_ATOMIC = atomic
        best[atomic] = max(best.get(atomic, 0.0), flops / do_bench(step, warmup=10, rep=60, return_mode="median") / 1e9)
    print(b, s, "pair", round(best[False]), "five-product", round(best[True]), flush=True)
