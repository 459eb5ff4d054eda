"""Probe: where the dK/dV kernel's time goes at short rows, on one H200.

``PYTHONPATH=. python3 benchmarks/probes/bwd_kv_fixed_cost.py OUTDIR [line,causal]``

The warp-specialized dK/dV kernel (``attention_bwd_kv_ws``, bf16, D=128) alone, writing dS as the
backward does (``ds``) or not (``no-ds``: ``configs.ATTN_BWD_DS`` off), on fixed row statistics.
``line``: full visibility, ``Sk`` = 4096 keys, 64 heads, ``Sq`` = 64 .. 4096 queries, so every
program walks ``n = G * Sq / 64`` tiles; the time per program (``ms * SMs / programs``, one program
per SM) against ``n`` is a line ``F + n t``, fitted by least squares: ``t`` a tile's cost when the
pipeline is full, ``F`` what a program costs beyond its tiles (loads, the ramp, the stores).
``causal``: the rows of ``bench attention`` (B * S = 32k tokens, H=16) and 1 x 8k GQA 16/4, each
measured against ``sum over programs (F + n t) / SMs`` from the line: the rest is what the masked
tiles and the grid's tail cost.
"""
import sys

import torch

from helpers import ROWS, bench, rec, run_sections  # beside this file
from splitsoftmax.ops.attention import bwd_plain as P
from splitsoftmax.ops._triton import configs

D = 128
BN = configs.ATTN_TILES[("bwd_kv_ws", 2, D)][1]  # keys per program
BM = configs.ATTN_TILES[("bwd_kv_ws", 2, D)][0]  # queries per tile
LINES = {}  # ds setting -> (F, t) in us


def _inputs(b, h, hkv, sq, sk):
    """q, k, v, dout ``(B, H, S, D)`` bf16, lse, delta ``(B, H, Sq)`` float32 (finite, fixed)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(b, h, sq, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(b, hkv, sk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    lse = torch.full((b, h, sq), 8.0, device="cuda")
    return q, k, v, dout, lse, torch.zeros_like(lse)


def _kv_ms(ds, q, k, v, dout, lse, delta, causal):
    """ms of the dK/dV launch alone (the dQ launch dropped from the plan), dS written (one buffer,
    whatever its size) or not."""
    was = configs.ATTN_BWD_DS, configs.ATTN_BWD_DS_MAX_BYTES
    configs.ATTN_BWD_DS, configs.ATTN_BWD_DS_MAX_BYTES = ds, 40 << 30
    try:
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        run = P._launches(q, k, v, dout, lse, delta, *grads, D ** -0.5, causal, 0)
        assert run.gluon[0] and (run.ds is not None) == ds, run.gluon
        run = run._replace(q=None)
        return bench(lambda: P._run(run, q, k, v, dout, lse, delta, *grads))
    finally:
        configs.ATTN_BWD_DS, configs.ATTN_BWD_DS_MAX_BYTES = was


def _fit(points):
    """``(F, t)`` of the least-squares line through ``(n, us)`` points."""
    n = torch.tensor([p[0] for p in points], dtype=torch.float64)
    y = torch.tensor([p[1] for p in points], dtype=torch.float64)
    a = torch.stack((torch.ones_like(n), n), 1)
    f, t = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1).tolist()
    return f, t


def line():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sk, h = 4096, 64
    for ds in (True, False):
        tag = "ds" if ds else "no-ds"
        points = []
        for g, seqs in ((1, (64, 128, 256, 512, 1024, 2048, 4096)), (4, (64, 256, 1024))):
            for sq in seqs:
                ops = _inputs(1, h, h // g, sq, sk)
                programs = (sk // BN) * (h // g)
                ms = _kv_ms(ds, *ops, False)
                n = g * sq // BM
                us = ms * 1e3 * sms / programs
                points.append((n, us))
                rec("line", f"{tag} G={g} Sq={sq} n={n}", ms, flops=4 * 2 * h * sq * sk * D, us_per_program=us)
        LINES[tag] = _fit(points)
        f, t = LINES[tag]
        print(f"line {tag}: F = {f:.2f} us, t = {t:.3f} us per tile (F = {f / t:.1f} tiles)", flush=True)
        ROWS.append({"group": "fit", "name": tag, "F_us": f, "t_us": t})


def causal():
    if not LINES:
        line()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [(f"{s // 1024}k B={32768 // s} H=16", 32768 // s, 16, 16, s) for s in (1024, 2048, 4096, 8192)]
    rows.append(("1 x 8k GQA 16/4", 1, 16, 4, 8192))
    for label, b, h, hkv, s in rows:
        tiles = [(h // hkv) * (s - j * BN) // BM for j in range(s // BN)]  # per key block of a head
        for ds in (True, False):
            tag = "ds" if ds else "no-ds"
            f, t = LINES[tag]
            ms = _kv_ms(ds, *_inputs(b, h, hkv, s, s), True)
            model = b * hkv * sum(f + n * t for n in tiles) / sms / 1e3
            rec("causal", f"{tag} {label}", ms, flops=4 * 2 * b * h * s * (s + 1) / 2 * D, line_ms=model,
                over_line=ms / model)


if __name__ == "__main__":
    run_sections({"line": line, "causal": causal}, sys.argv)
