"""Probe (tuning data): the attention backward's paths against the kernels they replace and the peers.

    PYTHONPATH=. python3 benchmarks/probes/attn_bwd_paths.py OUT_DIR [PREV_MODULE]

``PREV_MODULE`` (e.g. ``splitsoftmax.ops.attention._prev_fwd``): a copy of the module that held the
backward before, timed beside. One GPU, bf16, D=128. First a few tiles of the five-product kernel
(with and without the Q/dO guard of its masked tiles) at two shapes, the best kept; then per shape:
backward alone (``attn_bwd`` given ``lse``, ``delta``; ms) of the old pair, the new atomic path and
the new deterministic path, and forward+backward TFLOP/s (3.5x the forward's FLOPs) of
``ss.attention`` beside SDPA flash and cuDNN. Each new result is checked against SDPA flash's
gradients. Prints a table last; writes ``bwd_paths.json``.

Backs ``configs.ATTN_BWD_ATOMIC`` (off) and the five-product tiles ``configs.ATTN_TILES[("bwd", 2, D)]``.
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

import splitsoftmax as ss
from splitsoftmax.ops.attention import fwd as A
from splitsoftmax.ops.attention import bwd as AB
from splitsoftmax.ops._triton import configs

T0 = time.time()
BUDGET_S = 250


def ms(fn, grad_to_none=None):
    return min(do_bench(fn, warmup=20, rep=80, grad_to_none=grad_to_none, return_mode="median") for _ in range(2))


def make(b, h, hkv, s, bshd):
    if bshd:
        q, do = (torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        k, v = (torch.randn(b, s, hkv, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    else:
        q, do = (torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(b, hkv, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, do


def stats(q, k, v, do, causal):
    out, lse = A.attn_fwd(q, k, v, 128 ** -0.5, causal, out_dtype=torch.bfloat16)
    return lse, (do.float() * out.float()).sum(-1)


def bwd_ms(fn, q, k, v, do, lse, delta, causal, det=False):
    torch.use_deterministic_algorithms(det, warn_only=True)
    try:
        return ms(lambda: fn(q, k, v, do, lse, delta, 128 ** -0.5, causal))
    finally:
        torch.use_deterministic_algorithms(False)


def sdpa(backend):
    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    return run


def fwdbwd_tflops(fn, q, k, v, do, causal, flops):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    return 3.5 * flops / ms(lambda: fn(*leaves, causal).backward(do), leaves) / 1e9


def grad_diff(q, k, v, do, causal):
    """max over q, k, v of |ss grad - flash grad| / |flash grad| (Frobenius)."""
    got, ref = [], []
    flash = sdpa(SDPBackend.FLASH_ATTENTION)
    methods = ((lambda a, b, c: ss.attention(a, b, c, causal=causal), got), (lambda a, b, c: flash(a, b, c, causal), ref))
    for fn, dst in methods:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward(do)
        dst.extend(t.grad.float() for t in leaves)
    return max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref))


def sweep(res):
    tiles = [((32, 128, 8, 2), True), ((32, 128, 8, 2), False), ((64, 128, 8, 2), False), ((32, 128, 8, 3), False)]
    best = {}
    for b, h, hkv, s, causal in ((4, 16, 16, 8192, True), (1, 16, 4, 8192, True)):
        q, k, v, do = make(b, h, hkv, s, False)
        lse, delta = stats(q, k, v, do, causal)
        for tile, guard in tiles:
            configs.ATTN_TILES[("bwd", 2, 128)], configs.ATTN_BWD_GUARD = tile, guard
            try:
                t = bwd_ms(AB.attn_bwd, q, k, v, do, lse, delta, causal)
            except Exception as e:  # noqa: BLE001 (a tile may not fit)
                t = float("inf")
                print("tile failed", tile, repr(e)[:200], flush=True)
            best[(tile, guard)] = best.get((tile, guard), 0.0) + t
            res.append({"kind": "tile", "shape": [b, h, hkv, s, causal], "tile": tile, "guard": guard, "ms": t})
            print(json.dumps(res[-1]), flush=True)
        del q, k, v, do
    (tile, guard) = min(best, key=best.get)
    configs.ATTN_TILES[("bwd", 2, 128)], configs.ATTN_BWD_GUARD = tile, guard
    print("adopted", tile, "guard", guard, flush=True)
    return tile, guard


SHAPES = [  # b, h, hkv, s, causal, bshd
    (1, 16, 4, 8192, True, False), (1, 32, 8, 8192, True, False), (1, 32, 8, 8192, True, True),
    (4, 16, 16, 8192, True, False), (4, 16, 16, 8192, False, False), (16, 16, 16, 2048, True, False),
    (16, 16, 16, 2048, False, False), (1, 16, 16, 32768, True, False), (4, 16, 4, 2048, True, True),
]


def main():
    out_dir = sys.argv[1]
    prev = importlib.import_module(sys.argv[2]) if len(sys.argv) > 2 else None
    import triton
    res = [{"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cudnn": torch.backends.cudnn.version()}]
    tile, guard = sweep(res)
    rows = []
    for b, h, hkv, s, causal, bshd in SHAPES:
        if time.time() - T0 > BUDGET_S:
            print("time budget reached: shapes left out from", (b, h, hkv, s, causal, bshd), flush=True)
            break
        q, k, v, do = make(b, h, hkv, s, bshd)
        lse, delta = stats(q, k, v, do, causal)
        flops = 4 * b * h * s * s * 128 / (2 if causal else 1)
        r = {"shape": [b, h, hkv, s, causal, bshd], "splits": AB.splits(q, k, tile)}
        if prev is not None:
            r["old_bwd_ms"] = bwd_ms(prev.attn_bwd, q, k, v, do, lse, delta, causal)
        r["new_bwd_ms"] = bwd_ms(AB.attn_bwd, q, k, v, do, lse, delta, causal)
        r["det_bwd_ms"] = bwd_ms(AB.attn_bwd, q, k, v, do, lse, delta, causal, det=True)
        for name, fn in (("ss", lambda a, b_, c, cz: ss.attention(a, b_, c, causal=cz)),
                         ("flash", sdpa(SDPBackend.FLASH_ATTENTION)), ("cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))):
            try:
                r[f"{name}_fwdbwd"] = fwdbwd_tflops(fn, q, k, v, do, causal, flops)
            except Exception as e:  # noqa: BLE001 (a peer may refuse a shape)
                r[f"{name}_error"] = repr(e)[:200]
        r["grad_rel_diff_vs_flash"] = grad_diff(q, k, v, do, causal)
        rows.append(r)
        print(json.dumps(r), flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    res.append({"rows": rows, "tile": tile, "guard": guard})
    with open(os.path.join(out_dir, "bwd_paths.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("b h hkv s causal bshd | splits | old bwd ms | new bwd ms | det bwd ms | ss f+b | flash f+b | cudnn f+b | "
          "ss/cudnn | graddiff")
    for r in rows:
        sh = " ".join(str(int(x)) for x in r["shape"])
        print(f"{sh} | {r['splits']} | {r.get('old_bwd_ms', float('nan')):.3f} | {r['new_bwd_ms']:.3f} | "
              f"{r['det_bwd_ms']:.3f} | {r.get('ss_fwdbwd', 0):.0f} | {r.get('flash_fwdbwd', 0):.0f} | "
              f"{r.get('cudnn_fwdbwd', 0):.0f} | {r.get('ss_fwdbwd', 0) / max(r.get('cudnn_fwdbwd', 1), 1):.2f} | "
              f"{r['grad_rel_diff_vs_flash']:.1e}")
    print(f"elapsed {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
