"""Probe: the spread of the host bench's forward+backward rows, and what it follows.

    PYTHONPATH=. python3 benchmarks/probes/host_spread.py OUTDIR

At the host bench's causal bf16 shapes (B=1 H=8 S=512 and B=1 H=16 S=1k, D=128): ``ROUNDS`` rounds
of ``CALLS`` back-to-back forward+backward calls each (host time per call, as ``bench host`` times a
round), splitsoftmax and cuDNN's SDPA interleaved round by round, three ways in one process:
``default``; ``gc off`` (Python's cyclic collector disabled around the rounds: its pauses land in
whichever call triggers them); ``threads off`` (``torch.autograd.set_multithreading_enabled(False)``:
no hand-off to the engine's device thread, whose wake-ups cost what the scheduler gives them).
Prints every round and the median per way; writes ``host_spread.json`` to OUTDIR.
"""
import gc
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import splitsoftmax as ss
from splitsoftmax.tools.bench.host import CALLS, per_call_us

ROUNDS = 7
SHAPES = [(1, 8, 512), (1, 16, 1024)]


def cases(b, h, s):
    q, k, v = (torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def mine():
        ss.attention(q, k, v, causal=True).backward(dout)

    def peer():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
    return mine, peer


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    rows = []
    for shape in SHAPES:
        mine, peer = cases(*shape)
        for fn in (mine, peer):
            for _ in range(10):
                fn()
        for way in ("default", "gc off", "threads off"):
            if way == "gc off":
                gc.collect()
                gc.disable()
            ctx = torch.autograd.set_multithreading_enabled(way != "threads off")
            with ctx:
                rounds = [(per_call_us(mine)[0], per_call_us(peer)[0]) for _ in range(ROUNDS)]
            gc.enable()
            row = {"shape": shape, "way": way, "ss": [r[0] for r in rounds], "cudnn": [r[1] for r in rounds]}
            row["ss_median"], row["cudnn_median"] = statistics.median(row["ss"]), statistics.median(row["cudnn"])
            rows.append(row)
            print(f"{shape} {way:11s} ss " + " ".join(f"{x:6.1f}" for x in row["ss"]) + "  cudnn "
                  + " ".join(f"{x:6.1f}" for x in row["cudnn"]), flush=True)
    with open(os.path.join(out, "host_spread.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"{'shape':16s} {'way':11s} {'ss median':>9s} {'cudnn median':>12s} {'ratio':>6s}")
    for r in rows:
        print(f"{str(r['shape']):16s} {r['way']:11s} {r['ss_median']:9.1f} {r['cudnn_median']:12.1f} "
              f"{r['ss_median'] / r['cudnn_median']:6.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "host_spread_out")
