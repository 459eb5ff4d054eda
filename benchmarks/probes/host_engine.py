"""Probe: where the host time of an attention forward+backward goes through the autograd engine.

    PYTHONPATH=. python3 benchmarks/probes/host_engine.py

B=1 H=16 S=1024 D=128 bf16 causal (the host bench's row). A plain ``autograd.Function`` around the
forward op and the backward's two steps (row statistics, then the backward op), 300 calls back to
back, the engine's device threads on and off (``torch.autograd.set_multithreading_enabled``),
printing per call: the host time, the time inside the backward's body and its two steps, and the
time from ``backward()`` to the body and from the body's end to the return; then the same body
called directly (no engine); then ``ss.attention`` forward+backward both ways. Prints its rows
(docs/benchmarks/host.md).

Backs no setting: a diagnosis of the host time per call (docs/ARCHITECTURE.md, "Host time per call").
"""
import time, io, cProfile, pstats
import torch
from splitsoftmax.ops import _registry
from splitsoftmax.ops.attention import op as ops

dev = "cuda"
def per_call(fn, n=300):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6

B, H, S, D = 1, 16, 1024, 128
q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
scale = D ** -0.5
acc = {"body": 0.0, "stats": 0.0, "kern": 0.0, "n": 0}
prof = {"p": None}

def body(q, k, v, o, l, do_):
    t0 = time.perf_counter()
    lse, delta = ops.backward_stats(o, l, do_, None)
    t1 = time.perf_counter()
    g = _registry.call("attn_bwd", q, k, v, do_, lse, delta, scale, True, 0, None, 0.0, None, None, None, None, None)
    t2 = time.perf_counter()
    acc["stats"] += t1 - t0; acc["kern"] += t2 - t1; acc["body"] += t2 - t0; acc["n"] += 1
    return g

class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        o, l = ops.attn_fwd(q, k, v, scale, True, 0)
        ctx.save_for_backward(q, k, v, o, l)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(l)
        return o, l
    @staticmethod
    def backward(ctx, do_, dl):
        marks["t_start"] = time.perf_counter()
        if prof["p"] is not None:
            prof["p"].enable()
        q, k, v, o, l = ctx.saved_tensors
        dq, dk, dv, _ = body(q, k, v, o, l, do_)
        if prof["p"] is not None:
            prof["p"].disable()
        marks["t_end"] = time.perf_counter()
        return dq, dk, dv

def nog(f):
    def g():
        q.grad = k.grad = v.grad = None
        f()
    return g
def reset():
    for key in acc: acc[key] = 0.0 if key != "n" else 0
def report(name, us):
    n = max(acc["n"], 1)
    print(f"{name:50s} {us:8.1f} us/call | in body {acc['body']/n*1e6:7.1f} (stats {acc['stats']/n*1e6:6.1f}, "
          f"bwd op {acc['kern']/n*1e6:6.1f}) over {acc['n']} calls", flush=True)

with torch.no_grad():
    o0, l0 = ops.attn_fwd(q, k, v, scale, True, 0)
marks = {"pre": 0.0, "post": 0.0, "t_call": 0.0, "t_start": 0.0, "t_end": 0.0}
def timed_backward():
    q.grad = k.grad = v.grad = None
    o = F.apply(q, k, v)[0]
    marks["t_call"] = time.perf_counter()
    o.backward(do)
    t = time.perf_counter()
    marks["pre"] += marks["t_start"] - marks["t_call"]
    marks["post"] += t - marks["t_end"]
for _ in range(20): F.apply(q, k, v)[0].backward(do)
for mt in (True, False, True):
    with torch.autograd.set_multithreading_enabled(mt):
        reset(); marks["pre"] = marks["post"] = 0.0
        us = per_call(timed_backward); report(f"engine, multithreading {mt}", us)
        n = acc["n"]
        print(f"    backward() call to body start {marks['pre']/n*1e6:7.1f} us, body end to return {marks['post']/n*1e6:7.1f} us")
with torch.no_grad():
    reset(); us = per_call(lambda: body(q, k, v, o0, l0, do)); report("direct, no_grad, leaf tensors", us)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    reset(); us = per_call(lambda: body(qd, kd, vd, o0, l0, do)); report("direct, no_grad, detached", us)
reset(); us = per_call(lambda: body(q.detach(), k.detach(), v.detach(), o0, l0, do)); report("direct, grad mode on, detached", us)
# the same body when the GPU is busy: host time with a queue ahead of it
big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
def queued():
    big @ big
    body(q.detach(), k.detach(), v.detach(), o0, l0, do)
reset(); us = per_call(queued, 100); report("direct after a 1 ms matmul each call", us)
prof["p"] = cProfile.Profile()
for _ in range(100):
    F.apply(q, k, v)[0].backward(do)
torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(prof["p"], stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:6000])
import splitsoftmax as ss
def ssfb():
    q.grad = k.grad = v.grad = None
    ss.attention(q, k, v, causal=True).backward(do)
for mt in (True, False):
    with torch.autograd.set_multithreading_enabled(mt):
        print(f"ss fwd+bwd grads None, multithreading {mt}: {per_call(ssfb):7.1f} us")
