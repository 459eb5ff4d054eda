"""Hugging Face transformers integration: ``attn_implementation="splitsoftmax"`` (docs/API.md).

:func:`register` adds an attention function through transformers' ``AttentionInterface`` and a
mask function through its ``AttentionMaskInterface`` (transformers 4.53 and later, 4.x and 5.x).
The mask function never builds a dense mask: it describes the one the model asked for
(``_hf_masks.Visibility``) and the attention function maps that, with the layer's own arguments,
to the keywords of ``ss.attention``:

- causal or bidirectional, where the queries sit among the keys (KV caches, dynamic or static,
  with unfilled slots) -> ``causal``, ``q_offset``; padding masks -> ``kv_range``;
- packed sequences (``position_ids`` that restart, or ``cu_seq_lens_q/k`` as
  ``DataCollatorWithFlattening`` gives them) -> ``cu_seqlens``; ``sliding_window`` -> ``window_size``;
  ``softcap`` -> ``softcap``; ``s_aux`` (attention sinks) -> ``sinks``.

Two modes, chosen per model by its ``attn_implementation``. ``"splitsoftmax"``: every process
computes attention over its own batch with ``ss.attention`` (one process, or data parallelism: DDP,
FSDP). ``"splitsoftmax_sp"``: sequence parallelism over the group given to :func:`register`; every
rank of it holds its zigzag shard of the sequence (per document when packed; see
:func:`shard_inputs`) and the layers run ``ss.sharded_attention``. ``register(group,
sequence_parallel=True)`` makes ``"splitsoftmax"`` sequence-parallel too (the older spelling). A
2-D mesh (a 2-D DeviceMesh or a tuple ``(seq_group, heads_group)``) runs
``schedule="heads+ring"`` (or ``"heads+allgather"``) over it; ``register(plan="auto")`` lets the
planner choose the schedule and mesh at the first :func:`shard_inputs` (:func:`_plan_layers`). A
sequence-parallel model cannot generate (no KV cache across ranks): it is refused, naming the switch
to local attention. Under ``torch.autocast`` q, k, v
are cast like SDPA's. What cannot be expressed (dropout, attention weights, a 4-D mask tensor,
custom mask patterns, padding with holes) raises ``ValueError``; nothing silently differs from
``attn_implementation="sdpa"``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from torch import Tensor

from ..core.autocast import like_sdpa
from ..distributed import attn_meta
from ..distributed.comm import as_comm
from ..distributed.handshake import encode_dtype, handshake
from ..distributed.layout import shard_lengths, split_sizes
from ..distributed.mesh import Mesh, as_group, is_mesh, value_code
from ..distributed.shard import shard_as
from ..distributed.tree import allreduce_sum
from ..ops.attention.api import attention
from ..ops.attention.sharded import sharded_attention
from . import _hf_docs as docs
from ._hf_masks import Visibility, build

NAME = "splitsoftmax"
SP_NAME = "splitsoftmax_sp"
WHO = "attn_implementation='splitsoftmax'"
_CONFIG = {"group": None, "sequence_parallel": False}
# the sequence-parallel layers' schedule; plan="auto", and what it chose: (group or mesh, schedule, Plan,
# the candidate taken)
_LAYERS = {"schedule": "ring", "plan": None, "profile": None, "planned": None}
_SCHEDULES_1D = ("ring", "allgather", "heads")
_SCHEDULES_2D = ("heads+ring", "heads+allgather")


def register(group=None, *, sequence_parallel: bool = False, schedule: Optional[str] = None,
             plan: Optional[str] = None, profile=None) -> str:
    """Register ``attn_implementation="splitsoftmax"`` and ``"splitsoftmax_sp"`` with transformers;
    returns ``"splitsoftmax"``.

    The mode belongs to the model: ``"splitsoftmax"`` computes attention over each process's own
    batch (one process, or data parallelism); ``"splitsoftmax_sp"`` runs ``ss.sharded_attention``
    over ``group`` on inputs sharded by :func:`shard_inputs`. ``group``: None (the default group), a
    ProcessGroup or a 1-d DeviceMesh (``schedule`` ``"ring"``, the default, ``"allgather"`` or
    ``"heads"``), or a 2-D mesh, a 2-D DeviceMesh (dimension 0 sequence, 1 heads) or a tuple
    ``(seq_group, heads_group)`` (``schedule`` ``"heads+ring"``, the default, or ``"heads+allgather"``).
    ``sequence_parallel=True`` makes ``"splitsoftmax"`` sequence-parallel as well.

    ``plan="auto"`` (``group`` 1-d, no ``schedule``): the first :func:`shard_inputs` call asks
    ``ss.plan_attention`` for the schedule and mesh shape over ``group``'s ranks, from the model's
    heads (its ``config``) and that batch's lengths, builds the mesh and keeps it for every later
    batch (call :func:`register` again to plan anew). The layers run zigzag only, so the chosen
    candidate is the plan's best one with layout ``"zigzag"`` (or ``"heads"``, whose all-to-all
    gives every rank the whole sequence, so that its layout costs nothing): where the plan's best is
    ``"balanced"`` or ``"contiguous"``, the best zigzag candidate is taken. :func:`planned` tells
    what was chosen. ``profile`` (with ``plan="auto"`` only): the planner's rates, as
    ``ss.plan_attention`` takes them (a shipped name, the JSON of ``python -m splitsoftmax calibrate
    --out FILE``, a dict); the ranks must give the same one (the handshake refuses otherwise).
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    if plan is not None and not (isinstance(plan, str) and plan == "auto"):
        raise ValueError(f"plan must be None or 'auto', got {plan!r}")
    if plan is not None and (schedule is not None or is_mesh(group)):
        raise ValueError(f"plan='auto' chooses the schedule and the mesh itself: give a 1-d group and no schedule, "
                         f"got schedule={schedule!r} and a {'2-D mesh' if is_mesh(group) else '1-d group'}")
    if profile is not None and plan is None:
        raise ValueError("profile is the planner's: it goes with plan='auto'")
    if profile is not None:
        from ..planning.model import load_profile
        profile = load_profile(profile)
    _LAYERS.update(schedule=_layer_schedule(group, schedule), plan=plan, profile=profile, planned=None)
    _CONFIG.update(group=group, sequence_parallel=sequence_parallel)
    AttentionInterface.register(NAME, attention_forward)
    AttentionInterface.register(SP_NAME, sharded_attention_forward)
    AttentionMaskInterface.register(NAME, build)
    AttentionMaskInterface.register(SP_NAME, build)
    return NAME


def _layer_schedule(group, schedule: Optional[str]) -> str:
    """The layers' schedule on ``group``: the one given (checked against the group's dimensions), or
    ``"ring"`` on a 1-d group, ``"heads+ring"`` on a 2-D mesh."""
    options = _SCHEDULES_2D if is_mesh(group) else _SCHEDULES_1D
    if schedule is None:
        return options[0]
    if schedule not in options:
        raise ValueError(f"schedule={schedule!r}: on a {'2-D mesh' if is_mesh(group) else '1-d group'} the "
                         f"sequence-parallel layers run one of {', '.join(map(repr, options))}")
    return schedule


def planned() -> Optional[dict]:
    """What ``register(plan="auto")`` chose at the first :func:`shard_inputs`, or None before:
    ``{"schedule", "mesh": (heads_degree, seq_degree), "layout": "zigzag", "plan": Plan}``."""
    if _LAYERS["planned"] is None:
        return None
    _, schedule, plan, cand = _LAYERS["planned"]
    return {"schedule": schedule, "mesh": (cand.heads_degree, cand.seq_degree), "layout": "zigzag", "plan": plan}


def _layers() -> tuple:
    """``(group or mesh, schedule)`` of the sequence-parallel layers."""
    if _LAYERS["plan"] is None:
        return _CONFIG["group"], _LAYERS["schedule"]
    if _LAYERS["planned"] is None:
        raise ValueError(f"attn_implementation='{SP_NAME}' under register(plan='auto'): no plan yet; the first "
                         "shard_inputs(..., config=model.config) call makes it (shard the inputs with it)")
    return _LAYERS["planned"][:2]


def _sharded(sequence_parallel: Optional[bool]) -> bool:
    """Whether the layers run sequence-parallel: asked for (None: as :func:`register` set
    ``"splitsoftmax"``), and a group of more than one rank."""
    import torch.distributed as dist
    if not (_CONFIG["sequence_parallel"] if sequence_parallel is None else sequence_parallel):
        return False
    if not (dist.is_available() and dist.is_initialized()) and _CONFIG["group"] is None:
        raise ValueError(f"attn_implementation='{SP_NAME}' (or register(sequence_parallel=True)) needs an "
                         "initialised torch.distributed group (or register(group=...))")
    return as_group(_CONFIG["group"]).size > 1


def _generation_advice() -> str:
    """What to do instead of generating with sequence-parallel layers (this transformers' spelling)."""
    from transformers import PreTrainedModel
    switch = ("model.set_attn_implementation('splitsoftmax')" if hasattr(PreTrainedModel, "set_attn_implementation")
              else "model.config._attn_implementation = 'splitsoftmax'")
    return ("sequence-parallel layers cannot generate or evaluate with a KV cache (it would hold shards). Run "
            "generation on whole sequences with local attention, attn_implementation='splitsoftmax' or 'sdpa' (the "
            f"weights are whole on every rank): {switch}, or load the model with that attn_implementation")


def _refuse_extras(dropout: float, kwargs: dict) -> None:
    if dropout:
        raise ValueError(f"{WHO} does not implement attention dropout (dropout={dropout}); set the config's "
                         "attention dropout to 0 or use model.eval()")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{WHO} cannot return attention weights (output_attentions=True)")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{WHO} does not implement an additive position bias (position_bias)")


def _require(ok: Tensor, message: str) -> None:
    """``ValueError(message)`` unless ``ok`` (a bool tensor) holds: read on the host for CPU tensors,
    a device-side assertion on accelerators (no host synchronisation); nothing for meta tensors."""
    if ok.is_meta:
        return
    if ok.device.type == "cpu":
        if not bool(ok.all()):
            raise ValueError(message)
    else:
        torch._assert_async(ok.all(), message)


def _visibility(attention_mask, module, is_causal, query: Tensor, key: Tensor, where: str) -> Visibility:
    """The layer's :class:`Visibility`: from the mask function, or plain causal/full without one."""
    b, sq, sk = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if causal and sq != sk:
            raise ValueError(f"{WHO}{where}: a causal layer got {sq} queries and {sk} keys but no mask "
                             "description; where the queries sit among the keys is unknown (a cache transformers "
                             "builds no mask for)")
        return Visibility(causal, b, sq, sk)
    if not isinstance(attention_mask, Visibility):
        raise ValueError(f"{WHO}{where} got an explicit attention mask ({type(attention_mask).__name__}); it expresses "
                         "padding, packing, windows and caches through transformers' own mask arguments, not 4-D masks")
    vis = attention_mask
    if vis.refused:
        raise ValueError(f"{WHO}{where} {vis.refused}")
    if (vis.q_length, vis.kv_length) != (sq, sk):
        raise ValueError(f"{WHO}{where}: the mask is for {vis.q_length} queries and {vis.kv_length} keys, the layer "
                         f"got {sq} and {sk}")
    if vis.holes is not None:
        _require(~vis.holes, f"{WHO}{where}: an attention_mask row whose ones are not one contiguous run (padding "
                             "inside a sequence) cannot be expressed; pad on the left or the right only")
        vis.holes = None  # checked once for every layer that shares this mask
    return vis


def _variants(vis: Visibility, sliding_window, softcap, s_aux, where: str) -> dict:
    """``window_size``, ``softcap``, ``sinks`` keywords; the mask's window is the one SDPA applies,
    and a layer's ``sliding_window`` that contradicts it is refused."""
    kw = {}
    window = vis.window_size()
    if window is not None:
        if vis.causal and sliding_window is not None and window[0] != int(sliding_window) - 1:
            raise ValueError(f"{WHO}{where}: the mask's sliding window ({window[0] + 1}) differs from the layer's "
                             f"sliding_window={sliding_window}")
        kw["window_size"] = window
    if softcap is not None:
        kw["softcap"] = float(softcap)
    if s_aux is not None:
        kw["sinks"] = s_aux
    return kw


def attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None, sliding_window=None,
                      softcap: Optional[float] = None, s_aux: Optional[Tensor] = None, *,
                      sequence_parallel: Optional[bool] = None, schedule: Optional[str] = None, **kwargs) -> tuple:
    """transformers attention function: ``query (B, H, Sq, D)``, ``key/value (B, Hkv, Sk, D)``
    -> ``(out (B, Sq, H, Dv), None)``. GQA by ``H % Hkv``, ``scaling`` as the score scale.
    ``sequence_parallel``: None as :func:`register` set ``"splitsoftmax"``; ``schedule``: that of
    ``ss.sharded_attention`` when sequence-parallel (None: :func:`register`'s or its plan's;
    :func:`_schedule_implementation`)."""
    sharded = _sharded(sequence_parallel)
    layer = getattr(module, "layer_idx", None)
    where = f" (layer {layer})" if layer is not None else ""
    group = _CONFIG["group"]
    try:
        if sharded:
            group, layers_schedule = _layers()
            schedule = layers_schedule if schedule is None else schedule
        _refuse_extras(dropout, kwargs)
        vis = _visibility(attention_mask, module, is_causal, query, key, where)
        kw = dict(_variants(vis, sliding_window, softcap, s_aux, where), causal=vis.causal, scale=scaling)
    except ValueError as e:
        if sharded:
            _refuse_everywhere(group, "sharded_attention", e)
        raise
    if sharded:
        out = _sharded_forward(module, query, key, value, vis, dict(kw, schedule=schedule), kwargs, where, group)
    else:
        out = _local_forward(module, query, key, value, vis, kw, kwargs, where)
    return out.transpose(1, 2).contiguous(), None


def sharded_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs) -> tuple:
    """``attn_implementation="splitsoftmax_sp"``: :func:`attention_forward`, sequence-parallel over
    the group given to :func:`register` whatever its ``sequence_parallel``."""
    return attention_forward(module, query, key, value, attention_mask, sequence_parallel=True, **kwargs)


def _schedule_implementation(schedule: str) -> str:
    """Register and return an ``attn_implementation`` name whose layers are sequence-parallel, as
    ``"splitsoftmax_sp"``, with ``ss.sharded_attention``'s ``schedule`` (``"splitsoftmax_sp"`` runs
    ``"ring"``); ``python -m splitsoftmax verify --model`` runs a model under each schedule so."""
    from transformers import AttentionInterface, AttentionMaskInterface

    from ..core.checks import SCHEDULES, choice
    choice("schedule", schedule, tuple(s for s in SCHEDULES if s != "tree"))
    name = f"{SP_NAME}_{schedule.replace('+', '_')}"
    AttentionInterface.register(name, functools.partial(attention_forward, sequence_parallel=True, schedule=schedule))
    AttentionMaskInterface.register(name, build)
    return name


def _flatten(t: Tensor) -> Tensor:
    """``(B, H, S, D)`` -> ``(1, H, B*S, D)``: the batch as one packed row."""
    b, h, s, d = t.shape
    return t.transpose(0, 1).reshape(1, h, b * s, d)


def _local_forward(module, q, k, v, vis: Visibility, kw: dict, kwargs: dict, where: str) -> Tensor:
    """One process: ``ss.attention`` over this process's batch."""
    cu, flat = docs.local(vis, kwargs, q, where)
    if cu is None:
        docs.check_runs(module, kwargs.get("position_ids"), vis, where)
    if not q.is_meta:  # meta tensors: shapes only, the data-dependent keywords mean nothing
        if vis.kv_range is not None:
            kw["kv_range"] = vis.kv_range
        if isinstance(vis.q_offset, Tensor) or vis.q_offset:
            kw["q_offset"] = vis.q_offset
        if cu is not None:
            kw["cu_seqlens"] = cu
    if not flat:
        return attention(q, k, v, **kw)
    out = attention(_flatten(q), _flatten(k), _flatten(v), **kw)  # [1, H, B*S, Dv]
    return out.reshape(out.shape[1], q.shape[0], q.shape[2], out.shape[-1]).transpose(0, 1)


def _sharded_forward(module, q, k, v, vis: Visibility, kw: dict, kwargs: dict, where: str, group) -> Tensor:
    """Sequence parallel over ``group`` (or a 2-D mesh): this rank's zigzag shard of the sequence,
    ``ss.sharded_attention``. A refusal here (it may hold on this rank only: padding in its shard)
    is raised on every rank in the attention's handshake, the first collective of the layer; the
    positions check comes after."""
    try:
        if q.shape[2] != k.shape[2] or (isinstance(vis.q_offset, int) and vis.q_offset):
            raise ValueError(f"{WHO}{where} (sequence-parallel): queries ({q.shape[2]}) and keys ({k.shape[2]}) "
                             f"differ, a KV cache (a generation step): {_generation_advice()}")
        if vis.kv_range is not None:
            raise ValueError(f"{WHO}{where} (sequence-parallel) does not take padding masks; pack the sequences "
                             "instead (shard_inputs with position_ids that restart, or cu_seqlens)")
        cu = docs.given(kwargs)
    except ValueError as e:
        _refuse_everywhere(group, "sharded_attention", e)
    if cu is not None:
        kw["cu_seqlens"] = cu
    out = like_sdpa(sharded_attention)(q, k, v, group=group, layout="zigzag", **kw)
    docs.check_shard_positions(module, kwargs.get("position_ids"), q.shape[2], cu, group, where,
                               _generation_advice() if kwargs.get("use_cache") else None)
    return out


def _refuse_everywhere(group, op: str, error: ValueError):
    """Raise ``error`` here, and on the other ranks of ``group`` (in the handshake of ``op``, which
    they are making) a ``ValueError`` carrying its message, within the handshake's one exchange."""
    handshake(as_group(group), op, None, None, error)
    raise error


def _refuse_empty(s: int, group, cu) -> None:
    """After the shard handshake (S and the documents agreed): ``ValueError`` on every rank when a
    rank's shard (on a mesh: a mesh rank's piece of its sequence shard) holds no position, which a
    transformers model cannot run."""
    comm = as_group(group)
    seq = comm.seq if isinstance(comm, Mesh) else comm
    lengths = shard_lengths(s, seq.size, "zigzag", None if cu is None else attn_meta.doc_values(cu))
    if isinstance(comm, Mesh):
        lengths = [n for length in lengths for n in split_sizes(length, comm.shape[1])]
    empty = [r for r, n in enumerate(lengths) if n == 0]
    if empty:
        raise ValueError(f"shard_inputs: a sequence of {s} positions leaves rank(s) {empty} of {len(lengths)} an "
                         "empty zigzag shard, on which the model cannot run; give every rank at least one position "
                         "(a longer sequence, or fewer ranks)")


class ShardedInputs(dict):
    """The keyword arguments of the model (a dict), with ``loss_scale``: the factor by which to
    multiply the loss when DDP or FSDP averages gradients over every rank that shares the step (the
    ``dp_group`` ranks times the sequence-parallel ``group``): their product, ``P``."""

    loss_scale: int = 1


def shard_inputs(input_ids: Tensor, position_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None, *,
                 group=None, layout: str = "zigzag", ignore_index: int = -100, cu_seqlens=None,
                 dp_group=None, config=None) -> ShardedInputs:
    """This rank's shards (along the sequence, dim 1) of ``input_ids (B, S)``, ``position_ids``
    (default ``0..S-1``, restarting per document when packed) and ``labels``: a dict to pass to
    the model as keyword arguments, for ``attn_implementation="splitsoftmax_sp"``.

    Every rank passes the full tensors. ``group`` defaults to the group given to :func:`register`
    (on a 2-D mesh each rank gets its piece as ``ss.shard(x, dim=1, group=mesh, layout="zigzag",
    cu_seqlens=...)`` gives it). Under ``register(plan="auto")`` the first call (``group`` None)
    plans the layers' schedule and mesh over that group from ``config`` (``model.config``, or the
    model: its heads, kv heads and head dim) and this batch's lengths, and builds the mesh
    (collectively: every rank of the group calls it with the same batch).
    Packed documents, from ``position_ids`` that restart (the same in every row) or ``cu_seqlens``
    ``(N+1,)``, are zigzagged per document and passed on as ``cu_seq_lens_q/k``. Labels are shifted
    on the full sequence first (position ``i`` predicts token ``i + 1``; the last position gets
    ``ignore_index``) and returned sharded as ``labels`` and ``shift_labels``, with
    ``num_items_in_batch`` the global count of predicted tokens: each rank's loss is its tokens'
    share of the global mean, so the ranks' losses (and gradients) **sum** to the one-process loss.

    ``dp_group``: the data-parallel group whose ranks hold the other batches (every rank of it
    calls collectively); ``num_items_in_batch`` then counts the tokens of all of them. The result's
    ``loss_scale`` (``dp_group``'s size times ``group``'s, or the mesh's rank count) is what to
    multiply the loss by where DDP or FSDP averages gradients over those ranks: ``(out.loss *
    inputs.loss_scale).backward()`` then gives the gradient of the global mean loss, as one process
    on every batch computes it.
    """
    planning = group is None and _LAYERS["plan"] is not None
    group = _CONFIG["group"] if group is None else group
    try:
        if layout != "zigzag":
            raise ValueError(f"shard_inputs: layout={layout!r}; the sequence-parallel layers run layout='zigzag' "
                             "(per document when packed), so the inputs must be sharded that way")
        cu = docs.from_inputs(input_ids, position_ids, cu_seqlens)
        if position_ids is None:
            position_ids = docs.positions(cu, input_ids.shape[1], input_ids.device).expand(input_ids.shape[0], -1)
        shape = _model_shape(config) if planning and _LAYERS["planned"] is None else None
    except ValueError as e:
        _refuse_everywhere(group, "shard", e)
    if planning:
        group = _plan_layers(group, input_ids.shape, cu, shape)
    out = ShardedInputs(input_ids=shard_as(input_ids, 1, group, "zigzag", cu, "input_ids"))
    _refuse_empty(input_ids.shape[1], group, cu)
    out["position_ids"] = shard_as(position_ids.contiguous(), 1, group, "zigzag", cu, "position_ids")
    if cu is not None:
        out.update(docs.flash_kwargs(cu, input_ids.device))
    dp = None if dp_group is None else as_comm(dp_group)
    out.loss_scale = as_group(group).size * (1 if dp is None else dp.size)
    if labels is not None:
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
        out["shift_labels"] = out["labels"] = shard_as(shifted, 1, group, "zigzag", cu, "labels")
        count = (shifted != ignore_index).sum().reshape(1)
        if dp is not None and dp.size > 1:
            count = allreduce_sum(dp, count, "shard_inputs: num_items_in_batch over dp_group")
        out["num_items_in_batch"] = int(count)
    return out


def _model_shape(config) -> tuple:
    """``(heads, kv_heads, head_dim, dtype)`` of a transformers config, or of a model (its ``config``
    and its parameters' dtype); a config without a dtype: torch's default dtype."""
    if config is None:
        raise ValueError("shard_inputs: register(plan='auto') plans from the model's heads: pass config=model.config")
    dtype = next((d for d in (getattr(config, "dtype", None), getattr(config, "torch_dtype", None))
                  if isinstance(d, torch.dtype)), torch.get_default_dtype())
    config = getattr(config, "config", config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"shard_inputs: config ({type(config).__name__}) has no num_attention_heads to plan from")
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return heads, kv, head_dim, dtype


def _plan_layers(group, shape: tuple, cu, model: Optional[tuple]):
    """``register(plan="auto")``: the planned group or mesh, made at the first call. The ranks agree
    on what the plan is made from (a handshake: batches that differ are refused on every rank), so
    the deterministic planner gives each the same plan, and each builds the same mesh."""
    import os

    from .. import plan_attention
    from ..planning.model import load_profile
    if _LAYERS["planned"] is not None:
        return _LAYERS["planned"][0]
    profile = load_profile(_LAYERS["profile"])
    comm = as_comm(group)
    b, s = shape
    cu = None if cu is None else torch.as_tensor(cu).to(torch.int64)
    hosts = int(os.environ.get("LOCAL_WORLD_SIZE", "8"))  # torchrun's processes per host: one per GPU
    handshake(comm, "shard", {"input_ids.shape[0]": b, "input_ids.shape[1]": s,
                              "cu_seqlens": attn_meta.docs_code(None if cu is None else tuple(cu.tolist())),
                              "heads": model[0], "kv_heads": model[1], "head_dim": model[2],
                              "dtype": encode_dtype(model[3]), "gpus per host": hosts,
                              "profile": value_code(sorted(profile.data.items()))})
    plan = plan_attention(comm.size, **_planned_lengths(b, s, cu), heads=model[0], kv_heads=model[1], head_dim=model[2], dtype=model[3],
                          gpus_per_host=hosts, profile=profile)
    cand = next(r.candidate for r in plan.candidates if r.candidate.layout == "zigzag" or r.candidate.schedule == "heads")
    mesh = group if cand.schedule in _SCHEDULES_1D else \
        _build_mesh(comm, dataclasses.replace(plan, mesh=(cand.heads_degree, cand.seq_degree)))
    _LAYERS["planned"] = (mesh, cand.schedule, plan, cand)
    return mesh


def _planned_lengths(b: int, s: int, cu: Optional[Tensor]) -> dict:
    """The planner's ``seq_len`` (one row, one document) or ``cu_seqlens`` (the ``b`` rows of ``s``
    laid end to end, each with the documents of ``cu``)."""
    if cu is None and b == 1:
        return {"seq_len": s}
    rows = cu if cu is not None else torch.tensor([0, s])
    return {"cu_seqlens": torch.cat([rows[:-1] + r * s for r in range(b)] + [torch.tensor([b * s])])}


def _build_mesh(comm, plan) -> tuple:
    """``(seq_group, heads_group)`` of this rank in ``plan``'s mesh over the ranks of ``comm`` (heads
    groups contiguous, ``Plan.rank_groups``): every rank creates its two groups, sequence first,
    with ``torch.distributed.new_group``."""
    from ..distributed.comm import TorchComm
    if not isinstance(comm, TorchComm):
        heads_degree, seq_degree = plan.mesh
        raise ValueError(f"register(plan='auto') chose a {seq_degree} x {heads_degree} mesh, which it builds with "
                         f"torch.distributed.new_group; group must then be a torch.distributed group, got "
                         f"{type(comm).__name__}")
    ranks = comm.dist.get_process_group_ranks(comm.group)
    seq_groups, heads_groups = plan.rank_groups()
    mine = [next(g for g in groups if comm.rank in g) for groups in (seq_groups, heads_groups)]
    return tuple(comm.dist.new_group([ranks[i] for i in g], use_local_synchronization=True) for g in mine)
