"""Probe of the Gluon backward kernels against other copies of them, on one H200.

``PYTHONPATH=. python3 benchmarks/probes/bwd_gluon_copies.py OUTDIR [fb,fbv,prof]``: ``fb``, forward+backward TFLOP/s of
``ss.attention`` (bf16, D=128) at short causal rows (B * S = 32k tokens, H=16), GQA layers at
batch 1 and 4 and the variant rows of ``bench attention`` (``splitsoftmax.tools.bench.attention_variants``;
``fbv``: those alone; ``pieces``: :func:`pieces`),
with this tree's kernels (``tree``), with a setting of theirs changed (``_SETTINGS``) and with each copy
beside them: ``dq-<tag>`` runs the dQ kernel of
``splitsoftmax/ops/attention/gluon/_probe_<tag>_bwd.py``, ``kv-<tag>`` the dK/dV kernel of
``_probe_<tag>_bwd_kv.py`` beside it (copies of ``gluon/bwd.py`` / ``gluon/bwd_kv.py``,
ignored by git; carry them to the GPU machine), or those of the environment's ``CHOICES``
(comma-separated); the gradients of each compared with this tree's; ``prof``, the device time per
kernel of one forward+backward with each.

Backs ``configs.ATTN_BWD_DS``, ``ATTN_BWD_DS_MAX_BYTES`` / ``ATTN_BWD_DS_MIN_WAVES`` (the pieces) and the dQ
kernel's tile ``configs.ATTN_TILES[("bwd_q_ds", 2, 128)]``.
"""
import contextlib
import os
import sys

import torch

from helpers import bench, copy_tags, kernel_times, rec, run_sections
from splitsoftmax.tools.bench import attention_variants as V
from splitsoftmax.ops.attention import bwd_plain as P
from splitsoftmax.ops._triton import configs

D = 128


_COPIES = {"dq": ("_attn_bwd_q_gluon", "bwd"), "kv": ("_attn_bwd_kv_ws", "bwd_kv")}
# this tree's kernels with settings of theirs changed: name -> ((configs attribute, value), ..)
_SETTINGS = {"triton-pair": (("ATTN_BWD_GLUON", False), ), "ds-recomputed": (("ATTN_BWD_DS", False), ),
             "ds-one-piece": (("ATTN_BWD_DS_MAX_BYTES", 40 << 30), ), "ds-4g": (("ATTN_BWD_DS_MAX_BYTES", 4 << 30), )}
# the choices run, or those listed (comma-separated) in the environment's CHOICES
CHOICES = tuple(os.environ["CHOICES"].split(",")) if os.environ.get("CHOICES") else None


# the dQ kernel reading dS with another (BLOCK_M, num_warps, num_stages[, maxnreg]): dsq-<m>x<warps>x<stages>[x<regs>]
# in CHOICES
_DS_TILE = ("bwd_q_ds", 2, D)


def _kernels():
    """``tree`` (this tree's kernels), the settings of ``_SETTINGS``, the dQ tiles ``dsq-..`` named in
    ``CHOICES``, then ``dq-<tag>`` / ``kv-<tag>`` for each copy beside them."""
    every = ("tree", *_SETTINGS, *(c for c in CHOICES or () if c.startswith("dsq-")),
             *(f"{k}-{t}" for k, (_, module) in _COPIES.items() for t in copy_tags("splitsoftmax.ops.attention.gluon", module)))
    return tuple(c for c in every if c in CHOICES) if CHOICES else every


@contextlib.contextmanager
def kernel(name):
    """Within it the kernel that copy ``name`` replaces is the copy's (or the setting is changed)."""
    saved = dict(P._GLUON_MODULES)
    settings = _SETTINGS.get(name, ())
    was = [(attr, getattr(configs, attr)) for attr, _ in settings]
    tile = configs.ATTN_TILES[_DS_TILE]
    if settings:
        for attr, value in settings:
            setattr(configs, attr, value)
    elif name.startswith("dsq-"):
        configs.ATTN_TILES[_DS_TILE] = tuple(int(x) for x in name[4:].split("x"))
    elif name != "tree":
        which, tag = name.split("-", 1)
        fn, module = _COPIES[which]
        P._GLUON_MODULES[fn] = f"gluon._probe_{tag}_{module}"
    P._gluon_launcher.cache_clear()
    try:
        yield
    finally:
        P._GLUON_MODULES.update(saved)
        configs.ATTN_TILES[_DS_TILE] = tile
        for attr, value in was:
            setattr(configs, attr, value)
        P._gluon_launcher.cache_clear()


def _step(fn, leaves, dout):
    """One forward+backward of ``fn`` with fresh gradients (none accumulated): the gradients."""
    for t in leaves:
        t.grad = None
    fn(*leaves).backward(dout)
    return [t.grad for t in leaves]


def _time(group, name, fn, leaves, dout, flops):
    """Each kernel's gradients against the tree's (two calls each: the tree's also against
    themselves), then its time, the kernels in turn ``ROUNDS`` times over (the environment's; 2)."""
    grads = {}
    for which in _kernels():
        with kernel(which):
            grads[which] = [g.clone() for g in _step(fn, leaves, dout)]
            again = _step(fn, leaves, dout)
            print(f"{group} {name} {which}: the same gradients twice: "
                  f"{all(torch.equal(a, b) for a, b in zip(again, grads[which]))}", flush=True)
    for _ in range(int(os.environ.get("ROUNDS", "2"))):
        for which in _kernels():
            with kernel(which):
                same = [torch.equal(a, b) for a, b in zip(grads[which], grads["tree"])]
                rec(group, f"{name} {which}", bench(lambda: _step(fn, leaves, dout)), flops=flops,
                    same_grads=all(same), same_qkv=same)


def _profile(group, name, step, flops):
    """Record the device time per kernel of ``step`` (``helpers.kernel_times``)."""
    rows = kernel_times(step)
    print(f"{group} {name}: {sum(t for _, t in rows):.0f} us: " + "; ".join(f"{k[:40]} {t:.0f}" for k, t in rows[:6]),
          flush=True)
    rec(group, name, sum(t for _, t in rows) / 1e3, flops=flops, kernels=rows[:8])


def prof():
    """Device time per kernel of one forward+backward, each kernel choice and SDPA cuDNN, at causal
    rows of B * S = 32k tokens, H=16 (the environment's ``PROF_SEQS``, comma-separated; 1k and 2k)
    and the variant rows of ``PROF_VARIANTS`` (documents, window; cuDNN: not run)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import splitsoftmax as ss
    seqs = (int(s) for s in os.environ.get("PROF_SEQS", "1024,2048").split(",") if s)
    cases = [(f"{s // 1024}k causal", 32768 // s, s, None) for s in seqs]
    cases += [(name, 1, V.S, name) for name in os.environ.get("PROF_VARIANTS", "documents").split(",") if name]
    for label, b, s, variant in cases:
        leaves = [torch.randn(b, 16, s, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
        dout = torch.randn_like(leaves[0])
        flops = 3.5 * 4.0 * 16 * D * (V.visible_pairs(variant) if variant else b * s * (s + 1) / 2)
        for which in _kernels():
            with kernel(which):
                fn = V.ss_fn(variant, None)[0] if variant else (lambda *x: ss.attention(*x, causal=True))
                _profile("prof", f"{label} {which}", lambda: _step(fn, leaves, dout), flops)
        if not variant:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                _profile("prof", f"{label} cudnn", lambda: _step(lambda *x: F.scaled_dot_product_attention(
                    *x, is_causal=True), leaves, dout), flops)


def _causal_rows(group, shapes):
    """Time ``ss.attention(causal=True)`` forward+backward at each ``(label, B, H, Hkv, S)`` of
    ``shapes``, q/k/v ``(B, H, S, D)`` views of ``(B, S, H, D)`` tensors."""
    import splitsoftmax as ss
    for label, b, h, hkv, s in shapes:
        q = torch.randn(b, s, h, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        k, v = (torch.randn(b, s, hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                for _ in range(2))
        flops = 3.5 * 4.0 * b * h * D * s * (s + 1) / 2
        _time(group, label, lambda q, k, v: ss.attention(q, k, v, causal=True), [q, k, v], torch.randn_like(q),
              flops)


def _mha_rows(seqs):
    """``(label, B, H, Hkv, S)`` of the causal rows of ``bench attention`` (B * S = 32k tokens, H=16) at
    ``seqs``."""
    return [(f"{s // 1024}k causal B={32768 // s}", 32768 // s, 16, 16, s) for s in seqs]


def fb():
    shapes = _mha_rows((1024, 2048, 4096))
    shapes += [("1 x 8k causal GQA 16/4 views", 1, 16, 4, 8192), ("4 x 2k causal GQA 16/4 views", 4, 16, 4, 2048),
               ("1 x 32k causal GQA 16/4 views", 1, 16, 4, 32768), ("1 x 8k causal GQA 32/8 views", 1, 32, 8, 8192)]
    _causal_rows("fb", shapes)
    fb_variants()


def pieces():
    """Forward+backward at the rows whose ``dS^T`` buffer may pass the bound (``bench attention``'s
    causal 4k-32k, H=16, 1 x 32k GQA 16/4 views and the variant rows but softcap's; the environment's
    ``PIECE_SEQS``, comma-separated, for the causal lengths): run with ``CHOICES=tree,ds-one-piece`` to
    time the pieces against one buffer."""
    seqs = tuple(int(s) for s in os.environ.get("PIECE_SEQS", "4096,8192,16384,32768").split(",") if s)
    _causal_rows("pcs", _mha_rows(seqs) + [("1 x 32k causal GQA 16/4 views", 1, 16, 4, 32768)])
    q, k, v = (torch.randn(1, V.H, V.S, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    sinks = torch.randn(V.H, device="cuda") + 2.0
    for name in ("window", "documents", "sinks"):
        _time("pcs", name, V.ss_fn(name, sinks)[0], [q, k, v], torch.randn_like(q),
              3.5 * 4.0 * V.H * D * V.visible_pairs(name))


def fb_variants():
    """The ``fb`` section's variant rows alone (documents, window, softcap)."""
    q, k, v = (torch.randn(1, V.H, V.S, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    sinks = torch.randn(V.H, device="cuda") + 2.0
    for name in ("documents", "window", "softcap"):
        fn, _ = V.ss_fn(name, sinks)
        _time("fb", name, fn, [q, k, v], torch.randn_like(q), 3.5 * 4.0 * V.H * D * V.visible_pairs(name))


if __name__ == "__main__":
    run_sections({"fb": fb, "fbv": fb_variants, "pieces": pieces, "prof": prof}, sys.argv)
    print("\nsummary (TFLOP/s)")
    for r in __import__("helpers").ROWS:
        if "tflops" in r:
            print(f"{r['group']:4s} {r['name']:44s} {r['tflops']:6.0f} {r.get('same_grads', '')}")
