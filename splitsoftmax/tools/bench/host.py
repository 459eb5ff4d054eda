"""Host time per call at short lengths: splitsoftmax beside torch, in one run.

Host time is the wall time of ``CALLS`` back-to-back calls with no synchronisation between them,
divided by ``CALLS`` (the device is synchronised before the first); wall time adds the final
synchronisation. A row is host-bound where host time is close to wall time. Each splitsoftmax row
is timed twice in the same run, bound launches on and off (``configs.LAUNCH_DIRECT``), beside its
peer, in ``ROUNDS`` rounds that interleave the three; a row gives each one's median round (a
forward+backward round's time follows where the scheduler puts the autograd engine's device thread,
which runs the backward: one round is not a measurement); its target (softmax within 1.5x torch's host time, attention within 2x cuDNN's, decode within
2x SDPA's, the merge within 25 us) is marked met or not. With ``--profile``
each splitsoftmax row is also profiled with cProfile (the top functions by cumulative time go to
the JSON). ``--compiles`` records, for causal attention forward+backward at a few new lengths,
how many Triton kernels each first call compiled and its time.

    python -m splitsoftmax bench host --out bench_out [--profile] [--compiles]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

CALLS = 300
ROUNDS = 5


def per_call_us(fn, calls: int = CALLS) -> tuple[float, float]:
    """``(host, wall)`` microseconds per call of ``fn`` over ``calls`` back-to-back calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / calls, 1e6 * (t2 - t0) / calls


def _sdpa_cudnn(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _attention_case(b, h, s, backward):
    import splitsoftmax as ss
    q, k, v = (torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
               for _ in range(3))
    dout = torch.randn_like(q)

    def mine():
        out = ss.attention(q, k, v, causal=True)
        if backward:
            out.backward(dout)

    def peer():
        out = _sdpa_cudnn(q, k, v, True)
        if backward:
            out.backward(dout)
    return mine, peer


def _decode_case():
    import splitsoftmax as ss
    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return (lambda: ss.attention(q, k, v)), (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def _softmax_case():
    import splitsoftmax as ss
    x = torch.randn(8, 4096, device="cuda")
    return (lambda: ss.softmax(x)), (lambda: torch.softmax(x, -1))


def _merge_case():
    import splitsoftmax as ss
    outs = torch.randn(4, 8, 32, 1, 128, device="cuda")
    lses = torch.randn(4, 8, 32, 1, device="cuda")
    return (lambda: ss.merge_states(outs, lses)), None


def _cross_entropy_case():
    import splitsoftmax as ss
    logits = torch.randn(4096, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 32000, (4096,), device="cuda")
    return (lambda: ss.cross_entropy(logits, target).backward()), \
        (lambda: F.cross_entropy(logits, target).backward())


# (case, peer, make, target): the target a host time per call, ("x", r): within r times the peer's,
# or ("us", t): within t microseconds; None: none set
CASES = [
    ("attention causal B=1 H=8 S=512 fwd", "SDPA cuDNN", lambda: _attention_case(1, 8, 512, False), ("x", 2.0)),
    ("attention causal B=1 H=8 S=512 fwd+bwd", "SDPA cuDNN", lambda: _attention_case(1, 8, 512, True), ("x", 2.0)),
    ("attention causal B=1 H=16 S=1024 fwd", "SDPA cuDNN", lambda: _attention_case(1, 16, 1024, False), ("x", 2.0)),
    ("attention causal B=1 H=16 S=1024 fwd+bwd", "SDPA cuDNN", lambda: _attention_case(1, 16, 1024, True),
     ("x", 2.0)),
    ("attention causal B=2 H=32 S=2048 fwd", "SDPA cuDNN", lambda: _attention_case(2, 32, 2048, False), ("x", 2.0)),
    ("attention causal B=2 H=32 S=2048 fwd+bwd", "SDPA cuDNN", lambda: _attention_case(2, 32, 2048, True),
     ("x", 2.0)),
    ("decode B=8 H=32/8 Sq=1 Sk=4096", "SDPA", _decode_case, ("x", 2.0)),
    ("softmax 8x4096 fp32", "torch.softmax", _softmax_case, ("x", 1.5)),
    ("merge_states 4 x (8,32,1,128)", "", _merge_case, ("us", 25.0)),
    ("cross_entropy 4096x32000 bf16 fwd+bwd", "F.cross_entropy", _cross_entropy_case, None),
]


def target_met(row: dict, target) -> "bool | None":
    """Whether ``row``'s host time (bound launches on) meets ``target`` (None: no target, or no peer)."""
    if target is None:
        return None
    kind, value = target
    if kind == "us":
        return row["host_us"] <= value
    return row["host_us"] <= value * row["peer_host_us"] if "peer_host_us" in row else None


def _timed(fn, direct: bool) -> tuple[float, float]:
    """:func:`per_call_us` of ``fn`` with ``configs.LAUNCH_DIRECT`` set to ``direct`` (restored after)."""
    from ...ops._triton import configs
    was = configs.LAUNCH_DIRECT
    configs.LAUNCH_DIRECT = direct
    try:
        return per_call_us(fn)
    finally:
        configs.LAUNCH_DIRECT = was


def _profile(fn, calls: int = 100) -> str:
    """cProfile's top functions (cumulative) over ``calls`` calls of ``fn``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    return text.getvalue()


def _median_round(rounds: list) -> tuple[float, float]:
    """The ``(host, wall)`` of the round whose host time is the median of ``rounds``."""
    return sorted(rounds)[len(rounds) // 2]


def run_rows(profile: bool, rounds: int = ROUNDS) -> list:
    rows = []
    for name, peer_name, make, target in CASES:
        mine, peer = make()
        ways = {"": lambda: _timed(mine, True), "unbound_": lambda: _timed(mine, False)}
        if peer is not None:
            ways["peer_"] = lambda: per_call_us(peer)
        times = {w: [] for w in ways}
        for _ in range(rounds):
            for w, timed in ways.items():
                times[w].append(timed())
        row = {"case": name, "peer": peer_name, "rounds": {w or "ss": t for w, t in times.items()}}
        for w, t in times.items():
            row[f"{w}host_us"], row[f"{w}wall_us"] = _median_round(t)
        row["target"] = None if target is None else f"<={target[1]:g}{target[0]}"
        row["met"] = target_met(row, target)
        if profile:
            row["profile"] = _profile(mine)
        rows.append(row)
    return rows


def run_compiles(lengths=(1001, 1024, 1100, 2049, 3000)) -> list:
    """Per new length: seconds of the first causal forward+backward and the kernels it compiled."""
    import splitsoftmax as ss
    from ..warmup import compiled_variants
    rows = []
    for s in lengths:
        q, k, v = (torch.randn(1, 16, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        before = compiled_variants()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ss.attention(q, k, v, causal=True).sum().backward()
        torch.cuda.synchronize()
        after = compiled_variants()
        grew = {n: after[n] - before.get(n, 0) for n in after if after[n] != before.get(n, 0)}
        rows.append({"S": s, "seconds": time.perf_counter() - t0, "compiled": grew})
    return rows


def table(rows: list) -> str:
    """Host and wall microseconds per call: splitsoftmax bound (``LAUNCH_DIRECT``), unbound, the peer;
    the target and whether it is met."""
    lines = [f"{'case':42s} {'ss host':>8s} {'ss wall':>8s} {'unbound':>8s} {'peer host':>9s} {'peer wall':>9s} "
             f"{'target':>9s} {'met':>4s}  peer"]
    for r in rows:
        peer = (f"{r['peer_host_us']:9.1f} {r['peer_wall_us']:9.1f}" if "peer_host_us" in r else " " * 19)
        met = {True: "yes", False: "NO", None: "-"}[r.get("met")]
        lines.append(f"{r['case']:42s} {r['host_us']:8.1f} {r['wall_us']:8.1f} {r.get('unbound_host_us', 0):8.1f} "
                     f"{peer} {r.get('target') or '-':>9s} {met:>4s}  {r['peer']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="splitsoftmax bench host", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="folder for host.json")
    ap.add_argument("--profile", action="store_true", help="cProfile each splitsoftmax row")
    ap.add_argument("--compiles", action="store_true", help="first-call compiles at new lengths")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench host needs a CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    import triton
    result = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "calls": CALLS, "rounds": ROUNDS}}
    if args.compiles:  # first: every length is new to the process
        result["compiles"] = run_compiles()
    result["rows"] = run_rows(args.profile)
    with open(os.path.join(args.out, "host.json"), "w") as f:
        json.dump(result, f, indent=1)
    for c in result.get("compiles", []):
        print(f"S={c['S']}: first call {c['seconds']:.2f} s, compiled {c['compiled']}")
    print(table(result["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
