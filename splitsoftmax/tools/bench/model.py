"""Benchmark of a Hugging Face training step: a Llama-shaped model with random weights.

``python -m splitsoftmax bench model --out DIR`` builds, in one process on one GPU, a transformers
``LlamaForCausalLM`` from a ``LlamaConfig`` (no download: 8 layers, hidden 2048, 16 query / 4 kv
heads, head dim 128, bf16, random weights from a fixed seed) and times one training step (forward,
loss, backward) at each ``--shapes`` (``S`` x batch; default 8192 x 1 and 2048 x 4) with

- ``sdpa`` under SDPA's flash backend, ``sdpa`` under its cuDNN backend, and
- ``splitsoftmax`` (``splitsoftmax.integrations.transformers.register()``),

all on the same weights and tokens: median step time of ``--steps`` (after two warm-up steps), the
peak memory of a step, and each one's loss and first-layer gradient against the truth: a copy of
the same model (bf16 weights, float32 rotary frequencies) run in float32 (``sdpa``, whose float32
kernels keep float32 throughout). A step's loss difference is one signed sum over its tokens, so the
differences are also taken over ``--error-batches`` batches of tokens (the first the timed one) and
averaged; ``--error-batches 0`` times alone (the float32 model's attention does not fit at 32k).
Writes ``model.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

IMPLS = ("sdpa_flash", "sdpa_cudnn", "splitsoftmax")


DIMS = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=128)


def build(args, device: str = "cuda", **dims):
    """The bf16 model (random weights, seed 0) of ``args`` (vocab, intermediate, layers, shapes) and
    ``DIMS`` (``dims`` overrides them). Built in bf16 as transformers' loaders build it: the rotary
    frequencies (a buffer outside the state dict) stay float32; ``.to(dtype=torch.bfloat16)`` would
    round them, and a RoPE off by that rounding times the position is no attention error."""
    from transformers import LlamaConfig, LlamaForCausalLM, __version__
    # the keyword is ``dtype`` from transformers 4.56 on, ``torch_dtype`` before (the hf extra allows 4.53)
    key = "dtype" if tuple(int(n) for n in __version__.split(".")[:2]) >= (4, 56) else "torch_dtype"
    config = LlamaConfig(**{**DIMS, **dims}, vocab_size=args.vocab, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, max_position_embeddings=max(s for s, _ in args.shapes),
                         rope_theta=500000.0, attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, **{key: torch.bfloat16}).to(device)


def _backend(name: str):
    """The SDPA backend context of ``name`` (a null context for the others)."""
    import contextlib
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return {"sdpa_flash": lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION),
            "sdpa_cudnn": lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)}.get(name, contextlib.nullcontext)()


def _use(model, impl: str) -> None:
    """Switch the model's attention implementation (its config is shared by every layer)."""
    from ..verify.model import set_attention
    set_attention(model, "splitsoftmax" if impl == "splitsoftmax" else "sdpa")


def step(model, ids, impl: str):
    """One forward + backward; returns the loss (float) and the first layer's flat gradient (float32)."""
    model.zero_grad(set_to_none=True)
    with _backend(impl):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = [p.grad.float().flatten() for p in model.model.layers[0].parameters() if p.grad is not None]
    return loss.item(), torch.cat(grads)


def timed(model, ids, impl: str, steps: int) -> dict:
    """Median step time (ms) of ``steps`` after two warm-ups, and the peak memory of a step (GiB)."""
    for _ in range(2):
        step(model, ids, impl)
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with _backend(impl):
            model(input_ids=ids, labels=ids).loss.backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": statistics.median(times), "times_ms": times,
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30}


def truth(model, ids):
    """Loss and first-layer gradient of the same model run in float32: a copy of every parameter and
    buffer (the rotary frequencies too) and of the config, cast to float32, under ``sdpa``."""
    return truths(model, [ids])[0]


def truths(model, batches: list) -> list:
    """:func:`truth` of each batch of token ids, from one float32 copy."""
    import copy
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model).float()
    low = [n for n, t in [*ref.named_parameters(), *ref.named_buffers()] if t.dtype != torch.float32]
    if low:
        raise RuntimeError(f"the float32 reference holds non-float32 tensors: {low[:4]}")
    _use(ref, "sdpa")
    out = [step(ref, ids, "sdpa_fp32") for ids in batches]
    del ref
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def errors(model, ids, impl: str, ref: tuple) -> dict:
    """``impl``'s loss and its error, and the relative (2-norm) difference of its first-layer gradient,
    against ``ref = truth(model, ids)``."""
    ref_loss, ref_grad = ref
    _use(model, impl)
    loss, grad = step(model, ids, impl)
    return {"loss": loss, "loss_err": abs(loss - ref_loss),
            "grad_rel_err": ((grad - ref_grad).norm() / ref_grad.norm()).item()}


def errors_over(model, batches: list, impl: str, refs: list) -> dict:
    """:func:`errors` of the first batch, and the loss and gradient differences over every batch
    (``refs = truths(model, batches)``): each batch's, and their means."""
    each = [errors(model, ids, impl, ref) for ids, ref in zip(batches, refs)]
    return {**each[0], "loss_err_batches": [e["loss_err"] for e in each],
            "loss_err_mean": statistics.fmean(e["loss_err"] for e in each),
            "grad_rel_err_mean": statistics.fmean(e["grad_rel_err"] for e in each)}


def run_shape(model, s: int, b: int, steps: int, error_batches: int = 1) -> dict:
    """Every implementation at ``S = s``, batch ``b``: loss and gradient errors (the timed batch's, and
    over ``error_batches`` batches), then time and memory (the other batches' truths dropped first: a
    step's peak holds the timed batch's truth alone, as it did before they were taken).
    ``error_batches = 0``: time and memory alone, no float32 truth (at lengths where the float32
    model's attention does not fit)."""
    dev = next(model.parameters()).device
    batches = [torch.randint(0, model.config.vocab_size, (b, s), device=dev,
                             generator=torch.Generator(device=dev).manual_seed(seed))
               for seed in range(1, 1 + max(error_batches, 1))]
    refs = truths(model, batches) if error_batches else []
    rec = {"S": s, "B": b, **({"loss_fp32": refs[0][0]} if refs else {})}
    for impl in IMPLS:
        rec[impl] = _measured(impl, lambda: errors_over(model, batches, impl, refs)) if refs else {}
    del refs[1:]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for impl in IMPLS:
        if "error" not in rec[impl]:
            _use(model, impl)
            rec[impl] = {**rec[impl], **_measured(impl, lambda: timed(model, batches[0], impl, steps))}
        shown = {k: v for k, v in rec[impl].items() if k not in ("times_ms", "loss_err_batches")}
        print(json.dumps({impl: shown, "S": s, "B": b}), flush=True)
    return rec


def _measured(impl: str, measure) -> dict:
    """``measure()``, or the error a peer's backend raised (``splitsoftmax``'s is raised)."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 (a backend may refuse a shape; splitsoftmax must not)
        if impl == "splitsoftmax":
            raise
        return {"error": repr(e)[:300]}


def table(rows: list[dict]) -> str:
    lines = ["S     B | impl          ms      peak GiB  loss err   grad rel err | mean over batches: loss err, "
             "grad rel err | vs cuDNN"]
    for r in rows:
        cudnn = r.get("sdpa_cudnn", {}).get("ms")
        for impl in IMPLS:
            x = r[impl]
            if "error" in x:
                lines.append(f"{r['S']:<5} {r['B']} | {impl:<12} {x['error'][:60]}")
                continue
            ratio = f"{cudnn / x['ms']:.2f}x" if cudnn else ""
            errs = (f"{x['loss_err']:9.2e} {x['grad_rel_err']:12.4e} | ({len(x['loss_err_batches'])}) "
                    f"{x['loss_err_mean']:9.2e} {x['grad_rel_err_mean']:12.4e}" if "loss_err" in x else
                    f"{'-':>9} {'-':>12} | (0) {'-':>9} {'-':>12}")
            lines.append(f"{r['S']:<5} {r['B']} | {impl:<12} {x['ms']:7.1f} {x['peak_gib']:9.2f} {errs} | {ratio}")
    return "\n".join(lines)


def _shape(text: str) -> tuple[int, int]:
    s, b = text.lower().split("x")
    return int(s), int(b)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="splitsoftmax bench model", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="directory for model.json")
    ap.add_argument("--shapes", type=_shape, nargs="*", default=[(8192, 1), (2048, 4)], help="SxB, e.g. 8192x1")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--error-batches", type=int, default=4,
                    help="batches of tokens the loss and gradient differences are averaged over (0: no "
                         "float32 truth, time and memory alone)")
    args = ap.parse_args(argv)
    if args.error_batches < 0:
        ap.error(f"--error-batches must be >= 0, got {args.error_batches}")
    if not torch.cuda.is_available():
        print("bench model needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    from splitsoftmax.integrations.transformers import register
    register()
    import transformers
    import triton
    model = build(args)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "cudnn": torch.backends.cudnn.version(), "argv": sys.argv,
              "model": {"layers": args.layers, "hidden": DIMS["hidden_size"], "heads": "16/4",
                        "head_dim": DIMS["head_dim"], "vocab": args.vocab, "intermediate": args.intermediate,
                        "dtype": "bfloat16"},
              "rows": [run_shape(model, s, b, args.steps, args.error_batches) for s, b in args.shapes]}
    with open(os.path.join(args.out, "model.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
