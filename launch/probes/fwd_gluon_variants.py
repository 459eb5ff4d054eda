"""Probe of the variants' forward on the Gluon kernel against the Triton kernel, on one H200.

``PYTHONPATH=. python3 launch/probes/fwd_gluon_variants.py OUTDIR [SECTIONS]``, sections:

- ``fwd``: forward TFLOP/s over visible pairs at the variant rows of ``bench attention`` (32k, B=1,
  H=16, D=128, bf16; ``splitsoftmax.bench.attention_variants``), through ``ss.attention``, with the
  variants on the Gluon forward (``configs.ATTN_FWD_GLUON_VARIANTS``) and on the Triton one; each
  result checked against float64 on 64 rows (at most 2x torch's bf16 error);
- ``fb``: the same forward+backward;
- ``plain``: the plain forward on this Gluon kernel against an earlier one
  (``splitsoftmax/kernels/_prev_fwd_gluon.py``, a copy of it, when present): bit for bit, TFLOP/s;
- ``short``: the plain causal forward at 1k-4k (B * S = 32k tokens) on both kernels.
"""
import os
import sys

import torch

from helpers import bench, rec, run_sections
from splitsoftmax.bench import attention_variants as V
from splitsoftmax.kernels import attention as A
from splitsoftmax.kernels import configs

D = 128


def _variants(fb: bool):
    q, k, v = (torch.randn(1, V.H, V.S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sinks = torch.randn(V.H, device="cuda") + 2.0
    rows = torch.linspace(0, V.S - 1, 64, device="cuda").long()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    for name in ("causal", "documents", "window", "softcap"):
        flops = 4.0 * V.H * D * V.visible_pairs(name) * (3.5 if fb else 1.0)
        fn, _ = V.ss_fn(name, sinks)
        for on in (True, False):
            configs.ATTN_FWD_GLUON_VARIANTS = on
            kernel = "gluon" if on else "triton"
            with torch.no_grad():
                err, bar = V._err(fn(q, k, v), q, k, v, name, rows, sinks)
            if fb:
                ms = bench(lambda: fn(*leaves).backward(dout))
            else:
                with torch.no_grad():
                    ms = bench(lambda: fn(q, k, v))
            rec("fb" if fb else "fwd", f"{name} {kernel}", ms, flops=flops, err=err, torch_err=bar,
                ok=bool(err <= 2 * bar + 1e-6))
    configs.ATTN_FWD_GLUON_VARIANTS = True


def _prev_run(q, k, v, causal):
    """The plain forward on the previous Gluon kernel (its launch as ``attention`` made it)."""
    from splitsoftmax.kernels import _prev_fwd_gluon as P
    from splitsoftmax.kernels.attention_bwd_gluon import descriptor
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bm, bn, warps, stages = configs.ATTN_TILES[("fwd_gluon", 2, d)]
    out = A._empty_out(q, d, q.dtype)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    nb = configs.cdiv(sq, 2 * bm)
    grid = (min(nb * b * h, A.sm_count(q)),)
    ctr = torch.zeros(2, dtype=torch.int32, device=q.device)
    gh = A.head_group(nb, b * h, q, causal, 2 * warps)

    def run():
        P._attn_fwd_gluon[grid](descriptor(q, bm), descriptor(k, bn), descriptor(v, bn), out, lse, ctr,
                                *out.stride()[:3], *lse.stride(), h, h // hkv, nb, b * h, sq, sk, 0,
                                d ** -0.5 * 1.4426950408889634, gh, BLOCK_M=bm, BLOCK_N=bn, D=d, CAUSAL=causal,
                                STAGES=stages, num_warps=warps, maxnreg=configs.ATTN_FWD_GLUON_MAXNREG)
    return run, out, lse


def plain():
    shapes = [("32k causal B=1 H=16", 1, 16, 16, 32768, True, False), ("8k causal GQA 16/4 views", 1, 16, 4, 8192,
                                                                       True, True),
              ("4k causal B=8 H=16", 8, 16, 16, 4096, True, False), ("8k full B=4 H=16", 4, 16, 16, 8192, False, False)]
    for name, b, h, hkv, s, causal, views in shapes:
        def make(n):
            x = torch.randn(b, s, n, D, device="cuda", dtype=torch.bfloat16)
            return x.transpose(1, 2) if views else x.transpose(1, 2).contiguous()
        q, k, v = make(h), make(hkv), make(hkv)
        flops = 4.0 * b * h * D * (s * (s + 1) / 2 if causal else s * s)
        new = lambda: A.attn_fwd(q, k, v, D ** -0.5, causal, 0, out_dtype=q.dtype)  # noqa: E731
        o1, l1 = new()
        extra = {}
        if os.path.exists(os.path.join(os.path.dirname(A.__file__), "_prev_fwd_gluon.py")):
            run, o0, l0 = _prev_run(q, k, v, causal)
            run()
            extra["bitwise"] = bool(torch.equal(o0, o1) and torch.equal(l0, l1))
            rec("plain", f"{name} previous", bench(run), flops=flops)
        rec("plain", f"{name} new", bench(new), flops=flops, **extra)


def short():
    """The plain causal forward at B * S = 32k tokens (H=16) on the Triton kernel and the Gluon one."""
    for s in (1024, 2048, 4096):
        q, k, v = (torch.randn(32768 // s, 16, s, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4.0 * q.shape[0] * 16 * D * s * (s + 1) / 2
        outs = {}
        for name, least in (("triton", (1 << 30, 1 << 30)), ("gluon", (0, 0))):
            configs.ATTN_FWD_GLUON_MIN_SQ = least
            fn = lambda: A.attn_fwd(q, k, v, D ** -0.5, True, 0, out_dtype=q.dtype)  # noqa: E731
            outs[name] = fn()
            rec("short", f"{s} causal B={q.shape[0]} {name}", bench(fn), flops=flops)
        diff = (outs["triton"][0].double() - outs["gluon"][0].double()).abs().max().item()
        print(f"short {s}: largest |gluon - triton| {diff:.2e}", flush=True)
    configs.ATTN_FWD_GLUON_MIN_SQ = (1024, 4096)


if __name__ == "__main__":
    run_sections({"fwd": lambda: _variants(False), "fb": lambda: _variants(True), "plain": plain, "short": short},
                 sys.argv)
    print("\nsummary (TFLOP/s)")
    for r in __import__("helpers").ROWS:
        if "tflops" in r:
            print(f"{r['group']:6s} {r['name']:40s} {r['tflops']:6.0f} {r.get('ok', r.get('bitwise', ''))}")
