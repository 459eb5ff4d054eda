"""A tensor-parallel LM head: a GRPO-style loss and a decode step without gathering the logits.

Each rank holds a slice of the output projection's rows (the vocabulary, ``torch.tensor_split``
of ``V``: uneven widths), so it computes only its slice ``(N, V_r)`` of the logits. Training:
``ss.sharded_logprobs(..., return_entropy=True)`` gives the log-probability of each sampled token
and the entropy of the full distribution, from which a clipped policy-gradient loss with an
entropy bonus (GRPO: group-normalised advantages) is formed and back-propagated; each rank's
projection gradient is its slice of the full one. Decoding: ``ss.sharded_sample`` draws the next
token of each sequence (temperature, top-k, top-p) from the slices, with per-request seeds and the
step as offset. Both are checked against one process holding the whole projection (``ss.logprobs``,
``ss.sample``): the loss and gradients to a tolerance, the tokens bit for bit. Exits non-zero on a
mismatch.

Launch (from the repository root, with splitsoftmax installed or on PYTHONPATH):

    # one node, 2 ranks (NCCL with a GPU per rank, else Gloo on CPU processes)
    torchrun --nproc_per_node=2 examples/tp_lm_head_example.py

    # MPI (CPU tensors; add --allow-run-as-root when running as root)
    mpirun -n 2 python examples/tp_lm_head_example.py
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

CLIP, ENTROPY_BONUS, TEMPERATURE = 0.2, 0.01, 0.9
DECODE = dict(temperature=0.8, top_k=50, top_p=0.9)


def grpo_loss(logp, entropy, old_logp, advantage):
    """Clipped policy-gradient objective with an entropy bonus, averaged over the tokens."""
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - CLIP, 1 + CLIP) * advantage)
    return -(surrogate.mean() + ENTROPY_BONUS * entropy.mean())


def batch(n_prompts: int, group: int, length: int, hidden: int, vocab: int, device, dtype):
    """The same rollout on every rank: hidden states ``(N, E)``, sampled tokens, their old
    log-probabilities, and per-token advantages (rewards normalised within each prompt's group)."""
    g = torch.Generator().manual_seed(1)
    n = n_prompts * group * length
    h = torch.randn(n, hidden, generator=g).to(device, dtype)
    tokens = torch.randint(0, vocab, (n,), generator=g).to(device)
    old_logp = (-torch.rand(n, generator=g) * 8 - 4).to(device)
    reward = torch.randn(n_prompts, group, generator=g)
    adv = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)
    return h, tokens, old_logp, adv[:, :, None].expand(-1, -1, length).reshape(-1).to(device)


def summed(t: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``t`` over the ranks (every rank's copy gathered with ``ss.unshard``, then added)."""
    return ss.unshard(t.unsqueeze(0).contiguous(), 0, group=group).sum(0)


def rel_err(x: torch.Tensor, want: torch.Tensor) -> float:
    return ((x.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def train_step(w_full, w_part, rows: slice, data, group):
    """Loss and gradients sharded and in one process: ``(errors by name, loss)``."""
    h, tokens, old_logp, adv = data
    h_r = h.detach().clone().requires_grad_(True)
    w_r = w_part.detach().clone().requires_grad_(True)
    logp, ent = ss.sharded_logprobs(h_r @ w_r.T, tokens, temperature=TEMPERATURE, return_entropy=True, group=group)
    loss = grpo_loss(logp, ent, old_logp, adv)
    loss.backward()
    h_1 = h.detach().clone().requires_grad_(True)
    w_1 = w_full.detach().clone().requires_grad_(True)
    logp1, ent1 = ss.logprobs(h_1 @ w_1.T, tokens, temperature=TEMPERATURE, return_entropy=True)
    loss1 = grpo_loss(logp1, ent1, old_logp, adv)
    loss1.backward()
    errs = {"loss": rel_err(loss.detach(), loss1.detach()), "log-probs": rel_err(logp.detach(), logp1.detach()),
            "entropy": rel_err(ent.detach(), ent1.detach()), "grad W slice": rel_err(w_r.grad, w_1.grad[rows]),
            "grad hidden": rel_err(summed(h_r.grad, group), h_1.grad)}
    return errs, float(loss1.detach())


def decode_step(w_full, w_part, hidden: int, requests: int, step: int, device, dtype, group) -> tuple[bool, list]:
    """Next tokens of ``requests`` sequences, sharded and in one process: ``(equal, tokens)``."""
    g = torch.Generator().manual_seed(100 + step)
    last = torch.randn(requests, hidden, generator=g).to(device, dtype)
    seeds = (torch.arange(requests) * 1_000_003 + 17).to(device)      # one seed per request
    tokens = ss.sharded_sample(last @ w_part.T, seed=seeds, offset=step, group=group, **DECODE)
    want = ss.sample(last @ w_full.T, seed=seeds, offset=step, **DECODE)
    return torch.equal(tokens, want), tokens.tolist()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 128256 GPU, 5003 CPU)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="responses per prompt")
    p.add_argument("--length", type=int, default=16, help="tokens per response")
    opts = p.parse_args(argv)
    kind = launcher.launched_by()
    if kind is None:
        print("launch me with torchrun or mpirun (see python examples/tp_lm_head_example.py -h)", file=sys.stderr)
        return 2
    group, device, rank, world = launcher.init_ranks(kind)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    vocab = opts.vocab or (128256 if device.type == "cuda" else 5003)

    torch.manual_seed(0)  # the same projection on every rank; each keeps its rows
    w_full = (torch.randn(vocab, opts.hidden) / opts.hidden ** 0.5).to(device, dtype)
    bounds = [len(c) for c in torch.tensor_split(torch.arange(vocab), world)]
    rows = slice(sum(bounds[:rank]), sum(bounds[:rank + 1]))
    w_part = w_full[rows]
    data = batch(opts.prompts, opts.group, opts.length, opts.hidden, vocab, device, dtype)
    errs, loss = train_step(w_full, w_part, rows, data, group)
    decoded = [decode_step(w_full, w_part, opts.hidden, opts.prompts * opts.group, s, device, dtype, group)
               for s in range(3)]
    ok = all(e <= tol for e in errs.values()) and all(same for same, _ in decoded)
    if rank == 0:
        print(f"{world} ranks ({kind}, {device.type}, {dtype}), V={vocab}, this rank's slice {rows.stop - rows.start} "
              f"rows, {data[0].shape[0]} tokens, GRPO loss {loss:.6f}")
        for name, e in errs.items():
            print(f"  {name:<14} max rel err {e:.2e}  (tolerance {tol:g})")
        for step, (same, tokens) in enumerate(decoded):
            print(f"  decode step {step}: tokens {'equal' if same else 'DIFFER'} {tokens[:8]}...")
        print("OK: the sharded LM head matches one process" if ok else "MISMATCH")
    launcher.finish_ranks(kind)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
