"""Probe: the dK/dV kernel whose gradient products take P^T and dS^T from registers
(``kernels/attention_bwd_kv_rs.py``) against the warp-specialized one it would replace.

    PYTHONPATH=. python3 launch/probes/attention_bwd_kv_rs.py OUTDIR [check] [kernel] [table]

bf16, D=128, sm_90. ``check``: per tile, at odd lengths, GQA, (B, S, H, D) views, causal and full,
dK/dV against the warp-specialized kernel's (bit for bit, or the relative error against float64
at most 1.05x its) and a NaN/Inf in Q, K, dO reaching the same entries. ``kernel``: the dK/dV
kernel alone per tile (TFLOP/s of its four products). ``table``: ``ss.attention``
forward+backward TFLOP/s with each kernel beside SDPA cuDNN, twice in alternation.
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
KEY = ("bwd_kv_rs", 2, 128)
TILES = [tuple(int(x) for x in t.split("x")) for t in os.environ.get("TILES", "64x128x4x2,32x128x4x2,32x128x4x3").split(",")]
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
    return q, k, v, do, out, lse


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


def dkdv(q, k, v, do, out, lse, causal, rs, tile=None):
    configs.ATTN_BWD_KV_RS = rs
    if tile:
        configs.ATTN_TILES[KEY] = tile
    delta = (do.float() * out.float()).sum(-1)
    return ABP.attn_bwd(q, k, v, do, lse, delta, 128 ** -0.5, causal, 0, torch.float32)[1:]


if "check" in SECTIONS:
    ok_all = True
    for tile in TILES:
        for case in [(2, 4, 2, 333, True, True), (1, 4, 1, 1000, False, True), (1, 2, 2, 257, False, False),
                     (1, 8, 2, 1024, True, True), (1, 16, 4, 3000, True, True), (2, 4, 4, 700, False, False)]:
            q, k, v, do, out, lse = make(*case)
            want = ref64(q, k, v, do, case[-1])[1:]
            a = dkdv(q, k, v, do, out, lse, case[-1], True, tile)
            w = dkdv(q, k, v, do, out, lse, case[-1], False)
            same = all(torch.equal(x, y) for x, y in zip(a, w))
            e, ew = [rel(x, r) for x, r in zip(a, want)], [rel(x, r) for x, r in zip(w, want)]
            ok = all(x == x and x <= 1.05 * y + 1e-7 for x, y in zip(e, ew))
            ok_all &= ok
            say("check", tile, case, "rs", ["%.3e" % x for x in e], "ws", ["%.3e" % x for x in ew],
                "bitwise" if same else "not bitwise", "OK" if ok else "FAIL")
        for causal in (True, False):
            q, k, v, do, out, lse = make(1, 4, 2, 700, False, causal)
            do[0, 0, 10] = float("nan")
            q[0, 1, 20, 3] = float("inf")
            k[0, 0, 699, 7] = float("nan")
            k[0, 1, 130, 2] = float("inf")
            same = all(torch.equal(x.isnan(), y.isnan()) for x, y in zip(dkdv(q, k, v, do, out, lse, causal, True, tile),
                                                                          dkdv(q, k, v, do, out, lse, causal, False)))
            ok_all &= same
            say("nan-guard", tile, "causal" if causal else "full", "same NaN pattern" if same else "NaN PATTERN DIFFERS")
    say("CORRECT" if ok_all else "SOME CHECK FAILED")

SHAPES = [("1x8k 16/4 views causal", 1, 16, 4, 8192, True, True),
          ("4x2k 16/4 views causal", 4, 16, 4, 2048, True, True),
          ("1x8k 32/8 views causal", 1, 32, 8, 8192, True, True),
          ("4x8k 16 full", 4, 16, 16, 8192, False, False),
          ("1x32k 16/4 views causal", 1, 16, 4, 32768, True, True)]

if "kernel" in SECTIONS:
    for name, B, H, HKV, S, views, causal in SHAPES[:4]:
        q, k, v, do, out, lse = make(B, H, HKV, S, views, causal)
        delta = (do.float() * out.float()).sum(-1)
        flops = 4 * 2 * B * H * S * S * 128 / (2 if causal else 1)
        empty = torch.empty(0, device="cuda", dtype=q.dtype)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for label, tile in [("ws", None)] + [("rs", t) for t in TILES]:
            configs.ATTN_BWD_KV_RS = tile is not None
            if tile:
                configs.ATTN_TILES[KEY] = tile
            run = ABP._launches(q, k, v, do, lse, delta, empty, dk, dv, 128 ** -0.5, causal, 0)
            ms = do_bench(lambda: ABP._run(run, q, k, v, do, lse, delta, empty, dk, dv), warmup=25, rep=150,
                          return_mode="median")
            say("kv kernel", name, label, tile, "%.3f ms %.0f TFLOP/s" % (ms, flops / ms / 1e9))

if "table" in SECTIONS:
    configs.ATTN_TILES[KEY] = TILES[0]
    rows = []
    for name, B, H, HKV, S, views, causal in SHAPES:
        q, k, v, do, _, _ = make(B, H, HKV, S, views, causal)
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        flops = 3.5 * 4 * B * H * S * S * 128 / (2 if causal else 1)

        def step(fn):
            q.grad = k.grad = v.grad = None
            fn().backward(do)
        res = {"rs": [], "ws": [], "cuDNN": []}
        for _ in range(2):
            for label in ("rs", "ws"):
                configs.ATTN_BWD_KV_RS = label == "rs"
                ms = do_bench(lambda: step(lambda: ss.attention(q, k, v, causal=causal)), warmup=25, rep=200,
                              return_mode="median")
                res[label].append(flops / ms / 1e9)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                def peer():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                ms = do_bench(lambda: step(peer), warmup=25, rep=200, return_mode="median")
                res["cuDNN"].append(flops / ms / 1e9)
        rows.append((name, res))
    say(f"\ntile {TILES[0]}\nshape | ss rs (2 runs) | ss ws | cuDNN | rs / cuDNN (means)")
    for name, r in rows:
        mean = {a: sum(b) / len(b) for a, b in r.items()}
        say(f"{name} | " + " | ".join("/".join("%.0f" % x for x in r[a]) for a in ("rs", "ws", "cuDNN"))
            + f" | {mean['rs'] / mean['cuDNN']:.2f}")
