"""Probe: tiles of the softmax family's Triton kernels on one GPU, against torch.

    PYTHONPATH=. python3 benchmarks/probes/softmax_tiles.py OUTDIR [SECTIONS]

Backs these choices (numbers: docs/benchmarks/softmax.md and its history):
``configs.SoftmaxConfig.loop_tile_bytes``, ``loop_elems_per_warp`` and ``loop_stages`` (the looped
passes: 16 KB tiles, 4 warps for an 8192-wide bf16 tile, 3 tiles in flight), the looped loads'
``evict_last`` in ``ops/softmax/kernel.py``, and ``one_pass_tile_elems`` / ``elems_per_warp`` (the
one-pass tile of short rows).

SECTIONS (comma-separated, default all):
- loop: the statistics pass of 512x262144 bf16 under loop tiles, warps, stages and eviction policy,
  beside torch.logsumexp and the read rate of a 1 GiB sum;
- short: short rows (fp32, R*N = 2^27, N = 128, 512, 2048): the one-pass tile size and warps,
  softmax and log-softmax, beside torch.
Writes OUTDIR/probe.json.
"""
import importlib
import sys

import torch

from helpers import bench, guard, rec, run_sections  # beside this file


def _evict_first_copy():
    """A copy of ops/softmax/kernel.py whose loop loads use ``evict_first`` (``kernels/_probe_evict.py``)."""
    src = open("splitsoftmax/ops/softmax/kernel.py").read()
    assert src.count('eviction_policy="evict_last"') == 1
    with open("splitsoftmax/ops/softmax/_probe_evict.py", "w") as f:
        f.write(src.replace('eviction_policy="evict_last"', 'eviction_policy="evict_first"'))
    return importlib.import_module("splitsoftmax.ops.softmax._probe_evict")


def sec_loop():
    """512x262144 bf16 logsumexp (the statistics pass) under loop tiles, warps and stages, with the
    loads asking L2 to keep the row (``evict_last``, as configured) or not (``evict_first``)."""
    from splitsoftmax.ops._triton import configs
    from splitsoftmax.ops.softmax import kernel as K
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


def sec_short():
    """Short rows (fp32, R*N = 2^27): the one-pass tile size and warps against torch, (log-)softmax."""
    from splitsoftmax.ops._triton import configs
    from splitsoftmax.ops.softmax import kernel as K
    cfg = configs.SOFTMAX
    saved = dict(vars(cfg))
    for n in (128, 512, 2048):
        x = torch.randn((1 << 27) // n, n, device="cuda")
        nb = 2 * x.numel() * 4
        for log in (False, True):
            grp = f"short N={n} {'log_softmax' if log else 'softmax'}"
            tfn = torch.log_softmax if log else torch.softmax
            rec(grp, "torch", bench(lambda: tfn(x, -1)), nb)
            ref = tfn(x[:64].double(), -1)
            for tile in (4096, 8192, 16384):
                for per_warp in (256, 512, 1024):
                    vars(cfg).update(saved)
                    cfg.one_pass_tile_elems, cfg.elems_per_warp = tile, per_warp
                    p = K._plan(x)
                    name = f"tile{tile} pw{per_warp} rows{p.block_r} w{p.num_warps}"

                    def run():
                        err = (K.softmax_fwd(x, log)[0][:64].double() - ref).abs().max().item()
                        rec(grp, name, bench(lambda: K.softmax_fwd(x, log)), nb, err=f"{err:.1e}")
                    guard(grp, name, run)
        del x
    vars(cfg).update(saved)
    torch.cuda.empty_cache()


SECTIONS = {"loop": sec_loop, "short": sec_short}

if __name__ == "__main__":
    run_sections(SECTIONS, sys.argv)
