"""Probe: the host time of an attention-shaped autograd op as Python, as Python around C++, and as C++.

    PYTHONPATH=. python3 benchmarks/probes/host_cpp.py OUTDIR

The same work each way: a forward of one kernel into two fresh outputs (``out``, ``lse``), saving
q, k, v, out, lse; a backward of four kernels into five fresh buffers (row statistics ``lse2``,
``delta``; ``dq``, ``dk``, ``dv``). The kernels are stand-ins of one launch each (copies and a
fill: ``dq = dout``, ``dk = k``, ``dv = v``, ``delta = 1``, ``out = q``), so the rows differ only in
what runs on the host around them:

- ``python``: a Python ``torch.autograd.Function`` doing the allocations and launches in torch ops;
- ``python + C++ bodies``: the same Function whose forward and backward are one C++ call each;
- ``C++ Function``: a ``torch::autograd::Function`` built with ``torch.utils.cpp_extension.load_inline``
  (needs a C++ compiler and ninja on the GPU machine), called from Python once per forward;

each with the engine's device threads on and off (``torch.autograd.set_multithreading_enabled``),
B=1 H=16 S=1024 D=128 bf16 (the host bench's middle row), 300 calls back to back. Every way's
gradients are checked against the stand-ins' (``dq == dout``, ``dk == k``, ``dv == v``). Backs no
setting: how much of ``bench host``'s forward+backward gap a C++ op would close (docs/ARCHITECTURE.md,
"Host time per call"). Prints a table last and writes ``host_cpp.json`` to OUTDIR.
"""
import json
import os
import sys
import time

import torch

CALLS = 300
B, H, S, D = 1, 16, 1024, 128

CPP = r"""
#include <torch/extension.h>
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<at::Tensor> fwd_body(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  out.copy_(q);
  return {out, lse};
}

std::vector<at::Tensor> bwd_body(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout) {
  auto lse2 = at::empty_like(lse);
  auto delta = at::empty_like(lse);
  delta.fill_(1.0);
  auto dq = at::empty_like(q);
  auto dk = at::empty_like(k);
  auto dv = at::empty_like(v);
  dq.copy_(dout);
  dk.copy_(k);
  dv.copy_(v);
  return {dq, dk, dv};
}

struct Attn : public torch::autograd::Function<Attn> {
  static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v) {
    auto r = fwd_body(q, k, v);
    ctx->save_for_backward({q, k, v, r[0], r[1]});
    ctx->mark_non_differentiable({r[1]});
    return {r[0], r[1]};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto g = bwd_body(s[0], s[1], s[2], s[3], s[4], grads[0]);
    return {g[0], g[1], g[2]};
  }
};

std::vector<at::Tensor> attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  auto r = Attn::apply(q, k, v);
  return {r[0], r[1]};
}
"""


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


class PythonOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32, device=q.device)
        out.copy_(q)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        lse2, delta = torch.empty_like(lse), torch.empty_like(lse)
        delta.fill_(1.0)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dq.copy_(dout)
        dk.copy_(k)
        dv.copy_(v)
        return dq, dk, dv


def bodies_op(ext):
    class BodiesOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = ext.fwd_body(q, k, v)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            return tuple(ext.bwd_body(*ctx.saved_tensors, dout))
    return BodiesOp.apply


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    ways = {"python": PythonOp.apply}
    build = None
    try:
        from torch.utils.cpp_extension import load_inline
        t0 = time.perf_counter()
        ext = load_inline("ss_host_cpp_probe", cpp_sources=CPP, functions=["fwd_body", "bwd_body", "attn"],
                          build_directory=None, verbose=False)
        build = {"seconds": time.perf_counter() - t0}
        ways["python + C++ bodies"] = bodies_op(ext)
        ways["C++ Function"] = ext.attn
    except Exception as e:  # no compiler or ninja there: the Python row alone
        build = {"error": f"{type(e).__name__}: {e}"[:400]}
        print("C++ build failed:", build["error"], flush=True)
    rows = []
    for name, apply in ways.items():
        def step():
            q.grad = k.grad = v.grad = None
            apply(q, k, v)[0].backward(dout)
        for threads in (True, False):
            with torch.autograd.set_multithreading_enabled(threads):
                us = per_call_us(step)
                step()
                torch.cuda.synchronize()
                ok = torch.equal(q.grad, dout) and torch.equal(k.grad, k.detach()) and torch.equal(v.grad, v.detach())
            rows.append({"way": name, "threads": threads, "host_us": us, "grads_ok": ok})
            print(rows[-1], flush=True)
    with open(os.path.join(out_dir, "host_cpp.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "build": build,
                   "rows": rows}, f, indent=1)
    print(f"\n{'way':24s} {'threads':>8s} {'host us':>9s}  grads")
    for r in rows:
        print(f"{r['way']:24s} {str(r['threads']):>8s} {r['host_us']:9.1f}  {'ok' if r['grads_ok'] else 'WRONG'}")
    return 0 if all(r["grads_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bench_out"))
