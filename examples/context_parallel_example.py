"""A plain torch model trained context-parallel without edits: ``ss.context_parallel``.

The model is ordinary torch: its attention calls ``F.scaled_dot_product_attention(q, k, v,
is_causal=True, enable_gqa=True)`` and its rotary tables are buffers. Every rank builds the same
model and batch; inside ``ss.context_parallel(group, buffers=[tokens, labels, cos, sin], ...)`` the
buffers are this rank's zigzag shards of the sequence and every SDPA call attends over the whole
sequence (``ss.sharded_attention``). Each rank's loss is its share of the global mean and its
gradients are its share of the one-process gradients: summed over ranks (as data parallelism
would), loss and gradients are checked against the same step run in one process. Exits non-zero on
a mismatch.

Launch (from the repository root, with splitsoftmax installed or on PYTHONPATH):

    # one node, 2 ranks (NCCL with a GPU per rank, else Gloo on CPU processes)
    torchrun --nproc_per_node=2 examples/context_parallel_example.py --seq 8192

    # MPI (CPU tensors; add --allow-run-as-root when running as root)
    mpirun -n 2 python examples/context_parallel_example.py
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

try:
    import splitsoftmax as ss
except ModuleNotFoundError:  # not installed: use the checkout this script lives in
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import splitsoftmax as ss
from splitsoftmax.tools import launcher


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x (B, H, S, D)`` by the angles whose ``cos, sin`` are ``(S, D/2)``."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Layer(torch.nn.Module):
    """Pre-norm causal GQA attention with rotary q/k, then a GELU MLP: ``(B, S, E) -> (B, S, E)``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, hidden // heads
        self.wq = torch.nn.Linear(hidden, heads * self.d, bias=False)
        self.wkv = torch.nn.Linear(hidden, 2 * kv_heads * self.d, bias=False)
        self.wo = torch.nn.Linear(heads * self.d, hidden, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x, cos, sin):
        b, s, e = x.shape
        y = F.rms_norm(x, (e,))
        q = rotary(self.wq(y).view(b, s, self.h, self.d).transpose(1, 2), cos, sin)
        k, v = self.wkv(y).view(b, s, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, rotary(k, cos, sin), v, is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(F.rms_norm(x, (e,)))


class LM(torch.nn.Module):
    """Token ids ``(B, S)`` -> logits ``(B, S, V)``; rotary tables ``cos, sin (S, D/2)`` as buffers."""

    def __init__(self, seq: int, vocab: int, hidden: int, heads: int, kv_heads: int, layers: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(Layer(hidden, heads, kv_heads) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        d = hidden // heads
        angle = torch.arange(seq)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
        self.register_buffer("cos", angle.cos())
        self.register_buffer("sin", angle.sin())

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos.to(x.dtype), self.sin.to(x.dtype))
        return self.head(F.rms_norm(x, (x.shape[-1],)))


def train_step(model, tokens, labels, count: int) -> torch.Tensor:
    """Summed cross-entropy over ``count`` predicted tokens (the global count), backward."""
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / count
    loss.backward()
    return loss.detach()


def summed(t: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``t`` over the ranks (gather every rank's copy with ``ss.unshard``, then add)."""
    return ss.unshard(t.unsqueeze(0).contiguous(), 0, group=group).sum(0)


def rel_err(x: torch.Tensor, want: torch.Tensor) -> float:
    return ((x.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=None, help="global sequence length (default 4096 GPU, 128 CPU)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    opts = p.parse_args(argv)
    kind = launcher.launched_by()
    if kind is None:
        print("launch me with torchrun or mpirun (see the docstring: python examples/context_parallel_example.py -h)",
              file=sys.stderr)
        return 2
    group, device, rank, world = launcher.init_ranks(kind)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    s, vocab = opts.seq or (4096 if device.type == "cuda" else 128), 101

    torch.manual_seed(0)  # the same weights and batch on every rank
    model = LM(s, vocab, opts.hidden, opts.heads, opts.kv_heads, opts.layers).to(device, dtype)
    batch = torch.randint(0, vocab, (2, s + 1), device=device)
    tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # shifted on the full sequence

    want_loss = train_step(model, tokens, labels, labels.numel())  # reference: one process
    want = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()

    with ss.context_parallel(group, buffers=[tokens, labels, model.cos, model.sin], buffer_seq_dims=[1, 1, 0, 0]):
        local = tokens.shape[1]
        loss = train_step(model, tokens, labels, 2 * s)  # this rank's share of the global mean
    errs = {"loss": rel_err(summed(loss, group), want_loss)}
    errs |= {f"grad {n}": rel_err(summed(q.grad, group), want[n]) for n, q in model.named_parameters()}
    ok = all(e <= tol for e in errs.values())
    if rank == 0:
        print(f"{world} ranks ({kind}, {device.type}, {dtype}), S={s}, this rank's shard {local} positions")
        for name, e in errs.items():
            print(f"  {name:<28} max rel err {e:.2e}  (tolerance {tol:g})")
        print("OK: context-parallel step matches one process" if ok else "MISMATCH")
    launcher.finish_ranks(kind)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
