"""Probe: the causal attention forward on one GPU (B*S = 32k tokens, H=16, D=128, bf16), beside SDPA flash.

    PYTHONPATH=. python3 benchmarks/probes/attention_causal_forward.py OUTDIR [SECTIONS]

Backs these choices (numbers: docs/benchmarks/attention-forward.md and its history):
``configs.ATTN_TMA`` (Q/K/V tiles through TMA descriptors), ``ATTN_TMA_STORE`` and
``ATTN_TMA_ROWS`` (the output store and the descriptors' shape), the short-causal tile
``ATTN_TILES[("fwd_causal_short", 2, 128)]`` up to ``ATTN_SHORT_CAUSAL_SQ`` queries, and the NaN
guard of the diagonal tiles in ``ops/attention/fwd.py`` (masked tiles run unguarded, and re-run
with the guard only when their sum is not finite).

SECTIONS (comma-separated, default all): tma, store, tiles, guard (each function's docstring says
what it times). ``guard`` also times ``ops/attention/_probe_prev.py`` where present: an earlier form of
``ops/attention/fwd.py`` (``git show COMMIT:splitsoftmax/ops/attention/fwd.py > ...``, git-ignored,
so copy it to the GPU machine beside the tree). Patched copies are written beside it as
``ops/attention/_probe_*.py``. Writes OUTDIR/probe.json.
"""
import importlib
import os
import sys

import torch

from helpers import bench, causal_case, guard, rec, rec_flash_causal, run_sections  # beside this file

SEQS = (1024, 2048, 4096)
LAYOUTS = {"store rows": (True, True), "pointer-store heads": (False, False)}
# name -> (old, new) text patches of ops/attention/fwd.py
PATCHES = {"noguard": [("    if CAUSAL:  # a NaN/Inf value", "    if CAUSAL and False:  # a NaN/Inf value")]}


def _patched(*names):
    """A copy of the attention module with the named text patches (timing only)."""
    src = open("splitsoftmax/ops/attention/fwd.py").read()
    for name in names:
        for old, new in PATCHES[name]:
            assert src.count(old) == 1, (name, old)
            src = src.replace(old, new)
    mod = "_probe_" + "_".join(names)
    with open(f"splitsoftmax/ops/attention/{mod}.py", "w") as f:
        f.write(src)
    return importlib.import_module(f"splitsoftmax.ops.attention.{mod}")


def _noguard():
    return _patched("noguard")


def sec_tma():
    """S = 1k..8k: Q/K/V through TMA descriptors or pointer loads, under the short-causal tile (64x64)
    or the long one (128x128), through the public call."""
    import splitsoftmax as ss
    from splitsoftmax.ops._triton import configs
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


def sec_store():
    """S = 1k / 2k / 4k: the output stored through a TMA descriptor or pointers, row-view or per-head
    descriptors; the same call replayed from a graph, the launcher, the launcher without the guard."""
    import splitsoftmax as ss
    from splitsoftmax.tools.bench import graph_ms
    from splitsoftmax.ops.attention import fwd as A
    from splitsoftmax.ops._triton import configs
    ng = _noguard()
    saved = (configs.ATTN_TMA_STORE, configs.ATTN_TMA_ROWS)
    for S in SEQS:
        q, k, v, flops = causal_case(S)
        grp = f"store causal S={S}"
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


def sec_tiles():
    """S = 4k / 8k / 1k: short-causal tiles given to every causal S up to that one, public call."""
    import splitsoftmax as ss
    from splitsoftmax.ops._triton import configs
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
            configs.ATTN_TILES.update(saved[1])  # the same dict: ops.attention.decode holds it too


def sec_guard():
    """S = 1k / 2k / 4k through the launcher, two rounds: as it is, without the NaN guard (timing only),
    and an earlier form of the module where ``ops/attention/_probe_prev.py`` is present."""
    from splitsoftmax.ops.attention import fwd as A
    mods = {"as is": A, "noguard": _noguard()}
    if os.path.exists("splitsoftmax/ops/attention/_probe_prev.py"):
        mods["previous"] = importlib.import_module("splitsoftmax.ops.attention._probe_prev")
    for S in (1024, 2048, 4096):
        q, k, v, flops = causal_case(S)
        grp = f"guard causal S={S}"
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


SECTIONS = {"tma": sec_tma, "store": sec_store, "tiles": sec_tiles, "guard": sec_guard}

if __name__ == "__main__":
    run_sections(SECTIONS, sys.argv)
