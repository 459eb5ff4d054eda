"""Probe (no GPU needed): the size of the sampling records kernel compiled for sm_90, per number of
records, with and without the row's merge. Compiles ``_records_kernel`` for a GPUTarget as
``tests/test_sampling_compile.py`` does and counts its PTX instruction lines, barriers, shared
memory accesses and shuffles.

    PYTHONPATH=.:tests python3 benchmarks/probes/sampling_records_ptx.py

(with Triton 3.6.0 first on the path for the GPU machines' compiler, e.g. ``.triton-3.6.0`` beside a newer torch)

Numbers in docs/benchmarks/vocab-sampling.md (what the 64-record pass costs).

Backs ``configs.SAMPLE_RECORDS_MIN`` / ``SAMPLE_RECORDS_MAX`` (the records kernel's size per record count).
"""
import re

import test_sampling_compile as t
from splitsoftmax.ops.sampling import config as sc
from splitsoftmax.ops.sampling import fused as kf

CASES = [("greedy, 1 record", 1, dict(GREEDY=True, TOP_P=False, MOMENTS=False)),
         ("min-p, 64 records", 64, dict(GREEDY=False, TOP_P=False, MOMENTS=False)),
         ("top-p, 64 records", 64, dict(GREEDY=False, TOP_P=True, MOMENTS=True)),
         ("64 records, no merge", 64, dict(GREEDY=False, TOP_P=False, MOMENTS=False, FUSED=False)),
         ("64 records, 2 partials", 64, dict(GREEDY=False, TOP_P=False, MOMENTS=False, QP=2)),
         ("16 records", 16, dict(GREEDY=False, TOP_P=False, MOMENTS=False))]


def counts(ptx: str) -> dict:
    """Instruction lines of ``ptx`` (no directives, labels or braces) and some kinds among them."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("//", ".", "$", "{", "}"))]
    kinds = {"bar": r"bar\.sync|barrier", "st.shared": r"st\.shared", "ld.shared": r"ld\.shared", "shfl": r"shfl"}
    return {"instructions": len(lines), **{k: sum(1 for ln in lines if re.match(p, ln)) for k, p in kinds.items()}}


if __name__ == "__main__":
    for name, kr, extra in CASES:
        consts = dict(t.RECORDS, KR=kr, **extra)
        print(f"{name:24s}", counts(t._compile(kf._records_kernel, t.TYPES, consts, sc.WARPS).asm["ptx"]))
