"""Probe (tuning data, not part of the library): session 6's softmax questions, one GPU.

    PYTHONPATH=. python3 launch/probes/session6.py OUTDIR [SECTIONS]

SECTIONS (comma-separated, default all):
- coop: long rows on the coop path (softmax keeps exp(x - m_chunk): one exp per element) under
  chunk sizes, warps and programs per SM, against the two-pass / split paths and torch; where
  ``kernels/_probe_old_softmax.py`` is present (``git show 3d378cd:splitsoftmax/kernels/softmax.py``,
  git-ignored: pass it in the device call's ``carry``) also the kernel as it was (two exps per element).
  The copy of this file at commit 992b783 also timed a coop mode, removed since, that streamed
  its chunk twice (the second read from L2) instead of holding it;
- keepx: the coop kernel as it is against a copy whose softmax holds ``x`` (as log-softmax does) and
  takes a second exp per element at the output (the H200 read log-softmax 16% faster than softmax
  on 512x262144 bf16 in this session's first call);
- causal: causal attention forward at S = 1k..8k (B*S = 32k, H=16, D=128, bf16), TMA or pointer
  loads, under the short-causal tile (64x64) or the long one (128x128), beside SDPA flash;
- short: S = 1k / 2k causal forward through the public call under short-causal tiles (block sizes,
  warps, stages) beside SDPA flash and the TMA prototype (``attn_tma_kernel.py``, beside this file;
  results checked against the configured tile's);
- guard: S = 1k / 2k causal forward, the attention launcher as it is against a copy without the NaN
  guard of the diagonal tiles (timing only), beside the TMA prototype (it patches the guard as it
  was until session 7; ``session7.py variants`` times the later form);
- host: public calls whose GPU time is short (S=1k causal forward, 128k-key decode, 16384x4096
  logsumexp) with the host helpers ``configs.next_pow2`` / ``configs.cdiv`` as they are, and patched
  back to Triton's constexpr functions ``triton.next_power_of_2`` / ``triton.cdiv``, beside the peers;
- acc: the error of the looped paths (two-pass, split, coop) on fp32 rows of 40000 scaled by 4
  (rows a few elements dominate), against float64 and beside torch's own error;
- lse: the statistics pass (logsumexp) of 512x262144 bf16 under loop tiles, warps, stages, and a
  copy whose loads do not ask L2 to keep the row (``evict_first``; timing and results).
Writes OUTDIR/probe.json.
"""
import importlib
import os
import sys

import torch

# the probe helpers, beside this file
from session4 import ROWS, bench, causal_case, guard, rec, rec_flash_causal, run_sections

HELD = dict(coop_min_elem_bytes=1)


def _variants():
    """(name, config overrides, use the old kernel copy) of the coop section."""
    v = [("default", {}, False), ("no coop", dict(coop_max_chunks=0), False)]
    for chunk, per_warp, pps in ((16384, 2048, 1), (8192, 1024, 1), (8192, 1024, 2), (16384, 1024, 1)):
        over = dict(HELD, coop_chunk_elems=chunk, coop_elems_per_warp=per_warp, coop_programs_per_sm=pps)
        v.append((f"held {chunk} pw{per_warp} pps{pps}", over, False))
    v.append(("OLD held 16384 pw2048 pps1", dict(HELD), True))
    return v


def sec_coop():
    from splitsoftmax.kernels import configs
    from splitsoftmax.kernels import softmax as K
    old = None
    if os.path.exists("splitsoftmax/kernels/_probe_old_softmax.py"):
        old = importlib.import_module("splitsoftmax.kernels._probe_old_softmax")
    cfg = configs.SOFTMAX
    saved = dict(vars(cfg))
    for R, N, dt in ((512, 262144, torch.bfloat16), (2048, 65536, torch.bfloat16), (128, 1 << 20, torch.bfloat16),
                     (8, 262144, torch.bfloat16), (256, 131072, torch.float32), (64, 1 << 20, torch.float32)):
        x = torch.randn(R, N, device="cuda", dtype=dt) * 3
        nb = 2 * x.numel() * x.element_size()
        grp = f"coop {R}x{N} {str(dt)[6:]}"
        rows = torch.arange(0, R, max(1, R // 16), device="cuda")
        rec(grp, "torch.softmax", bench(lambda: torch.softmax(x, -1)), nb)
        for log in (False, True):
            fn = torch.log_softmax if log else torch.softmax
            ref = fn(x[rows].double(), -1)
            for name, over, use_old in _variants():
                if use_old and old is None:
                    continue
                vars(cfg).update(saved)
                vars(cfg).update(over)
                mod = old if use_old else K
                p = K._plan(x)
                if use_old and p.path != "coop":
                    continue
                if log and not (name.startswith("default") or name.startswith("no coop") or "OLD" in name):
                    continue
                label = f"{'log ' if log else ''}{name}: {p.path} C{p.splits} tile{p.block_n} w{p.num_warps}"

                def run(label=label, mod=mod):
                    y = mod.softmax_fwd(x, log)[0]
                    err = ((y[rows].double() - ref).abs() / (ref.abs() + 1)).max().item()
                    rec(grp, label, bench(lambda: mod.softmax_fwd(x, log)), nb, err=f"{err:.1e}")
                guard(grp, label, run)
        vars(cfg).update(saved)
        del x
        torch.cuda.empty_cache()


def _evict_first_copy():
    src = open("splitsoftmax/kernels/softmax.py").read()
    assert src.count('eviction_policy="evict_last"') == 1
    with open("splitsoftmax/kernels/_probe_evict.py", "w") as f:
        f.write(src.replace('eviction_policy="evict_last"', 'eviction_policy="evict_first"'))
    return importlib.import_module("splitsoftmax.kernels._probe_evict")


def sec_lse():
    from splitsoftmax.kernels import configs
    from splitsoftmax.kernels import softmax as K
    ev = _evict_first_copy()
    cfg = configs.SOFTMAX
    saved = dict(vars(cfg))
    x = torch.randn(512, 262144, device="cuda", dtype=torch.bfloat16) * 3
    ref = torch.logsumexp(x.double(), 1)
    nb = x.numel() * 2
    grp = "lse 512x262144 bf16"
    rec(grp, "torch.logsumexp", bench(lambda: torch.logsumexp(x, 1)), nb)
    src = torch.randn(1 << 28, device="cuda")
    rec(grp, "read rate (torch sum, 1 GiB fp32)", bench(lambda: src.sum()), src.numel() * 4)
    del src
    for tile, per_warp, stages in ((16384, 2048, 3), (16384, 2048, 4), (16384, 2048, 2), (32768, 2048, 3),
                                   (32768, 4096, 3), (16384, 4096, 3), (8192, 1024, 4)):
        for mod, tag in ((K, ""), (ev, " evict_first")):
            vars(cfg).update(saved)
            cfg.loop_tile_bytes, cfg.loop_elems_per_warp, cfg.loop_stages = tile, per_warp, stages
            p = K._plan(x, stats_only=True)
            name = f"tile{tile >> 10}KB w{p.num_warps} st{stages}{tag}"

            def run(name=name, mod=mod):
                err = (mod.lse_rows(x).double() - ref).abs().max().item()
                rec(grp, name, bench(lambda: mod.lse_rows(x)), nb, err=f"{err:.1e}")
            guard(grp, name, run)
    vars(cfg).update(saved)


KEEP_P = ("return (x if LOG else p), m, tl.sum(p, axis=1)", """    if LOG:
        y = _norm_tile(t, lse, m, inv, True)
    else:
        y = t * (tl.math.exp2((m_tile - m) * _LOG2E) * inv)[:, None]
""")
KEEP_X = ("return x, m, tl.sum(p, axis=1)", """    y = _norm_tile(t, lse, m, inv, LOG)
""")


def sec_keepx():
    from splitsoftmax.kernels import softmax as K
    src = open("splitsoftmax/kernels/softmax.py").read()
    for a, b in zip(KEEP_P, KEEP_X):
        assert src.count(a) == 1, a
        src = src.replace(a, b)
    with open("splitsoftmax/kernels/_probe_keepx.py", "w") as f:
        f.write(src)
    kx = importlib.import_module("splitsoftmax.kernels._probe_keepx")
    for R, N, dt in ((512, 262144, torch.bfloat16), (2048, 65536, torch.bfloat16), (256, 131072, torch.float32)):
        x = torch.randn(R, N, device="cuda", dtype=dt) * 3
        nb = 2 * x.numel() * x.element_size()
        grp = f"keepx {R}x{N} {str(dt)[6:]}"
        rows = torch.arange(0, R, max(1, R // 16), device="cuda")
        for log in (False, True):
            ref = (torch.log_softmax if log else torch.softmax)(x[rows].double(), -1)
            for mod, name in ((K, "as is"), (kx, "keep x")):
                label = f"{'log ' if log else ''}{name}: {K._plan(x).path}"

                def run(label=label, mod=mod, log=log, ref=ref):
                    y = mod.softmax_fwd(x, log)[0]
                    err = ((y[rows].double() - ref).abs() / (ref.abs() + 1)).max().item()
                    rec(grp, label, bench(lambda: mod.softmax_fwd(x, log)), nb, err=f"{err:.1e}")
                guard(grp, label, run)
        del x
        torch.cuda.empty_cache()


def sec_acc():
    from splitsoftmax.kernels import configs
    from splitsoftmax.kernels import softmax as K
    cfg = configs.SOFTMAX
    saved = dict(vars(cfg))
    x = torch.randn(400, 40000, device="cuda") * 4
    for log in (False, True):
        fn = torch.log_softmax if log else torch.softmax
        ref = fn(x.double(), -1)
        torch_err = (fn(x, -1).double() - ref).abs().max().item()
        for name, over in (("coop", {}), ("two_pass", dict(coop_max_chunks=0, split_rows_per_sm=0.0)),
                           ("split", dict(coop_max_chunks=0, split_rows_per_sm=1e9))):
            vars(cfg).update(saved)
            vars(cfg).update(over)
            err = (K.softmax_fwd(x, log)[0].double() - ref).abs().max().item()
            ROWS.append({"group": "acc", "name": name, "log": log, "err": err, "torch_err": torch_err})
            print(f"acc log={log} {name:9s} {K._plan(x).path:9s} err {err:.3e} torch {torch_err:.3e} "
                  f"ratio {err / torch_err:.2f}", flush=True)
    vars(cfg).update(saved)


def sec_causal():
    import splitsoftmax as ss
    from splitsoftmax.kernels import configs
    saved = (configs.ATTN_TMA, configs.ATTN_SHORT_CAUSAL_SQ)
    for S in (1024, 2048, 4096, 8192):
        q, k, v, flops = causal_case(S)
        grp = f"causal fwd S={S}"
        rec_flash_causal(grp, q, k, v, flops)
        for tma in (True, False):
            for short in (True, False):
                configs.ATTN_TMA, configs.ATTN_SHORT_CAUSAL_SQ = tma, (S if short else 0)
                name = f"{'tma' if tma else 'pointers'} {'64x64' if short else '128x128'}"
                with torch.no_grad():
                    guard(grp, name, lambda: rec(grp, name, bench(lambda: ss.attention(q, k, v, causal=True)),
                                                 flops=flops))
        configs.ATTN_TMA, configs.ATTN_SHORT_CAUSAL_SQ = saved
        del q, k, v
        torch.cuda.empty_cache()


def sec_short():
    import splitsoftmax as ss
    from splitsoftmax.kernels import configs
    key = ("fwd_causal_short", 2, 128)
    saved = configs.ATTN_TILES[key]
    import attn_tma_kernel as proto  # beside this file
    for S in (1024, 2048):
        q, k, v, flops = causal_case(S)
        grp = f"short causal S={S}"
        rec_flash_causal(grp, q, k, v, flops)
        with torch.no_grad():
            want = ss.attention(q, k, v, causal=True).float()
            for tile in ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (32, 64, 4, 3),
                         (64, 64, 8, 3), (128, 64, 8, 3), (64, 128, 4, 2)):
                configs.ATTN_TILES[key] = tile
                name = f"ss {tile}"

                def run(name=name):
                    diff = (ss.attention(q, k, v, causal=True).float() - want).abs().max().item()
                    rec(grp, name, bench(lambda: ss.attention(q, k, v, causal=True)), flops=flops, diff=diff)
                guard(grp, name, run)
            configs.ATTN_TILES[key] = saved
            guard(grp, "prototype tma (64, 64, 4, 3)", lambda: rec(
                grp, "prototype tma (64, 64, 4, 3)",
                bench(lambda: proto.attn_fwd_tma(q, k, v, True, 64, 64, 4, 3)), flops=flops))
        del q, k, v
        torch.cuda.empty_cache()


def sec_guard():
    from splitsoftmax.kernels import attention as A
    src = open("splitsoftmax/kernels/attention.py").read()
    old = "    if MASKED and CAUSAL:  # a NaN/Inf value"
    assert src.count(old) == 1
    with open("splitsoftmax/kernels/_probe_noguard.py", "w") as f:
        f.write(src.replace(old, "    if MASKED and CAUSAL and False:  # a NaN/Inf value"))
    ng = importlib.import_module("splitsoftmax.kernels._probe_noguard")
    import attn_tma_kernel as proto  # beside this file
    for S in (1024, 2048):
        q, k, v, flops = causal_case(S)
        grp = f"guard causal S={S}"
        for name, fn in (("as is", lambda: A.attn_fwd(q, k, v, 128 ** -0.5, True, out_dtype=q.dtype)),
                         ("no guard", lambda: ng.attn_fwd(q, k, v, 128 ** -0.5, True, out_dtype=q.dtype)),
                         ("prototype", lambda: proto.attn_fwd_tma(q, k, v, True, 64, 64, 4, 3))):
            guard(grp, name, lambda: rec(grp, name, bench(fn), flops=flops))
        del q, k, v


def sec_host():
    import triton
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import splitsoftmax as ss
    from splitsoftmax.kernels import configs
    mine = (configs.next_pow2, configs.cdiv)
    q, k, v = (torch.randn(32, 16, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qd = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    kd, vd = (torch.randn(1, 8, 131072, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(16384, 4096, device="cuda")
    cases = [("fwd S=1k causal", lambda: ss.attention(q, k, v, causal=True), 4 * 32 * 16 * 1024 ** 2 * 128 / 2, None),
             ("decode 128k", lambda: ss.attention(qd, kd, vd), None, 2 * kd.numel() * 2),
             ("logsumexp 16384x4096", lambda: ss.logsumexp(x), None, x.numel() * 4)]
    peers = [lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), lambda: torch.logsumexp(x, -1)]
    with torch.no_grad():
        for (name, fn, flops, nb), peer in zip(cases, peers):
            grp = f"host {name}"
            backend = SDPBackend.CUDNN_ATTENTION if name.startswith("decode") else SDPBackend.FLASH_ATTENTION
            with sdpa_kernel(backend):
                guard(grp, "peer", lambda: rec(grp, "peer", bench(peer), nb, flops))
            for tag, helpers in (("host helpers", mine), ("triton constexpr helpers", (triton.next_power_of_2,
                                                                                        triton.cdiv))):
                configs.next_pow2, configs.cdiv = helpers
                rec(grp, tag, bench(fn), nb, flops)
            configs.next_pow2, configs.cdiv = mine


SECTIONS = {"coop": sec_coop, "lse": sec_lse, "keepx": sec_keepx, "causal": sec_causal, "short": sec_short,
            "guard": sec_guard, "host": sec_host, "acc": sec_acc}

if __name__ == "__main__":
    run_sections(SECTIONS, sys.argv)
