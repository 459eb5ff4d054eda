"""Benchmark of attention: SDPA flash, SDPA cuDNN and FlexAttention beside ``ss.attention``.

``python -m splitsoftmax bench attention --out DIR`` runs, in one process and on one GPU:

- prefill, bf16, H=16, D=128, B*S = 32k tokens, S in 1k..32k, causal and not: forward and
  forward+backward TFLOP/s (fwd ``4*B*H*S*S*D``, halved when causal; fwd+bwd 3.5x that);
- decode, one query, GQA 32/8, D=128, bf16, 128k and 1M keys: GB/s of K+V read, called eagerly
  and replayed from a CUDA graph (the host's launch cost hidden, as decode loops run);
- the merge of 8 float32 partials (out 1x32x8192x128 each): GB/s of partials read + result written,
  fused kernel vs torch eager (lse weights, and the pairwise sigmoid form);
- the attention variants (documents, window, softcap, sinks) beside FlexAttention, and GQA at
  batch 1 contiguous and as ``(B, S, H, D)`` views beside cuDNN (``attention_variants``, forward;
  ``--no-variants`` leaves them out, ``--only-variants`` runs nothing else);
- batch 1, GQA 32/8 and 16/4, causal, S=8k, contiguous and as (B, H, S, D) views of (B, S, H, D)
  tensors: forward and forward+backward TFLOP/s (``--no-gqa`` leaves them out);
- optionally (``--sweep``) alternative tiles of each kernel first; the best of each is then used.

Every shape is checked before it is timed: on 128 sampled query rows the error of ss against a
float64 reference must be at most 2x SDPA-flash's (FlashAttention's rule); gradients are compared
with SDPA-flash's. Writes ``attention.json`` and ``attention.png`` to ``--out`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

import splitsoftmax as ss
from splitsoftmax.core import state
from splitsoftmax.ops.attention import fwd as A
from splitsoftmax.ops.attention import bwd as AB
from splitsoftmax.ops._triton import configs
from splitsoftmax.ops.attention import decode
from splitsoftmax.ops.merge import kernel as merge

from . import attention_variants, best_ms, graph_ms

TOKENS, HEADS, DIM = 32768, 16, 128
SEQS = [1024, 2048, 4096, 8192, 16384, 32768]
FLEX_SEQS = [2048, 8192, 32768]
DECODE_KEYS = [131072, 1048576]
# tile candidates (BLOCK_M, BLOCK_N, warps, stages) timed with --sweep (tuning data for configs.py)
SWEEP = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 128, 8, 2)],
    "bwd_kv": [(16, 128, 8, 3), (32, 128, 8, 2), (32, 64, 8, 3), (32, 128, 8, 3)],
    "bwd_q": [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 4)],
    "decode": [(16, 128, 4, 4), (16, 64, 4, 4), (16, 128, 4, 3), (16, 64, 4, 6), (16, 128, 8, 4)],
}


def _ms(fn, grad_to_none=None) -> float:
    return best_ms(fn, rep=200, grad_to_none=grad_to_none)


def _graph_ms(fn) -> float:
    return graph_ms(fn, rep=200)


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    return run


def _flex_fn(s: int, causal: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, s, s, device="cuda") if causal else None
    return lambda q, k, v, c: flex(q, k, v, block_mask=mask)


def peers():
    from torch.nn.attention import SDPBackend
    return {"ss": lambda q, k, v, c: ss.attention(q, k, v, causal=c),
            "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION), "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION)}


def sampled_error(out, q, k, v, causal, rows) -> float:
    """max |out - ref| on query ``rows``, ref = float64 attention of those rows over all keys."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q[:, :, rows].double() @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > rows[:, None], float("-inf"))
    ref = torch.softmax(s, -1) @ vv
    got = out[:, :, rows].double()
    return float("nan") if torch.isnan(got).any() else (got - ref).abs().max().item()


def prefill(seqs, flex_seqs) -> list[dict]:
    """Forward and forward+backward TFLOP/s of every method at every (S, causal)."""
    res = []
    for s in seqs:
        b = TOKENS // s
        for causal in (False, True):
            q, k, v = (torch.randn(b, HEADS, s, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            dout = torch.randn_like(q)
            flops = 4 * b * HEADS * s * s * DIM / (2 if causal else 1)
            rows = torch.linspace(0, s - 1, 128, device="cuda").long()
            methods = peers()
            if s in flex_seqs:
                try:
                    methods["flex"] = _flex_fn(s, causal)
                except Exception as e:  # noqa: BLE001 (FlexAttention may not build here)
                    print(f"flex unavailable: {e!r}"[:200], file=sys.stderr)
            rec = {"S": s, "B": b, "causal": causal}
            ref_err = {}
            for n, f in list(methods.items()):
                try:
                    with torch.no_grad():
                        ref_err[n] = sampled_error(f(q, k, v, causal), q, k, v, causal, rows)
                except Exception as e:  # noqa: BLE001 (a peer may not build here; ss must)
                    if n == "ss":
                        raise
                    rec[f"{n}_error"] = repr(e)[:200]
                    del methods[n]
            rec["err"] = ref_err
            rec["correct"] = ref_err["ss"] <= 2 * ref_err["sdpa_flash"]
            for n, f in methods.items():
                try:
                    with torch.no_grad():
                        rec[f"{n}_fwd"] = flops / _ms(lambda: f(q, k, v, causal)) / 1e9
                    if n == "flex":
                        continue
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    f(*leaves, causal).backward(dout)
                    if n in ("ss", "sdpa_flash"):
                        rec[f"{n}_grads"] = [t.grad.float() for t in leaves]
                    rec[f"{n}_fwdbwd"] = 3.5 * flops / _ms(lambda: f(*leaves, causal).backward(dout), leaves) / 1e9
                except Exception as e:  # noqa: BLE001 (a peer may refuse a shape; ss must not)
                    if n == "ss":
                        raise
                    rec[f"{n}_error"] = repr(e)[:200]
            rec["grad_rel_diff_vs_flash"] = max(((a - c).norm() / c.norm()).item() for a, c in
                                                zip(rec.pop("ss_grads"), rec.pop("sdpa_flash_grads")))
            res.append(rec)
            print(json.dumps({kk: (round(vv, 1) if isinstance(vv, float) else vv) for kk, vv in rec.items()
                              if kk != "err"}), flush=True)
            del q, k, v, dout
    return res


def decoding(keys_list) -> list[dict]:
    """GB/s of K+V for one query, GQA 32/8, D=128, bf16 (ss, SDPA flash, SDPA cuDNN)."""
    res = []
    for n in keys_list:
        q = torch.randn(1, 32, 1, DIM, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8, n, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gb = 2 * k.numel() * k.element_size() / 1e9
        rows = torch.zeros(1, dtype=torch.long, device="cuda")
        rec = {"keys": n, "nsplit": decode.plan(q, k, v, False, 0).nsplit, "err": {}}
        with torch.no_grad():
            for name, f in peers().items():
                try:
                    rec["err"][name] = sampled_error(f(q, k, v, False), q, k, v, False, rows)
                    rec[f"{name}_gbs"] = gb / _ms(lambda: f(q, k, v, False)) * 1e3
                except Exception as e:  # noqa: BLE001 (a backend may refuse GQA decode ...)
                    rec[f"{name}_error"] = repr(e)[:200]
                    if name == "ss":
                        raise
                    # ... then it reads K/V repeated to the 32 query heads (GB/s still of the 8-head K+V)
                    kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
                    rec["err"][name] = sampled_error(f(q, kr, vr, False), q, k, v, False, rows)
                    rec[f"{name}_gbs"] = gb / _ms(lambda: f(q, kr, vr, False)) * 1e3
                    rec[f"{name}_note"] = "K/V repeated to 32 heads (no GQA support)"
                    del kr, vr
            for name, f in peers().items():  # launch cost hidden: what the kernels themselves do
                kk, vv = (k, v) if f"{name}_note" not in rec else (k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))
                try:
                    rec[f"{name}_graph_gbs"] = gb / _graph_ms(lambda: f(q, kk, vv, False)) * 1e3
                except Exception as e:  # noqa: BLE001
                    rec[f"{name}_graph_error"] = repr(e)[:200]
                del kk, vv
        rec["correct"] = rec["err"]["ss"] <= 2 * rec["err"].get("sdpa_flash", float("inf"))
        res.append(rec)
        print(json.dumps(rec), flush=True)
    return res


def pairwise_merge(outs, lses):
    """What torch's context parallel does: fold partials in pairwise with sigmoid weights."""
    out, lse = outs[0].float(), lses[0].float()
    for i in range(1, outs.shape[0]):
        out = out - torch.sigmoid(lses[i] - lse).unsqueeze(-1) * (out - outs[i])
        lse = lse - F.logsigmoid(lse - lses[i])
    return out, lse


def merging() -> dict:
    """GB/s of the 8-partial merge (out fp32 1x32x8192x128 each)."""
    outs = torch.randn(8, 1, 32, 8192, DIM, device="cuda")
    lses = torch.randn(8, 1, 32, 8192, device="cuda") * 3
    gb = (outs.numel() + lses.numel() + outs[0].numel() + lses[0].numel()) * 4 / 1e9
    out, lse = merge.merge_out_lse(outs, lses)
    ro, rl = state.merge_out_lse(outs.double(), lses.double())
    rec = {"max_err": (out.double() - ro).abs().max().item(), "lse_err": (lse.double() - rl).abs().max().item()}
    rec["correct"] = rec["max_err"] < 1e-5 and rec["lse_err"] < 1e-5
    for name, f in (("ss", merge.merge_out_lse), ("torch_lse_weights", state.merge_out_lse),
                    ("torch_pairwise_sigmoid", pairwise_merge)):
        rec[f"{name}_gbs"] = gb / _ms(lambda: f(outs, lses)) * 1e3
    print(json.dumps(rec), flush=True)
    return rec


def _try_tile(res: list, rec: dict, fn) -> None:
    """Append ``rec`` with ``fn()``'s measurement (or the error: a tile may not fit) and print it."""
    try:
        rec.update(fn())
    except Exception as e:  # noqa: BLE001 (e.g. OutOfResources for a too-deep pipeline)
        rec["error"] = repr(e)[:160]
    res.append(rec)
    print(json.dumps(rec), flush=True)


def sweep() -> list[dict]:
    """TFLOP/s (ms for backward, GB/s for decode) of each candidate tile at S=8k (decode: 1M keys)."""
    res = []
    s, b, sc = 8192, TOKENS // 8192, DIM ** -0.5
    q, k, v = (torch.randn(b, HEADS, s, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda")
    for causal in (False, True):
        flops = 4 * b * HEADS * s * s * DIM / (2 if causal else 1)
        o, lse_ = A.attn_fwd(q, k, v, sc, causal, out_dtype=q.dtype)
        delta = (dout.float() * o.float()).sum(-1)
        for tile in SWEEP["fwd"]:
            p = decode.Plan(tile, False, 1, s)
            _try_tile(res, {"kind": "fwd", "tile": tile, "causal": causal}, lambda: {
                "tflops": flops / _ms(lambda: A.launch_fwd(q, k, v, out, lse, sc, causal, 0, p)) / 1e9})
        for kind in ("bwd_kv", "bwd_q"):
            saved = configs.ATTN_TILES[(kind, 2, 128)]
            for tile in SWEEP[kind]:
                configs.ATTN_TILES[(kind, 2, 128)] = tile
                _try_tile(res, {"kind": kind, "tile": tile, "causal": causal}, lambda: {
                    "ms": _ms(lambda: AB.attn_bwd(q, k, v, dout, lse_, delta, sc, causal))})
            configs.ATTN_TILES[(kind, 2, 128)] = saved
    del q, k, v, dout, out
    qd = torch.randn(1, 32, 1, DIM, device="cuda", dtype=torch.bfloat16)
    kd, vd = (torch.randn(1, 8, 1 << 20, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    saved = configs.ATTN_TILES[("decode", 2, 128)]
    for tile in SWEEP["decode"]:
        configs.ATTN_TILES[("decode", 2, 128)] = tile
        _try_tile(res, {"kind": "decode", "tile": tile}, lambda: {
            "gbs": 2 * kd.numel() * 2 / _ms(lambda: A.attn_fwd(qd, kd, vd, sc, False, out_dtype=qd.dtype)) / 1e6})
    configs.ATTN_TILES[("decode", 2, 128)] = saved
    for per_sm in (1, 2, 4, 8):
        configs.ATTN_SPLIT_PROGRAMS_PER_SM = per_sm
        _try_tile(res, {"kind": "split_per_sm", "tile": per_sm}, lambda: {
            "gbs": 2 * kd.numel() * 2 / _ms(lambda: A.attn_fwd(qd, kd, vd, sc, False, out_dtype=qd.dtype)) / 1e6})
    configs.ATTN_SPLIT_PROGRAMS_PER_SM = 2
    return res


def adopt_best(res: list[dict]) -> dict:
    """Set configs.ATTN_TILES (bf16, D=128) to the sweep's best tile of each kind; return them."""
    score = {"fwd": lambda r: r.get("tflops", 0.0), "bwd_kv": lambda r: -r.get("ms", math.inf),
             "bwd_q": lambda r: -r.get("ms", math.inf), "decode": lambda r: r.get("gbs", 0.0)}
    best = {}
    for kind, f in score.items():
        totals = {}
        for r in res:
            if r["kind"] == kind:
                totals[tuple(r["tile"])] = totals.get(tuple(r["tile"]), 0.0) + f(r)
        if totals:
            best[kind] = max(totals, key=totals.get)
            configs.ATTN_TILES[(kind, 2, 128)] = best[kind]
    splits = {r["tile"]: r["gbs"] for r in res if r["kind"] == "split_per_sm" and "gbs" in r}
    if splits:
        best["split_per_sm"] = configs.ATTN_SPLIT_PROGRAMS_PER_SM = max(splits, key=splits.get)
    print("tiles adopted:", json.dumps(best), flush=True)
    return best


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, (causal, phase) in zip(axes, [(False, "fwd"), (True, "fwd"), (False, "fwdbwd"), (True, "fwdbwd")]):
        rows = [r for r in result["prefill"] if r["causal"] == causal]
        for n in ("ss", "sdpa_flash", "sdpa_cudnn", "flex"):
            pts = [(r["S"], r[f"{n}_{phase}"]) for r in rows if f"{n}_{phase}" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{phase} {'causal' if causal else 'full'} (bf16, H=16, D=128)")
        ax.set_xlabel("S (B*S = 32k)")
        ax.set_ylabel("TFLOP/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(result: dict) -> str:
    lines = ["S     causal | ss fwd  flash  cudnn  flex  ss/flash | ss f+b  flash  cudnn  ss/flash | ok"]
    for r in result["prefill"]:
        lines.append(f"{r['S']:<5} {str(r['causal']):<6} | {r['ss_fwd']:6.0f} {r['sdpa_flash_fwd']:6.0f} "
                     f"{r.get('sdpa_cudnn_fwd', float('nan')):6.0f} {r.get('flex_fwd', float('nan')):5.0f} "
                     f"{r['ss_fwd'] / r['sdpa_flash_fwd']:8.2f} | {r['ss_fwdbwd']:6.0f} {r['sdpa_flash_fwdbwd']:6.0f} "
                     f"{r.get('sdpa_cudnn_fwdbwd', float('nan')):6.0f} {r['ss_fwdbwd'] / r['sdpa_flash_fwdbwd']:8.2f}"
                     f" | {r['correct']}")
    for r in result["decode"]:
        lines.append(f"decode {r['keys']:>8} keys (GB/s, eager | graph): ss {r.get('ss_gbs', 0):.0f} | "
                     f"{r.get('ss_graph_gbs', 0):.0f}  flash {r.get('sdpa_flash_gbs', 0):.0f} | "
                     f"{r.get('sdpa_flash_graph_gbs', 0):.0f}  cudnn {r.get('sdpa_cudnn_gbs', 0):.0f} | "
                     f"{r.get('sdpa_cudnn_graph_gbs', 0):.0f}  splits {r['nsplit']}  ok {r['correct']}")
    m = result["merge"]
    lines.append(f"merge 8 partials (GB/s): ss {m['ss_gbs']:.0f}  torch lse-weights {m['torch_lse_weights_gbs']:.0f}"
                 f"  torch pairwise {m['torch_pairwise_sigmoid_gbs']:.0f}  ok {m['correct']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from .attention_gqa import gqa_rows, gqa_table
    ap = argparse.ArgumentParser(prog="splitsoftmax bench attention", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="directory for attention.json / attention.png")
    ap.add_argument("--seqs", type=int, nargs="*", default=SEQS)
    ap.add_argument("--decode-keys", type=int, nargs="*", default=DECODE_KEYS)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-variants", action="store_true", help="leave out the variant and GQA-layout rows")
    ap.add_argument("--only-variants", action="store_true", help="run the variant and GQA-layout rows only")
    ap.add_argument("--no-gqa", dest="gqa", action="store_false",
                    help="leave out the batch-1 GQA rows (32/8, 16/4 at 8k, both layouts)")
    ap.add_argument("--sweep", action="store_true",
                    help="first time alternative tiles (bf16, D=128) and run the rest with the best of each")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import triton
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "argv": sys.argv}
    if args.sweep:
        result["sweep"] = sweep()
        result["tiles_adopted"] = adopt_best(result["sweep"])
    result["tiles"] = {f"{kd}/{sz}/{hd}": t for (kd, sz, hd), t in configs.ATTN_TILES.items() if (sz, hd) == (2, 128)}
    result["split_programs_per_sm"] = configs.ATTN_SPLIT_PROGRAMS_PER_SM
    rows = []
    if not args.no_variants:
        result["variants"], result["layouts"] = attention_variants.variant_rows(), attention_variants.layout_rows()
        rows = result["variants"] + result["layouts"]
    if args.only_variants:
        with open(os.path.join(args.out, "attention.json"), "w") as f:
            json.dump(result, f, indent=1)
        print("\n".join(attention_variants.table_lines(result["variants"], result["layouts"])))
        return 0 if all(r["correct"] for r in rows) else 1
    result["merge"] = merging()
    result["decode"] = decoding(args.decode_keys)
    result["prefill"] = prefill(args.seqs, [] if args.no_flex else FLEX_SEQS)
    result["gqa"] = gqa_rows(peers, sampled_error) if args.gqa else []
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "attention.png"))
    print(table(result))
    if rows:
        print("\n".join(attention_variants.table_lines(result["variants"], result["layouts"])))
    print("\n".join(gqa_table(result["gqa"])))
    ok = all(r["correct"] for r in result["prefill"] + result["decode"] + result["gqa"] + rows)
    ok = ok and result["merge"]["correct"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
