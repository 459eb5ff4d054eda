"""Probe of the forward's mask variants and layouts on one GPU (``python3 benchmarks/probes/fwd_variants.py MODE``).

MODE ``warm``: compile every kernel the timing mode runs (splitsoftmax's, FlexAttention's), so that
it can run beside the test suite first. MODE ``bench``:

1. the forward before the mask variants (``splitsoftmax/ops/attention/_probe_prev.py``, a copy of the
   previous ``ops/attention/fwd.py``) against the current one: results bit for bit, and TFLOP/s;
2. (B, S, H, D) views read as ``(B * S, H * D)`` row descriptors against ``(B, H, S, D)`` ones;
   softcap through ``tanh.approx`` against the exact form;
3. the variant and GQA-layout rows of ``bench attention`` (``splitsoftmax.tools.bench.attention_variants``).

Writes ``fwd_variants.json`` to ``$OUT`` (or the working directory) and prints a table last.

Backs ``configs.ATTN_TMA_ROWS`` (row descriptors) and ``configs.ATTN_SOFTCAP_APPROX``; the variants'
forward kernel itself is ``configs.ATTN_FWD_GLUON_VARIANTS``' (``fwd_gluon_variants.py``).
"""
from __future__ import annotations

import json
import os
import sys

import torch

from splitsoftmax.tools.bench import attention_variants as V
from splitsoftmax.tools.bench import best_ms
from splitsoftmax.ops.attention import fwd as A
from splitsoftmax.ops._triton import configs
from splitsoftmax.core.mask import Mask

D = 128
SC = D ** -0.5


def _prev():
    from splitsoftmax.ops.attention import _probe_prev
    return _probe_prev


def _qkv(b, h, hkv, sq, sk, views=False):
    def make(n, s):
        if views:
            return torch.randn(b, s, n, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(b, n, s, D, device="cuda", dtype=torch.bfloat16)
    return make(h, sq), make(hkv, sk), make(hkv, sk)


# name, (b, h, hkv, sq, sk), causal, diag, views
SHAPES = [("8k full B=4 H=16", (4, 16, 16, 8192, 8192), False, 0, False),
          ("8k causal B=4 H=16", (4, 16, 16, 8192, 8192), True, 0, False),
          ("1k causal B=32 H=16", (32, 16, 16, 1024, 1024), True, 0, False),
          ("8k causal GQA 32/8 B=1 views", (1, 32, 8, 8192, 8192), True, 0, True),
          ("decode 128k GQA 32/8", (1, 32, 8, 1, 131072), False, 0, False),
          ("decode 128k causal GQA 32/8 B=4", (4, 32, 8, 1, 131072), True, 131071, False)]


def _flops(b, h, sq, sk, causal, diag) -> float:
    pairs = sum(min(sk, max(0, i + diag + 1)) for i in range(sq)) if causal else sq * sk
    return 4.0 * b * h * D * pairs


def against_previous(rows: list) -> None:
    prev = _prev()
    for name, (b, h, hkv, sq, sk), causal, diag, views in SHAPES:
        q, k, v = _qkv(b, h, hkv, sq, sk, views)
        new = A.attn_fwd(q, k, v, SC, causal, diag, out_dtype=q.dtype)
        old = prev.attn_fwd(q, k, v, SC, causal, diag, out_dtype=q.dtype)
        rec = {"shape": name, "bitwise": all(torch.equal(x, y) for x, y in zip(new, old)),
               "out_bshd": new[0].transpose(1, 2).is_contiguous()}
        # TFLOP/s, or for one query (decode) GB/s of K+V read
        f = 2 * k.numel() * k.element_size() * 1e3 if sq == 1 else _flops(b, h, sq, sk, causal, diag)
        rec["unit"] = "GB/s" if sq == 1 else "TFLOP/s"
        def rate(mod):
            return f / best_ms(lambda: mod.attn_fwd(q, k, v, SC, causal, diag, out_dtype=q.dtype)) / 1e9
        rec["prev"], rec["new"] = rate(prev), rate(A)
        if views:
            configs.ATTN_TMA_ROWS = False
            rec["new_4d_descriptors"] = rate(A)
            configs.ATTN_TMA_ROWS = True
        rows.append(rec)
        print(json.dumps(rec), flush=True)
        del q, k, v, new, old


def softcap_forms(rows: list) -> None:
    q, k, v = _qkv(1, 16, 16, 32768, 32768)
    f = 4.0 * 16 * D * V.visible_pairs("softcap")
    for approx in (True, False):
        configs.ATTN_SOFTCAP_APPROX = approx
        m = Mask(softcap=50.0)
        rec = {"shape": f"softcap 50 32k causal H=16, tanh {'approx' if approx else 'exact'}",
               "new": f / best_ms(lambda: A.attn_fwd(q, k, v, SC, True, 0, out_dtype=q.dtype, mask=m)) / 1e9}
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    configs.ATTN_SOFTCAP_APPROX = True


def warm() -> None:
    """One call of everything ``bench`` times (compiles; no timing)."""
    q, k, v = _qkv(1, 16, 16, 32768, 32768)
    sinks = torch.randn(16, device="cuda")
    with torch.no_grad():
        for name in V.VARIANTS:
            V.ss_fn(name, sinks)[0](q, k, v)
            try:
                V.flex_fn(name, sinks)(q, k, v)
            except Exception as e:  # noqa: BLE001
                print("flex", name, repr(e)[:200], flush=True)
        for approx in (True, False):
            configs.ATTN_SOFTCAP_APPROX = approx
            A.attn_fwd(q, k, v, SC, True, 0, out_dtype=q.dtype, mask=Mask(softcap=50.0))
        configs.ATTN_SOFTCAP_APPROX = True
        prev = _prev()
        for _, (b, h, hkv, sq, sk), causal, diag, views in SHAPES:
            q, k, v = _qkv(b, h, hkv, sq, sk, views)
            A.attn_fwd(q, k, v, SC, causal, diag, out_dtype=q.dtype)
            prev.attn_fwd(q, k, v, SC, causal, diag, out_dtype=q.dtype)
        torch.cuda.synchronize()
    print("warm", flush=True)


def main(mode: str) -> int:
    if mode == "warm":
        warm()
        return 0
    rows: list = []
    against_previous(rows)
    softcap_forms(rows)
    variants = V.variant_rows()
    layouts = V.layout_rows()
    out = os.environ.get("OUT", ".")
    import triton
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cudnn": torch.backends.cudnn.version()}
    with open(os.path.join(out, "fwd_variants.json"), "w") as fh:
        json.dump({"meta": meta, "probe": rows, "variants": variants, "layouts": layouts}, fh, indent=1)
    print(json.dumps(meta))
    print("shape | prev  new  (4d desc) | bitwise  out (B,S,H,D)")
    for r in rows:
        print(f"{r['shape']:<34} | {r.get('prev', float('nan')):5.0f} {r['new']:5.0f} "
              f"{r.get('new_4d_descriptors', float('nan')):5.0f} | {r.get('bitwise', '')} {r.get('out_bshd', '')}")
    print("\n".join(V.table_lines(variants, layouts)))
    return 0 if all(r.get("bitwise", True) for r in rows) and all(r["correct"] for r in variants + layouts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bench"))
