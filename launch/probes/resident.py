"""Probe (tuning data, not part of the library): session 4's kernel changes against the ones before,
one GPU, one call.

    PYTHONPATH=. python3 launch/probes/resident.py OUTDIR [SECTIONS]

SECTIONS (comma-separated, default all): softmax (the resident path's grid, chunk, lag and L2
budget against the two-pass path and torch), attn (forward and forward+backward at S=1k/2k with the
causal diagonal guard as it is against the one before, ``kernels/_old_attention.py`` = the previous
commit's ``kernels/attention.py`` if present, beside SDPA flash; forward tiles), decode (profile of
split-KV decode at 128k keys beside cuDNN). Writes OUTDIR/probe.json.
"""
import importlib
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return min(do_bench(fn, warmup=25, rep=120, return_mode="median") for _ in range(2))


ROWS = []


def rec(group, name, ms, nbytes=None, flops=None, err=None):
    r = {"group": group, "name": name, "ms": ms, "err": err}
    if nbytes:
        r["gbps"] = nbytes / ms / 1e6
    if flops:
        r["tflops"] = flops / ms / 1e9
    ROWS.append(r)
    rate = f"{r['gbps']:7.0f} GB/s" if nbytes else f"{r['tflops']:6.0f} TFLOP/s"
    print(f"{group:26s} {name:44s} {ms:8.4f} ms {rate} err={err}", flush=True)


def guard(group, name, f):
    try:
        f()
    except Exception as e:  # noqa: BLE001  (a variant that fails is recorded, the rest go on)
        print(f"{group:26s} {name:44s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        ROWS.append({"group": group, "name": name, "error": f"{type(e).__name__}: {str(e)[:500]}"})


def sec_softmax():
    from splitsoftmax.kernels import configs
    from splitsoftmax.kernels import softmax as K
    cfg = configs.SOFTMAX
    saved = dict(vars(cfg))
    for R, N, dt in ((512, 262144, torch.bfloat16), (1024, 131072, torch.float32), (2048, 65536, torch.float32),
                     (4096, 65536, torch.bfloat16)):
        x = torch.randn(R, N, device="cuda", dtype=dt) * 3
        idx = torch.tensor([0, 1, R // 2, R - 1], device="cuda")
        ref = torch.softmax(x[idx].double(), 1)
        grp = f"softmax {R}x{N} {str(dt)[6:]}"
        nb = 2 * x.numel() * x.element_size()

        def run(name):
            y, _ = K.softmax_fwd(x, False)  # outputs NaN-free only if every element was written
            err = ((y[idx].double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
            bad = int(torch.isnan(y).sum())
            rec(grp, f"{name} [{K._plan(x).path}]", bench(lambda: K.softmax_fwd(x, False)), nb,
                err=f"{err:.1e}" + (f" {bad} NaN" if bad else ""))

        rec(grp, "torch.softmax", bench(lambda: torch.softmax(x, 1)), nb)
        cfg.resident_programs_per_sm = 0
        guard(grp, "two_pass", lambda: run("two_pass"))
        for per_sm in (1, 2, 4):
            for chunk in (32768, 65536, 131072):
                for lag in (0, 1):
                    for l2 in (16 << 20, 32 << 20):
                        cfg.resident_programs_per_sm, cfg.resident_chunk_bytes = per_sm, chunk
                        cfg.resident_lag, cfg.resident_l2_bytes = lag, l2
                        p = K._plan(x)
                        name = f"pps{per_sm} chunk{chunk >> 10}K lag{lag} l2 {l2 >> 20}M S{p.splits} G{p.groups}"
                        guard(grp, name, lambda: run(name))
        vars(cfg).update(saved)
        del x
        torch.cuda.empty_cache()


def _attn_modules():
    from splitsoftmax.kernels import attention as new
    try:
        old = importlib.import_module("splitsoftmax.kernels._old_attention")
    except ImportError:
        old = None
    return [("new", new)] + ([("old", old)] if old else [])


def sec_attn():
    from splitsoftmax.kernels import configs
    saved = configs.ATTN_TILES[("fwd", 2, 128)]
    mods = _attn_modules()
    for S in (1024, 2048, 4096):
        B = 32768 // S
        q, k, v = (torch.randn(B, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        scale = 128 ** -0.5
        for causal in (True, False):
            f1 = 4 * B * 16 * S * S * 128 / (2 if causal else 1)
            grp = f"attn S{S} c{int(causal)}"
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                rec(grp, "flash fwd", bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), flops=f1)
                qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))

                def fb():
                    qq.grad = kk.grad = vv.grad = None
                    F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal).backward(do)
                rec(grp, "flash fwd+bwd", bench(fb), flops=3.5 * f1)
            tiles = ((128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3)) if S <= 2048 else (saved,)
            for tile in tiles:
                configs.ATTN_TILES[("fwd", 2, 128)] = tile
                for name, A in mods:
                    guard(grp, f"{name} fwd {tile}", lambda: rec(grp, f"{name} fwd {tile}", bench(
                        lambda: A.attn_fwd(q, k, v, scale, causal, out_dtype=torch.bfloat16)), flops=f1))
            configs.ATTN_TILES[("fwd", 2, 128)] = saved
            for name, A in mods:
                def fwdbwd(A=A):
                    o, lse = A.attn_fwd(q, k, v, scale, causal, out_dtype=torch.bfloat16)
                    delta = (o.float() * do.float()).sum(-1)
                    A.attn_bwd(q, k, v, do, lse, delta, scale, causal)
                guard(grp, f"{name} fwd+bwd", lambda: rec(grp, f"{name} fwd+bwd (launchers)", bench(fwdbwd),
                                                          flops=3.5 * f1))
        del q, k, v, do
        torch.cuda.empty_cache()


def sec_decode():
    import splitsoftmax as ss
    from torch.profiler import ProfilerActivity, profile
    for keys in (131072, 1048576):
        q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, keys, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nb = 2 * k.numel() * 2
        for name, fn in (("cudnn", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
                         ("ss", lambda: ss.attention(q, k, v))):
            rec(f"decode {keys}", name, bench(fn), nb)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            print(f"==== decode {keys} {name}: 20 calls ====")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=50))


SECTIONS = {"softmax": sec_softmax, "attn": sec_attn, "decode": sec_decode}

if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    a = torch.randn(2**28, device="cuda")
    b = torch.empty_like(a)
    rec("ceiling", "copy", bench(lambda: b.copy_(a)), 2 * a.numel() * 4)
    del a, b
    for s in (sys.argv[2].split(",") if len(sys.argv) > 2 else list(SECTIONS)):
        SECTIONS[s]()
        with open(os.path.join(out, "probe.json"), "w") as f:
            json.dump(ROWS, f, indent=1)
