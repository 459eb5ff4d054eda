"""Probe: device time per kernel of one ``ss.attention`` forward+backward, beside SDPA cuDNN's.

    PYTHONPATH=. python3 benchmarks/probes/attention_kernel_times.py OUTDIR

bf16, D=128, causal, q/k/v as ``(B, H, S, D)`` views of ``(B, S, H, D)`` tensors: GQA 16/4 at
1 x 8192 and 4 x 2048, the torch profiler's device time per kernel averaged over 10 steps after 3,
printed and written to OUTDIR/attn_prof.json (docs/benchmarks/attention-backward.md).

Backs no setting by itself: it shows where a forward+backward's device time goes, which chose
the next kernel to change (``configs.ATTN_BWD_GLUON``, ``configs.ATTN_BWD_DS``).
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import splitsoftmax as ss
from helpers import kernel_times


def main(out_dir: str) -> None:
    res = {}
    for b, s in ((1, 8192), (4, 2048)):
        def view(heads):
            return torch.randn(b, s, heads, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        q, k, v = (view(n).requires_grad_() for n in (16, 4, 4))
        dout = torch.randn_like(q)

        def step(attn):
            q.grad = k.grad = v.grad = None
            attn().backward(dout)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = kernel_times(lambda: step(lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True)))
        mine = kernel_times(lambda: step(lambda: ss.attention(q, k, v, causal=True)))
        for name, rows in (("ss", mine), ("cudnn", cudnn)):
            res[f"{b}x{s} {name}"] = rows
            total = sum(t for _, t in rows)
            print(f"--- {b} x {s} {name}: {total:.0f} us: " + "; ".join(f"{k[:48]} {t:.0f}" for k, t in rows),
                  flush=True)
    json.dump(res, open(f"{out_dir}/attn_prof.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
