"""Benchmark of the vocabulary statistics against torch on one GPU, in parts (``--parts``).

``python -m splitsoftmax bench vocab --out DIR``:

- ``stats``: the log-probability of a target plus the entropy (``ss.logprobs(...,
  return_entropy=True)``) and the KL divergence (``ss.kl_div``) on 8192 x 128256 bf16 logits (10%
  of the rows ignored), against what RL trainers write in torch (a float32 copy, ``log_softmax``,
  a gather, ``-(p * logp).sum()``), eager and under ``torch.compile``, all in the same process.
  First a correctness gate on small shapes (few rows, so rows split over programs; bf16 and
  float32; a temperature): every output and gradient's error against float64 at most 2x torch's
  own error in the same dtype (+ a float32 floor). Then medians of ``triton.testing.do_bench``
  for the forward and the forward + backward, and the peak memory each adds above its inputs;
  the device copy of the logits (one read + one write) and a read (``amax``) as the yardsticks;
  tile variants of splitsoftmax beside the defaults.
- ``sampling``: ``ss.sample`` against torch's samplers at batch 1, 32 and 256 over V = 128256
  (``bench/vocab_sampling.py``).

Writes ``vocab.json`` (one entry per part) and ``vocab_<part>.png`` to ``--out`` and prints tables.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import splitsoftmax as ss
from splitsoftmax.core import reference as ref
from splitsoftmax.ops._triton import configs

from . import best_ms
from . import vocab_sampling as sampling

STATS_SHAPE = (8192, 128256)
# (forward tile, backward tile) variants of ss timed beside the defaults (configs.py)
STATS_VARIANTS = [((8192, 8192, 8, 3), (4096, 4096, 16, 3)), ((4096, 4096, 8, 3), (8192, 8192, 16, 2)),
                  ((8192, 8192, 16, 3), (2048, 2048, 8, 3)), ((16384, 16384, 16, 2), (4096, 4096, 8, 3))]


def torch_stats(logits, target, temperature: float = 1.0):
    """The torch peer: ``(logp, entropy)`` through a float32 copy and ``log_softmax`` (ignored rows 0)."""
    logp = torch.log_softmax(logits.float() / temperature, -1)
    lp = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    skip = target == -100
    return torch.where(skip, 0.0, lp), torch.where(skip, 0.0, -(logp.exp() * logp).sum(-1))


def torch_kl(p, q, temperature: float = 1.0):
    """The torch peer: ``KL(softmax(p/T) || softmax(q/T))`` through float32 copies."""
    lp, lq = torch.log_softmax(p.float() / temperature, -1), torch.log_softmax(q.float() / temperature, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def ss_stats(logits, target, temperature: float = 1.0):
    return ss.logprobs(logits, target, temperature=temperature, return_entropy=True)


def ss_kl(p, q, temperature: float = 1.0):
    return ss.kl_div(p, q, temperature=temperature)


def _data(n, v, dtype, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    p = (torch.randn(n, v, generator=g, device=device) * 2).to(dtype)
    q = (p.float() + torch.randn(n, v, generator=g, device=device)).to(dtype)
    target = torch.randint(0, v, (n,), generator=g, device=device)
    target[torch.rand(n, generator=g, device=device) < 0.1] = -100
    return p, q, target


def _outputs_and_grads(fn, tensors, *args, **kw):
    """``fn(*tensors)`` (outputs as a tuple) and the gradients of a fixed weighted sum of them."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    outs = fn(*leaves, *args, **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    w = torch.linspace(0.5, 1.5, outs[0].numel(), device=outs[0].device, dtype=torch.float64).bfloat16()
    loss = sum((torch.where(torch.isfinite(o), o, 0.0) * w.to(o.dtype)).sum() for o in outs)
    return [o.detach() for o in outs], list(torch.autograd.grad(loss, leaves))


def _max_err(got: list, want: list) -> float:
    return max(((a.double() - b).abs().nan_to_num(nan=float("inf"))).max().item() for a, b in zip(got, want))


GATE_SHAPES = [(3, 50000, torch.float32, 1.0), (64, 32000, torch.bfloat16, 0.7), (1000, 4099, torch.bfloat16, 1.0),
               (5, 128256, torch.float16, 1.3)]


def gate_stats(shapes=GATE_SHAPES, device="cuda") -> list:
    """Errors against float64 on small shapes: ss's at most 2x torch's in the same dtype + 1e-6."""
    rows = []
    for n, v, dtype, temperature in shapes:
        p, q, target = _data(n, v, dtype, seed=n, device=device)
        for name, ours, peer, oracle, inputs, extra in (
                ("logprobs+entropy", ss_stats, torch_stats, lambda a, t, T: ref.vocab_stats(a, t, temperature=T),
                 (p,), (target,)),
                ("kl_div", ss_kl, torch_kl, lambda a, b, T: ref.kl_div(a, b, temperature=T), (p, q), ())):
            want = _outputs_and_grads(oracle, [t.double() for t in inputs], *extra, temperature)
            got = _outputs_and_grads(ours, inputs, *extra, temperature=temperature)
            theirs = _outputs_and_grads(peer, inputs, *extra, temperature=temperature)
            err = max(_max_err(got[0], want[0]), _max_err(got[1], want[1]))
            terr = max(_max_err(theirs[0], want[0]), _max_err(theirs[1], want[1]))
            rows.append({"op": name, "shape": f"{n}x{v}", "dtype": str(dtype), "T": temperature, "ss_err": err,
                         "torch_err": terr, "ok": err <= 2 * terr + 1e-6})
    return rows


def _peak_mib(fn) -> float:
    """Peak memory ``fn()`` adds above what is allocated before it, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _timings(fn, inputs: list, extra: tuple) -> dict:
    """Forward (no grad) and forward + backward of ``fn``: median ms and peak MiB above the inputs."""
    leaves = [t.requires_grad_() for t in inputs]

    def fwd():
        with torch.no_grad():
            return fn(*leaves, *extra)

    def fwd_bwd():
        outs = fn(*leaves, *extra)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.grad(sum(o.sum() for o in outs), leaves)
    fwd_bwd()
    fwd()  # (warm-ups: torch.compile compiles each grad mode once)
    res = {"fwd_peak_mib": _peak_mib(fwd), "fwd_bwd_peak_mib": _peak_mib(fwd_bwd)}
    res.update(fwd_ms=best_ms(fwd), fwd_bwd_ms=best_ms(fwd_bwd))
    return res


def _variants(fn, inputs, extra) -> dict:
    """ss timed with each (forward, backward) tile pair of STATS_VARIANTS."""
    saved = configs.VOCAB_FWD_TILE, configs.VOCAB_BWD_TILE
    out = {}
    try:
        for fwd_tile, bwd_tile in STATS_VARIANTS:
            configs.VOCAB_FWD_TILE, configs.VOCAB_BWD_TILE = fwd_tile, bwd_tile
            t = _timings(fn, inputs, extra)
            out[f"fwd{fwd_tile} bwd{bwd_tile}"] = {"fwd_ms": t["fwd_ms"], "fwd_bwd_ms": t["fwd_bwd_ms"]}
    finally:
        configs.VOCAB_FWD_TILE, configs.VOCAB_BWD_TILE = saved
    return out


def _check_big(p, target) -> dict:
    """ss against float64 on 16 rows of the timed logits (logp, entropy), and the largest error."""
    idx = torch.linspace(0, p.shape[0] - 1, 16, device=p.device).long()
    got = ss_stats(p, target)
    want = ref.vocab_stats(p[idx], target[idx])
    err = max((g[idx].double() - w).abs().max().item() for g, w in zip(got, want))
    return {"rows_checked": 16, "max_err": err, "ok": err <= 1e-4}


def stats_part(args) -> dict:
    """The ``stats`` part: gate, yardsticks, ss / torch eager / torch.compile timings, variants."""
    gate = gate_stats()
    n, v = STATS_SHAPE
    p, q, target = _data(n, v, torch.bfloat16)
    nbytes = p.numel() * p.element_size()
    dst = torch.empty_like(p)
    copy_ms, read_ms = best_ms(lambda: dst.copy_(p)), best_ms(lambda: p.amax(-1))
    del dst
    result = {"shape": f"{n}x{v} bf16", "logits_mib": nbytes / 2**20, "copy_ms": copy_ms, "read_ms": read_ms,
              "big_check": _check_big(p, target), "gate": gate, "impls": {}}
    peers = {"ss": (ss_stats, ss_kl), "torch": (torch_stats, torch_kl)}
    if not args.no_compile:
        peers["torch.compile"] = (torch.compile(torch_stats), torch.compile(torch_kl))
    for name, (stats_fn, kl_fn) in peers.items():
        result["impls"][name] = {"stats": _timings(stats_fn, [p], (target,)), "kl": _timings(kl_fn, [p, q], ())}
        torch.cuda.empty_cache()
    if not args.no_variants:
        result["ss_variants"] = _variants(ss_stats, [p], (target,))
    s = result["impls"]["ss"]["stats"]
    result["targets"] = {"fwd_ms <= 1.0": s["fwd_ms"] <= 1.0,
                         "fwd peak <= logits + 64 MiB": s["fwd_peak_mib"] <= 64,
                         "fwd_bwd <= 1.3 x copy": s["fwd_bwd_ms"] <= 1.3 * copy_ms,
                         "fwd_bwd / copy": s["fwd_bwd_ms"] / copy_ms}
    return result


def table_stats(r: dict) -> str:
    lines = ["gate: op shape dtype T ss_err torch_err ok"]
    lines += [f"  {g['op']:17} {g['shape']:11} {g['dtype']:15} {g['T']:.1f} {g['ss_err']:.2e} {g['torch_err']:.2e} "
              f"{g['ok']}" for g in r["gate"]]
    lines.append(f"{r['shape']} ({r['logits_mib']:.0f} MiB): copy {r['copy_ms']:.3f} ms (read + write), read "
                 f"{r['read_ms']:.3f} ms; float64 check on {r['big_check']['rows_checked']} rows: max err "
                 f"{r['big_check']['max_err']:.2e}")
    lines.append("  impl            op     fwd ms  fwd+bwd ms  fwd peak MiB  fwd+bwd peak MiB")
    for name, ops in r["impls"].items():
        for op, t in ops.items():
            lines.append(f"  {name:15} {op:5} {t['fwd_ms']:8.3f} {t['fwd_bwd_ms']:11.3f} {t['fwd_peak_mib']:13.0f} "
                         f"{t['fwd_bwd_peak_mib']:17.0f}")
    for name, t in r.get("ss_variants", {}).items():
        lines.append(f"  ss {name:50} {t['fwd_ms']:8.3f} {t['fwd_bwd_ms']:8.3f}")
    lines.append(f"  targets: {r['targets']}")
    return "\n".join(lines)


def plot_stats(r: dict, path: str) -> bool:
    """Bars of forward and forward + backward time (log-prob + entropy) and their peak memory."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(r["impls"])
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, key in enumerate(("fwd", "fwd_bwd")):
        xs = [j + 0.4 * i for j in range(len(names))]
        bars = ax_t.bar(xs, [r["impls"][n]["stats"][f"{key}_ms"] for n in names], 0.4, label=key.replace("_", "+"))
        ax_t.bar_label(bars, fmt="%.2f", fontsize=8)
        bars = ax_m.bar(xs, [r["impls"][n]["stats"][f"{key}_peak_mib"] / 1024 for n in names], 0.4,
                        label=key.replace("_", "+"))
        ax_m.bar_label(bars, fmt="%.2f", fontsize=8)
    ax_t.axhline(r["copy_ms"], color="k", ls="--", lw=1, label="copy of the logits")
    for ax, unit in ((ax_t, "ms"), (ax_m, "GiB above the logits")):
        ax.set_xticks([j + 0.2 for j in range(len(names))], names)
        ax.set_ylabel(unit)
        ax.legend()
    fig.suptitle(f"log-prob + entropy, {r['shape']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# part name -> (run(args) -> result, table(result) -> str, plot(result, path) -> bool, passed(result) -> bool)
PARTS = {"stats": (stats_part, table_stats, plot_stats,
                   lambda r: all(g["ok"] for g in r["gate"]) and r["big_check"]["ok"])}
PARTS["sampling"] = sampling.PART


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="splitsoftmax bench vocab", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="folder for vocab.json and the plots")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer")
    ap.add_argument("--no-variants", action="store_true", help="time only the default tiles")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if any(p not in PARTS for p in parts):
        ap.error(f"--parts: choose from {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        print("bench vocab needs a CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    import triton
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    results, ok = {}, True
    for name in parts:
        run, table, plot, passed = PARTS[name]
        results[name] = run(args)
        print(table(results[name]))
        plot(results[name], os.path.join(args.out, f"vocab_{name}.png"))
        ok = ok and passed(results[name])
    with open(os.path.join(args.out, "vocab.json"), "w") as f:
        json.dump({"meta": meta, "parts": results}, f, indent=1)
    print(json.dumps(meta))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
