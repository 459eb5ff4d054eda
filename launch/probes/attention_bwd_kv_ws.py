"""Probe: the warp-specialized dK/dV kernel (``configs.ATTN_BWD_KV_WS``, sm_90) against the first
Gluon dK/dV kernel and the Triton one.

    PYTHONPATH=. python3 launch/probes/attention_bwd_kv_ws.py OUTDIR [check] [kernel] [table]

bf16, D=128. ``check``: per tile, at odd lengths, GQA and (B, S, H, D) views, dK/dV against float64
(relative Frobenius error, at most 1.05x the first Gluon kernel's), whether they equal that
kernel's bit for bit, and a NaN/Inf row of dO / Q / K reaching the same entries. ``kernel``: the
dK/dV kernel alone (TFLOP/s of its four products), Triton, first Gluon, then the warp-specialized
one per tile. ``table``: ``ss.attention`` forward+backward TFLOP/s (3.5x the forward's products)
with each dK/dV kernel beside SDPA cuDNN, alternating, twice. No section named: all three.
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
KEY = ("bwd_kv_ws", 2, 128)
# tiles: (BLOCK_M, BLOCK_N, num_warps, STAGES), or $TILES as "64x64x4x3,64x64x4x2"
TILES = ([tuple(int(x) for x in t.split("x")) for t in os.environ["TILES"].split(",")] if os.environ.get("TILES")
         else [(64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 3)])
SECTIONS = sys.argv[2:] or ["check", "kernel", "table"]
log = open(f"{OUT}/log_{'_'.join(SECTIONS)}.txt", "w")


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


def use(kernel):
    """Select the dK/dV kernel: "triton", "gluon" (the first Gluon one) or "ws"."""
    configs.ATTN_BWD_GLUON = kernel != "triton"
    configs.ATTN_BWD_KV_WS = kernel == "ws"


def kv_grads(q, k, v, do, lse, delta, causal, kernel):
    use(kernel)
    return ABP.attn_bwd(q, k, v, do, lse, delta, 128 ** -0.5, causal, 0, torch.float32)[1:]


def checks():
    ok_all, default = True, configs.ATTN_TILES[KEY]
    for tile in TILES:
        configs.ATTN_TILES[KEY] = tile
        for case in [(2, 4, 2, 333, True, True), (1, 4, 1, 1000, False, True), (1, 2, 2, 257, False, False),
                     (1, 8, 2, 1024, True, True), (1, 16, 4, 2048, True, True)]:
            q, k, v, do, lse, delta = make(*case)
            want = ref64(q, k, v, do, case[-1])[1:]
            ws = kv_grads(q, k, v, do, lse, delta, case[-1], "ws")
            gl = kv_grads(q, k, v, do, lse, delta, case[-1], "gluon")
            e, eg = [rel(a, w) for a, w in zip(ws, want)], [rel(a, w) for a, w in zip(gl, want)]
            ok = all(x == x and x <= 1.05 * y + 1e-7 for x, y in zip(e, eg))
            ok_all &= ok
            same = all(torch.equal(a, b) for a, b in zip(ws, gl))
            say("check", tile, case, "ws", ["%.3e" % x for x in e], "gluon", ["%.3e" % x for x in eg],
                "bitwise equal" if same else "differ", "OK" if ok else "FAIL")
        for causal in (True, False):
            q, k, v, do, lse, delta = make(1, 4, 2, 300, False, causal)
            do[0, 0, 10] = float("nan")
            q[0, 1, 20, 3] = float("inf")
            k[0, 0, 299, 7] = float("nan")
            pats = [[g.isnan() for g in kv_grads(q, k, v, do, lse, delta, causal, kern)]
                    for kern in ("ws", "triton")]
            same = all(torch.equal(a, b) for a, b in zip(*pats)) and all(t.any() for t in pats[1])
            ok_all &= same
            say("nan-guard", tile, "causal" if causal else "full", "same NaN pattern" if same else "NaN PATTERN DIFFERS")
    configs.ATTN_TILES[KEY] = default
    use("ws")
    say("CORRECT" if ok_all else "SOME CHECK FAILED")


SHAPES = [("1x8k 16/4 views causal", 1, 16, 4, 8192, True, True),
          ("4x2k 16/4 views causal", 4, 16, 4, 2048, True, True),
          ("1x8k 32/8 views causal", 1, 32, 8, 8192, True, True),
          ("4x8k 16 full", 4, 16, 16, 8192, False, False)]


def kernel_times():
    default = configs.ATTN_TILES[KEY]
    for name, B, H, HKV, S, views, causal in SHAPES:
        q, k, v, do, lse, delta = make(B, H, HKV, S, views, causal)
        flops = 4 * 2 * B * H * S * S * 128 / (2 if causal else 1)
        dq = torch.empty(0, device="cuda", dtype=q.dtype)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for label, tile in [("triton", None), ("gluon", None)] + [("ws", t) for t in TILES]:
            use(label)
            configs.ATTN_TILES[KEY] = tile or default
            run = ABP._launches(q, k, v, do, lse, delta, dq, dk, dv, 128 ** -0.5, causal, 0)
            assert run.gluon[0] == {"triton": None, "gluon": "_attn_bwd_kv_gluon", "ws": "_attn_bwd_kv_ws"}[label]
            ms = do_bench(lambda: ABP._run(run, q, k, v, do, lse, delta, dq, dk, dv), warmup=25, rep=150,
                          return_mode="median")
            say("kv kernel", name, label, tile or "", "%.3f ms %.0f TFLOP/s" % (ms, flops / ms / 1e9))
        configs.ATTN_TILES[KEY] = default
    use("ws")


def table():
    rows = []
    for name, B, H, HKV, S, views, causal in SHAPES + [("4x8k 16 causal", 4, 16, 16, 8192, False, True),
                                                      ("1x32k 16/4 views causal", 1, 16, 4, 32768, True, True)]:
        q, k, v, do, _, _ = make(B, H, HKV, S, views, causal)
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        flops = 3.5 * 4 * B * H * S * S * 128 / (2 if causal else 1)

        def step(fn):
            q.grad = k.grad = v.grad = None
            fn().backward(do)
        res = {"ss ws": [], "ss gluon": [], "cuDNN": []}
        for _ in range(2):
            for label in ("ss ws", "ss gluon"):
                use(label[3:])
                ms = do_bench(lambda: step(lambda: ss.attention(q, k, v, causal=causal)), warmup=25, rep=200,
                              return_mode="median")
                res[label].append(flops / ms / 1e9)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                def peer():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                ms = do_bench(lambda: step(peer), warmup=25, rep=200, return_mode="median")
                res["cuDNN"].append(flops / ms / 1e9)
        use("ws")
        rows.append((name, res))
    say("\nfwd+bwd TFLOP/s | ss, ws dK/dV (2 runs) | ss, first Gluon dK/dV | cuDNN | ws / cuDNN (means)")
    for name, r in rows:
        mean = {a: sum(b) / len(b) for a, b in r.items()}
        say(f"{name} | " + " | ".join("/".join("%.0f" % x for x in r[a]) for a in ("ss ws", "ss gluon", "cuDNN"))
            + f" | {mean['ss ws'] / mean['cuDNN']:.2f}")


if "check" in SECTIONS:
    checks()
if "kernel" in SECTIONS:
    kernel_times()
if "table" in SECTIONS:
    table()
