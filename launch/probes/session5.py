"""Probe (tuning data, not part of the library): session 5's host-path and kernel questions, one GPU.

    PYTHONPATH=. python3 launch/probes/session5.py OUTDIR [SECTIONS]

SECTIONS (comma-separated, default all):
- host: host time per call of each layer of a 128k-key decode, and a cProfile of the public call;
- decode: 128k / 1M-key decode, eager and CUDA-graph replay, beside cuDNN; at 1M also the split
  programs per SM (the copy of this file at commit 853e5c9 also timed the split merge fused into
  the split kernel, which that commit had);
- coop: long rows held on chip by sibling programs against the two-pass / split paths and torch,
  chunk sizes, warps, persistent grids, and a copy without the exchange (timing only);
- causal: S=1k / 2k causal forward, the kernel as it is against copies of it patched for timing only
  (no NaN guard on the diagonal tile; the diagonal tile unmasked, wrong results; a sum-based
  guard), beside SDPA flash.
Writes OUTDIR/probe.json.
"""
import importlib
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from session4 import ROWS, bench, guard, rec, rec_profile, run_sections  # the probe helpers, beside this file
from splitsoftmax.bench import graph_ms


def decode_inputs(keys):
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, keys, 128, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def sec_host():
    import triton
    import triton.language as tl
    import splitsoftmax as ss
    from splitsoftmax import _checks
    from splitsoftmax.kernels import attention as A, decode as P

    @triton.jit
    def _touch(X, n):
        tl.store(X + tl.arange(0, 16), tl.zeros([16], tl.float32), mask=tl.arange(0, 16) < n)

    q, k, v = decode_inputs(131072)
    scale = 128 ** -0.5
    buf = torch.empty(16, device="cuda")
    parts = {"ss.attention no_grad (direct)": lambda: ss.attention(q, k, v),
             "ss.attention via op": lambda: torch.ops.splitsoftmax.attn_fwd(q, k, v, scale, False, 0),
             "kernels.attn_fwd": lambda: A.attn_fwd(q, k, v, scale, False, out_dtype=torch.bfloat16),
             "plan": lambda: P.plan(q, k, v, False, 0),
             "checks": lambda: _checks.attention_args(q, k, v, None, False),
             "torch.zeros(8, int32)": lambda: torch.zeros(8, dtype=torch.int32, device="cuda"),
             "2x torch.empty": lambda: (torch.empty(33, 1, 32, 1, 128, device="cuda"),
                                        torch.empty(33, 1, 32, 1, device="cuda")),
             "triton launch, 2 args": lambda: _touch[(1,)](buf, 16)}
    with torch.no_grad():
        for name, fn in parts.items():
            us = host_us(fn)
            print(f"host {name:34s} {us:7.1f} us per call", flush=True)
            ROWS.append({"group": "host", "name": name, "us": us})
    with torch.no_grad():
        rec_profile("host", "cprofile", lambda: ss.attention(q, k, v))


def sec_decode():
    import splitsoftmax as ss
    from splitsoftmax.kernels import configs
    for keys in (131072, 1048576):
        q, k, v = decode_inputs(keys)
        nb = 2 * k.numel() * 2
        grp = f"decode {keys}"
        with torch.no_grad():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                def cudnn():
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                want = cudnn().float()
                rec(grp, "cudnn eager", bench(cudnn), nb)
                rec(grp, "cudnn graph", graph_ms(cudnn), nb)
            pps_list = (2, 3, 4) if keys > 131072 else (2,)
            for pps in pps_list:
                configs.ATTN_SPLIT_PROGRAMS_PER_SM = pps
                name = f"ss pps={pps}"

                def one(name=name):
                    diff = (ss.attention(q, k, v).float() - want).abs().max().item()
                    rec(grp, name + " eager", bench(lambda: ss.attention(q, k, v)), nb, diff_vs_cudnn=diff)
                    rec(grp, name + " graph", graph_ms(lambda: ss.attention(q, k, v)), nb)
                guard(grp, name, one)
        configs.ATTN_SPLIT_PROGRAMS_PER_SM = 2
        del q, k, v
        torch.cuda.empty_cache()


GUARD = "        if tl.max(nonfinite) > 0:  # rare: one scalar test keeps the diagonal tile cheap\n"
PATCHES = {
    "noguard": [(GUARD, "        if False:\n")],
    "sumguard": [("        nonfinite = _nonfinite(v)  # [BLOCK_N, BLOCK_DV]\n" + GUARD,
                  "        total = tl.sum(tl.sum(v.to(tl.float32), 1), 0)\n"
                  "        if (tl.abs(total) < float('inf')) == 0:\n"
                  "            nonfinite = _nonfinite(v)\n")],
    "unmasked(wrong)": [("kj, pos, hi, diag, qk_scale, dmask, dvmask, CAUSAL, True,",
                         "kj, pos, hi, diag, qk_scale, dmask, dvmask, CAUSAL, False,")],
}


def _patched(tag, patches):
    src = open("splitsoftmax/kernels/attention.py").read()
    for old, new in patches:
        assert old in src, (tag, old)
        src = src.replace(old, new)
    name = f"_probe_{''.join(c for c in tag if c.isalnum())}"
    with open(f"splitsoftmax/kernels/{name}.py", "w") as f:
        f.write(src)
    return importlib.import_module(f"splitsoftmax.kernels.{name}")


def sec_causal():
    from splitsoftmax.kernels import attention as A0, configs
    mods = [("as is", A0)] + [(tag, _patched(tag, p)) for tag, p in PATCHES.items()]
    key = ("fwd_causal_short", 2, 128)
    saved = configs.ATTN_TILES[key]
    for S in (1024, 2048):
        B = 32768 // S
        q, k, v = (torch.randn(B, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scale = 128 ** -0.5
        f1 = 4 * B * 16 * S * S * 128 / 2
        grp = f"causal S{S}"
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            rec(grp, "flash fwd", bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), flops=f1)
        want = A0.attn_fwd(q, k, v, scale, True, out_dtype=torch.bfloat16)[0]
        for tile in ((64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)):
            configs.ATTN_TILES[key] = tile
            for tag, A in mods:
                def run(A=A):
                    fn = lambda: A.attn_fwd(q, k, v, scale, True, out_dtype=torch.bfloat16)  # noqa: E731
                    diff = (fn()[0].float() - want.float()).abs().max().item()
                    rec(grp, f"{tag} {tile}", bench(fn), flops=f1, diff=diff)
                guard(grp, f"{tag} {tile}", run)
        configs.ATTN_TILES[key] = saved
        del q, k, v
        torch.cuda.empty_cache()


WAIT = ("        pm, pl, complete = _gather_states(st_ptr, rows, C, spin, BLOCK_C)\n",
        "            m, l, _ = _stats(x_ptr + rows[:, None].to(tl.int64) * stride_x, rmask, 0, N, LOOP_N, 1)\n")
LOCAL = """        xx = cur.to(tl.float32)
        m = tl.max(xx, axis=1)
        l = tl.sum(tl.math.exp2((xx - _ref(m)[:, None]) * _LOG2E), axis=1)
"""


def _local_only():
    """A copy of kernels/softmax.py whose coop programs normalise with their own chunk's state
    instead of waiting for and merging their siblings' (timing only: wrong results)."""
    src = open("splitsoftmax/kernels/softmax.py").read()
    a, b = src.index(WAIT[0]), src.index(WAIT[1]) + len(WAIT[1])
    with open("splitsoftmax/kernels/_probe_coop_local.py", "w") as f:
        f.write(src[:a] + LOCAL + src[b:])
    return importlib.import_module("splitsoftmax.kernels._probe_coop_local")


def sec_coop():
    """Long rows held on chip by sibling programs (the coop path) against the two-pass / split paths
    and torch, under chunk sizes, warps and persistent grids; GB/s of 2N (read + write)."""
    from splitsoftmax.kernels import configs
    from splitsoftmax.kernels import softmax as K
    local = _local_only()
    cfg = configs.SOFTMAX
    saved = dict(vars(cfg))
    variants = [(None, None, 1, K)]
    for chunk, per_warp in ((16384, 2048), (16384, 1024), (8192, 1024), (8192, 512), (4096, 512)):
        variants.append((chunk, per_warp, 1, K))
    variants += [(16384, 1024, 1, local), (8192, 512, 1, local), (16384, 2048, 2, K), (8192, 1024, 2, K)]
    for R, N, dt in ((512, 262144, torch.bfloat16), (256, 131072, torch.float32), (64, 1 << 20, torch.float32),
                     (2048, 65536, torch.bfloat16), (8, 262144, torch.bfloat16)):
        x = torch.randn(R, N, device="cuda", dtype=dt) * 3
        nb = 2 * x.numel() * x.element_size()
        grp = f"coop {R}x{N} {str(dt)[6:]}"
        rows = torch.arange(0, R, max(1, R // 16), device="cuda")
        ref = torch.softmax(x[rows].double(), -1)
        rec(grp, "torch.softmax", bench(lambda: torch.softmax(x, -1)), nb)
        for chunk, per_warp, pps, mod in variants:
            vars(cfg).update(saved)
            if chunk is None:
                cfg.coop_max_chunks = 0
            else:
                cfg.coop_chunk_elems, cfg.coop_elems_per_warp, cfg.coop_programs_per_sm = chunk, per_warp, pps
            p = K._plan(x)
            name = f"{p.path} chunk={p.chunk} w{p.num_warps} S{p.splits} pps{pps}" + (" LOCAL" if mod is local else "")

            def run(name=name, mod=mod):
                y = mod.softmax_fwd(x, False)[0]
                err = ((y[rows].double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
                rec(grp, name, bench(lambda: mod.softmax_fwd(x, False)), nb, max_rel_err=err)
            guard(grp, name, run)
        vars(cfg).update(saved)
        del x
        torch.cuda.empty_cache()


SECTIONS = {"host": sec_host, "decode": sec_decode, "causal": sec_causal, "coop": sec_coop}

if __name__ == "__main__":
    run_sections(SECTIONS, sys.argv)
