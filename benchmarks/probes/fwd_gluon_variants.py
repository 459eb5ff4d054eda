"""Probe of the variants' forward on the Gluon kernel against the Triton kernel, on one H200.

``PYTHONPATH=. python3 benchmarks/probes/fwd_gluon_variants.py OUTDIR [SECTIONS]``, sections:

- ``fwd``: forward TFLOP/s over visible pairs at the variant rows of ``bench attention`` (32k, B=1,
  H=16, D=128, bf16; ``splitsoftmax.tools.bench.attention_variants``), through ``ss.attention``, with the
  variants on the Gluon forward (``configs.ATTN_FWD_GLUON_VARIANTS``) and on the Triton one; each
  result checked against float64 on 64 rows (at most 2x torch's bf16 error), an earlier Gluon
  kernel's also against this tree's bit for bit;
- ``fb``: the same forward+backward;
- ``plain``: the plain forward on this Gluon kernel against earlier ones: bit for bit or the largest
  difference, TFLOP/s;
- ``short``: the plain causal forward at 1k-4k (B * S = 32k tokens) on the Triton kernel and the
  Gluon one.

Earlier Gluon kernels, where a section names them: ``splitsoftmax/ops/attention/gluon/_probe_<tag>_fwd.py``
(copies of an earlier ``attention_fwd_gluon.py`` with this one's arguments, ignored by git; carry
them to the GPU machine), each launched as ``gluon-<tag>`` exactly as this tree launches its own.
"""
import contextlib
import importlib
import sys

import torch

from helpers import bench, copy_tags, rec, run_sections
from splitsoftmax.tools.bench import attention_variants as V
from splitsoftmax.ops.attention import fwd as A
from splitsoftmax.ops._triton import configs
from splitsoftmax.ops._triton.launch import Launcher

D = 128


def _gluon_kernels():
    """``gluon`` (this tree's Gluon kernel) and ``gluon-<tag>`` for each earlier copy beside it."""
    return ("gluon", *(f"gluon-{t}" for t in copy_tags("splitsoftmax.ops.attention.gluon", "fwd")))


_LAUNCHERS = {}


@contextlib.contextmanager
def kernel(name):
    """Within it the forward runs on kernel ``name``: ``triton`` (every forward on the Triton kernel),
    ``gluon`` (this tree's choice) or ``gluon-<tag>`` (an earlier Gluon kernel where this tree's
    would run)."""
    saved = (A._gluon_fwd_launcher, configs.ATTN_FWD_GLUON_MIN_SQ, configs.ATTN_FWD_GLUON_VARIANTS)
    if name == "triton":
        configs.ATTN_FWD_GLUON_MIN_SQ = (1 << 30, 1 << 30)
        configs.ATTN_FWD_GLUON_VARIANTS = False
    elif name != "gluon":
        if name not in _LAUNCHERS:
            module = importlib.import_module(f"splitsoftmax.ops.attention.gluon._probe_{name[len('gluon-'):]}_fwd")
            _LAUNCHERS[name] = Launcher(module._attn_fwd_gluon)
        A._gluon_fwd_launcher = lambda: _LAUNCHERS[name]
    try:
        yield
    finally:
        A._gluon_fwd_launcher, configs.ATTN_FWD_GLUON_MIN_SQ, configs.ATTN_FWD_GLUON_VARIANTS = saved


def _variants(fb: bool):
    q, k, v = (torch.randn(1, V.H, V.S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sinks = torch.randn(V.H, device="cuda") + 2.0
    rows = torch.linspace(0, V.S - 1, 64, device="cuda").long()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    for name in ("causal", "documents", "window", "softcap"):
        flops = 4.0 * V.H * D * V.visible_pairs(name) * (3.5 if fb else 1.0)
        fn, _ = V.ss_fn(name, sinks)
        outs = {}
        for which in ("triton", *_gluon_kernels()):
            with kernel(which):
                with torch.no_grad():
                    outs[which] = fn(q, k, v)
                    err, bar = V._err(outs[which], q, k, v, name, rows, sinks)
                extra = {"bitwise": bool(torch.equal(outs[which], outs["gluon"]))} if "-" in which else {}
                if fb:
                    ms = bench(lambda: fn(*leaves).backward(dout))
                else:
                    with torch.no_grad():
                        ms = bench(lambda: fn(q, k, v))
            rec("fb" if fb else "fwd", f"{name} {which}", ms, flops=flops, err=err, torch_err=bar,
                ok=bool(err <= 2 * bar + 1e-6), **extra)


def plain():
    shapes = [("32k causal B=1 H=16", 1, 16, 16, 32768, True, False), ("8k causal GQA 16/4 views", 1, 16, 4, 8192,
                                                                       True, True),
              ("4k causal B=8 H=16", 8, 16, 16, 4096, True, False), ("8k full B=4 H=16", 4, 16, 16, 8192, False, False)]
    for name, b, h, hkv, s, causal, views in shapes:
        def make(n):
            x = torch.randn(b, s, n, D, device="cuda", dtype=torch.bfloat16)
            return x.transpose(1, 2) if views else x.transpose(1, 2).contiguous()
        q, k, v = make(h), make(hkv), make(hkv)
        flops = 4.0 * b * h * D * (s * (s + 1) / 2 if causal else s * s)
        fn = lambda: A.attn_fwd(q, k, v, D ** -0.5, causal, 0, out_dtype=q.dtype)  # noqa: E731
        outs = {}
        for which in _gluon_kernels():
            with kernel(which):
                outs[which] = fn()
                extra = {}
                if which != "gluon":
                    (o0, l0), (o1, l1) = outs[which], outs["gluon"]
                    extra = {"bitwise": bool(torch.equal(o0, o1) and torch.equal(l0, l1)),
                             "out_diff": (o0.float() - o1.float()).abs().max().item(),
                             "lse_diff": (l0 - l1).abs().max().item()}
                rec("plain", f"{name} {which}", bench(fn), flops=flops, **extra)


def short():
    """The plain causal forward at B * S = 32k tokens (H=16) on each kernel."""
    for s in (1024, 2048, 4096):
        q, k, v = (torch.randn(32768 // s, 16, s, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4.0 * q.shape[0] * 16 * D * s * (s + 1) / 2
        outs = {}
        for which in ("triton", *_gluon_kernels()):
            with kernel(which):
                if which != "triton":
                    configs.ATTN_FWD_GLUON_MIN_SQ = (0, 0)
                fn = lambda: A.attn_fwd(q, k, v, D ** -0.5, True, 0, out_dtype=q.dtype)  # noqa: E731
                outs[which] = fn()
                rec("short", f"{s} causal B={q.shape[0]} {which}", bench(fn), flops=flops)
        for which in _gluon_kernels():
            diff = (outs["triton"][0].double() - outs[which][0].double()).abs().max().item()
            print(f"short {s}: largest |{which} - triton| {diff:.2e}", flush=True)


if __name__ == "__main__":
    run_sections({"fwd": lambda: _variants(False), "fb": lambda: _variants(True), "plain": plain, "short": short},
                 sys.argv)
    print("\nsummary (TFLOP/s)")
    for r in __import__("helpers").ROWS:
        if "tflops" in r:
            print(f"{r['group']:6s} {r['name']:40s} {r['tflops']:6.0f} {r.get('ok', '')} {r.get('bitwise', '')}")
