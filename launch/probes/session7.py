"""Probe (tuning data, not part of the library): session 7's attention forward questions, one GPU.

    PYTHONPATH=. python3 launch/probes/session7.py OUTDIR [SECTIONS]

SECTIONS (comma-separated, default all):
- tma: S = 1k / 2k / 4k causal forward (B*S = 32k, H=16, D=128, bf16) through the public call, with the
  output stored through a TMA descriptor or through pointers (``configs.ATTN_TMA_STORE``) and with
  ``(B * H * S, D)`` row-view descriptors or ``(B, H, S, D)`` ones (``configs.ATTN_TMA_ROWS``), in two
  rounds (the spread between rounds is the noise); beside SDPA flash, the same call replayed from a
  CUDA graph (no host cost), the launcher ``kernels.attention.attn_fwd``, a copy without the NaN
  guard of the diagonal tiles, and the TMA prototype (``attn_tma_kernel.py``, beside this file).
Writes OUTDIR/probe.json.
"""
import importlib
import sys

import torch

from session4 import bench, guard, rec, run_sections  # the probe helpers, beside this file

SEQS = (1024, 2048, 4096)
LAYOUTS = {"store rows": (True, True), "store heads": (True, False), "pointer-store heads": (False, False)}


def _noguard():
    """A copy of the attention module whose diagonal tiles skip the NaN guard (timing only)."""
    src = open("splitsoftmax/kernels/attention.py").read()
    old = "    if MASKED and CAUSAL:  # a NaN/Inf value"
    assert src.count(old) == 1
    with open("splitsoftmax/kernels/_probe_noguard.py", "w") as f:
        f.write(src.replace(old, "    if MASKED and CAUSAL and False:  # a NaN/Inf value"))
    return importlib.import_module("splitsoftmax.kernels._probe_noguard")


def sec_tma():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import splitsoftmax as ss
    from splitsoftmax.bench import graph_ms
    from splitsoftmax.kernels import attention as A
    from splitsoftmax.kernels import configs
    import attn_tma_kernel as proto  # beside this file
    ng = _noguard()
    saved = (configs.ATTN_TMA_STORE, configs.ATTN_TMA_ROWS)
    for S in SEQS:
        q, k, v = (torch.randn(32768 // S, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * q.shape[0] * 16 * S * S * 128 / 2
        grp = f"causal fwd S={S}"
        with torch.no_grad():
            want = ss.attention(q, k, v, causal=True)
            for rnd in (1, 2):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    rec(grp, f"sdpa flash r{rnd}",
                        bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), flops=flops)
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
        del q, k, v, want
        torch.cuda.empty_cache()


SECTIONS = {"tma": sec_tma}

if __name__ == "__main__":
    run_sections(SECTIONS, sys.argv)
