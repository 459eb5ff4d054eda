"""``python -m splitsoftmax warmup``: compile the attention kernels of a model ahead of its first step.

A Triton kernel is compiled once for each set of its specialisations: the tile shapes (chosen by
length), whether the lengths fill whole tiles, the dtypes, the head dims and the mask flags. For
one ``(dtype, head dim, causal)`` the attention forward and backward compile at most one variant
per length bucket below; a first call at any other length of a compiled bucket compiles nothing:

- short (at most ``configs.ATTN_SHORT_CAUSAL_SQ`` queries) or long,
- whole tiles (the length a multiple of 128) or a partial last tile,
- self-attention (``Sq == Sk``) or decoding (one query).

Warmup runs one forward and backward at a length of every bucket, so the compiles happen before the
training or serving loop starts (Triton also keeps them in its on-disk cache for later processes).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

# one length of each bucket: (queries, keys); see the module docstring
BUCKETS = ((1024, 1024), (1000, 1000), (4096, 4096), (4100, 4100), (1, 4096), (1, 4100))


def compiled_variants() -> dict:
    """Compiled variants held by each Triton kernel of the package (``module.kernel`` -> count)."""
    import importlib
    import pkgutil

    import splitsoftmax.kernels as pkg
    from triton.runtime.jit import JITFunction
    sizes = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"splitsoftmax.kernels.{info.name}")
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction):
                sizes[f"{info.name}.{name}"] = sum(len(c[0]) for c in fn.device_caches.values())
    return sizes


def _runs(head_dim: int, dtype: torch.dtype, causal: tuple, heads: int, kv_heads: int):
    """``(label, fn)`` for every bucket and causal flag."""
    import splitsoftmax as ss
    for is_causal in causal:
        for sq, sk in BUCKETS:
            def run(sq=sq, sk=sk, is_causal=is_causal):
                q = torch.randn(1, heads, sq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                k, v = (torch.randn(1, kv_heads, sk, head_dim, device="cuda", dtype=dtype, requires_grad=True)
                        for _ in range(2))
                ss.attention(q, k, v, causal=is_causal).sum().backward()
            yield f"attention {'causal' if is_causal else 'full'} Sq={sq} Sk={sk}", run


def warm(head_dim: int, dtype: torch.dtype, causal: tuple, heads: int = 8, kv_heads: int = 8, out=sys.stdout) -> int:
    """Compile every bucket's kernels, printing one progress line per run; returns the run count."""
    runs = list(_runs(head_dim, dtype, causal, heads, kv_heads))
    for i, (label, fn) in enumerate(runs, 1):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        done = "#" * (20 * i // len(runs))
        print(f"[{done:<20s}] {i}/{len(runs)} {label}: {time.perf_counter() - t0:.1f} s", file=out, flush=True)
    return len(runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="splitsoftmax warmup", description=__doc__.split("\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--heads", type=int, default=8, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA when fewer than --heads)")
    ap.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("warmup compiles the CUDA kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    if args.heads % args.kv_heads:
        ap.error(f"--heads={args.heads} must be a multiple of --kv-heads={args.kv_heads}")
    causal = {"both": (True, False), "causal": (True,), "full": (False,)}[args.causal]
    warm(args.head_dim, getattr(torch, args.dtype), causal, args.heads, args.kv_heads)
    return 0
