"""A long sequence split across ranks: one transformer block's attention through ``ss.sharded_attention``.

Every rank builds the same block (q/k/v/o projections, GQA, rotary positions) and the same random
hidden state ``x (B, S, E)``; ``ss.shard(..., layout="zigzag")`` keeps this rank's part of the
sequence (chunks ``r`` and ``2P-1-r`` of ``2P``, which balances causal work), the projections run
on the shard, ``ss.sharded_attention(causal=True, layout="zigzag")`` attends over the whole
sequence, and ``ss.unshard`` reassembles the output to check it, forward and backward, against the
same block run in one process with ``ss.attention``. Exits non-zero on a mismatch.

Launch (from the repository root, with splitsoftmax installed or on PYTHONPATH):

    # one node, 2 ranks (NCCL with a GPU per rank, else Gloo on CPU processes)
    torchrun --nproc_per_node=2 examples/long_context_example.py --seq 32768

    # two nodes, 8 GPUs each: run on every node, the endpoint being one node's address
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-id=ss-example \\
        --rdzv-endpoint=node0.example:29500 examples/long_context_example.py --seq 131072

    # MPI (CPU tensors; add --allow-run-as-root when running as root)
    mpirun -n 2 python examples/long_context_example.py
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

try:
    import splitsoftmax as ss
except ModuleNotFoundError:  # not installed: use the checkout this script lives in
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import splitsoftmax as ss
from splitsoftmax.tools import launcher


class Block(torch.nn.Module):
    """The attention half of a transformer block: ``x (B, S, E) -> (B, S, E)``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, hidden // heads
        self.wq = torch.nn.Linear(hidden, heads * self.d, bias=False)
        self.wk = torch.nn.Linear(hidden, kv_heads * self.d, bias=False)
        self.wv = torch.nn.Linear(hidden, kv_heads * self.d, bias=False)
        self.wo = torch.nn.Linear(heads * self.d, hidden, bias=False)

    def heads(self, x: torch.Tensor, n: int, pos: torch.Tensor) -> torch.Tensor:
        """``(B, S, n*D)`` -> ``(B, n, S, D)`` with rotary embedding at global positions ``pos (S,)``."""
        b, s, _ = x.shape
        x = x.view(b, s, n, self.d).transpose(1, 2)
        freq = 10000.0 ** (-torch.arange(0, self.d, 2, device=x.device, dtype=torch.float32) / self.d)
        ang = pos.to(torch.float32)[:, None] * freq[None, :]  # [S, D/2]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, attend) -> torch.Tensor:
        q = self.heads(self.wq(x), self.h, pos)
        k = self.heads(self.wk(x), self.hkv, pos)
        v = self.wv(x).view(x.shape[0], x.shape[1], self.hkv, self.d).transpose(1, 2)
        o = attend(q, k, v)  # [B, H, S, D]
        return self.wo(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


def summed(t: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``t`` over the ranks (gather every rank's copy with ``ss.unshard``, then add)."""
    return ss.unshard(t.unsqueeze(0).contiguous(), 0, group=group).sum(0)


def rel_err(x: torch.Tensor, want: torch.Tensor) -> float:
    return ((x.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=None, help="global sequence length (default 8192 GPU, 256 CPU)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    opts = p.parse_args(argv)
    kind = launcher.launched_by()
    if kind is None:
        print("launch me with torchrun or mpirun (see the docstring: python examples/long_context_example.py -h)",
              file=sys.stderr)
        return 2
    group, device, rank, world = launcher.init_ranks(kind)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    s = opts.seq or (8192 if device.type == "cuda" else 256)

    torch.manual_seed(0)  # the same weights and inputs on every rank
    block = Block(opts.hidden, opts.heads, opts.kv_heads).to(device, dtype)
    x = torch.randn(1, s, opts.hidden, device=device, dtype=dtype, requires_grad=True)
    target = torch.randn(1, s, opts.hidden, device=device, dtype=dtype)
    pos = torch.arange(s, device=device)

    # sharded: this rank's zigzag part of the sequence (positions too), attention over all of it
    x_r = ss.shard(x, 1, group=group, layout="zigzag")
    pos_r = ss.shard(pos, 0, group=group, layout="zigzag")
    attend = lambda q, k, v: ss.sharded_attention(q, k, v, causal=True, group=group, layout="zigzag")  # noqa: E731
    y_r = block(x_r, pos_r, attend)
    (y_r.float() * ss.shard(target, 1, group=group, layout="zigzag").float()).sum().backward()
    y = ss.unshard(y_r.detach(), 1, group=group, layout="zigzag")
    grads = {"x": x.grad}  # shard's backward already gathered every rank's part
    grads |= {n: summed(p.grad, group) for n, p in block.named_parameters()}  # data-parallel style sum

    # reference: the same block on the full sequence in this process
    x_ref = x.detach().clone().requires_grad_(True)
    block.zero_grad()
    y_ref = block(x_ref, pos, lambda q, k, v: ss.attention(q, k, v, causal=True))
    (y_ref.float() * target.float()).sum().backward()
    want = {"x": x_ref.grad} | {n: p.grad for n, p in block.named_parameters()}

    errs = {"output": rel_err(y, y_ref.detach())} | {f"grad {n}": rel_err(grads[n], want[n]) for n in want}
    ok = all(e <= tol for e in errs.values())
    if rank == 0:
        print(f"{world} ranks ({kind}, {device.type}, {dtype}), S={s}, this rank's shard {x_r.shape[1]} positions")
        for name, e in errs.items():
            print(f"  {name:<14} max rel err {e:.2e}  (tolerance {tol:g})")
        print("OK: sharded block matches one process" if ok else "MISMATCH")
    if kind == "torchrun":
        torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
