"""Probe: the softmax family's coop path on one GPU (a row too long for one program, held on chip by
co-resident sibling programs), against the two-pass / split paths and torch; GB/s of 2N.

    PYTHONPATH=. python3 benchmarks/probes/softmax_coop.py OUTDIR [SECTIONS]

Backs these choices (numbers: docs/benchmarks/softmax.md and its history): the coop fields of
``configs.SoftmaxConfig`` (``coop_chunk_elems``, ``coop_elems_per_warp``, ``coop_programs_per_sm``,
``coop_min_elem_bytes``: 2-byte inputs take coop at any row count), and the coop kernel holding
``exp(x - m_chunk)`` for softmax (one exp per element) rather than ``x``.

SECTIONS (comma-separated, default all):
- coop: 512x262144, 2048x65536, 128x1M, 8x262144 bf16 and 256x131072, 64x1M fp32, softmax and
  log-softmax; where ``ops/softmax/_probe_old_softmax.py`` is present (an earlier
  ``git show COMMIT:splitsoftmax/ops/softmax/kernel.py``, git-ignored, so copy it to the GPU machine
  beside the tree), also that kernel;
- keepx: the kernel as it is against a copy (``ops/softmax/_probe_keepx.py``) whose softmax holds ``x``.
Writes OUTDIR/probe.json.
"""
import importlib
import os
import sys

import torch

from helpers import bench, guard, rec, run_sections  # beside this file


HELD = dict(coop_min_elem_bytes=1)


def _variants():
    """(name, config overrides, use the old kernel copy) of the coop section."""
    v = [("default", {}, False), ("no coop", dict(coop_max_chunks=0), False)]
    for chunk, per_warp, pps in ((16384, 2048, 1), (8192, 1024, 1), (8192, 1024, 2), (16384, 1024, 1)):
        over = dict(HELD, coop_chunk_elems=chunk, coop_elems_per_warp=per_warp, coop_programs_per_sm=pps)
        v.append((f"held {chunk} pw{per_warp} pps{pps}", over, False))
    v.append(("OLD held 16384 pw2048 pps1", dict(HELD), True))
    return v


def sec_coop():
    """Long rows on the coop path under chunk sizes, warps and programs per SM, against the two-pass /
    split paths (coop off) and torch; the kernel as it was where ``_probe_old_softmax.py`` is present."""
    from splitsoftmax.ops._triton import configs
    from splitsoftmax.ops.softmax import kernel as K
    old = None
    if os.path.exists("splitsoftmax/ops/softmax/_probe_old_softmax.py"):
        old = importlib.import_module("splitsoftmax.ops.softmax._probe_old_softmax")
    cfg = configs.SOFTMAX
    saved = dict(vars(cfg))
    for R, N, dt in ((512, 262144, torch.bfloat16), (2048, 65536, torch.bfloat16), (128, 1 << 20, torch.bfloat16),
                     (8, 262144, torch.bfloat16), (256, 131072, torch.float32), (64, 1 << 20, torch.float32)):
        x = torch.randn(R, N, device="cuda", dtype=dt) * 3
        nb = 2 * x.numel() * x.element_size()
        grp = f"coop {R}x{N} {str(dt)[6:]}"
        rows = torch.arange(0, R, max(1, R // 16), device="cuda")
        rec(grp, "torch.softmax", bench(lambda: torch.softmax(x, -1)), nb)
        for log in (False, True):
            fn = torch.log_softmax if log else torch.softmax
            ref = fn(x[rows].double(), -1)
            for name, over, use_old in _variants():
                if use_old and old is None:
                    continue
                vars(cfg).update(saved)
                vars(cfg).update(over)
                mod = old if use_old else K
                p = K._plan(x)
                if use_old and p.path != "coop":
                    continue
                if log and not (name.startswith("default") or name.startswith("no coop") or "OLD" in name):
                    continue
                label = f"{'log ' if log else ''}{name}: {p.path} C{p.splits} tile{p.block_n} w{p.num_warps}"

                def run(label=label, mod=mod):
                    y = mod.softmax_fwd(x, log)[0]
                    err = ((y[rows].double() - ref).abs() / (ref.abs() + 1)).max().item()
                    rec(grp, label, bench(lambda: mod.softmax_fwd(x, log)), nb, err=f"{err:.1e}")
                guard(grp, label, run)
        vars(cfg).update(saved)
        del x
        torch.cuda.empty_cache()


KEEP_P = ("return (x if LOG else p), m, tl.sum(p, axis=1)", """    if LOG:
        y = _norm_tile(t, lse, m, inv, True)
    else:
        y = t * (tl.math.exp2((m_tile - m) * LOG2E) * inv)[:, None]
""")
KEEP_X = ("return x, m, tl.sum(p, axis=1)", """    y = _norm_tile(t, lse, m, inv, LOG)
""")


def sec_keepx():
    """The coop kernel as it is (softmax holds exp(x - m_chunk)) against a copy whose softmax holds ``x``
    and takes a second exp per element at the output, as log-softmax does."""
    from splitsoftmax.ops.softmax import kernel as K
    src = open("splitsoftmax/ops/softmax/kernel.py").read()
    for a, b in zip(KEEP_P, KEEP_X):
        assert src.count(a) == 1, a
        src = src.replace(a, b)
    with open("splitsoftmax/ops/softmax/_probe_keepx.py", "w") as f:
        f.write(src)
    kx = importlib.import_module("splitsoftmax.ops.softmax._probe_keepx")
    for R, N, dt in ((512, 262144, torch.bfloat16), (2048, 65536, torch.bfloat16), (256, 131072, torch.float32)):
        x = torch.randn(R, N, device="cuda", dtype=dt) * 3
        nb = 2 * x.numel() * x.element_size()
        grp = f"keepx {R}x{N} {str(dt)[6:]}"
        rows = torch.arange(0, R, max(1, R // 16), device="cuda")
        for log in (False, True):
            ref = (torch.log_softmax if log else torch.softmax)(x[rows].double(), -1)
            for mod, name in ((K, "as is"), (kx, "keep x")):
                label = f"{'log ' if log else ''}{name}: {K._plan(x).path}"

                def run(label=label, mod=mod, log=log, ref=ref):
                    y = mod.softmax_fwd(x, log)[0]
                    err = ((y[rows].double() - ref).abs() / (ref.abs() + 1)).max().item()
                    rec(grp, label, bench(lambda: mod.softmax_fwd(x, log)), nb, err=f"{err:.1e}")
                guard(grp, label, run)
        del x
        torch.cuda.empty_cache()


SECTIONS = {"coop": sec_coop, "keepx": sec_keepx}

if __name__ == "__main__":
    run_sections(SECTIONS, sys.argv)
