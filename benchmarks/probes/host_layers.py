"""Host time per call of each layer under ``ss.softmax`` (8 x 4096 fp32) and the decode call (B 8,
H 32/8, 4096 keys, bf16), beside torch's: where the microseconds over the peer's go.

No setting: it backs the lean launch path's choices (docs/benchmarks/host.md). Each row is
``bench host``'s host time (back-to-back calls, no synchronisation, divided by the count)::

    PYTHONPATH=. python3 benchmarks/probes/host_layers.py OUTDIR
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

from splitsoftmax.tools.bench.host import per_call_us


def _rows() -> list:
    import splitsoftmax as ss
    from splitsoftmax.ops import _registry
    from splitsoftmax.ops.attention import fwd as attn_fwd
    from splitsoftmax.ops.attention import decode
    from splitsoftmax.ops.softmax import kernel as sm

    x = torch.randn(8, 4096, device="cuda")
    y, lse = torch.empty_like(x), torch.empty(8, device="cuda")
    sm.softmax_fwd(x, False)
    from splitsoftmax.ops._triton import configs
    run = next(v for k, v in configs.SOFTMAX.memo.items() if k[0] == "fwd" and k[1:3] == (8, 4096))
    bound = run[3]
    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    s = 128 ** -0.5
    cases = [
        ("softmax", "torch.softmax", lambda: torch.softmax(x, -1)),
        ("softmax", "torch.empty_like(x)", lambda: torch.empty_like(x)),
        ("softmax", "torch.empty((8, 4096), dtype, device)",
         lambda: torch.empty((8, 4096), dtype=x.dtype, device=x.device)),
        ("softmax", "x.add_(0) (one torch launch)", lambda: x.add_(0)),
        ("softmax", "ss.softmax", lambda: ss.softmax(x)),
        ("softmax", "_registry.call", lambda: _registry.call("softmax_fwd", x, False)),
        ("softmax", "custom op's implementation", lambda: _registry.IMPLS["softmax_fwd"](x, False)),
        ("softmax", "kernel.softmax_fwd", lambda: sm.softmax_fwd(x, False)),
        *([("softmax", "kernel.softmax_out (no lse)", lambda: sm.softmax_out(x, False))]
          if hasattr(sm, "softmax_out") else []),
        ("softmax", "bound(x, y, lse)", lambda: bound(x, y, lse)),
        ("softmax", "bound.direct((x, y, lse))", lambda: bound.direct((x, y, lse))),
        ("decode", "SDPA enable_gqa", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        ("decode", "ss.attention", lambda: ss.attention(q, k, v)),
        ("decode", "_registry.call", lambda: _registry.call("attn_fwd", q, k, v, s, False, 0)),
        ("decode", "fwd.attn_fwd", lambda: attn_fwd.attn_fwd(q, k, v, s, False, 0, out_dtype=q.dtype)),
        ("decode", "decode.plan", lambda: decode.plan(q, k, v, False, 0)),
        ("decode", "torch.empty x4 (out, lse, partials)", lambda: (
            torch.empty((8, 32, 1, 128), dtype=q.dtype, device=q.device),
            torch.empty((8, 32, 1), dtype=torch.float32, device=q.device),
            torch.empty((4, 256, 128), dtype=torch.float32, device=q.device),
            torch.empty((4, 256), dtype=torch.float32, device=q.device))),
    ]
    cases += _decode_launches(attn_fwd, q, k, v, s)
    rows = []
    for what, name, fn in cases:
        host, wall = per_call_us(fn, 2000)
        rows.append({"op": what, "layer": name, "host_us": host, "wall_us": wall})
        print(f"{what:8s} {name:42s} {host:8.2f} us host {wall:8.2f} us wall", flush=True)
    return rows


def _decode_launches(attn_fwd, q, k, v, s) -> list:
    """The decode call's two launches alone (the split forward's, the merge's: their bound C calls
    on kept operands), where this tree keeps them per geometry (none before it did)."""
    attn_fwd.attn_fwd(q, k, v, s, False, 0, out_dtype=q.dtype)
    runs = [r for r in getattr(attn_fwd, "_FWD_LAUNCHES", {}).values() if type(r).__name__ == "_Plain"]
    run = next((r for r in runs if r.merge is not None), None)
    if run is None or run.fwd[0].direct is None or run.merge.direct is None:
        return []
    out = torch.empty((8, 32, 1, 128), dtype=q.dtype, device=q.device)
    lse = torch.empty((8, 32, 1), dtype=torch.float32, device=q.device)
    outs = torch.empty((run.p.nsplit, 256, 128), dtype=torch.float32, device=q.device)
    lses = torch.empty((run.p.nsplit, 256), dtype=torch.float32, device=q.device)
    fwd, merge = run.fwd[0].direct, run.merge.direct
    return [("decode", f"split forward launch alone ({run.p.nsplit} splits)",
             lambda: fwd((q, k, v, outs, lses, lses, lses, lses))),
            ("decode", "merge launch alone", lambda: merge((outs, lses, out, lse)))]


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "host_layers_out"
    rows = _rows()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "host_layers.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
