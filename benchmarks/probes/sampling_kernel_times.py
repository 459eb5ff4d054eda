"""Probe: device time per kernel of one ``ss.sample`` draw.

    PYTHONPATH=. python3 benchmarks/probes/sampling_kernel_times.py OUTDIR

V = 128256 fp32 logits, batch 1 and 256, plain / top-k 50 / top-p 0.9 / min-p 0.1: the torch
profiler's device time per kernel averaged over 20 draws after 5 (warm L2, no flush), printed and
written to OUTDIR/samp_prof.json (docs/benchmarks/vocab-sampling.md).

Backs the records pass's sizes ``configs.SAMPLE_RECORDS_MIN`` / ``SAMPLE_GROUP`` and, with
``sampling_configs.py``, the settings of ``ops/sampling/config.py``.
"""
import sys, json
import torch
import splitsoftmax as ss
from torch.profiler import profile, ProfilerActivity
out = sys.argv[1]
V = 128256
res = {}
for n in (1, 256):
    x = torch.randn(n, V, device="cuda") * 3
    for name, kw in [("plain", {}), ("top_k=50", dict(top_k=50)), ("top_p=0.9", dict(top_p=0.9)),
                     ("min_p=0.1", dict(min_p=0.1))]:
        f = lambda: ss.sample(x, seed=1, offset=2, **kw)
        for _ in range(5): f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(20): f()
            torch.cuda.synchronize()
        ev = [(e.key, e.device_time_total / 20, e.count / 20) for e in p.key_averages() if e.device_time_total > 0]
        ev.sort(key=lambda t: -t[1])
        res[f"{n} {name}"] = ev
        print(f"--- batch {n} {name}: " + "; ".join(f"{k[:40]} {t:.1f}us x{c:g}" for k, t, c in ev), flush=True)
json.dump(res, open(f"{out}/samp_prof.json", "w"), indent=1)
