"""``python -m splitsoftmax verify --model CONFIG``: a transformers model's loss and every parameter
gradient, sequence-parallel over the launched ranks, against the same model on one rank.

``CONFIG`` is a built-in tiny config (:data:`CONFIGS`: Llama, Qwen2 with a sliding window on one
layer, Mistral's window, Gemma-2's softcaps and alternating window, gpt-oss's sinks and window) or
a ``config.json`` path. Every rank builds the model with random weights from one seed and runs, for
each candidate of :func:`candidates` (schedule and mesh shape) and each batch (plain, and packed
documents whose ``position_ids`` restart), its zigzag shard through ``shard_inputs`` and
``attn_implementation="splitsoftmax_sp"`` with that schedule; the ranks' losses and gradients are
summed (``shard_inputs`` makes them shares of the one-rank ones). Rank 0 then runs the one-rank
model (transformers' ``eager`` attention, each packed document alone) and its float64 copy, the
truth. ``SPLITSOFTMAX_VERIFY_PERTURB=RANK:SIZE`` (a test hook) makes that rank add SIZE to its
embeddings: a wrong sharded run, which must be reported as a mismatch.

Tolerance, per quantity (the loss, and each parameter's gradient), in :func:`compare.rel_err`'s
measure (max abs difference over ``max(1, max |one-rank|)``): the sharded run must meet verify's
rule against float64, ``w * (k * e + floor)`` (``k`` = 2 for the loss, 4 for gradients; ``e`` the
one-rank run's own error against float64; ``floor`` :func:`compare.floor`; ``w = 1 + log2 P``), so
by the triangle inequality its difference from the one-rank run is at most that plus ``e``.
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ...core.checks import SCHEDULES
from .. import launcher
from .compare import GRAD_FACTOR, floor, rel_err
from .job import Job

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, attention_dropout=0.0,
             tie_word_embeddings=False)
WINDOW = 8
# name -> (transformers model_type, what the tiny config sets beside SMALL)
CONFIGS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                              query_pre_attn_scalar=16)),
    # every expert on every token: a near tie of the router cannot flip a top-k between runs
    "gpt-oss": ("gpt_oss", dict(sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=2)),
}
# schedule -> the mesh shapes (sequence degree, heads degree) it runs on P ranks; the 2-D schedules
# run every mesh with both degrees above 1
MESHES = {
    "ring": lambda p: [(p, 1)],
    "allgather": lambda p: [(p, 1)],
    "heads": lambda p: [(1, p)],  # any head counts: tensor_split of the heads, Hkv < P allowed
    "heads+ring": lambda p: [(p // h, h) for h in range(2, p) if p % h == 0],
    "heads+allgather": lambda p: [(p // h, h) for h in range(2, p) if p % h == 0],
}
TOLERANCE = ("rel = max |sharded - one rank| / max(1, max |one rank|), per quantity (the loss; each parameter's "
             "gradient, the row showing the one nearest its tolerance);\ntolerance = (1 + log2 P) * (k * e + floor) "
             "+ e, with e the one-rank float32 run's own rel error against its float64 copy, k = 2 (loss) or 4 "
             "(gradients), floor = twice the float32 rounding of the float64 result + 4 float32 ulps")
PERTURB = "SPLITSOFTMAX_VERIFY_PERTURB"  # "RANK:SIZE": that rank adds SIZE to its embeddings (a wrong run)


def candidates(world: int) -> list[tuple[str, tuple[int, int]]]:
    """``(schedule, (sequence degree, heads degree))`` for every training schedule the package
    accepts (``core.checks.SCHEDULES``) and every mesh shape of it on ``world`` ranks."""
    return [(s, mesh) for s in SCHEDULES if s in MESHES for mesh in MESHES[s](world)]


def load_config(spec: str):
    """The transformers config of a built-in name or of a ``config.json`` path (``ValueError``
    naming ``--model`` when it is neither, has no ``model_type``, or this transformers lacks it)."""
    from transformers import AutoConfig, __version__
    if spec in CONFIGS:
        model_type, kw = CONFIGS[spec]
        kw = {**SMALL, **kw}
    elif os.path.isfile(spec):
        with open(spec) as f:
            kw = json.load(f)
        if not isinstance(kw, dict) or "model_type" not in kw:
            raise ValueError(f"--model {spec!r}: a config.json needs a \"model_type\" (e.g. \"llama\")")
        model_type = kw.pop("model_type")
    else:
        raise ValueError(f"--model {spec!r} is neither a built-in config ({', '.join(CONFIGS)}) nor a config.json file")
    try:
        return AutoConfig.for_model(model_type, **kw)
    except (KeyError, ValueError) as e:
        raise ValueError(f"--model {spec!r}: transformers {__version__} cannot build model_type {model_type!r}: "
                         f"{e}") from None


def describe(config) -> str:
    """One line: the model type and the attention shape that the schedules see."""
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    extras = [f"{k}={getattr(config, k)}" for k in ("sliding_window", "attn_logit_softcapping")
              if getattr(config, k, None)]
    if config.model_type == "gpt_oss":
        extras.append("sinks")
    return (f"{config.model_type}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{heads}/{kv} heads{', ' if extras else ''}{', '.join(extras)}")


def set_attention(model, name: str) -> None:
    """Switch every layer of ``model`` to ``attn_implementation=name`` (transformers 4.53 has no
    ``set_attn_implementation``; its layers read the config on every call)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def build(config, device: torch.device):
    """The float32 model of ``config`` with random weights from seed 0, under eager attention (and
    eager experts where transformers has a choice: its grouped matmul takes no float64)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model.to(device).eval()


def batches(world: int, vocab: int) -> list[tuple[str, Tensor, Optional[list[int]]]]:
    """``(name, input_ids (2, S), document lengths or None)``: S = 8P + 3 (uneven zigzag chunks, longer
    than the built-in window), plain, then packed documents of lengths 2P - 1, 5 and the rest."""
    s = 8 * world + 3
    ids = torch.randint(0, vocab, (2, s), generator=torch.Generator().manual_seed(1))
    docs = [2 * world - 1, 5, s - 2 * world - 4]
    return [(f"S={s}", ids, None), (f"S={s} docs {'+'.join(map(str, docs))}", ids, docs)]


def positions(ids: Tensor, docs: Optional[list[int]]) -> Optional[Tensor]:
    """``position_ids`` restarting at every document (None without documents)."""
    if docs is None:
        return None
    return torch.cat([torch.arange(n) for n in docs]).expand(ids.shape[0], -1).contiguous()


def _grads(model) -> list[Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def one_rank(model, ids: Tensor, docs: Optional[list[int]]) -> tuple[Tensor, list[Tensor]]:
    """Loss and every parameter's gradient of the whole batch on this process: each document through
    the model alone (what packing means; some models build no packed mask from ``position_ids``),
    then the mean cross-entropy of every position but the last against the next token."""
    model.zero_grad(set_to_none=True)
    ids = ids.to(model.device)
    cuts = torch.tensor([0, *(docs or [ids.shape[1]])]).cumsum(0).tolist()
    logits = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(cuts, cuts[1:]) if b > a],
                       1)
    logits = logits[:, :-1].flatten(0, 1)
    loss = torch.nn.functional.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                                             ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), _grads(model)


def sharded(model, job: Job, schedule: str, group, ids: Tensor, docs: Optional[list[int]]) -> tuple:
    """This rank's shard through the sequence-parallel model; loss and gradients summed over ranks."""
    from ...distributed.comm import as_comm
    from ...distributed.tree import allreduce_sum
    from ...integrations import transformers as sst
    sst.register(group)
    set_attention(model, sst._schedule_implementation(schedule))
    model.zero_grad(set_to_none=True)
    dev = model.device
    pos = positions(ids, docs)
    inputs = sst.shard_inputs(ids.to(dev), None if pos is None else pos.to(dev), ids.to(dev), group=group)
    hook = _perturbation(model, job.rank)
    try:
        loss = model(**inputs, use_cache=False).loss
    finally:
        if hook is not None:
            hook.remove()
    loss.backward()
    grads = _grads(model)
    flat = allreduce_sum(as_comm(job.group), torch.cat([loss.detach().reshape(1)] + [g.flatten() for g in grads]),
                         "verify --model: loss and gradients")
    parts = torch.split(flat[1:], [g.numel() for g in grads])
    return flat[0], [t.view_as(g) for t, g in zip(parts, grads)]


def _perturbation(model, rank: int):
    """The test hook of :data:`PERTURB`: on its rank, a forward hook adding SIZE to the embeddings."""
    spec = os.environ.get(PERTURB)
    if not spec or int(spec.split(":")[0]) != rank:
        return None
    size = float(spec.split(":")[1])
    return model.get_input_embeddings().register_forward_hook(lambda m, a, out: out + size)


@dataclass
class ModelRow:
    """One line of the model table: a (batch, schedule, mesh) run against the one-rank run."""

    batch: str
    schedule: str
    mesh: str
    loss_abs: float
    loss_rel: float
    loss_tol: float
    grad_abs: float
    grad_rel: float  # of the parameter nearest its tolerance
    grad_tol: float
    worst: str  # that parameter
    seconds: float

    @property
    def ok(self) -> bool:
        return self.loss_rel <= self.loss_tol and self.grad_rel <= self.grad_tol  # NaN fails


HEADER = ("batch", "schedule", "mesh", "loss abs", "loss rel", "tolerance", "grad abs", "grad rel", "tolerance",
          "fwd+bwd", "parameter nearest its tolerance")


def table(rows: list[ModelRow]) -> str:
    """The header and one aligned line per row."""
    cells = [HEADER] + [(r.batch, r.schedule, r.mesh, f"{r.loss_abs:.2e}", f"{r.loss_rel:.2e}", f"{r.loss_tol:.2e}",
                         f"{r.grad_abs:.2e}", f"{r.grad_rel:.2e}", f"{r.grad_tol:.2e}", f"{r.seconds:.2f}s",
                         f"{r.worst}  {'ok' if r.ok else 'MISMATCH'}") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER) - 1)]
    return "\n".join("  ".join([*(c[i].ljust(widths[i]) if i < 3 else c[i].rjust(widths[i])
                                 for i in range(len(widths))), c[-1]]) for c in cells)


def _tolerance(peer: Tensor, truth: Tensor, factor: float, widen: float) -> float:
    """verify's rule against float64, plus the one-rank run's own error (see the module)."""
    e = rel_err(peer, truth)
    return widen * (factor * e + floor(truth, peer.dtype)) + e


def compare_run(batch: str, schedule: str, mesh: str, got: tuple, peer: tuple, truth: tuple, names: list[str],
                world: int, seconds: float) -> ModelRow:
    """The row of a sharded run ``got`` against the one-rank ``peer``, tolerances from ``truth``."""
    widen = 1.0 + math.log2(max(world, 1))
    (loss, grads), (ploss, pgrads), (tloss, tgrads) = got, peer, truth
    ratios = []
    for name, g, p, t in zip(names, grads, pgrads, tgrads):
        tol = _tolerance(p, t, GRAD_FACTOR, widen)
        err = rel_err(g, p)
        ratios.append((err / tol if tol else (0.0 if err == 0 else math.inf), err, tol, name))
    _, grad_rel, grad_tol, worst = max(ratios, key=lambda r: (math.isnan(r[0]), r[0]))
    grad_abs = max((g.double() - p.double()).abs().max().item() for g, p in zip(grads, pgrads))
    return ModelRow(batch, schedule, mesh, abs(loss.item() - ploss.item()), rel_err(loss, ploss),
                    _tolerance(ploss, tloss, 2.0, widen), grad_abs, grad_rel, grad_tol, worst, seconds)


def model_rows(job: Job, config) -> list[ModelRow]:
    """Every candidate and batch sharded over the job's ranks, then (rank 0 only) the one-rank runs and
    the rows; the other ranks return ``[]``."""
    model = build(config, job.device)
    runs = []
    todo = [(b, c) for b in batches(job.world, config.vocab_size) for c in candidates(job.world)]
    for i, ((name, ids, docs), (schedule, mesh)) in enumerate(todo, 1):
        if job.rank == 0:
            print(f"[{i}/{len(todo)}] {config.model_type} {name} {schedule} {mesh[0]}x{mesh[1]} on {job.world} "
                  f"ranks ({job.device.type})", file=sys.stderr, flush=True)
        start = time.perf_counter()
        got = sharded(model, job, schedule, launcher.mesh_groups(job.group, job.rank, *mesh), ids, docs)
        runs.append((name, schedule, f"{mesh[0]}x{mesh[1]}", got, time.perf_counter() - start, ids, docs))
    if job.rank:
        return []
    set_attention(model, "eager")
    names = [n for n, _ in model.named_parameters()]
    truth_model = copy.deepcopy(model).to("cpu", torch.float64)
    refs = {}
    rows = []
    for name, schedule, mesh, got, secs, ids, docs in runs:
        if name not in refs:
            refs[name] = one_rank(model, ids, docs), one_rank(truth_model, ids, docs)
        peer, truth = refs[name]
        peer = (peer[0].cpu(), [g.cpu() for g in peer[1]])
        rows.append(compare_run(name, schedule, mesh, (got[0].cpu(), [g.cpu() for g in got[1]]), peer, truth,
                                names, job.world, secs))
    return rows
