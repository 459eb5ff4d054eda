"""Probe: device time per kernel of one training step of ``bench model``'s Llama-shaped model,
splitsoftmax beside SDPA cuDNN.

    PYTHONPATH=. python3 benchmarks/probes/model_step_kernels.py OUTDIR [SxB ...]

For each shape (default 8192x1 and 2048x4): the torch profiler's device time per kernel name,
averaged over 3 steps after 2, for ``splitsoftmax`` and ``sdpa`` under cuDNN; printed side by side
(largest difference first) with each one's total device time and its step time, written to
OUTDIR/model_prof.json (docs/benchmarks/model-step.md).

Backs no setting: a diagnosis of the training step's gap to cuDNN (which kernel to change next).
"""
import json
import sys
import types

import torch
from torch.profiler import ProfilerActivity, profile

from splitsoftmax.tools.bench import model as bm

STEPS = 3


def kernel_times(model, ids, impl: str) -> tuple[dict, float]:
    """{kernel name: us per step}, and the step's wall time (ms, events) over ``STEPS``."""
    bm._use(model, impl)
    for _ in range(2):
        bm.step(model, ids, impl)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            model.zero_grad(set_to_none=True)
            with bm._backend(impl):
                model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
    times = {e.key: e.device_time_total / STEPS for e in prof.key_averages() if e.device_time_total > 0}
    wall = bm.timed(model, ids, impl, STEPS)["ms"]
    return times, wall


def main(out_dir: str, shapes: list[str]) -> None:
    from splitsoftmax.integrations.transformers import register
    register()
    args = types.SimpleNamespace(vocab=32000, intermediate=8192, layers=8,
                                 shapes=[bm._shape(s) for s in shapes])
    model = bm.build(args)
    res = {}
    for s, b in args.shapes:
        ids = torch.randint(0, 32000, (b, s), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        mine, mine_ms = kernel_times(model, ids, "splitsoftmax")
        peer, peer_ms = kernel_times(model, ids, "sdpa_cudnn")
        res[f"{s}x{b}"] = {"splitsoftmax": mine, "sdpa_cudnn": peer, "ms": [mine_ms, peer_ms]}
        print(f"=== {s} x {b}: step ss {mine_ms:.2f} ms, cuDNN {peer_ms:.2f} ms; device total "
              f"ss {sum(mine.values()) / 1e3:.2f} ms, cuDNN {sum(peer.values()) / 1e3:.2f} ms", flush=True)
        names = sorted(set(mine) | set(peer), key=lambda n: -abs(mine.get(n, 0) - peer.get(n, 0)))
        for n in names[:24]:
            print(f"  ss {mine.get(n, 0):9.0f}  cuDNN {peer.get(n, 0):9.0f}  {n[:110]}", flush=True)
    json.dump(res, open(f"{out_dir}/model_prof.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["8192x1", "2048x4"])
