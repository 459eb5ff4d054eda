"""Data parallel x context parallel: a 2-D mesh (dp, cp), DDP over every rank, splitsoftmax over cp.

Each of the ``dp`` replicas trains on its own batch; the ``cp`` ranks of a replica hold zigzag
shards of that batch's sequences (``shard_inputs``) and run the attention layers with
``ss.sharded_attention`` over their ``cp`` group (``register(mesh["cp"])`` and a model loaded with
``attn_implementation="splitsoftmax_sp"``).

The loss, which is where one-process equality is won or lost: with ``shard_inputs`` each rank's
loss is the sum of its tokens' losses divided by ``num_items_in_batch``, so a replica's ``cp``
losses *sum* to its mean loss. DDP (and FSDP2, whose reduce-scatter averages the same way) over
all ``P = dp * cp`` ranks *averages* gradients, dividing by ``P``. ``shard_inputs(...,
dp_group=mesh["dp"])`` counts the predicted tokens of every replica in ``num_items_in_batch`` and
returns ``loss_scale = P``; the loss multiplied by it gives, averaged, exactly the gradient of the
mean loss over the whole global batch, as one process computes it (the same rule as the Trainer's
``average_tokens_across_devices``). This script checks that, forward and backward, against one
process running the whole batch with ``attn_implementation="sdpa"``, and exits non-zero on a mismatch.

Launch (from the repository root, with splitsoftmax installed or on PYTHONPATH):

    torchrun --standalone --nproc_per_node=4 examples/mesh_2d_example.py --dp 2 --cp 2
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

try:
    import splitsoftmax  # noqa: F401
except ModuleNotFoundError:  # not installed: use the checkout this script lives in
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from splitsoftmax.tools import launcher
from splitsoftmax.integrations import transformers as sst

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def models(device):
    """The same random tiny Llama twice: ``splitsoftmax`` (trained here) and ``sdpa`` (the check)."""
    import transformers
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation="splitsoftmax_sp"))
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation="sdpa"))
    ref.load_state_dict(ours.state_dict())
    return ours.to(device), ref.to(device)


def step(ddp, ids, mesh):
    """One training step of this rank: its replica's rows, its cp shard, the loss scaled for DDP."""
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    rows = ids.shape[0] // dp
    mine = ids[dp_rank * rows:(dp_rank + 1) * rows]
    inputs = sst.shard_inputs(mine, labels=mine, dp_group=mesh["dp"])  # over the cp group given to register()
    loss = ddp(**inputs).loss
    (loss * inputs.loss_scale).backward()  # DDP averages over all dp * cp ranks
    return loss.detach()


def rel_err(x: torch.Tensor, want: torch.Tensor) -> float:
    return ((x.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    p.add_argument("--cp", type=int, default=2, help="context-parallel ranks per replica")
    p.add_argument("--seq", type=int, default=64)
    opts = p.parse_args(argv)
    if launcher.launched_by() != "torchrun":
        print("launch me with torchrun (see: python examples/mesh_2d_example.py -h)", file=sys.stderr)
        return 2
    from torch.distributed.device_mesh import init_device_mesh
    _, device, rank, world = launcher.init_ranks("torchrun")
    if world != opts.dp * opts.cp:
        print(f"--dp {opts.dp} x --cp {opts.cp} != {world} ranks", file=sys.stderr)
        return 2
    mesh = init_device_mesh(device.type, (opts.dp, opts.cp), mesh_dim_names=("dp", "cp"))
    sst.register(mesh["cp"])
    ours, ref = models(device)
    ddp = torch.nn.parallel.DistributedDataParallel(ours, device_ids=[device.index] if device.type == "cuda" else None)
    ids = torch.randint(0, SMALL["vocab_size"], (2 * opts.dp, opts.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    loss = step(ddp, ids, mesh)
    dist.all_reduce(loss)  # the ranks' shares of the global mean loss
    want = ref(ids, labels=ids).loss
    want.backward()
    errs = {"loss": rel_err(loss, want.detach())}
    errs |= {f"grad {n}": rel_err(q.grad, p.grad) for (n, p), q in zip(ref.named_parameters(), ours.parameters())}
    ok = all(e <= 1e-4 for e in errs.values())
    if rank == 0:
        print(f"{world} ranks as dp={opts.dp} x cp={opts.cp} ({device.type}), S={opts.seq}: "
              f"largest error {max(errs.values()):.2e} over loss and {len(errs) - 1} gradients (tolerance 1e-4)")
        print("OK: DDP x context parallel equals one process" if ok else
              "MISMATCH: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items() if v > 1e-4))
    launcher.finish_ranks("torchrun")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
