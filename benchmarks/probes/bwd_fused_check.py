"""Probe: the fused five-product backward (``configs.ATTN_BWD_FUSED``) on one Hopper GPU, checked and
timed beside the pair and cuDNN in the same run.

``PYTHONPATH=$PWD python3 benchmarks/probes/bwd_fused_check.py --out $OUT``

bf16, D=128, rows ``B x H x S`` (query heads / kv heads): 1x16x2k, 16x16x2k, 1x16x8k, 1x16x32k and
1x32/8x8k (GQA), each causal and full. Per row:

- **check**: the gradients of the fused kernel and of the pair (``bwd.attn_bwd`` on the whole
  problem, its outputs allocated over memory filled with NaN just before) against float64 on batch
  element 0, kv head 0 and its query heads (float64 attention, query rows in chunks), by
  FlashAttention's rule: the error at most 2x that of torch's SDPA in bf16 (the flash backend, else
  the best available) on the same heads plus twice the error of rounding the float64 gradient to
  bf16; every gradient of the whole problem finite. ``lse`` and ``delta`` of the checked heads are
  the float64 ones (``delta`` from the output rounded to bf16), the others the library forward's.
- **time**: the backward call (``bwd.attn_bwd``, device time of CUDA events, median of reps after
  warm-up) with the fused kernel, with the pair, and cuDNN's (torch SDPA's cuDNN backend: the
  autograd backward of its output, which includes its ``dO . O`` pass and dQ cast; GQA through
  ``enable_gqa`` where the backend takes it, else K/V repeated); plus the library's whole autograd
  backward (``delta`` included) fused and pair.

Writes ``OUT/bwd_fused_check.json`` (every number, the device, the Triton version, the fused
kernel's masks) and prints a table last. TFLOP/s by FlashAttention's count (bwd = 2.5 x 4 B H S^2 D,
halved causal).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import splitsoftmax as ss
from splitsoftmax.core.mask import NO_MASK
from splitsoftmax.ops._triton import configs
from splitsoftmax.ops.attention import bwd as AB
from splitsoftmax.ops.attention import bwd_plain as ABP

D = 128
BF16 = torch.bfloat16
ROWS = [(1, 16, 16, 2048), (16, 16, 16, 2048), (1, 16, 16, 8192), (1, 16, 16, 32768), (1, 32, 8, 8192)]
# the fused kernel's visibilities here, whatever the shipped default allows (the probe times both)
FUSED_MASKS = frozenset({"full", "causal"})


def _reps(ms_guess: float) -> int:
    """Timed repetitions: about 1.5 s of device time per measurement, 5 to 30."""
    return max(5, min(30, int(1500 / max(ms_guess, 0.05))))


def timed(fn, reps=None) -> float:
    """Median device ms of ``fn`` over CUDA events, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if reps is None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        reps = _reps(a.elapsed_time(b))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return sorted(x.elapsed_time(y) for x, y in times)[reps // 2]


class Flags:
    """``configs.ATTN_BWD_FUSED`` (and the fused masks of this probe, at every size: no fewest
    programs per SM) on or off within a block."""

    def __init__(self, fused: bool):
        self.fused = fused

    def __enter__(self):
        self.was = configs.ATTN_BWD_FUSED, configs.ATTN_BWD_FUSED_MASKS, configs.ATTN_BWD_FUSED_MIN_WAVES
        configs.ATTN_BWD_FUSED = self.fused
        configs.ATTN_BWD_FUSED_MASKS = self.was[1] | FUSED_MASKS
        configs.ATTN_BWD_FUSED_MIN_WAVES = 0

    def __exit__(self, *exc):
        configs.ATTN_BWD_FUSED, configs.ATTN_BWD_FUSED_MASKS, configs.ATTN_BWD_FUSED_MIN_WAVES = self.was


def poison(nbytes: int) -> None:
    """Fill ``nbytes`` of the caching allocator's memory with NaN and free it: outputs allocated next
    that nothing writes read NaN."""
    t = torch.empty(nbytes // 4 + 1, dtype=torch.float32, device="cuda")
    t.fill_(float("nan"))
    del t


def oracle(q, k, v, dout, scale, causal, chunk=4096):
    """float64 ``(dq, dk, dv, lse, delta, out)`` of query heads ``q (G, S, D)`` over kv head ``k, v
    (S, D)`` (dk, dv summed over the heads), query rows in chunks; ``delta`` from ``out`` rounded to
    bf16 (what the kernels are given), the gradients from the exact one."""
    g, s, _ = q.shape
    q64, k64, v64, do64 = q.double(), k.double(), v.double(), dout.double()
    dq = torch.empty_like(q64)
    dk, dv = torch.zeros_like(k64), torch.zeros_like(v64)
    lse = torch.empty(g, s, dtype=torch.float64, device=q.device)
    delta = torch.empty(g, s, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q64)
    cols = torch.arange(s, device=q.device)
    for h in range(g):
        for r0 in range(0, s, chunk):
            r1 = min(s, r0 + chunk)
            sc = (q64[h, r0:r1] @ k64.T) * scale
            if causal:
                sc.masked_fill_(cols[None, :] > torch.arange(r0, r1, device=q.device)[:, None], float("-inf"))
            m = torch.logsumexp(sc, -1)
            p = torch.exp(sc - m[:, None])
            del sc
            o = p @ v64
            dp = do64[h, r0:r1] @ v64.T
            dexact = (do64[h, r0:r1] * o).sum(-1)
            ds = p * (dp - dexact[:, None])
            del dp
            dq[h, r0:r1] = (ds @ k64) * scale
            dk += (ds.T @ q64[h, r0:r1]) * scale
            dv += p.T @ do64[h, r0:r1]
            del ds, p
            lse[h, r0:r1] = m
            out[h, r0:r1] = o
            delta[h, r0:r1] = (dout[h, r0:r1].float() * o.to(BF16).float()).sum(-1)
    return dq, dk, dv, lse.float(), delta, out


def peer_grads(q, k, v, dout, scale, causal):
    """bf16 gradients of torch's SDPA (the flash backend where it runs, else efficient, else math) on
    ``q (1, G, S, D)``, ``k, v (1, 1, S, D)``; ``(grads, backend)``."""
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        try:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale, enable_gqa=True)
            out.backward(dout)
        except RuntimeError:
            continue
        return [t.grad for t in leaves], backend.name
    raise RuntimeError("no SDPA backend ran")


def err(x, ref) -> float:
    return (x.double() - ref).abs().max().item()


def check(q, k, v, dout, lse, delta, scale, causal, fused: bool) -> dict:
    """FlashAttention's rule on batch 0, kv head 0 (module docstring) for the fused kernel or the pair."""
    g = q.shape[1] // k.shape[1]
    sl = (q[0, :g], k[0, 0], v[0, 0], dout[0, :g])
    dq64, dk64, dv64, lse64, delta64, _ = oracle(*sl, scale, causal)
    lse, delta = lse.clone(), delta.clone()
    lse[0, :g], delta[0, :g] = lse64, delta64
    peer, backend = peer_grads(q[:1, :g], k[:1, :1], v[:1, :1], dout[:1, :g], scale, causal)
    with Flags(fused):
        if fused:
            assert ABP.fused(q, k, v, dout, causal, NO_MASK, None), "the fused kernel does not take this case"
        poison(3 * q.numel() * 4 + k.numel() * 8)
        got = AB.attn_bwd(q, k, v, dout, lse, delta, scale, causal, 0, out_dtype=BF16)
    torch.cuda.synchronize()
    res = {"peer": backend, "finite": all(bool(torch.isfinite(t).all()) for t in got)}
    ok = res["finite"]
    for name, full, p, w in zip("qkv", got, peer, (dq64, dk64, dv64)):
        mine = full[0, :g] if name == "q" else full[0, 0]
        p = p[0] if name == "q" else p[0, 0]
        atol = 2 * err(w.to(BF16), w)
        e, ep = err(mine, w), err(p, w)
        good = e <= 2 * ep + atol
        ok = ok and good
        res[f"d{name}"] = {"err": e, "peer_err": ep, "atol": atol / 2, "ok": good}
    res["ok"] = ok
    return res


def cudnn_bwd(q, k, v, dout, scale, causal):
    """``(fn, gqa)``: one autograd backward of SDPA's cuDNN output (graph kept), GQA by ``enable_gqa``
    or, where the backend refuses it, K/V repeated per query head ("repeat")."""
    g = q.shape[1] // k.shape[1]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    how = "native" if g == 1 else "enable_gqa"
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale, enable_gqa=g > 1)
    except RuntimeError:
        how = "repeat"
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(g, 1),
                                                 leaves[2].repeat_interleave(g, 1), is_causal=causal, scale=scale)
    return (lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)), how


def row(b, h, hkv, s, causal, results):
    name = f"{b}x{h}/{hkv}x{s // 1024}k {'causal' if causal else 'full'}"
    torch.manual_seed(0)
    q, dout = (torch.randn(b, h, s, D, device="cuda", dtype=BF16) for _ in range(2))
    k, v = (torch.randn(b, hkv, s, D, device="cuda", dtype=BF16) for _ in range(2))
    scale = 1 / math.sqrt(D)
    r = {"name": name, "b": b, "h": h, "hkv": hkv, "s": s, "causal": causal}
    flops = 2.5 * 4 * b * h * s * s * D / (2 if causal else 1)
    t0 = time.time()
    with torch.no_grad():
        out, lse = ss.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
        delta = (dout.float() * out.float()).sum(-1)
    for tag, fused in (("fused", True), ("pair", False)):
        try:
            r[f"check_{tag}"] = check(q, k, v, dout, lse, delta, scale, causal, fused)
        except Exception as e:  # noqa: BLE001  (recorded; the probe goes on)
            r[f"check_{tag}"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        torch.cuda.empty_cache()
    for tag, fused in (("fused", True), ("pair", False)):
        try:
            with Flags(fused):
                r[f"ms_{tag}"] = timed(lambda: AB.attn_bwd(q, k, v, dout, lse, delta, scale, causal, 0,
                                                           out_dtype=BF16))
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                o = ss.attention(*leaves, causal=causal, scale=scale)
                r[f"ms_{tag}_autograd"] = timed(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True))
                del o, leaves
        except Exception as e:  # noqa: BLE001
            r[f"error_{tag}"] = f"{type(e).__name__}: {str(e)[:400]}"
    try:
        fn, how = cudnn_bwd(q, k, v, dout, scale, causal)
        r["ms_cudnn"], r["cudnn_gqa"] = timed(fn), how
        del fn
    except Exception as e:  # noqa: BLE001
        r["error_cudnn"] = f"{type(e).__name__}: {str(e)[:400]}"
    for tag in ("fused", "pair", "cudnn", "fused_autograd", "pair_autograd"):
        if f"ms_{tag}" in r:
            r[f"tflops_{tag}"] = flops / r[f"ms_{tag}"] / 1e9
    r["wall_s"] = time.time() - t0
    results.append(r)
    print(f"{name}: {json.dumps({k: v for k, v in r.items() if k.startswith(('ms_', 'check_'))}, default=str)}",
          flush=True)
    del q, k, v, dout, out, lse, delta
    torch.cuda.empty_cache()


def table(results) -> str:
    head = (f"{'row':24s} {'fused ms':>9s} {'pair ms':>9s} {'cuDNN ms':>9s} {'fused/cuDNN':>11s} "
            f"{'fused/pair':>10s} {'TF/s fused':>10s} {'check fused':>11s} {'check pair':>10s}")
    lines = [head]
    for r in results:
        f, p, c = (r.get(f"ms_{t}") for t in ("fused", "pair", "cudnn"))
        fmt = lambda x: f"{x:9.3f}" if x else f"{'-':>9s}"  # noqa: E731
        ratio = lambda a, b: f"{b / a:.3f}x" if a and b else "-"  # noqa: E731  (speed of a over b)
        tf = r.get("tflops_fused")
        lines.append(f"{r['name']:24s} {fmt(f)} {fmt(p)} {fmt(c)} {ratio(f, c):>11s} {ratio(f, p):>10s} "
                     f"{(f'{tf:.0f}' if tf else '-'):>10s} {str(r['check_fused'].get('ok')):>11s} "
                     f"{str(r['check_pair'].get('ok')):>10s}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", default="", help="comma-separated row indices (default: all)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import triton
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "fused_masks": sorted(FUSED_MASKS | configs.ATTN_BWD_FUSED_MASKS),
            "tile": configs.ATTN_TILES[("bwd_fused", 2, D)]}
    results = []
    pick = [int(i) for i in args.rows.split(",")] if args.rows else range(len(ROWS))
    for i in pick:
        b, h, hkv, s = ROWS[i]
        for causal in (True, False):
            try:
                row(b, h, hkv, s, causal, results)
            except Exception as e:  # noqa: BLE001  (a row that fails is recorded, the rest go on)
                results.append({"name": f"{b}x{h}/{hkv}x{s} causal={causal}", "error": f"{type(e).__name__}: {e}",
                                "check_fused": {}, "check_pair": {}})
                print(results[-1], flush=True)
            with open(os.path.join(args.out, "bwd_fused_check.json"), "w") as f:
                json.dump({"meta": meta, "rows": results}, f, indent=1, default=str)
    print(json.dumps(meta))
    print("ratios: a/b = b's time over a's (above 1: a faster)")
    print(table(results))
    return 0 if all(r["check_fused"].get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
