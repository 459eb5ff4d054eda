"""Hugging Face ``Trainer`` with sequence parallelism: ``attn_implementation="splitsoftmax_sp"``.

The recipe is three pieces, all in this file:

- ``SequenceParallelTrainer``: every rank of a sequence-parallel group must read the **same**
  batches (its data-parallel replica's), while the Trainer's own data loader gives every rank a
  different one; this subclass samples over the data-parallel group only. It refuses
  ``average_tokens_across_devices=False``, the one setting under which the loss would be wrong.
- ``collate``: stacks the replica's rows and returns ``sst.shard_inputs(ids, labels=ids)``: this
  rank's zigzag shard, shifted labels as ``labels`` and ``shift_labels``.
- The loss needs nothing by hand: the Trainer counts the predicted tokens of every rank's shard
  (``shift_labels``, or the already shifted ``labels``) and sums the counts over all ranks, which
  is the global count, and multiplies the loss by the number of processes, which undoes the
  averaging of DDP: the step's gradient is that of the global mean loss, as one process computes it.

This script trains a tiny random Llama for two SGD steps and checks the weights against one
process training on the whole batches with ``attn_implementation="sdpa"``; it exits non-zero on a
mismatch. Launch (from the repository root; ``pip install "splitsoftmax[hf]"`` brings accelerate):

    torchrun --standalone --nproc_per_node=2 examples/trainer_sp_example.py           # sp = 2
    torchrun --standalone --nproc_per_node=4 examples/trainer_sp_example.py --dp 2    # dp 2 x sp 2
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

try:
    import splitsoftmax  # noqa: F401
except ModuleNotFoundError:  # not installed: use the checkout this script lives in
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import transformers  # noqa: E402

from splitsoftmax.tools import launcher  # noqa: E402
from splitsoftmax.integrations import transformers as sst  # noqa: E402

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


class SequenceParallelTrainer(transformers.Trainer):
    """A ``Trainer`` whose ranks of one sequence-parallel group read the same batches.

    ``dp_group``: the data-parallel group (None: one replica, every rank in one sequence-parallel
    group). The model is loaded with ``attn_implementation="splitsoftmax_sp"`` and
    ``data_collator`` shards each batch (see :func:`collate`).
    """

    def __init__(self, *args, dp_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.args.average_tokens_across_devices:
            raise ValueError("SequenceParallelTrainer: average_tokens_across_devices=False would divide each rank's "
                             "loss by its own shard's tokens and let DDP average the ranks: set it to True")
        self.dp_group = dp_group

    def get_train_dataloader(self) -> DataLoader:
        dp = self.dp_group
        sampler = DistributedSampler(self.train_dataset, num_replicas=1 if dp is None else dist.get_world_size(dp),
                                     rank=0 if dp is None else dist.get_rank(dp), shuffle=True, seed=self.args.seed)
        return DataLoader(self.train_dataset, batch_size=self._train_batch_size, sampler=sampler,
                          collate_fn=self.data_collator, drop_last=self.args.dataloader_drop_last)


def collate(features: list) -> dict:
    """Rows of equal length ``{"input_ids": (S,)}`` -> this rank's shard of the batch (a dict)."""
    ids = torch.stack([torch.as_tensor(f["input_ids"]) for f in features])
    return dict(sst.shard_inputs(ids, labels=ids))


def train(model, data, opts, workdir: str, dp_group=None):
    """Two SGD steps of the recipe (no clipping, constant rate: a wrong loss scale shows)."""
    args = transformers.TrainingArguments(
        output_dir=workdir, per_device_train_batch_size=opts.batch, max_steps=opts.steps, learning_rate=0.5,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=not torch.cuda.is_available(), seed=opts.seed,
        average_tokens_across_devices=True, disable_tqdm=True)
    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=data, data_collator=collate,
                                      dp_group=dp_group)
    trainer.train()
    return trainer


def reference(model, data, opts, dp: int):
    """One process: the global batch of each step is every replica's rows, sampled as above."""
    order = [list(DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=opts.seed)) for r in range(dp)]
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(opts.steps):
        rows = [i for r in range(dp) for i in order[r][step * opts.batch:(step + 1) * opts.batch]]
        ids = torch.stack([torch.as_tensor(data[i]["input_ids"]) for i in rows])
        model(ids, labels=ids, use_cache=False).loss.backward()
        sgd.step()
        sgd.zero_grad()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (the rest of the ranks: sp)")
    p.add_argument("--seq", type=int, default=37)
    p.add_argument("--batch", type=int, default=2, help="rows per replica and step")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=3)
    opts = p.parse_args(argv)
    if launcher.launched_by() != "torchrun":
        print("launch me with torchrun (see: python examples/trainer_sp_example.py -h)", file=sys.stderr)
        return 2
    _, device, rank, world = launcher.init_ranks("torchrun")
    if world % opts.dp:
        print(f"--dp {opts.dp} does not divide {world} ranks", file=sys.stderr)
        return 2
    sp = world // opts.dp
    groups = [dist.new_group(list(range(d * sp, (d + 1) * sp))) for d in range(opts.dp)]  # sp: consecutive ranks
    dps = [dist.new_group(list(range(s, world, sp))) for s in range(sp)]
    sst.register(groups[rank // sp])
    dp_group = dps[rank % sp] if opts.dp > 1 else None
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, SMALL["vocab_size"], (opts.seq,), generator=gen)} for _ in range(8)]
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation="splitsoftmax_sp"))
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation="sdpa"))
    ref.load_state_dict(ours.state_dict())
    with tempfile.TemporaryDirectory() as workdir:
        train(ours, data, opts, workdir, dp_group)
    reference(ref, data, opts, opts.dp)
    errs = {n: ((q.detach().cpu().double() - w.detach().double()).abs().max()
                / w.detach().double().abs().max().clamp_min(1e-30)).item()
            for (n, w), q in zip(ref.named_parameters(), ours.parameters())}
    ok = max(errs.values()) <= 1e-4
    if rank == 0:
        print(f"{world} ranks as dp={opts.dp} x sp={sp}, Trainer, {opts.steps} SGD steps, S={opts.seq}: largest "
              f"weight error {max(errs.values()):.2e} over {len(errs)} tensors (tolerance 1e-4)")
        print("OK: the Trainer with sequence parallelism equals one process" if ok else
              "MISMATCH: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items() if v > 1e-4))
    launcher.finish_ranks("torchrun")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
