"""Probe: the Gluon backward kernels (``configs.ATTN_BWD_GLUON``, sm_90) against the Triton ones.

    PYTHONPATH=. python3 benchmarks/probes/attention_bwd_gluon.py OUTDIR [kv] [q] [table]

bf16, D=128. ``kv`` and ``q`` (the warp-specialized dK/dV kernel and the dQ kernel): first the
checks, at odd lengths, GQA and (B, S, H, D) views, each tile's dQ/dK/dV against float64 (relative
Frobenius error, at most 1.5x the Triton kernels') and a NaN/Inf row of dO / Q reaching the same
gradient entries; then the kernel alone per tile (TFLOP/s of its products) beside the Triton
kernel. ``table``: ``ss.attention`` forward+backward TFLOP/s (3.5x the forward's products) with the
Gluon kernels on and off beside SDPA cuDNN, each timed twice in alternation (docs/benchmarks/attention-backward.md,
G1, G2). No section named: all three.
"""
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import splitsoftmax as ss
from splitsoftmax.ops.attention import bwd_plain as ABP
from splitsoftmax.ops._triton import configs

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
os.makedirs(OUT, exist_ok=True)
configs.LAUNCH_VERIFY = True
KEY = ("bwd_kv_ws", 2, 128)  # (num_warps: each of the warp-specialized kernel's three warpgroups')
TILES = [tuple(int(x) for x in t.split("x")) for t in os.environ.get("TILES", "64x64x4x3,64x64x4x4,64x64x4x2,32x64x4x3")
         .split(",")]
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


def bwd(q, k, v, do, lse, delta, causal, gluon):
    configs.ATTN_BWD_GLUON = gluon
    return ABP.attn_bwd(q, k, v, do, lse, delta, 128 ** -0.5, causal, 0, torch.float32)


SECTIONS = sys.argv[2:] or ["kv", "q", "table"]
SHAPES = [("1x8k 16/4 views causal", 1, 16, 4, 8192, True, True),
          ("4x2k 16/4 views causal", 4, 16, 4, 2048, True, True), ("4x8k 16 full", 4, 16, 16, 8192, False, False)]


def checks(key, tiles):
    """Each tile of ``key`` (the other kernel at its default) against float64 and the Triton kernels."""
    ok_all, default = True, configs.ATTN_TILES[key]
    for tile in tiles:
        configs.ATTN_TILES[key] = tile
        for case in [(2, 4, 2, 333, True, True), (1, 4, 1, 1000, False, True), (1, 2, 2, 257, False, False),
                     (1, 8, 2, 1024, True, True)]:
            q, k, v, do, lse, delta = make(*case)
            want = ref64(q, k, v, do, case[-1])
            e = [rel(a, w) for a, w in zip(bwd(q, k, v, do, lse, delta, case[-1], True), want)]
            et = [rel(a, w) for a, w in zip(bwd(q, k, v, do, lse, delta, case[-1], False), want)]
            ok = all(x == x and x <= 1.5 * y + 1e-6 for x, y in zip(e, et))
            ok_all &= ok
            say("check", key[0], tile, case, "gluon", ["%.2e" % x for x in e], "triton", ["%.2e" % x for x in et],
                "OK" if ok else "FAIL")
        q, k, v, do, lse, delta = make(1, 2, 2, 256, False, True)
        do[0, 0, 10] = float("nan")
        q[0, 1, 20, 3] = float("inf")
        k[0, 0, 255, 7] = float("nan")
        same = all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(bwd(q, k, v, do, lse, delta, True, True),
                                                                        bwd(q, k, v, do, lse, delta, True, False)))
        ok_all &= same
        say("nan-guard", key[0], tile, "same NaN pattern" if same else "NaN PATTERN DIFFERS")
    configs.ATTN_TILES[key] = default
    say("CORRECT" if ok_all else "SOME CHECK FAILED")


def kernel_times(kind, key, tiles):
    """The dK/dV (``kind`` "kv") or dQ ("q") kernel alone, the Triton one and the Gluon one per tile."""
    for name, B, H, HKV, S, views, causal in SHAPES:
        q, k, v, do, lse, delta = make(B, H, HKV, S, views, causal)
        flops = (4 if kind == "kv" else 3) * 2 * B * H * S * S * 128 / (2 if causal else 1)
        empty = torch.empty(0, device="cuda", dtype=q.dtype)
        dq, dk, dv = (torch.empty_like(x) if (kind == "q") == (x is q) else empty for x in (q, k, v))
        default = configs.ATTN_TILES[key]
        for label, tile in [("triton", None)] + [("gluon", t) for t in tiles]:
            configs.ATTN_BWD_GLUON = tile is not None
            configs.ATTN_TILES[key] = tile or default
            run = ABP._launches(q, k, v, do, lse, delta, dq, dk, dv, 128 ** -0.5, causal, 0)
            ms = do_bench(lambda: ABP._run(run, q, k, v, do, lse, delta, dq, dk, dv), warmup=25, rep=150,
                          return_mode="median")
            say(f"{kind} kernel", name, label, tile, "%.3f ms %.0f TFLOP/s" % (ms, flops / ms / 1e9))
        configs.ATTN_TILES[key] = default
        configs.ATTN_BWD_GLUON = True


if "kv" in SECTIONS:
    checks(KEY, TILES)
    kernel_times("kv", KEY, TILES)
if "q" in SECTIONS:
    KEY_Q = ("bwd_q_gluon", 2, 128)
    TILES_Q = [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2)]
    checks(KEY_Q, TILES_Q)
    kernel_times("q", KEY_Q, TILES_Q)

if "table" in SECTIONS:
    rows = []
    for name, B, H, HKV, S, views, causal in [("1x8k 16/4 views causal", 1, 16, 4, 8192, True, True),
                                              ("4x2k 16/4 views causal", 4, 16, 4, 2048, True, True),
                                              ("1x8k 32/8 views causal", 1, 32, 8, 8192, True, True),
                                              ("4x8k 16 causal", 4, 16, 16, 8192, False, True),
                                              ("4x8k 16 full", 4, 16, 16, 8192, False, False),
                                              ("1x32k 16/4 views causal", 1, 16, 4, 32768, True, True)]:
        q, k, v, do, _, _ = make(B, H, HKV, S, views, causal)
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        flops = 3.5 * 4 * B * H * S * S * 128 / (2 if causal else 1)

        def step(fn):
            q.grad = k.grad = v.grad = None
            fn().backward(do)
        res = {"ss gluon": [], "ss triton": [], "cuDNN": []}
        for _ in range(2):
            for label in ("ss gluon", "ss triton"):
                configs.ATTN_BWD_GLUON = label == "ss gluon"
                ms = do_bench(lambda: step(lambda: ss.attention(q, k, v, causal=causal)), warmup=25, rep=200,
                              return_mode="median")
                res[label].append(flops / ms / 1e9)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                def peer():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                ms = do_bench(lambda: step(peer), warmup=25, rep=200, return_mode="median")
                res["cuDNN"].append(flops / ms / 1e9)
        configs.ATTN_BWD_GLUON = True
        rows.append((name, res))
    say("\nshape | ss gluon (2 runs) | ss triton | cuDNN | gluon / cuDNN (means)")
    for name, r in rows:
        mean = {a: sum(b) / len(b) for a, b in r.items()}
        say(f"{name} | " + " | ".join("/".join("%.0f" % x for x in r[a]) for a in ("ss gluon", "ss triton", "cuDNN"))
            + f" | {mean['ss gluon'] / mean['cuDNN']:.2f}")
