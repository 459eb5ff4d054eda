"""Hugging Face transformers integration: ``attn_implementation="splitsoftmax"``.

``register()`` adds an attention function through transformers' ``AttentionInterface`` and a mask
function through its ``AttentionMaskInterface``. The mask function never builds a mask: it checks
that the mask the model asked for is one the attention function computes exactly (causal or
full, no padding, no sliding window, no custom mask pattern) and raises ``ValueError`` otherwise,
so nothing is silently dropped.

- One process (or ``sequence_parallel=False``): ``ss.attention`` (causal is aligned bottom-right
  when a KV cache makes the keys longer than the queries, as transformers expects).
- Inside an initialised ``torch.distributed`` group of size > 1: every rank holds its zigzag
  shard of the sequence (see :func:`shard_inputs`) and the layers run ``ss.sharded_attention``
  with ``layout="zigzag"``; ``position_ids`` are checked to be the zigzag shard of ``0..S-1``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _checks
from ..distributed import layout as lay
from ..distributed import shard, sharded_attention
from ..functional import attention
from ..ops import call

NAME = "splitsoftmax"
_CONFIG = {"group": None, "sequence_parallel": True}
# attention kwargs that change the math and that this implementation cannot honour
_REFUSED = {"sliding_window": "sliding-window attention", "softcap": "logit soft-capping",
            "s_aux": "attention sinks", "position_bias": "an additive position bias"}


def _sharded() -> bool:
    """Whether attention runs sequence-parallel: an initialised group of size > 1, and allowed."""
    import torch.distributed as dist
    if not _CONFIG["sequence_parallel"] or not (dist.is_available() and dist.is_initialized()):
        return False
    group = _CONFIG["group"]
    return dist.get_world_size(group) > 1


def _zigzag_positions(local: int, device) -> Tensor:
    """The global positions of this rank's zigzag shard (total length from one small all-reduce)."""
    import torch.distributed as dist
    group = _CONFIG["group"]
    total = torch.tensor([local], dtype=torch.int64,
                         device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(total, group=group)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = lay.shard_lengths(int(total.item()), size, "zigzag")
    segs = lay.segments("zigzag", lengths, rank)
    return torch.cat([torch.arange(s.glob, s.glob + s.n) for s in segs]).to(device)


def _check_positions(module, position_ids: Optional[Tensor], local: int) -> None:
    """On the first layer: ``position_ids`` must be this rank's zigzag shard of ``0..S-1``."""
    if position_ids is None or getattr(module, "layer_idx", 0) != 0:
        return
    want = _zigzag_positions(local, position_ids.device)
    if position_ids.shape[-1] != local or not bool((position_ids == want).all()):
        raise ValueError("attn_implementation='splitsoftmax' (sequence-parallel): position_ids are not this rank's "
                         "zigzag shard of 0..S-1; shard input_ids, position_ids and labels with "
                         "splitsoftmax.integrations.transformers.shard_inputs (packed sequences are not supported)")


def _check_runs(module, position_ids: Optional[Tensor]) -> None:
    """One process, first layer: each row of ``position_ids`` must be one contiguous run (no packing)."""
    if position_ids is None or getattr(module, "layer_idx", 0) != 0 or position_ids.shape[-1] < 2:
        return
    if not bool((position_ids.diff(dim=-1) == 1).all()):
        raise ValueError("attn_implementation='splitsoftmax' cannot express packed sequences (position_ids that "
                         "restart or jump within a row)")


def attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                      **kwargs) -> tuple[Tensor, None]:
    """transformers attention function: ``query (B, H, Sq, D)``, ``key/value (B, Hkv, Sk, D)``
    -> ``(out (B, Sq, H, D), None)``. GQA by ``H % Hkv``, ``scaling`` as the score scale."""
    if attention_mask is not None:
        raise ValueError("attn_implementation='splitsoftmax' got an explicit attention mask; it computes causal or "
                         "full attention only (no padding, no custom mask)")
    if dropout:
        raise ValueError(f"attn_implementation='splitsoftmax' does not implement attention dropout (dropout={dropout}); "
                         "set the config's attention_dropout to 0 or use model.eval()")
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation='splitsoftmax' does not implement {what} ({name}={kwargs[name]!r})")
    if kwargs.get("output_attentions"):
        raise ValueError("attn_implementation='splitsoftmax' cannot return attention weights (output_attentions=True)")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    sq, sk = query.shape[2], key.shape[2]
    if _sharded():
        if sq != sk:
            raise ValueError(f"attn_implementation='splitsoftmax' (sequence-parallel): queries ({sq}) and keys ({sk}) "
                             "differ in length; a KV cache is not supported across ranks")
        _check_positions(module, kwargs.get("position_ids"), sq)
        out = sharded_attention(query, key, value, causal=causal, scale=scaling, group=_CONFIG["group"],
                                layout="zigzag")
        return out.transpose(1, 2).contiguous(), None
    _check_runs(module, kwargs.get("position_ids"))
    if causal and sk != sq:
        # a KV cache: query i sits at key position sk - sq + i (bottom-right alignment)
        s = _checks.attention_args(query, key, value, scaling, causal)
        out, _ = call("attn_fwd", query, key, value, s, True, sk - sq)
    else:
        out = attention(query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def check_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function=None, attention_mask: Optional[Tensor] = None, local_size: Optional[int] = None,
                  use_vmap: bool = False, **kwargs) -> None:
    """transformers mask function: returns ``None`` (the attention function knows causal vs full)
    when that is exactly the requested mask; raises ``ValueError`` for what it cannot express."""
    from transformers import masking_utils as mu

    if local_size is not None:
        raise ValueError(f"attn_implementation='splitsoftmax' does not implement sliding-window or chunked "
                         f"attention (window {local_size})")
    if use_vmap:
        raise ValueError("attn_implementation='splitsoftmax' cannot express a custom mask pattern "
                         "(or_mask_function / and_mask_function)")
    padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None and not bool(padding.all()):
        raise ValueError("attn_implementation='splitsoftmax' does not support padding (attention_mask with zeros); "
                         "use unpadded batches of equal length")
    plain = mask_function in (mu.causal_mask_function, mu.bidirectional_mask_function)
    if not plain and not _sharded():  # sharded: the zigzag position jumps look like packing; checked later
        raise ValueError("attn_implementation='splitsoftmax' cannot express this mask (packed sequences, i.e. "
                         "position_ids that restart, or a model-specific mask pattern)")
    return None


def register(*, group=None, sequence_parallel: bool = True) -> str:
    """Register ``attn_implementation="splitsoftmax"`` with transformers; returns the name.

    ``group``: the ``torch.distributed`` group the sequence is sharded over (default: the world);
    ``sequence_parallel=False`` keeps attention single-process even in an initialised group
    (e.g. plain data parallelism).
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    _CONFIG.update(group=group, sequence_parallel=sequence_parallel)
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, check_mask)
    return NAME


def shard_inputs(input_ids: Tensor, position_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None, *,
                 group=None, layout: str = "zigzag", ignore_index: int = -100) -> dict:
    """This rank's shards (along the sequence, dim 1) of ``input_ids (B, S)``, ``position_ids``
    (default ``0..S-1``) and, if given, ``labels``: a dict to pass to the model as keyword arguments.

    Every rank passes the full tensors. Labels are shifted on the full sequence first (position
    ``i`` predicts token ``i + 1``; the last position gets ``ignore_index``) and returned sharded as
    both ``labels`` and ``shift_labels`` (so the model's loss does not shift again across a shard
    boundary), with ``num_items_in_batch`` = the global count of predicted tokens: each rank's loss
    is then its tokens' share of the global mean, and the ranks' losses (and gradients) sum to it.
    """
    _checks.choice("layout", layout, _checks.LAYOUTS)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
    out = {"input_ids": shard(input_ids, 1, group=group, layout=layout),
           "position_ids": shard(position_ids.contiguous(), 1, group=group, layout=layout)}
    if labels is not None:
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
        out["shift_labels"] = out["labels"] = shard(shifted, 1, group=group, layout=layout)
        out["num_items_in_batch"] = int((shifted != ignore_index).sum())
    return out
