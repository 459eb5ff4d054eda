"""Probe (tuning data, not part of the library): streaming-kernel variants on one GPU, one call.

    PYTHONPATH=. python3 launch/probes/stream.py OUTDIR [SECTIONS]

SECTIONS (comma-separated, default all): lse (statistics pass: tile, warps, per-lane states, hand
prefetch, tl.range stages), norm (normalising pass), softmax (512x262144 bf16: persistent two-pass
and a register-resident split row with a per-row arrival counter), ce (ss vs torch cross-entropy),
prof (profile of the ss cross-entropy step), decode (split programs per SM x decode tiles), attn
(forward tiles at S=1k/2k). Prints one line per variant, writes OUTDIR/probe.json.
"""
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

LOG2E = tl.constexpr(1.4426950408889634)
NEG = float("-inf")


@triton.jit
def _upd(m, l, x, LANE: tl.constexpr):
    if LANE:
        m_new = tl.maximum(m, x)
        mu = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.math.exp2((m - mu) * LOG2E) + tl.math.exp2((x - mu) * LOG2E)
    else:
        m_new = tl.maximum(m, tl.max(x, 1))
        mu = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.math.exp2((m - mu) * LOG2E) + tl.sum(tl.math.exp2((x - mu[:, None]) * LOG2E), 1)
    return m_new, l


@triton.jit
def _row_stats(xb, N, BLOCK: tl.constexpr, LANE: tl.constexpr, PREFETCH: tl.constexpr, PIPE: tl.constexpr):
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    if LANE:
        m = tl.full([1, BLOCK], float("-inf"), tl.float32)
        l = tl.zeros([1, BLOCK], tl.float32)
    else:
        m = tl.full([1], float("-inf"), tl.float32)
        l = tl.zeros([1], tl.float32)
    n_full = N // BLOCK
    if PREFETCH:
        nxt = tl.load(xb + cols, mask=cols < N, other=float("-inf"))
        for i in range(1, tl.cdiv(N, BLOCK)):
            cur = nxt
            c = i * BLOCK + cols
            nxt = tl.load(xb + c, mask=c < N, other=float("-inf"))
            m, l = _upd(m, l, cur.to(tl.float32), LANE)
        m, l = _upd(m, l, nxt.to(tl.float32), LANE)
    else:
        for i in tl.range(0, n_full, num_stages=PIPE):
            x = tl.load(xb + i * BLOCK + cols).to(tl.float32)
            m, l = _upd(m, l, x, LANE)
        c = n_full * BLOCK + cols
        x = tl.load(xb + c, mask=c < N, other=float("-inf")).to(tl.float32)
        m, l = _upd(m, l, x, LANE)
    if LANE:
        mr = tl.max(m, 1)
        mu = tl.where(mr == float("-inf"), 0.0, mr)
        l = tl.sum(l * tl.math.exp2((m - mu[:, None]) * LOG2E), 1)
        m = mr
    return m, l  # [1]


@triton.jit
def lse_k(X, OUT, N, sx, BLOCK: tl.constexpr, LANE: tl.constexpr, PREFETCH: tl.constexpr, PIPE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m, l = _row_stats(X + row * sx, N, BLOCK, LANE, PREFETCH, PIPE)
    tl.store(OUT + row + tl.arange(0, 1), m + tl.log2(l) / LOG2E)


@triton.jit
def _norm_row(xb, yb, lse, N, BLOCK: tl.constexpr, PREFETCH: tl.constexpr, REVERSE: tl.constexpr):
    """y = exp(x - lse), tiles in reverse (REVERSE) or forward order."""
    cols = tl.arange(0, BLOCK)[None, :]
    nt = tl.cdiv(N, BLOCK)
    if PREFETCH:
        t0 = nt - 1 if REVERSE else 0
        nxt = tl.load(xb + t0 * BLOCK + cols, mask=t0 * BLOCK + cols < N, other=0.0)
        for i in range(1, nt + 1):
            cur = nxt
            tc = nt - i if REVERSE else i - 1
            tn = nt - 1 - i if REVERSE else i
            cn = tn * BLOCK + cols
            nxt = tl.load(xb + cn, mask=(cn < N) & (tn >= 0) & (tn < nt), other=0.0)
            cc = tc * BLOCK + cols
            y = tl.math.exp2((cur.to(tl.float32) - lse[:, None]) * LOG2E)
            tl.store(yb + cc, y.to(yb.dtype.element_ty), mask=cc < N)
    else:
        for i in range(0, nt):
            t = nt - 1 - i if REVERSE else i
            c = t * BLOCK + cols
            x = tl.load(xb + c, mask=c < N, other=0.0).to(tl.float32)
            y = tl.math.exp2((x - lse[:, None]) * LOG2E)
            tl.store(yb + c, y.to(yb.dtype.element_ty), mask=c < N)


@triton.jit
def norm_k(X, Y, LSE, N, sx, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(LSE + row + tl.arange(0, 1))
    _norm_row(X + row * sx, Y + row * sx, lse, N, BLOCK, PREFETCH, False)


@triton.jit
def softmax2_k(X, Y, R, N, sx, BLOCK: tl.constexpr, PIPE: tl.constexpr, LANE: tl.constexpr):
    """Persistent two-pass softmax: program p takes rows p, p + P, ..."""
    for row in range(tl.program_id(0), R, tl.num_programs(0)):
        xb = X + row * sx
        m, l = _row_stats(xb, N, BLOCK, LANE, 0, PIPE)
        lse = tl.where(l == 0, float("-inf"), m + tl.log2(l) / LOG2E)
        _norm_row(xb, Y + row * sx, lse, N, BLOCK, 0, True)


@triton.jit
def coop_k(X, Y, PM, PL, CNT, R, N, sx, CHUNK: tl.constexpr, S: tl.constexpr, SPIN_MAX: tl.constexpr):
    """Split-row softmax, each chunk held in registers across a per-row arrival counter.

    Persistent grid P (a multiple of S, all resident): task t -> (row t // S, split t % S).
    """
    cols = tl.arange(0, CHUNK)
    for t in range(tl.program_id(0), R * S, tl.num_programs(0)):
        row = t // S
        sp = t % S
        c = sp * CHUNK + cols
        xb = X + row * sx
        x = tl.load(xb + c, mask=c < N, other=float("-inf"))  # [CHUNK], input dtype
        xf = x.to(tl.float32)
        m = tl.max(xf, 0)
        mu = tl.where(m == float("-inf"), 0.0, m)
        l = tl.sum(tl.math.exp2((xf - mu) * LOG2E), 0)
        tl.store(PM + row * S + sp, m)
        tl.store(PL + row * S + sp, l)
        tl.debug_barrier()
        cnt = tl.atomic_add(CNT + row, 1, sem="release")
        spins = 0
        while (cnt < S - 1) & (spins < SPIN_MAX):  # bounded: a missing sibling gives NaN, not a hang
            cnt = tl.atomic_add(CNT + row, 0, sem="acquire") - 1
            spins += 1
        s = tl.arange(0, S)
        pm = tl.load(PM + row * S + s, cache_modifier=".cv")
        pl = tl.load(PL + row * S + s, cache_modifier=".cv")
        M = tl.max(pm, 0)
        Mu = tl.where(M == float("-inf"), 0.0, M)
        L = tl.sum(pl * tl.math.exp2((pm - Mu) * LOG2E), 0)
        inv = tl.where(L == 0, 0.0, 1.0 / L)
        inv = tl.where(cnt < S - 1, float("nan"), inv)
        y = tl.math.exp2((x.to(tl.float32) - Mu) * LOG2E) * inv
        tl.store(Y + row * sx + c, y.to(Y.dtype.element_ty), mask=c < N)


def gbps(nbytes, ms):
    return nbytes / ms / 1e6


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=150, return_mode="median")


class Log:
    """Result rows, printed as they come."""

    def __init__(self):
        self.rows = []

    def rec(self, group, name, ms, nbytes, err=None):
        r = {"group": group, "name": name, "ms": ms, "gbps": gbps(nbytes, ms), "err": err}
        self.rows.append(r)
        print(f"{group:22s} {name:40s} {ms:8.4f} ms {r['gbps']:7.0f} GB/s err={err}", flush=True)

    def tflops(self, group, name, ms, flops):
        self.rows.append({"group": group, "name": name, "ms": ms, "tflops": flops / ms / 1e9})
        print(f"{group} {name:34s} {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)

    def guard(self, group, name, f):
        try:
            f()
        except Exception as e:  # noqa: BLE001  (a variant that fails to compile or run is recorded)
            print(f"{group:22s} {name:40s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            self.rows.append({"group": group, "name": name, "error": f"{type(e).__name__}: {str(e)[:500]}"})


def sec_lse(log, sms):
    for R, N, dt in ((8192, 131072, torch.bfloat16), (512, 262144, torch.bfloat16), (16384, 4096, torch.float32)):
        x = torch.randn(R, N, device="cuda", dtype=dt) * 3
        ref = torch.logsumexp(x[:64].double(), 1)
        grp = f"lse {R}x{N} {str(dt)[6:]}"
        nb = x.numel() * x.element_size()
        log.rec(grp, "torch.logsumexp", bench(lambda: torch.logsumexp(x, 1)), nb)
        for block, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)):
            modes = ((0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)) + (((0, 0, 3),) if block == 8192 else ())
            for lane, pre, pipe in modes:
                name = f"B{block} w{warps} lane{lane} pre{pre} pipe{pipe}"

                def run():
                    o = torch.full((R,), float("nan"), device="cuda")
                    f = lambda: lse_k[(R,)](x, o, N, x.stride(0), BLOCK=block, LANE=lane, PREFETCH=pre,  # noqa: E731
                                            PIPE=pipe, num_warps=warps)
                    f()
                    log.rec(grp, name, bench(f), nb, (o[:64].double() - ref).abs().max().item())
                log.guard(grp, name, run)
        del x


def sec_norm(log, sms):
    R, N, dt = 8192, 131072, torch.bfloat16
    x = torch.randn(R, N, device="cuda", dtype=dt) * 3
    lse = torch.logsumexp(x.float(), 1)
    y = torch.empty_like(x)
    grp = f"norm {R}x{N} bf16"
    nb = 2 * x.numel() * x.element_size()
    log.rec(grp, "torch exp(x-lse)", bench(lambda: torch.exp(x - lse[:, None].to(dt))), nb)
    for block, warps in ((1024, 4), (1024, 8), (2048, 4), (2048, 8), (2048, 16), (4096, 4), (4096, 8), (4096, 16)):
        for pre in (0, 1):
            name = f"B{block} w{warps} pre{pre}"

            def run():
                f = lambda: norm_k[(R,)](x, y, lse, N, x.stride(0), BLOCK=block, PREFETCH=pre, num_warps=warps)  # noqa: E731
                y.fill_(float("nan"))
                f()
                err = (y[:8].double() - torch.softmax(x[:8].double(), 1)).abs().max().item()
                log.rec(grp, name, bench(f), nb, err)
            log.guard(grp, name, run)


def sec_softmax(log, sms):
    import splitsoftmax as ss
    R, N = 512, 262144
    x = torch.randn(R, N, device="cuda", dtype=torch.bfloat16) * 3
    y = torch.empty_like(x)
    ref = torch.softmax(x[:16].double(), 1)
    grp = "softmax 512x262144 bf16"
    nb = 2 * x.numel() * 2

    def check(name, f):  # y poisoned, one run checked (relative error, every element written), then timed
        y.fill_(float("nan"))
        f()
        torch.cuda.synchronize()
        err = ((y[:16].double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
        bad = int(torch.isnan(y).sum())
        if bad:
            log.rows.append({"group": grp, "name": name, "error": f"{bad} NaN, err {err}"})
            print(f"{grp:22s} {name:40s} WRONG: {bad} NaN")
            return
        log.rec(grp, name, bench(f), nb, f"{err:.2e}")

    log.rec(grp, "torch.softmax", bench(lambda: torch.softmax(x, 1)), nb)
    log.guard(grp, "ss.softmax", lambda: log.rec(grp, "ss.softmax", bench(lambda: ss.softmax(x)), nb))
    for P in (sms, 2 * sms, R):
        for block, warps in ((8192, 8), (8192, 16), (16384, 16), (16384, 8)):
            for pipe in (1, 3):
                name = f"2pass P{P} B{block} w{warps} pipe{pipe}"
                log.guard(grp, name, lambda: check(name, lambda: softmax2_k[(P,)](
                    x, y, R, N, x.stride(0), BLOCK=block, PIPE=pipe, LANE=0, num_warps=warps)))
    for S, warps, per_sm in ((4, 16, 1), (8, 16, 1), (8, 8, 1), (8, 8, 2), (16, 8, 1), (16, 8, 2), (16, 4, 2),
                             (32, 4, 2), (32, 4, 4)):
        chunk = N // S
        pm = torch.empty(R * S, device="cuda")
        pl = torch.empty(R * S, device="cuda")
        cnt = torch.zeros(R, dtype=torch.int32, device="cuda")
        args = (x, y, pm, pl, cnt, R, N, x.stride(0))
        try:
            ck = coop_k.warmup(*args, CHUNK=chunk, S=S, SPIN_MAX=1 << 20, num_warps=warps, grid=(1,))
            ck._init_handles()
        except Exception as e:  # noqa: BLE001
            print("coop warmup failed", S, warps, e)
            continue
        # every program of the persistent grid must be resident, or a row's chunks never meet
        resident = min(per_sm, 65536 // max(1, ck.n_regs * 32 * warps), 64 // warps)
        P = (sms * resident) // S * S
        name = f"coop S{S} w{warps} P{P} regs{ck.n_regs} spill{ck.n_spills}"

        def f():
            cnt.zero_()
            coop_k[(P,)](*args, CHUNK=chunk, S=S, SPIN_MAX=1 << 20, num_warps=warps)
        log.guard(grp, name, lambda: check(name, f))


def _ce_inputs():
    N, V = 8192, 131072
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return logits, torch.randint(0, V, (N,), device="cuda")


def sec_ce(log, sms):
    import splitsoftmax as ss
    logits, tgt = _ce_inputs()
    grp = "CE 8192x131072 bf16"
    for name, fn in (("torch", lambda: torch.nn.functional.cross_entropy(logits, tgt)),
                     ("ss", lambda: ss.cross_entropy(logits, tgt))):
        def fb(fn=fn):
            logits.grad = None
            fn().backward()
        log.rec(grp, name + " fwd", bench(lambda: fn().detach()), logits.numel() * 2)
        log.rec(grp, name + " fwd+bwd", bench(fb), 3 * logits.numel() * 2)


def sec_prof(log, sms):
    import splitsoftmax as ss
    from torch.profiler import ProfilerActivity, profile
    logits, tgt = _ce_inputs()
    for eps in (0.0, 0.1):
        def fb():
            logits.grad = None
            ss.cross_entropy(logits, tgt, label_smoothing=eps).backward()
        for _ in range(3):
            fb()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fb()
            torch.cuda.synchronize()
        print(f"==== profile ss CE eps={eps} (5 iterations) ====")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def sec_decode(log, sms):
    import splitsoftmax as ss
    from splitsoftmax.kernels import configs
    grp = "decode"
    saved = configs.ATTN_SPLIT_PROGRAMS_PER_SM, configs.ATTN_TILES[("decode", 2, 128)]
    for keys in (131072, 1048576):
        q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, keys, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nb = 2 * k.numel() * 2
        log.rec(grp, f"{keys} cudnn", bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, enable_gqa=True)), nb)
        for pps in (1, 2, 3, 4, 6):
            configs.ATTN_SPLIT_PROGRAMS_PER_SM = pps
            for tile in ((16, 64, 4, 4), (16, 64, 4, 3), (16, 128, 4, 3), (16, 64, 8, 4), (16, 32, 4, 4)):
                configs.ATTN_TILES[("decode", 2, 128)] = tile
                name = f"{keys} pps{pps} tile{tile}"
                log.guard(grp, name, lambda: log.rec(grp, name, bench(lambda: ss.attention(q, k, v)), nb))
        configs.ATTN_SPLIT_PROGRAMS_PER_SM, configs.ATTN_TILES[("decode", 2, 128)] = saved
        g = torch.cuda.CUDAGraph()
        ss.attention(q, k, v)
        with torch.cuda.graph(g):
            ss.attention(q, k, v)
        log.rec(grp, f"{keys} ss graph", bench(g.replay), nb)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            ss.attention(q, k, v)
        print(f"decode {keys}: host {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms per eager call", flush=True)
        torch.cuda.synchronize()


def sec_attn(log, sms):
    import splitsoftmax as ss
    from splitsoftmax.kernels import configs
    fl = torch.nn.attention
    saved = configs.ATTN_TILES[("fwd", 2, 128)]
    for S in (1024, 2048):
        B = 32768 // S
        q, k, v = (torch.randn(B, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            flops = 4 * B * 16 * S * S * 128 / (2 if causal else 1)
            for be, nm in ((fl.SDPBackend.FLASH_ATTENTION, "flash"), (fl.SDPBackend.CUDNN_ATTENTION, "cudnn")):
                with fl.sdpa_kernel(be):
                    ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
                log.tflops("attn fwd", f"S{S} c{int(causal)} {nm}", ms, flops)
            for tile in ((128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3),
                         (128, 128, 8, 2), (128, 64, 4, 4)):
                configs.ATTN_TILES[("fwd", 2, 128)] = tile
                log.guard("attn fwd", str(tile), lambda: log.tflops(
                    "attn fwd", f"S{S} c{int(causal)} ss {tile}", bench(lambda: ss.attention(q, k, v, causal=causal)),
                    flops))
        configs.ATTN_TILES[("fwd", 2, 128)] = saved


SECTIONS = {"lse": sec_lse, "norm": sec_norm, "softmax": sec_softmax, "ce": sec_ce, "prof": sec_prof,
            "decode": sec_decode, "attn": sec_attn}


def main(out, sections):
    os.makedirs(out, exist_ok=True)
    log = Log()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    a = torch.randn(2**28, device="cuda")
    b = torch.empty_like(a)
    log.rec("ceiling", "copy", bench(lambda: b.copy_(a)), 2 * a.numel() * 4)
    log.rec("ceiling", "read(sum)", bench(lambda: a.sum()), a.numel() * 4)
    del a, b
    for name in sections:
        SECTIONS[name](log, sms)
        torch.cuda.empty_cache()
    with open(os.path.join(out, "probe.json"), "w") as f:
        json.dump(log.rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else list(SECTIONS))
