"""Benchmark of ``ss.cross_entropy`` against ``torch.nn.functional.cross_entropy`` on one GPU.

``python -m splitsoftmax.tools.bench.cross_entropy --out DIR`` (or ``splitsoftmax bench cross_entropy``):

1. Correctness gate: on small shapes (float32 and bf16, few rows so rows split across programs,
   label smoothing, ignored rows) loss and logits gradient against float64 torch; the error must be
   at most 2x torch's own error in the same dtype (+ a float32 floor).
2. Timing and memory on (8192 x 131072) bf16 logits, 10% of rows ignored: forward, and forward +
   backward (median of ``triton.testing.do_bench``), and the peak memory a forward + backward adds
   above the logits, for torch and for ss (tile variants of ss too), all in the same process.

Writes ``cross_entropy.json`` to ``--out`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from splitsoftmax.ops.cross_entropy import kernel as tce
from splitsoftmax.ops.cross_entropy.api import cross_entropy

SHAPE = (8192, 131072)
# (forward tile, backward tile) of ss: the defaults first, then variants timed beside them
DEFAULT = (tce.CE_FWD_TILE, tce.CE_BWD_TILE)
VARIANTS = [DEFAULT, ((4096, 8, 3), (4096, 8, 3)), ((8192, 8, 1), (2048, 8, 3)), ((2048, 4, 1), (2048, 4, 3))]


def _data(n, v, dtype, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(n, v, generator=g, device=device) * 2).to(dtype)
    target = torch.randint(0, v, (n,), generator=g, device=device)
    target[torch.rand(n, generator=g, device=device) < 0.1] = -100
    return logits, target


def _loss_grad(fn, logits, target, **kw):
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, target, **kw)
    loss.backward()
    return loss.detach(), x.grad


def gate() -> list:
    """Errors against float64 on small shapes (rows split, label smoothing, ignored rows)."""
    rows = []
    for n, v, dtype, eps in [(3, 50000, torch.float32, 0.0), (64, 32000, torch.bfloat16, 0.1),
                             (1000, 4099, torch.bfloat16, 0.0), (5, 131072, torch.float16, 0.2)]:
        logits, target = _data(n, v, dtype, seed=n)
        want, gwant = _loss_grad(F.cross_entropy, logits.double(), target, label_smoothing=eps)
        tl, tg = _loss_grad(F.cross_entropy, logits, target, label_smoothing=eps)
        got, g = _loss_grad(cross_entropy, logits, target, label_smoothing=eps)
        err = max((got.double() - want).abs().item(), (g.double() - gwant).abs().max().item())
        terr = max((tl.double() - want).abs().item(), (tg.double() - gwant).abs().max().item())
        ok = got.dtype == dtype and g.dtype == dtype and err <= 2 * terr + 1e-5
        rows.append({"shape": f"{n}x{v}", "dtype": str(dtype), "eps": eps, "ss_err": err, "torch_err": terr, "ok": ok})
    return rows


def _ms(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def _peak_mib(fn, x) -> float:
    """Peak memory above the inputs of one forward + backward, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    x.grad = None
    return peak / 2**20


def measure(name: str, fn, x, target, eps: float) -> dict:
    fwd = lambda: fn(x, target, label_smoothing=eps)  # noqa: E731

    def fwd_bwd():
        x.grad = None
        fwd().backward()
    fwd_bwd()
    peak = _peak_mib(fwd, x)
    with torch.no_grad():
        t_fwd = _ms(fwd)
    t_all = _ms(fwd_bwd)
    x.grad = None
    return {"impl": name, "eps": eps, "fwd_ms": t_fwd, "fwd_bwd_ms": t_all, "peak_mib": peak}


def run_bench() -> list:
    logits, target = _data(*SHAPE, torch.bfloat16)
    x = logits.requires_grad_(True)
    results = []
    for eps in (0.0, 0.1):
        results.append(measure("torch", F.cross_entropy, x, target, eps))
        for fwd_tile, bwd_tile in VARIANTS:
            tce.CE_FWD_TILE, tce.CE_BWD_TILE = fwd_tile, bwd_tile
            tag = " (default)" if (fwd_tile, bwd_tile) == DEFAULT else ""
            results.append(measure(f"ss fwd{fwd_tile} bwd{bwd_tile}{tag}", cross_entropy, x, target, eps))
    tce.CE_FWD_TILE, tce.CE_BWD_TILE = DEFAULT
    return results


def table(gate_rows: list, results: list) -> str:
    lines = ["gate: shape dtype eps ss_err torch_err ok"]
    lines += [f"  {r['shape']:12} {r['dtype']:15} {r['eps']:.1f} {r['ss_err']:.2e} {r['torch_err']:.2e} {r['ok']}"
              for r in gate_rows]
    lines.append(f"{SHAPE[0]}x{SHAPE[1]} bf16: impl, eps, fwd ms, fwd+bwd ms, peak MiB, speed-up vs torch (fwd+bwd)")
    base = {r["eps"]: r for r in results if r["impl"] == "torch"}
    for r in results:
        lines.append(f"  {r['impl']:46} {r['eps']:.1f} {r['fwd_ms']:7.3f} {r['fwd_bwd_ms']:7.3f} "
                     f"{r['peak_mib']:8.0f} {base[r['eps']]['fwd_bwd_ms'] / r['fwd_bwd_ms']:5.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="splitsoftmax bench cross_entropy", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="folder for cross_entropy.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench cross_entropy needs a CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    gate_rows = gate()
    results = run_bench()
    import triton
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with open(os.path.join(args.out, "cross_entropy.json"), "w") as f:
        json.dump({"meta": meta, "gate": gate_rows, "results": results}, f, indent=1)
    print(json.dumps(meta))
    print(table(gate_rows, results))
    return 0 if all(r["ok"] for r in gate_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
