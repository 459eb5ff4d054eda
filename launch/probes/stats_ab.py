"""Probe (tuning data): A/B of the statistics-pass structure (masked tail tile always or only when
the range has one; a per-lane row-sum accumulator carried or not), interleaved in one process.

    PYTHONPATH=. python3 launch/probes/stats_ab.py OUTDIR
"""
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _online(m, l, x):
    m_new = tl.maximum(m, tl.max(x, axis=1))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2((x - ref[:, None]) * LOG2E)
    l = l * tl.math.exp2((m - ref) * LOG2E) + tl.sum(p, axis=1)
    return m_new, l


@triton.jit
def k(x_ptr, pm_ptr, pl_ptr, R, N, stride_x, chunk, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
      TAIL_IF: tl.constexpr, TOTAL: tl.constexpr):
    rows = tl.program_id(0) + tl.arange(0, 1)
    rmask = rows < R
    s = tl.program_id(1)
    start = s * chunk
    end = tl.minimum(start + chunk, N)
    xb = x_ptr + rows[:, None].to(tl.int64) * stride_x
    cols = tl.arange(0, BLOCK_N)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    total = tl.zeros([1, BLOCK_N], tl.float32)
    n_full = (end - start) // BLOCK_N
    for i in tl.range(n_full, num_stages=STAGES):
        c0 = tl.multiple_of(start + i * BLOCK_N, BLOCK_N)
        x = tl.load(xb + (c0 + cols)[None, :], mask=rmask[:, None], other=float("-inf"),
                    eviction_policy="evict_last").to(tl.float32)
        m, l = _online(m, l, x)
        if TOTAL:
            total += x
    if TAIL_IF:
        if start + n_full * BLOCK_N < end:
            c = start + n_full * BLOCK_N + cols
            x = tl.load(xb + c[None, :], mask=rmask[:, None] & (c < end)[None, :], other=float("-inf")).to(tl.float32)
            m, l = _online(m, l, x)
    else:
        c = start + n_full * BLOCK_N + cols
        x = tl.load(xb + c[None, :], mask=rmask[:, None] & (c < end)[None, :], other=float("-inf")).to(tl.float32)
        m, l = _online(m, l, x)
    off = rows.to(tl.int64) * tl.num_programs(1) + s
    tl.store(pm_ptr + off, m, mask=rmask)
    tl.store(pl_ptr + off, l + tl.sum(total, axis=1) * 0.0, mask=rmask)


def main():
    shapes = [  # R, N, dtype, splits, block, [(warps, stages)]
        (512, 262144, torch.bfloat16, 1, 8192, [(8, 3), (16, 1), (8, 1)]),
        (8, 1 << 24, torch.float32, 66, 4096, [(4, 3), (8, 1), (8, 3)]),
        (16384, 4096, torch.float32, 1, 4096, [(4, 1), (8, 1)]),
        (8192, 131072, torch.bfloat16, 1, 8192, [(8, 3), (16, 1)]),
    ]
    out = []
    for R, N, dt, S, B, cfgs in shapes:
        x = torch.randn(R, N, device="cuda", dtype=dt)
        tiles = triton.cdiv(N, B)
        chunk = triton.cdiv(tiles, S) * B
        S = triton.cdiv(N, chunk)
        pm = torch.empty(R, S, device="cuda")
        pl = torch.empty_like(pm)
        ref = torch.logsumexp(x[:4].double(), 1)
        nb = x.numel() * x.element_size()
        for rep in range(2):
            for w, st in cfgs:
                for tail_if, total in ((0, 0), (1, 0), (0, 1), (1, 1)):
                    f = lambda: k[(R, S)](x, pm, pl, R, N, x.stride(0), chunk, BLOCK_N=B, STAGES=st, TAIL_IF=tail_if,
                                          TOTAL=total, num_warps=w)
                    f()
                    mm = pm[:4].double().max(1).values
                    lse = mm + torch.log((pl[:4].double() * torch.exp(pm[:4].double() - mm[:, None])).sum(1))
                    err = (lse - ref).abs().max().item()
                    ms = do_bench(f, warmup=25, rep=100, return_mode="median")
                    line = f"{R}x{N} {str(dt)[6:]:8s} S{S:<3d} w{w:<2d} s{st} tail_if{tail_if} total{total} rep{rep}: {nb / ms / 1e6:6.0f} GB/s err {err:.1e}"
                    out.append(line)
                    print(line, flush=True)
        del x
    with open(sys.argv[1] + "/stats_ab.txt", "w") as f:
        f.write("\n".join(out))


if __name__ == "__main__":
    main()
