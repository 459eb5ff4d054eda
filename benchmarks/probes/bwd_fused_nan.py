"""Where the fused backward's NaN pattern differs from the pair's: for each case and each injected
non-finite value (a NaN row of dO, an Inf in a row of Q, a NaN in a key), the gradient entries
that are NaN under one kernel and not the other, by head, row range and column.

No setting: it locates what keeps ``configs.ATTN_BWD_FUSED`` off (its NaN/Inf pattern with GQA,
``tests/test_gpu_attention_bwd.py::test_fused_backward``). sm_90, a Triton that takes the fused
kernel (``configs.ATTN_BWD_FUSED_MASKS``)::

    PYTHONPATH=. python3 benchmarks/probes/bwd_fused_nan.py OUTDIR
"""
import json
import math
import os
import sys

import torch

import splitsoftmax as ss
from splitsoftmax.core.mask import NO_MASK
from splitsoftmax.ops._triton import configs
from splitsoftmax.ops.attention import bwd as AB
from splitsoftmax.ops.attention import bwd_plain as ABP

# b, h, hkv, s, causal, (B, S, H, D) views: the failing case, then one change of it at a time
CASES = [(1, 32, 8, 1111, True, True), (1, 32, 8, 1111, True, False), (1, 32, 32, 1111, True, True),
         (1, 32, 8, 1024, True, True), (1, 16, 4, 2048, True, False)]


def _inputs(b, h, hkv, s, bshd):
    def make(n):
        t = torch.randn(b, s, n, 128, device="cuda", dtype=torch.bfloat16)
        return t.transpose(1, 2) if bshd else t.transpose(1, 2).contiguous()
    return make(h), make(hkv), make(hkv), make(h)


def _injected(q, k, dout, what):
    s, h = q.shape[2], q.shape[1]
    q2, k2, dout2 = q.clone(), k.clone(), dout.clone()
    if what == "dout NaN row":
        dout2[0, 0, s // 3] = float("nan")
    elif what == "q Inf":
        q2[0, h - 1, s // 2, 5] = float("inf")
    else:
        k2[0, 0, s - 1, 7] = float("nan")
    return q2, k2, dout2


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "bwd_fused_nan_out"
    configs.ATTN_BWD_FUSED_MIN_WAVES = 0  # the fused kernel at every size
    torch.manual_seed(0)
    rows = []
    for b, h, hkv, s, causal, bshd in CASES:
        q, k, v, dout = _inputs(b, h, hkv, s, bshd)
        scale = 1 / math.sqrt(128)
        o, lse = ss.attention(q, k, v, causal=causal, return_lse=True)
        delta = (dout.float() * o.float()).sum(-1)
        for what in ("dout NaN row", "q Inf", "k NaN"):
            q2, k2, dout2 = _injected(q, k, dout, what)
            nans, ran = {}, {}
            for fused in (True, False):
                configs.ATTN_BWD_FUSED = fused
                ran[fused] = ABP.fused(q2, k2, v, dout2, causal, NO_MASK, None)
                nans[fused] = [g.isnan() for g in AB.attn_bwd(q2, k2, v, dout2, lse, delta, scale, causal, 0, NO_MASK,
                                                              out_dtype=torch.float32)]
            for name, a, t in zip("qkv", nans[True], nans[False]):
                r = {"case": f"{b}x{h}/{hkv}x{s} causal={int(causal)} bshd={int(bshd)}", "inject": what,
                     "grad": "d" + name, "fused_ran": ran[True], "fused_nan": int(a.sum()), "pair_nan": int(t.sum())}
                d = (a != t).nonzero()
                if len(d):
                    r.update(differ=len(d), fused_only=int((a & ~t).sum()), heads=sorted(set(d[:, 1].tolist()))[:16],
                             rows=[d[:, 2].min().item(), d[:, 2].max().item()], cols=sorted(set(d[:, 3].tolist()))[:16])
                rows.append(r)
                print(json.dumps(r), flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bwd_fused_nan.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\ncase / inject / grad: NaN entries fused, pair; differing")
    for r in rows:
        print(f"{r['case']:34s} {r['inject']:13s} {r['grad']}: {r['fused_nan']:8d} {r['pair_nan']:8d} "
              f"{r.get('differ', 0):6d} {r.get('heads', '')} {r.get('rows', '')}")


if __name__ == "__main__":
    main()
