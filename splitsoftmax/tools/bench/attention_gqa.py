"""``bench attention``'s batch-1 GQA rows: 32/8 and 16/4 query/kv heads, causal, S=8k, D=128, bf16,
as contiguous (B, H, S, D) tensors and as (B, H, S, D) views of (B, S, H, D) ones (the layout
Hugging Face models hand over), forward and forward+backward TFLOP/s beside SDPA flash and cuDNN.
"""
from __future__ import annotations

import json

import torch

from . import best_ms

DIM = 128
GQA_SHAPES = [(32, 8), (16, 4)]  # query heads, kv heads: batch 1, causal, S=8k, as Llama-style models run


def _bshd(b, s, h, hkv, device="cuda"):
    """q, k, v, dout as (B, H, S, D) views of (B, S, H, D) tensors (the Hugging Face layout)."""
    q, dout = (torch.randn(b, s, h, DIM, device=device, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(b, s, hkv, DIM, device=device, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    return q, k, v, dout


def _ms(fn, grad_to_none=None) -> float:
    return best_ms(fn, rep=200, grad_to_none=grad_to_none)


def gqa_rows(peers, sampled_error, seq: int = 8192) -> list[dict]:
    """Forward and forward+backward TFLOP/s at batch 1, GQA 32/8 and 16/4, causal, contiguous
    (B, H, S, D) and (B, H, S, D) views of (B, S, H, D), each peer on the same tensors; ss's
    forward error on sampled rows against float64 (2x SDPA flash's) and its gradients' relative
    difference from SDPA flash's. ``peers()`` gives the methods, ``sampled_error`` the forward check
    (both from :mod:`splitsoftmax.tools.bench.attention`)."""
    res = []
    rows = torch.linspace(0, seq - 1, 128, device="cuda").long()
    flops = 4 * seq * seq * DIM / 2
    for h, hkv in GQA_SHAPES:
        for layout in ("bhsd", "bshd"):
            q, k, v, dout = _bshd(1, seq, h, hkv)
            if layout == "bhsd":
                q, k, v, dout = (t.contiguous() for t in (q, k, v, dout))
            rec = {"H": h, "Hkv": hkv, "S": seq, "layout": layout, "err": {}}
            grads = {}
            for n, f in peers().items():
                try:
                    with torch.no_grad():
                        rec["err"][n] = sampled_error(f(q, k, v, True), q, k, v, True, rows)
                        rec[f"{n}_fwd"] = h * flops / _ms(lambda: f(q, k, v, True)) / 1e9
                    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                    f(*leaves, True).backward(dout)
                    grads[n] = [t.grad.float() for t in leaves]
                    rec[f"{n}_fwdbwd"] = 3.5 * h * flops / _ms(lambda: f(*leaves, True).backward(dout), leaves) / 1e9
                except Exception as e:  # noqa: BLE001 (a peer may refuse a shape; ss must not)
                    if n == "ss":
                        raise
                    rec[f"{n}_error"] = repr(e)[:200]
            flash = grads.get("sdpa_flash")
            rec["grad_rel_diff_vs_flash"] = (float("nan") if flash is None else max(
                ((a - c).norm() / c.norm()).item() for a, c in zip(grads["ss"], flash)))
            rec["correct"] = (rec["err"]["ss"] <= 2 * rec["err"].get("sdpa_flash", float("inf"))
                              and rec["grad_rel_diff_vs_flash"] < 2e-2)
            res.append(rec)
            print(json.dumps({kk: (round(vv, 1) if isinstance(vv, float) else vv) for kk, vv in rec.items()
                              if kk != "err"}), flush=True)
            del q, k, v, dout, grads
    return res


def gqa_table(rows: list[dict]) -> list[str]:
    lines = ["GQA b=1 causal  layout | ss fwd  flash  cudnn | ss f+b  flash  cudnn  ss/cudnn | ok"]
    for r in rows:
        nan = float("nan")
        lines.append(f"{r['H']}/{r['Hkv']} S={r['S']} {r['layout']} | {r['ss_fwd']:6.0f} "
                     f"{r.get('sdpa_flash_fwd', nan):6.0f} {r.get('sdpa_cudnn_fwd', nan):6.0f} | "
                     f"{r['ss_fwdbwd']:6.0f} {r.get('sdpa_flash_fwdbwd', nan):6.0f} "
                     f"{r.get('sdpa_cudnn_fwdbwd', nan):6.0f} "
                     f"{r['ss_fwdbwd'] / r.get('sdpa_cudnn_fwdbwd', nan):8.2f} | "
                     f"{r['correct']}")
    return lines
