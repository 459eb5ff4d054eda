"""Probe: the causal attention kernels' launch order (``configs.ATTN_ORDER_WAVES``) at model shapes.

    PYTHONPATH=. python3 benchmarks/probes/attention_order.py OUTDIR

bf16, D=128, causal unless said, q/k/v as ``(B, H, S, D)`` views of ``(B, S, H, D)`` tensors where
``views``: ``ss.attention`` forward and forward+backward TFLOP/s (3.5x the forward's products) with
the grid's own order (0) and heads taken in groups (the default), each timed twice in alternation
(the better kept), beside SDPA cuDNN in the same run. Before timing, the outputs and gradients of
the two orders must be equal bit for bit (the order moves programs, not arithmetic). Rows go to
OUTDIR/order.json (docs/benchmarks/attention-backward.md).
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import splitsoftmax as ss
from splitsoftmax.ops._triton import configs

SHAPES = [  # B, S, H, Hkv, views, causal
    (1, 8192, 16, 4, True, True), (4, 2048, 16, 4, True, True), (1, 8192, 32, 8, True, True),
    (4, 8192, 16, 16, False, True), (1, 32768, 16, 4, True, True), (1, 8192, 16, 4, True, False),
]
DEFAULT = configs.ATTN_ORDER_WAVES


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=80, return_mode="median")


def tensors(b, s, h, hkv, views):
    def make(heads):
        if views:
            return torch.randn(b, s, heads, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(b, heads, s, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = (make(n).requires_grad_() for n in (h, hkv, hkv))
    return q, k, v, torch.randn_like(q)


def step(q, k, v, dout, attn):
    q.grad = k.grad = v.grad = None
    attn().backward(dout)


def same_results(q, k, v, dout, causal) -> bool:
    got = []
    for waves in (0, DEFAULT):
        configs.ATTN_ORDER_WAVES = waves
        out = ss.attention(q, k, v, causal=causal)
        step(q, k, v, dout, lambda: ss.attention(q, k, v, causal=causal))
        got.append([out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
    return all(torch.equal(a, b) for a, b in zip(*got))


def main(out_dir: str) -> None:
    rows = []
    for b, s, h, hkv, views, causal in SHAPES:
        q, k, v, dout = tensors(b, s, h, hkv, views)
        flops = 4 * b * h * s * s * 128 / (2 if causal else 1)
        row = {"B": b, "S": s, "H": h, "Hkv": hkv, "views": views, "causal": causal,
               "bitwise_equal": same_results(q, k, v, dout, causal)}
        mine = lambda: ss.attention(q, k, v, causal=causal)  # noqa: E731
        for waves in (0, DEFAULT, 0, DEFAULT):
            configs.ATTN_ORDER_WAVES = waves
            with torch.no_grad():
                fwd = flops / ms(mine) / 1e9
            fb = 3.5 * flops / ms(lambda: step(q, k, v, dout, mine)) / 1e9
            row[f"fwd_{waves}"] = max(row.get(f"fwd_{waves}", 0.0), fwd)
            row[f"fb_{waves}"] = max(row.get(f"fb_{waves}", 0.0), fb)
        configs.ATTN_ORDER_WAVES = DEFAULT
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)  # noqa: E731
            with torch.no_grad():
                row["fwd_cudnn"] = flops / ms(cudnn) / 1e9
            row["fb_cudnn"] = 3.5 * flops / ms(lambda: step(q, k, v, dout, cudnn)) / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    json.dump(rows, open(f"{out_dir}/order.json", "w"), indent=1)
    print("B x S, heads, views, causal | fwd: order 0, grouped, cuDNN | fwd+bwd: order 0, grouped, cuDNN | equal")
    for r in rows:
        print(f"{r['B']} x {r['S']} {r['H']}/{r['Hkv']} {'views' if r['views'] else 'contig'} "
              f"{'causal' if r['causal'] else 'full'} | {r['fwd_0']:.0f} {r[f'fwd_{DEFAULT}']:.0f} "
              f"{r['fwd_cudnn']:.0f} | {r['fb_0']:.0f} {r[f'fb_{DEFAULT}']:.0f} {r['fb_cudnn']:.0f} | "
              f"{r['bitwise_equal']}")


if __name__ == "__main__":
    main(sys.argv[1])
