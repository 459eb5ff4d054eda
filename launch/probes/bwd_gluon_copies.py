"""Probe of the Gluon dQ kernel against earlier copies of it, on one H200.

``PYTHONPATH=. python3 launch/probes/bwd_gluon_copies.py OUTDIR [fb]``: forward+backward TFLOP/s of
``ss.attention`` (bf16, D=128) at short causal rows, the model's GQA layer and the variant rows of
``bench attention`` (``splitsoftmax.bench.attention_variants``), the dQ kernel from this tree
(``dq``) and from each ``splitsoftmax/kernels/_probe_<tag>_bwd_gluon.py`` beside it (``dq-<tag>``:
copies of an earlier ``attention_bwd_gluon.py``, ignored by git; carry them to the GPU machine), the
gradients of each compared with this tree's.
"""
import contextlib
import sys

import torch

from helpers import bench, copy_tags, rec, run_sections
from splitsoftmax.bench import attention_variants as V
from splitsoftmax.kernels import attention_bwd_plain as P

D = 128


def _kernels():
    """``dq`` (this tree's dQ kernel) and ``dq-<tag>`` for each earlier copy beside it."""
    return ("dq", *(f"dq-{t}" for t in copy_tags("bwd_gluon")))


@contextlib.contextmanager
def kernel(name):
    """Within it the dQ kernel is ``name``'s."""
    saved = P._GLUON_MODULES["_attn_bwd_q_gluon"]
    if name != "dq":
        P._GLUON_MODULES["_attn_bwd_q_gluon"] = f"_probe_{name[len('dq-'):]}_bwd_gluon"
    P._gluon_launcher.cache_clear()
    try:
        yield
    finally:
        P._GLUON_MODULES["_attn_bwd_q_gluon"] = saved
        P._gluon_launcher.cache_clear()


def _time(group, name, fn, leaves, dout, flops):
    grads = {}
    for which in _kernels():
        with kernel(which):
            for t in leaves:
                t.grad = None
            fn(*leaves).backward(dout)
            grads[which] = [t.grad.clone() for t in leaves]
            same = all(torch.equal(a, b) for a, b in zip(grads[which], grads["dq"]))
            rec(group, f"{name} {which}", bench(lambda: fn(*leaves).backward(dout)), flops=flops, same_grads=same)


def fb():
    import splitsoftmax as ss
    for label, b, h, hkv, s in (("2k causal B=16", 16, 16, 16, 2048), ("1 x 8k causal GQA 16/4 views", 1, 16, 4, 8192)):
        q = torch.randn(b, s, h, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        k, v = (torch.randn(b, s, hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                for _ in range(2))
        flops = 3.5 * 4.0 * b * h * D * s * (s + 1) / 2
        _time("fb", label, lambda q, k, v: ss.attention(q, k, v, causal=True), [q, k, v], torch.randn_like(q), flops)
    q, k, v = (torch.randn(1, V.H, V.S, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    sinks = torch.randn(V.H, device="cuda") + 2.0
    for name in ("documents", "window"):
        fn, _ = V.ss_fn(name, sinks)
        _time("fb", name, fn, [q, k, v], torch.randn_like(q), 3.5 * 4.0 * V.H * D * V.visible_pairs(name))


if __name__ == "__main__":
    run_sections({"fb": fb}, sys.argv)
    print("\nsummary (TFLOP/s)")
    for r in __import__("helpers").ROWS:
        if "tflops" in r:
            print(f"{r['group']:4s} {r['name']:44s} {r['tflops']:6.0f} {r.get('same_grads', '')}")
