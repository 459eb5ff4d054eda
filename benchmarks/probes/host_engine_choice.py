"""Probe: what the autograd engine's choices save in host time per attention forward+backward.

    PYTHONPATH=. python3 benchmarks/probes/host_engine_choice.py OUTDIR

At the host bench's three causal bf16 shapes (B=1 H=8 S=512, B=1 H=16 S=1k, B=2 H=32 S=2k, D=128),
300 back-to-back ``ss.attention`` forward+backward calls, timed as ``bench host`` times them (host
time: no synchronisation until the last call), each way in one process:

- ``backward``: ``out.backward(dout)``, the engine's device threads on (torch's default);
- ``threads off``: the same under ``torch.autograd.set_multithreading_enabled(False)``;
- ``run_backward``: ``Variable._execution_engine.run_backward`` called directly (what
  ``Tensor.backward`` reaches after its Python argument handling);
- both: ``run_backward`` with the threads off.

Every way's gradients must equal the default's bit for bit (the same kernels run). Backs no
setting: the library flips no global switch; docs/ARCHITECTURE.md ("Host time per call") documents
the choice for users. Prints a table last and writes ``host_engine_choice.json`` to OUTDIR.
"""
import json
import os
import sys
import time

import torch
from torch.autograd import Variable

import splitsoftmax as ss

CALLS = 300
SHAPES = [(1, 8, 512), (1, 16, 1024), (2, 32, 2048)]


def per_call_us(fn, calls=CALLS):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / calls


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for b, h, s in SHAPES:
        q, k, v = (torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)

        def backward():
            q.grad = k.grad = v.grad = None
            ss.attention(q, k, v, causal=True).backward(dout)

        def run_backward():
            q.grad = k.grad = v.grad = None
            out = ss.attention(q, k, v, causal=True)
            Variable._execution_engine.run_backward((out,), (dout,), False, False, (), True, True)

        grads = {}
        times = {}
        for name, fn, threads in (("backward", backward, True), ("threads off", backward, False),
                                  ("run_backward", run_backward, True),
                                  ("run_backward, threads off", run_backward, False)):
            with torch.autograd.set_multithreading_enabled(threads):
                times[name] = per_call_us(fn)
                for t in (q, k, v):
                    t.grad = None
                fn()
                grads[name] = [t.grad.clone() for t in (q, k, v)]
        same = {name: all(torch.equal(a, b) for a, b in zip(g, grads["backward"])) for name, g in grads.items()}
        rows.append({"shape": f"B={b} H={h} S={s}", "host_us": times, "same_grads": same})
        print(rows[-1], flush=True)
    with open(os.path.join(out_dir, "host_engine_choice.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    names = list(rows[0]["host_us"])
    print(f"\n{'shape':20s} " + " ".join(f"{n:>26s}" for n in names) + "  grads equal")
    for r in rows:
        print(f"{r['shape']:20s} " + " ".join(f"{r['host_us'][n]:26.1f}" for n in names)
              + f"  {all(r['same_grads'].values())}")
    return 0 if all(all(r["same_grads"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bench_out"))
