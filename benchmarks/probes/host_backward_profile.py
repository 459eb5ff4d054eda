"""Probe: where the host time of an attention forward+backward goes, by function.

    PYTHONPATH=. python3 benchmarks/probes/host_backward_profile.py

The host bench's shortest causal row (B=1 H=8 S=512, D=128, bf16), forward+backward, with the
autograd engine's threads off (``torch.autograd.set_multithreading_enabled(False)``: the backward
then runs on the calling thread, where cProfile sees it): 300 calls timed, then 300 under cProfile,
its functions printed by own time and by cumulative time. Backs no setting: it says which layers a
leaner backward would remove (docs/benchmarks/host.md).
"""
import cProfile
import io
import pstats
import time

import torch

import splitsoftmax as ss


def main() -> None:
    torch.autograd.set_multithreading_enabled(False)
    q, k, v = (torch.randn(1, 8, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def step():
        ss.attention(q, k, v, causal=True).backward(dout)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(300):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"threads off, host us a call: {(t1 - t0) / 300 * 1e6:.1f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        step()
    torch.cuda.synchronize()
    prof.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(45)
        print(text.getvalue())


if __name__ == "__main__":
    main()
