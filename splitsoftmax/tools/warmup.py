"""``python -m splitsoftmax warmup``: compile the attention kernels of a model ahead of its first step.

A Triton kernel compiles once per set of specialisations: its constexprs (tiles, flags), and of its
other arguments the dtypes, the 16-byte alignment of pointers and, for integers, being 1 or a
multiple of 16. For one model (dtype, head dim, heads, kv heads, layout) and batch size, a plain
``ss.attention`` forward and backward (no variant keywords) depends on the lengths only through
its **bucket**, worked out on the host by the planners (:func:`bucket`):

- the forward's tile (``decode.plan``): causal over at most ``configs.ATTN_SHORT_CAUSAL_SQ``
  queries or more, decoding (at most ``configs.ATTN_PACK_MAX_SQ`` queries) or not, and a decode
  split's pipeline depth (at most ``configs.ATTN_SHORT_SPLIT_TILES`` key tiles per split or more);
- whole tiles (``Sq``, ``Sk`` multiples of the tile: 2-D TMA row views) or a partial last tile;
- on sm_90 in bfloat16, the Gluon forward (``ops.attention.fwd.gluon_fwd_length``) or the Triton one;
- one key split or several (split-KV: fewer than ``configs.ATTN_SPLIT_PROGRAMS_PER_SM`` programs
  per SM otherwise, which depends on batch x heads x query blocks), and then the merge kernel
  (``merge.merge_plan``: row-tiled, or all parts at once in ``BLOCK_P`` = the split count rounded
  up to a power of two, at least ``configs.MERGE_PARTS_MIN_BLOCK``: one for every prefill, one per
  power of two of the split count for decoding);
- which strides proportional to a length are multiples of 16: of the tensors (``Sq`` times the head
  dim, times ``H`` times it, ``Sk`` times it, ...; the row statistics' strides are not specialised);
  whether the sizes fit int32; and the backward prologue's rows per program (``attn_prep``: up to
  ``configs.ATTN_PREP_TILE_ELEMS`` elements, fewer rows only for short lengths).

Warmup plans every self-attention length ``Sq = Sk`` from ``MIN_LEN`` to ``--max-len`` and every
decode length (``Sq = 1``, ``Sk`` from 1 to ``--max-len``) at ``--batch``, then runs one forward and
backward at the shortest length of each bucket it found (a few dozen), so that the compiles happen
before the training or serving loop starts; Triton also keeps them in its on-disk cache for later
processes. A first call at any other length of a compiled bucket compiles nothing
(tests/test_gpu_host.py on the GPU, tests/test_warmup.py on the CPU with the launches recorded).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

MIN_LEN = 64  # shortest self-attention length planned (shorter ones: decoding, or rare)
MAX_LEN = 16384
LAYOUTS = ("bhsd", "bshd")  # q/k/v as contiguous (B, H, S, D), or (B, H, S, D) views of (B, S, H, D)


def compiled_variants() -> dict:
    """Compiled variants held by each Triton kernel of the package (``module.kernel`` -> count)."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    from .. import ops
    sizes = {}
    for info in pkgutil.walk_packages(ops.__path__, "splitsoftmax.ops."):
        if info.ispkg:
            continue
        mod = importlib.import_module(info.name)
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and fn.__module__ == info.name:
                sizes[f"{info.name[len('splitsoftmax.ops.'):]}.{name}"] = sum(len(c[0]) for c in fn.device_caches.values())
    return sizes


def _shaped(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """A tensor of ``shape`` on ``like``'s device and dtype holding no memory (the planners read shapes)."""
    return like.expand(shape)


def bucket(b: int, h: int, hkv: int, sq: int, sk: int, d: int, causal: bool, like: torch.Tensor) -> tuple:
    """What fixes the compiled kernels of ``ss.attention`` over ``q (b, h, sq, d)``, ``k, v (b, hkv,
    sk, d)`` of ``like``'s dtype and device, and its backward (see the module docstring)."""
    from ..ops._triton import configs
    from ..ops._triton import device
    from ..ops.attention import decode
    from ..ops.merge import kernel as merge
    from ..ops.attention.fwd import gluon_fwd_length
    from ..ops.attention.bwd import splits
    from ..ops._triton.launch import fits_int32
    q, k = _shaped(like, b, h, sq, d), _shaped(like, b, hkv, sk, d)
    p = decode.plan(q, k, k, causal, 0)
    bm, bn = p.tile[:2]
    merged = None
    if p.nsplit > 1:
        kind, _, kwargs = merge.merge_plan(p.nsplit, b * h * sq, d, device.sm_count(q),
                                           configs.MERGE_PDL and device.hopper(q))
        merged = kind, tuple(kwargs.items())
    bwd_split = configs.ATTN_BWD_ATOMIC and splits(q, k, decode.attn_tile("bwd", q.dtype, d, d)) != (1, 1)
    prep_rows = min(configs.next_pow2(sq), configs.ATTN_PREP_TILE_ELEMS // configs.next_pow2(d))  # attn_prep's tile
    # the strides proportional to a length, of the tensors (the row statistics' are not specialised)
    strides = (*(sq * c % 16 == 0 for c in (d, h * d, b * h * d)),
               *(sk * c % 16 == 0 for c in (d, hkv * d, b * hkv * d)))
    # the Gluon forward on sm_90 (ops.attention.fwd._gluon_fwd_tile) at its lengths
    gluon = (gluon_fwd_length(sq, causal) and p.nsplit == 1 and not p.pack and like.dtype == torch.bfloat16
             and device.sm90(like))
    return (causal, p.tile, p.pack, sq % bm == 0 and sk % bn == 0, p.nsplit > 1, merged, bwd_split, prep_rows,
            strides, fits_int32(b * h * sq * d * p.nsplit, b * hkv * sk * d), gluon)


def buckets(head_dim: int, dtype: torch.dtype, causal: tuple, heads: int = 8, kv_heads: int = 8, batch: int = 1,
            max_len: int = MAX_LEN, device="cuda") -> list:
    """``(Sq, Sk, causal)``: the shortest self-attention (``Sq = Sk`` in ``[MIN_LEN, max_len]``) and
    decode (``Sq = 1``, ``Sk <= max_len``) lengths of each :func:`bucket`, in the order found."""
    like = torch.empty((), dtype=dtype, device=device)
    found = {}
    for is_causal in causal:
        for sq, sk in [(s, s) for s in range(MIN_LEN, max_len + 1)] + [(1, s) for s in range(1, max_len + 1)]:
            key = bucket(batch, heads, kv_heads, sq, sk, head_dim, is_causal, like)
            found.setdefault(key, (sq, sk, is_causal))
    return list(found.values())


def run(sq: int, sk: int, causal: bool, head_dim: int, dtype: torch.dtype, heads: int = 8, kv_heads: int = 8,
        batch: int = 1, layout: str = "bhsd", device="cuda") -> None:
    """One ``ss.attention`` forward and backward at these sizes, inputs laid out as ``layout``."""
    import splitsoftmax as ss

    def leaf(h, s):
        if layout == "bshd":
            x = torch.randn(batch, s, h, head_dim, device=device, dtype=dtype).transpose(1, 2)
        else:
            x = torch.randn(batch, h, s, head_dim, device=device, dtype=dtype)
        return x.requires_grad_()

    q, k, v = leaf(heads, sq), leaf(kv_heads, sk), leaf(kv_heads, sk)
    ss.attention(q, k, v, causal=causal).sum().backward()


def warm(head_dim: int, dtype: torch.dtype, causal: tuple, heads: int = 8, kv_heads: int = 8, out=sys.stdout,
         batch: int = 1, max_len: int = MAX_LEN, layout: str = "bhsd") -> int:
    """Compile every bucket's kernels (CUDA), printing one progress line per run; returns the run count."""
    cases = buckets(head_dim, dtype, causal, heads, kv_heads, batch, max_len)
    for i, (sq, sk, is_causal) in enumerate(cases, 1):
        t0 = time.perf_counter()
        run(sq, sk, is_causal, head_dim, dtype, heads, kv_heads, batch, layout)
        torch.cuda.synchronize()
        done = "#" * (20 * i // len(cases))
        label = f"attention {'causal' if is_causal else 'full'} Sq={sq} Sk={sk}"
        print(f"[{done:<20s}] {i}/{len(cases)} {label}: {time.perf_counter() - t0:.1f} s", file=out, flush=True)
    return len(cases)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="splitsoftmax warmup", description=__doc__.split("\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--heads", type=int, default=8, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA when fewer than --heads)")
    ap.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    ap.add_argument("--batch", type=int, default=1, help="batch size (the key split depends on it)")
    ap.add_argument("--max-len", type=int, default=MAX_LEN, help="longest sequence (and decode key) length")
    ap.add_argument("--layout", choices=LAYOUTS, default="bhsd",
                    help="bhsd: contiguous (B, H, S, D); bshd: (B, H, S, D) views of (B, S, H, D), as Hugging Face")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("warmup compiles the CUDA kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    if args.heads % args.kv_heads:
        ap.error(f"--heads={args.heads} must be a multiple of --kv-heads={args.kv_heads}")
    if args.batch < 1 or args.max_len < 1:
        ap.error(f"--batch={args.batch} and --max-len={args.max_len} must be positive")
    causal = {"both": (True, False), "causal": (True,), "full": (False,)}[args.causal]
    warm(args.head_dim, getattr(torch, args.dtype), causal, args.heads, args.kv_heads, batch=args.batch,
         max_len=args.max_len, layout=args.layout)
    return 0
