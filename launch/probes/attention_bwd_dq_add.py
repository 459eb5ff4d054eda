"""Probe: the warp-specialized dK/dV kernel adding dQ (``configs.ATTN_BWD_KV_WS_DQ``, five products
per tile pair) against the pair (that kernel without dQ, then the Gluon dQ kernel).

    PYTHONPATH=. python3 launch/probes/attention_bwd_dq_add.py OUTDIR [check] [kernel] [table]

bf16, D=128, sm_90. ``check``: at odd lengths, GQA, (B, S, H, D) views, causal and full, dK/dV
equal to the pair's bit for bit, dQ's error against float64 (relative Frobenius) at most 1.05x
the pair's, and a NaN/Inf row of dO / Q / K reaching the same gradient entries. ``kernel``: the
backward alone (``attn_bwd`` given ``lse`` and ``delta``: the zeroed float32 dQ and its cast
included), ms and TFLOP/s of the pair's seven products' useful five. ``table``: ``ss.attention``
forward+backward TFLOP/s (3.5x the forward's products) with the flag on and off beside SDPA
cuDNN, each timed twice in alternation. No section named: all three.
"""
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import splitsoftmax as ss
from splitsoftmax.kernels import attention_bwd_plain as ABP
from splitsoftmax.kernels import configs

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
os.makedirs(OUT, exist_ok=True)
configs.LAUNCH_VERIFY = True
SECTIONS = sys.argv[2:] or ["check", "kernel", "table"]
log = open(f"{OUT}/log.txt", "w")


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    log.write(s + "\n")
    log.flush()


def make(B, H, HKV, S, views, causal, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shp = (lambda h: (B, S, h, 128)) if views else (lambda h: (B, h, S, 128))
    q, k, v, do = (torch.randn(*shp(h), device="cuda", dtype=torch.bfloat16, generator=g) for h in (H, HKV, HKV, H))
    if views:
        q, k, v, do = (x.transpose(1, 2) for x in (q, k, v, do))
    out, lse = ss.attention(q, k, v, causal=causal, return_lse=True)
    return q, k, v, do, lse, (do.float() * out.float()).sum(-1)


def ref64(q, k, v, do, causal):
    G = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.double().detach().requires_grad_() for x in (q, k, v))
    s = qd @ kd.repeat_interleave(G, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    (s.softmax(-1) @ vd.repeat_interleave(G, 1)).backward(do.double())
    return qd.grad, kd.grad, vd.grad


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bwd(q, k, v, do, lse, delta, causal, adds):
    configs.ATTN_BWD_KV_WS_DQ = adds
    return ABP.attn_bwd(q, k, v, do, lse, delta, 128 ** -0.5, causal, 0, torch.float32)


if "check" in SECTIONS:
    ok_all = True
    for case in [(2, 4, 2, 333, True, True), (1, 4, 1, 1000, False, True), (1, 2, 2, 257, False, False),
                 (1, 8, 2, 1024, True, True), (1, 16, 4, 3000, True, True), (2, 4, 4, 700, False, False)]:
        q, k, v, do, lse, delta = make(*case)
        want = ref64(q, k, v, do, case[-1])
        on, off = bwd(q, k, v, do, lse, delta, case[-1], True), bwd(q, k, v, do, lse, delta, case[-1], False)
        e = [rel(a, w) for a, w in zip(on, want)]
        et = [rel(a, w) for a, w in zip(off, want)]
        same = torch.equal(on[1], off[1]) and torch.equal(on[2], off[2])
        ok = same and e[0] == e[0] and e[0] <= 1.05 * et[0]
        ok_all &= ok
        say("check", case, "adds dq", ["%.3e" % x for x in e], "pair", ["%.3e" % x for x in et],
            "dk/dv bitwise" if same else "DK/DV DIFFER", "OK" if ok else "FAIL")
    for causal in (True, False):
        q, k, v, do, lse, delta = make(1, 2, 2, 256, False, causal)
        do[0, 0, 10] = float("nan")
        q[0, 1, 20, 3] = float("inf")
        k[0, 0, 255, 7] = float("nan")
        same = all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(bwd(q, k, v, do, lse, delta, causal, True),
                                                                        bwd(q, k, v, do, lse, delta, causal, False)))
        ok_all &= same
        say("nan-guard causal" if causal else "nan-guard full", "same NaN pattern" if same else "NaN PATTERN DIFFERS")
    say("CORRECT" if ok_all else "SOME CHECK FAILED")

SHAPES = [("1x8k 16/4 views causal", 1, 16, 4, 8192, True, True),
          ("4x2k 16/4 views causal", 4, 16, 4, 2048, True, True),
          ("1x8k 32/8 views causal", 1, 32, 8, 8192, True, True),
          ("4x8k 16 causal", 4, 16, 16, 8192, False, True),
          ("4x8k 16 full", 4, 16, 16, 8192, False, False),
          ("1x32k 16/4 views causal", 1, 16, 4, 32768, True, True)]

if "kernel" in SECTIONS:
    for name, B, H, HKV, S, views, causal in SHAPES:
        q, k, v, do, lse, delta = make(B, H, HKV, S, views, causal)
        flops = 5 * 2 * B * H * S * S * 128 / (2 if causal else 1)
        res = {}
        for _ in range(2):
            for adds in (False, True):
                configs.ATTN_BWD_KV_WS_DQ = adds
                ms = do_bench(lambda: ABP.attn_bwd(q, k, v, do, lse, delta, 128 ** -0.5, causal, 0, torch.bfloat16),
                              warmup=25, rep=150, return_mode="median")
                res.setdefault(adds, []).append(ms)
        say("backward", name, "pair %s ms" % "/".join("%.3f" % x for x in res[False]),
            "adds dq %s ms" % "/".join("%.3f" % x for x in res[True]),
            "-> %.0f / %.0f TFLOP/s" % (flops / min(res[False]) / 1e9, flops / min(res[True]) / 1e9))

if "table" in SECTIONS:
    rows = []
    for name, B, H, HKV, S, views, causal in SHAPES:
        q, k, v, do, _, _ = make(B, H, HKV, S, views, causal)
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        flops = 3.5 * 4 * B * H * S * S * 128 / (2 if causal else 1)

        def step(fn):
            q.grad = k.grad = v.grad = None
            fn().backward(do)
        res = {"adds dq": [], "pair": [], "cuDNN": []}
        for _ in range(2):
            for label in ("adds dq", "pair"):
                configs.ATTN_BWD_KV_WS_DQ = label == "adds dq"
                ms = do_bench(lambda: step(lambda: ss.attention(q, k, v, causal=causal)), warmup=25, rep=200,
                              return_mode="median")
                res[label].append(flops / ms / 1e9)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                def peer():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                ms = do_bench(lambda: step(peer), warmup=25, rep=200, return_mode="median")
                res["cuDNN"].append(flops / ms / 1e9)
        rows.append((name, res))
    say("\nshape | ss adds dq (2 runs) | ss pair | cuDNN | adds dq / cuDNN (means)")
    for name, r in rows:
        mean = {a: sum(b) / len(b) for a, b in r.items()}
        say(f"{name} | " + " | ".join("/".join("%.0f" % x for x in r[a]) for a in ("adds dq", "pair", "cuDNN"))
            + f" | {mean['adds dq'] / mean['cuDNN']:.2f}")
