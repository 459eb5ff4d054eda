"""Probe of the backward kernels' repeatability on one H200: the same operands through the pair of
``attention_bwd_plain`` many times, every gradient buffer filled with NaN before each call.

``PYTHONPATH=. python3 benchmarks/probes/bwd_kv_repeat.py OUTDIR [rep]``: causal, bf16, D=128, the row
statistics (``lse``, ``delta``) computed once per shape; for each shape and each kernel choice of
``bwd_gluon_copies`` (this tree's, ``triton-pair``, the copies beside it) and ``kv-stages<N>`` (the
dK/dV tile with ``N`` Q/dO buffers): how many of ``CALLS`` calls give other dQ / dK / dV than the first
(bit for bit), NaNs left (rows no program wrote), the largest difference and where the differing
elements lie: their key blocks (of ``BLOCK_N`` rows) and each block's number of query tiles; the
first call's largest difference from the Triton pair's (the scale of a change of summation order).
``fb``: forward+backward TFLOP/s of ``ss.attention`` with each choice of ``FB`` (or of the environment's
``FB``, comma-separated) at the shapes users run, and each choice's gradients against the first's.

Backs the dK/dV tile's buffer count ``configs.ATTN_TILES[("bwd_kv_ws", 2, 128)]`` (repeatable gradients).
"""
import contextlib
import os
import sys
from collections import Counter

import torch

from bwd_gluon_copies import _kernels, kernel
from helpers import bench, copy_tags, rec, run_sections
from splitsoftmax.ops.attention import fwd as A
from splitsoftmax.ops.attention import bwd_plain as P
from splitsoftmax.ops._triton import configs

D = 128
CALLS = 200
KV_TILE = ("bwd_kv_ws", 2, D)
STAGES = ("kv-stages2", "kv-stages4")
Q_TILE = ("bwd_q_gluon", 2, D)
# the fb section's choices, or those listed (comma-separated) in the environment's FB
FB = tuple(os.environ["FB"].split(",")) if os.environ.get("FB") else (
    "tree", "kv-stages4", *(f"kv-{t}" for t in copy_tags("bwd_kv_ws")))


@contextlib.contextmanager
def choice(name):
    """``kernel(name)``, or this tree's kernels with ``kv-stages<N>``: ``N`` Q/dO buffers in the dK/dV
    kernel; ``dq-<BM>x<BN>x<warps>x<stages>``: that tile for the dQ kernel."""
    if name.startswith("kv-stages"):
        which, tile = KV_TILE, (*configs.ATTN_TILES[KV_TILE][:3], int(name[len("kv-stages"):]))
    elif name.startswith("dq-"):
        which, tile = Q_TILE, tuple(int(x) for x in name[3:].split("x"))
    else:
        with kernel(name):
            yield
        return
    saved = configs.ATTN_TILES[which]
    configs.ATTN_TILES[which] = tile
    try:
        yield
    finally:
        configs.ATTN_TILES[which] = saved


def _case(b, h, hkv, s, views):
    """Operands (B, H, S, D) (views of (B, S, H, D) tensors where ``views``), ``dout``, ``lse``, ``delta``."""
    def t(heads):
        x = torch.randn(b, s, heads, D, device="cuda", dtype=torch.bfloat16)
        return x.transpose(1, 2) if views else x.transpose(1, 2).contiguous()
    q, k, v, dout = t(h), t(hkv), t(hkv), t(h)
    o, lse = A.attn_fwd(q, k, v, D ** -0.5, True, out_dtype=q.dtype)
    return q, k, v, dout, lse, (dout.float() * o.float()).sum(-1)


def _grads(ops):
    """``(dq, dk, dv)`` float32 of one call, each buffer NaN before it."""
    q, k, v, dout, lse, delta = ops
    dq, dk, dv = (torch.full_like(x, float("nan"), dtype=torch.float32) for x in (q, k, v))
    P._run(P._launches(q, k, v, dout, lse, delta, dq, dk, dv, D ** -0.5, True, 0), q, k, v, dout, lse, delta,
           dq, dk, dv)
    return dq, dk, dv


def _where(a, b, bm, bn, sq, nb):
    """Key blocks (of ``bn`` rows) where ``a`` and ``b`` (B, H, S, D) differ: ``{block: elements}`` and
    ``{query tiles (of ``bm`` rows) of the block, causal, per query head: elements}``."""
    diff = (a != b).sum(dim=-1)  # (B, H, S)
    per_block = diff.reshape(*diff.shape[:2], nb, bn).sum(-1).sum((0, 1))
    blocks = {int(i): int(n) for i, n in enumerate(per_block.tolist()) if n}
    tiles = Counter()
    for i, n in blocks.items():
        tiles[(sq - i * bn + bm - 1) // bm] += n
    return blocks, dict(tiles)


def _repeat(group, name, ops):
    """``CALLS`` calls against the first: record the differences."""
    first = _grads(ops)
    torch.cuda.synchronize()
    nan = [int(x.isnan().sum()) for x in first]
    bm, bn = configs.ATTN_TILES[KV_TILE][:2]
    sq, nb = ops[0].shape[2], ops[1].shape[2] // bn
    differ, largest, blocks, tiles = [0, 0, 0], [0.0, 0.0, 0.0], Counter(), Counter()
    for _ in range(CALLS - 1):
        again = _grads(ops)
        for i, (a, b) in enumerate(zip(again, first)):
            if not torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)):
                differ[i] += 1
                largest[i] = max(largest[i], float((a - b).abs().nan_to_num(0.0).max()))
                if i:
                    bl, ti = _where(a, b, bm, bn, sq, nb)
                    blocks.update(bl)
                    tiles.update(ti)
    q = ops[0]
    flops = 2.5 * 4.0 * q.shape[0] * q.shape[1] * D * sq * (sq + 1) / 2  # (a backward: 2.5x the forward's)
    rec(group, name, bench(lambda: _grads(ops)), flops=flops, calls=CALLS, differ_q_k_v=differ, largest=largest,
        nan=nan, blocks=dict(sorted(blocks.items())[:40]), tiles=dict(sorted(tiles.items())))
    return first


def rep():
    cases = [("2k MHA views B=16", 16, 16, 16, 2048, True), ("2k MHA contiguous B=16", 16, 16, 16, 2048, False),
             ("1k MHA views B=32", 32, 16, 16, 1024, True), ("2k GQA 16/4 views B=16", 16, 16, 4, 2048, True)]
    for label, b, h, hkv, s, views in cases:
        torch.manual_seed(0)
        ops = _case(b, h, hkv, s, views)
        with choice("triton-pair"):
            pair = _grads(ops)
        for name in (*_kernels(), *STAGES):
            with choice(name):
                first = _repeat(label, name, ops)
            print(f"{label} {name}: first call against the Triton pair: "
                  f"{[float((a - b).abs().max()) for a, b in zip(first, pair)]}", flush=True)
        del ops, pair


def fb():
    import splitsoftmax as ss
    shapes = [("2k causal B=16 H=16", 16, 16, 16, 2048, True), ("4k causal B=8 H=16", 8, 16, 16, 4096, True),
              ("8k causal B=4 H=16 contiguous", 4, 16, 16, 8192, False),
              ("1 x 8k causal GQA 16/4", 1, 16, 4, 8192, True), ("1 x 8k causal GQA 32/8", 1, 32, 8, 8192, True)]
    for label, b, h, hkv, s, views in shapes:
        q, k, v, dout = _case(b, h, hkv, s, views)[:4]
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        flops = 3.5 * 4.0 * b * h * D * s * (s + 1) / 2

        def step():
            for t in leaves:
                t.grad = None
            ss.attention(*leaves, causal=True).backward(dout)
        grads = {}
        for name in FB:  # each choice's gradients against the first's (largest difference of dQ, dK, dV)
            with choice(name):
                step()
            grads[name] = [t.grad.float() for t in leaves]
            print(f"fb {label} {name}: gradients against {FB[0]}'s: "
                  f"{[float((a - b).abs().max()) for a, b in zip(grads[name], grads[FB[0]])]}", flush=True)
        del grads
        for _ in range(2):
            for name in FB:
                with choice(name):
                    rec("fb " + label, name, bench(step), flops=flops)


if __name__ == "__main__":
    run_sections({"rep": rep, "fb": fb}, sys.argv)
    print("\nsummary: calls giving other dQ/dK/dV than the first, of", CALLS)
    for r in __import__("helpers").ROWS:
        if "differ_q_k_v" in r:
            print(f"{r['group']:26s} {r['name']:16s} {str(r['differ_q_k_v']):12s} nan {str(r['nan']):12s} "
                  f"{r['ms']:.3f} ms tiles {r['tiles']}")
    print("\nforward+backward TFLOP/s")
    for r in __import__("helpers").ROWS:
        if r["group"].startswith("fb ") and "tflops" in r:
            print(f"{r['group']:36s} {r['name']:16s} {r['tflops']:6.0f}")
