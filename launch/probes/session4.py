"""Probe (tuning data, not part of the library): session 4's kernel changes against the ones before,
one GPU, one call.

    PYTHONPATH=. python3 launch/probes/session4.py OUTDIR [SECTIONS]

SECTIONS (comma-separated, default all):
- softmax: 512x262144 bf16 logsumexp and two-pass softmax under loop tiles, warps, stages and a
  forced split of the statistics pass;
- attn: forward tiles and forward+backward at S=1k/2k/4k beside SDPA flash, the kernels as they are
  against ``kernels/_old_attention.py`` when present (a copy of an earlier ``kernels/attention.py``,
  never committed);
- decode: profile of split-KV decode at 128k and 1M keys beside cuDNN, host time of each layer;
- short: short rows (N = 128, 512, 2048 fp32): one-pass tile size and warps beside torch;
- causal: the short-causal forward tile at S=1k/2k beside SDPA flash.
Writes OUTDIR/probe.json.
"""
import importlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return min(do_bench(fn, warmup=25, rep=120, return_mode="median") for _ in range(2))


ROWS = []


def rec(group, name, ms, nbytes=None, flops=None, **extra):
    """Record and print one timing; ``extra`` (an error, a difference) goes along."""
    r = {"group": group, "name": name, "ms": ms, **extra}
    if nbytes:
        r["gbps"] = nbytes / ms / 1e6
    if flops:
        r["tflops"] = flops / ms / 1e9
    ROWS.append(r)
    rate = f"{r['gbps']:7.0f} GB/s" if nbytes else f"{r['tflops']:6.0f} TFLOP/s"
    print(f"{group:26s} {name:44s} {ms:8.4f} ms {rate} {extra or ''}", flush=True)


def guard(group, name, f):
    try:
        f()
    except Exception as e:  # noqa: BLE001  (a variant that fails is recorded, the rest go on)
        print(f"{group:26s} {name:44s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        ROWS.append({"group": group, "name": name, "error": f"{type(e).__name__}: {str(e)[:500]}"})


def rec_profile(group, name, fn, n=300, rows=30):
    """Record and print a cProfile (by own time) of ``n`` calls of ``fn``."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(rows)
    print(text.getvalue(), flush=True)
    ROWS.append({"group": group, "name": name, "text": text.getvalue()})


def causal_case(S):
    """The bench's prefill inputs at sequence length ``S`` (B*S = 32k tokens, H=16, D=128, bf16) and
    the causal forward's FLOPs."""
    q, k, v = (torch.randn(32768 // S, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return q, k, v, 4 * q.shape[0] * 16 * S * S * 128 / 2


def rec_flash_causal(group, q, k, v, flops, name="sdpa flash"):
    """Record SDPA flash's causal forward on these inputs."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        rec(group, name, bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), flops=flops)


def run_sections(sections, argv):
    """``argv = [script, OUTDIR, [SECTIONS]]``: run the named sections (default all), each guarded,
    and write every recorded row to ``OUTDIR/probe.json`` even when one fails."""
    out = argv[1]
    os.makedirs(out, exist_ok=True)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    try:
        for s in (argv[2].split(",") if len(argv) > 2 else list(sections)):
            guard(s, "section", sections[s])
    finally:
        with open(os.path.join(out, "probe.json"), "w") as f:
            json.dump(ROWS, f, indent=1)


def sec_softmax():
    """512x262144 bf16: the statistics pass (logsumexp) and the two-pass softmax under config
    variants (loop tile, warps, stages; a forced split of the statistics pass)."""
    from splitsoftmax.kernels import configs
    from splitsoftmax.kernels import softmax as K
    cfg = configs.SOFTMAX
    saved = dict(vars(cfg))
    R, N = 512, 262144
    x = torch.randn(R, N, device="cuda", dtype=torch.bfloat16) * 3
    ref_lse = torch.logsumexp(x.double(), 1)
    nb = x.numel() * 2
    rec("lse 512x262144", "torch.logsumexp", bench(lambda: torch.logsumexp(x, 1)), nb)
    rec("softmax 512x262144", "torch.softmax", bench(lambda: torch.softmax(x, 1)), 2 * nb)
    for tile, per_warp, stages in ((16384, 1024, 3), (16384, 1024, 4), (16384, 2048, 3), (32768, 2048, 3),
                                   (32768, 4096, 3), (32768, 2048, 2), (8192, 512, 4)):
        for split_pps in (0, 4, 8, 16):
            vars(cfg).update(saved)
            cfg.loop_tile_bytes, cfg.loop_elems_per_warp, cfg.loop_stages = tile, per_warp, stages
            if split_pps:
                cfg.split_rows_per_sm, cfg.split_programs_per_sm, cfg.split_min_tiles = 1e9, split_pps, 2
            p = K._plan(x, stats_only=True)
            name = f"tile{tile >> 10}K pw{per_warp} st{stages} S{p.splits} w{p.num_warps}"

            def lse_run():
                got = K.lse_rows(x)
                err = (got.double() - ref_lse).abs().max().item()
                rec("lse 512x262144", name, bench(lambda: K.lse_rows(x)), nb, err=f"{err:.1e}")
            guard("lse 512x262144", name, lse_run)
            if not split_pps:
                guard("softmax 512x262144", name, lambda: rec("softmax 512x262144", name,
                                                              bench(lambda: K.softmax_fwd(x, False)), 2 * nb))
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
    saved = configs.ATTN_TILES[("fwd", 2, 128)], configs.ATTN_TILES[("fwd_causal_short", 2, 128)]
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
            tiles = ((128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3)) if S <= 2048 else saved[:1]
            for tile in tiles:
                configs.ATTN_TILES[("fwd", 2, 128)] = configs.ATTN_TILES[("fwd_causal_short", 2, 128)] = tile
                for name, A in mods:
                    guard(grp, f"{name} fwd {tile}", lambda: rec(grp, f"{name} fwd {tile}", bench(
                        lambda: A.attn_fwd(q, k, v, scale, causal, out_dtype=torch.bfloat16)), flops=f1))
            configs.ATTN_TILES[("fwd", 2, 128)], configs.ATTN_TILES[("fwd_causal_short", 2, 128)] = saved
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
        _host_times(q, k, v)


def _host_times(q, k, v):
    """Host time per call of each layer of the decode path (the GPU runs behind, asynchronously)."""
    import splitsoftmax as ss
    from splitsoftmax import _checks
    from splitsoftmax.kernels import attention as A, decode as P
    scale = 128 ** -0.5
    parts = {"ss.attention": lambda: ss.attention(q, k, v),
             "kernels.attn_fwd": lambda: A.attn_fwd(q, k, v, scale, False, out_dtype=torch.bfloat16),
             "plan": lambda: P.plan(q, k, v, False, 0),
             "checks": lambda: _checks.attention_args(q, k, v, None, False),
             "2x torch.empty": lambda: (torch.empty(33, 1, 32, 1, 128, device="cuda"),
                                        torch.empty(33, 1, 32, 1, device="cuda"))}
    for name, fn in parts.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        print(f"decode {k.shape[2]} host: {name:18s} {host:7.1f} us per call", flush=True)
        ROWS.append({"group": f"decode {k.shape[2]} host", "name": name, "us": host})


def sec_short():
    """Short rows (fp32, R*N = 2^27): the one-pass tile size and warps against torch, (log-)softmax."""
    from splitsoftmax.kernels import configs
    from splitsoftmax.kernels import softmax as K
    cfg = configs.SOFTMAX
    saved = dict(vars(cfg))
    for n in (128, 512, 2048):
        x = torch.randn((1 << 27) // n, n, device="cuda")
        nb = 2 * x.numel() * 4
        for log in (False, True):
            grp = f"short N={n} {'log_softmax' if log else 'softmax'}"
            tfn = torch.log_softmax if log else torch.softmax
            rec(grp, "torch", bench(lambda: tfn(x, -1)), nb)
            ref = tfn(x[:64].double(), -1)
            for tile in (4096, 8192, 16384):
                for per_warp in (256, 512, 1024):
                    vars(cfg).update(saved)
                    cfg.one_pass_tile_elems, cfg.elems_per_warp = tile, per_warp
                    p = K._plan(x)
                    name = f"tile{tile} pw{per_warp} rows{p.block_r} w{p.num_warps}"

                    def run():
                        err = (K.softmax_fwd(x, log)[0][:64].double() - ref).abs().max().item()
                        rec(grp, name, bench(lambda: K.softmax_fwd(x, log)), nb, err=f"{err:.1e}")
                    guard(grp, name, run)
        del x
    vars(cfg).update(saved)
    torch.cuda.empty_cache()


def sec_causal():
    """Causal forward at S=1k/2k (H=16, D=128, bf16, B*S=32k): short-causal tile variants beside flash."""
    from splitsoftmax.kernels import attention as A
    from splitsoftmax.kernels import configs
    key = ("fwd_causal_short", 2, 128)
    saved = configs.ATTN_TILES[key]
    for S in (1024, 2048):
        B = 32768 // S
        q, k, v = (torch.randn(B, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        f1 = 4 * B * 16 * S * S * 128 / 2
        grp = f"causal fwd S{S}"
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            rec(grp, "flash", bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), flops=f1)
        for tile in ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (32, 64, 4, 3),
                     (64, 64, 8, 3), (128, 32, 8, 3), (64, 128, 8, 3)):
            configs.ATTN_TILES[key] = tile
            guard(grp, str(tile), lambda: rec(grp, str(tile), bench(
                lambda: A.attn_fwd(q, k, v, 128 ** -0.5, True, out_dtype=torch.bfloat16)), flops=f1))
        configs.ATTN_TILES[key] = saved
        del q, k, v
    torch.cuda.empty_cache()


SECTIONS = {"softmax": sec_softmax, "attn": sec_attn, "decode": sec_decode, "short": sec_short, "causal": sec_causal}

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
