"""Probe (tuning data, not part of the library): session 7's attention forward questions, one GPU.

    PYTHONPATH=. python3 launch/probes/session7.py OUTDIR [SECTIONS]

SECTIONS (comma-separated, default all):
- tma: S = 1k / 2k / 4k causal forward (B*S = 32k, H=16, D=128, bf16) through the public call, with
  the output stored through a TMA descriptor or through pointers (``configs.ATTN_TMA_STORE``) and
  with ``(B * H * S, D)`` row-view descriptors or ``(B, H, S, D)`` ones (``configs.ATTN_TMA_ROWS``),
  beside SDPA flash, the same call replayed from a CUDA graph (no host cost), the launcher
  ``kernels.attention.attn_fwd``, a copy without the NaN guard of the diagonal tiles, and the TMA
  prototype (``attn_tma_kernel.py``, beside this file);
- tiles: S = 4k / 8k / 1k causal forward through the public call under tiles (block sizes, warps,
  stages) given to every causal S up to that one (``configs.ATTN_SHORT_CAUSAL_SQ``), beside SDPA
  flash;
- variants: S = 1k / 2k / 4k causal forward through the launcher ``kernels.attention.attn_fwd``, as
  it is, in a copy patched (``PATCHES``) without the NaN guard, and (where ``kernels/_probe_prev.py``
  is present, git-ignored: pass it in the device call's ``carry``) an earlier form of the module, in
  two rounds, beside SDPA flash and the prototype;
- decode: one query, GQA 32/8, D=128, bf16, 128k and 1M keys through the public call, eager and
  replayed from a CUDA graph, with the split-KV merge launched under programmatic dependent launch
  or not (``configs.MERGE_PDL``), in two rounds, beside SDPA cuDNN. (Host time per decode call:
  ``session5.py host``.)
Writes OUTDIR/probe.json.
"""
import importlib
import os
import sys

import torch

# the probe helpers, beside this file
from session4 import bench, causal_case, guard, rec, rec_flash_causal, run_sections

SEQS = (1024, 2048, 4096)
LAYOUTS = {"store rows": (True, True), "pointer-store heads": (False, False)}


# name -> (old, new) text patches of kernels/attention.py
PATCHES = {"noguard": [("    if CAUSAL:  # a NaN/Inf value", "    if CAUSAL and False:  # a NaN/Inf value")]}


def _patched(*names):
    """A copy of the attention module with the named text patches (timing only)."""
    src = open("splitsoftmax/kernels/attention.py").read()
    for name in names:
        for old, new in PATCHES[name]:
            assert src.count(old) == 1, (name, old)
            src = src.replace(old, new)
    mod = "_probe_" + "_".join(names)
    with open(f"splitsoftmax/kernels/{mod}.py", "w") as f:
        f.write(src)
    return importlib.import_module(f"splitsoftmax.kernels.{mod}")


def _noguard():
    return _patched("noguard")


def sec_tma():
    import splitsoftmax as ss
    from splitsoftmax.bench import graph_ms
    from splitsoftmax.kernels import attention as A
    from splitsoftmax.kernels import configs
    import attn_tma_kernel as proto  # beside this file
    ng = _noguard()
    saved = (configs.ATTN_TMA_STORE, configs.ATTN_TMA_ROWS)
    for S in SEQS:
        q, k, v, flops = causal_case(S)
        grp = f"causal fwd S={S}"
        with torch.no_grad():
            want = ss.attention(q, k, v, causal=True)
            for rnd in (1,):
                rec_flash_causal(grp, q, k, v, flops, f"sdpa flash r{rnd}")
                for name, (store, rows) in LAYOUTS.items():
                    configs.ATTN_TMA_STORE, configs.ATTN_TMA_ROWS = store, rows

                    def run(name=name, rnd=rnd):
                        same = torch.equal(ss.attention(q, k, v, causal=True), want)
                        rec(grp, f"ss {name} r{rnd}", bench(lambda: ss.attention(q, k, v, causal=True)),
                            flops=flops, same=same)
                    guard(grp, name, run)
                configs.ATTN_TMA_STORE, configs.ATTN_TMA_ROWS = saved
            guard(grp, "graph", lambda: rec(grp, "ss graph replay", graph_ms(
                lambda: ss.attention(q, k, v, causal=True)), flops=flops))
            guard(grp, "launcher", lambda: rec(grp, "launcher attn_fwd", bench(
                lambda: A.attn_fwd(q, k, v, 128 ** -0.5, True, out_dtype=q.dtype)), flops=flops))
            guard(grp, "no guard", lambda: rec(grp, "launcher without NaN guard", bench(
                lambda: ng.attn_fwd(q, k, v, 128 ** -0.5, True, out_dtype=q.dtype)), flops=flops))
            guard(grp, "prototype", lambda: rec(grp, "prototype tma (64, 64, 4, 3)", bench(
                lambda: proto.attn_fwd_tma(q, k, v, True, 64, 64, 4, 3)), flops=flops))


def sec_tiles():
    import splitsoftmax as ss
    from splitsoftmax.kernels import configs
    saved = configs.ATTN_SHORT_CAUSAL_SQ, dict(configs.ATTN_TILES)
    key = ("fwd_causal_short", 2, 128)
    for S in (4096, 8192, 1024):
        q, k, v, flops = causal_case(S)
        grp = f"tiles causal S={S}"
        rec_flash_causal(grp, q, k, v, flops)
        with torch.no_grad():
            want = ss.attention(q, k, v, causal=True).float()
            for tile in ((64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 4, 2), (128, 64, 4, 3)):
                configs.ATTN_SHORT_CAUSAL_SQ = S
                configs.ATTN_TILES[key] = tile

                def run(tile=tile):
                    diff = (ss.attention(q, k, v, causal=True).float() - want).abs().max().item()
                    rec(grp, f"ss {tile}", bench(lambda: ss.attention(q, k, v, causal=True)), flops=flops, diff=diff)
                guard(grp, str(tile), run)
            configs.ATTN_SHORT_CAUSAL_SQ = saved[0]
            configs.ATTN_TILES.update(saved[1])  # the same dict: kernels.decode holds it too


def sec_variants():
    from splitsoftmax.kernels import attention as A
    import attn_tma_kernel as proto  # beside this file
    mods = {"as is": A, "noguard": _noguard()}
    if os.path.exists("splitsoftmax/kernels/_probe_prev.py"):
        mods["previous"] = importlib.import_module("splitsoftmax.kernels._probe_prev")
    for S in (1024, 2048, 4096):
        q, k, v, flops = causal_case(S)
        grp = f"variants causal S={S}"
        with torch.no_grad():
            want = A.attn_fwd(q, k, v, 128 ** -0.5, True, out_dtype=q.dtype)
            for rnd in (1, 2):
                rec_flash_causal(grp, q, k, v, flops, f"sdpa flash r{rnd}")
                for name, mod in mods.items():
                    def run(name=name, mod=mod, rnd=rnd):
                        fn = lambda: mod.attn_fwd(q, k, v, 128 ** -0.5, True, out_dtype=q.dtype)  # noqa: E731
                        same = torch.equal(fn()[0], want[0])
                        rec(grp, f"{name} r{rnd}", bench(fn), flops=flops, same=same)
                    guard(grp, name, run)
                guard(grp, "prototype", lambda: rec(grp, f"prototype r{rnd}", bench(
                    lambda: proto.attn_fwd_tma(q, k, v, True, 64, 64, 4, 3)), flops=flops))


def sec_decode():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import splitsoftmax as ss
    from splitsoftmax.bench import graph_ms
    from splitsoftmax.kernels import configs
    saved = configs.MERGE_PDL
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    for keys in (131072, 1048576):
        k, v = (torch.randn(1, 8, keys, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nbytes = 2 * k.numel() * 2
        grp = f"decode {keys}"
        with torch.no_grad():
            want = ss.attention(q, k, v)
            for rnd in (1, 2):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    peer = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                    rec(grp, f"cudnn eager r{rnd}", bench(peer), nbytes)
                    rec(grp, f"cudnn graph r{rnd}", graph_ms(peer), nbytes)
                for pdl in (True, False):
                    configs.MERGE_PDL = pdl
                    fn = lambda: ss.attention(q, k, v)  # noqa: E731
                    same = torch.equal(fn(), want)
                    rec(grp, f"ss pdl={pdl} eager r{rnd}", bench(fn), nbytes, same=same)
                    guard(grp, f"graph pdl={pdl}", lambda: rec(grp, f"ss pdl={pdl} graph r{rnd}", graph_ms(fn), nbytes))
                configs.MERGE_PDL = saved


SECTIONS = {"tma": sec_tma, "tiles": sec_tiles, "variants": sec_variants, "decode": sec_decode}

if __name__ == "__main__":
    run_sections(SECTIONS, sys.argv)
