"""Probe: where the time of a logsumexp goes (public call, launcher, statistics kernel, torch).

    PYTHONPATH=. python3 launch/probes/lse_diag.py
"""

import torch
from triton.testing import do_bench

import splitsoftmax as ss
from splitsoftmax.kernels import softmax as ks

for R, N in ((8, 1 << 24), (1, 1 << 28), (512, 262144)):
    x = torch.randn(R, N, device="cuda", dtype=torch.float32 if R < 100 else torch.bfloat16)
    nb = x.numel() * x.element_size()
    p = ks._plan(x, stats_only=True)
    for name, f in (("ss.logsumexp", lambda: ss.logsumexp(x)), ("lse_rows", lambda: ks.lse_rows(x)),
                    ("partials only", lambda: ks._partials(x, p) if p.splits > 1 else ks.lse_rows(x)),
                    ("torch.logsumexp", lambda: torch.logsumexp(x, -1))):
        f()
        ms = [do_bench(f, warmup=25, rep=100, return_mode="median") for _ in range(2)]
        print(f"{R}x{N} {p} {name:16s} " + " ".join(f"{nb / m / 1e6:6.0f}" for m in ms) + " GB/s", flush=True)
    del x
