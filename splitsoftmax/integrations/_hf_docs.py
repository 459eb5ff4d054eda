"""Packed documents in the transformers integration: ``cu_seqlens`` from what the model gives.

transformers marks packed rows in two ways: ``position_ids`` that restart (its mask function then
carries the document id of every token) and FlashAttention's ``cu_seq_lens_q/k`` (as
``DataCollatorWithFlattening`` returns them, over the batch's tokens laid end to end). Both become
the ``cu_seqlens`` keyword, read to the host once per forward (every layer shares the result).
Rows packed differently in one batch are laid end to end as one row, which is exact.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..distributed import unshard

WHO = "attn_implementation='splitsoftmax'"


def _starts_cu(new: Tensor, total: int) -> Tensor:
    """``cu_seqlens`` (CPU int64) from a boolean "a document starts here" vector."""
    return torch.cat((torch.nonzero(new).flatten(), torch.tensor([total]))).to(torch.int64)


def from_doc_ids(doc_ids: Tensor, b: int, s: int) -> tuple:
    """``(cu, flat)`` from document ids ``(B or 1, S)``: one ``cu`` over ``S`` when every row has
    the same documents (``flat=False``), else over the ``B*S`` tokens laid end to end."""
    d = doc_ids.to("cpu")
    new = torch.ones(d.shape, dtype=torch.bool)
    new[:, 1:] = d[:, 1:] != d[:, :-1]
    if d.shape[0] == 1 or bool((new == new[:1]).all()):
        return _starts_cu(new[0], s), False
    return _starts_cu(new.reshape(-1), b * s), True


def given(kwargs: dict) -> Optional[Tensor]:
    """FlashAttention's ``cu_seq_lens_q/k`` (``cumulative_seqlens_q/k`` in transformers 4.5x), which
    must be one set of boundaries (self-attention), or None."""
    cq = kwargs.get("cu_seq_lens_q", kwargs.get("cumulative_seqlens_q"))
    ck = kwargs.get("cu_seq_lens_k", kwargs.get("cumulative_seqlens_k"))
    if cq is None and ck is None:
        return None
    if cq is None or ck is None or (cq is not ck and not torch.equal(torch.as_tensor(cq).cpu(),
                                                                      torch.as_tensor(ck).cpu())):
        raise ValueError(f"{WHO}: cu_seq_lens_q and cu_seq_lens_k differ; packed self-attention takes one set of "
                         "document boundaries")
    return cq


def _stream(cu: Tensor, flat: bool, b: int, s: int) -> Tensor:
    """Document starts over the ``B*S`` tokens laid end to end (to compare two descriptions)."""
    if flat:
        return cu[:-1]
    return torch.unique(torch.cat([cu[:-1] + r * s for r in range(b)]))


def local(vis, kwargs: dict, q: Tensor, where: str) -> tuple:
    """``(cu_seqlens CPU int64 or None, flat)`` for one process; ``flat``: the batch is laid end to
    end as one row. Cached on the layer type's mask, so only the first layer reads to the host."""
    cached = getattr(vis, "_docs", None)
    if cached is not None:
        return cached
    result = (None, False)
    b, s = q.shape[0], q.shape[2]
    if not q.is_meta:
        if vis.docs is not None:
            result = from_doc_ids(vis.docs, b, s)
        cu_given = given(kwargs)
        if cu_given is not None:
            result = _from_given(cu_given, result, b, s, where)
        if result[1] and (vis.kv_range is not None or isinstance(vis.q_offset, Tensor) or vis.q_offset):
            raise ValueError(f"{WHO}{where}: rows packed differently cannot be combined with padding or a KV cache")
    vis._docs = result
    return result


def _from_given(cu_given, from_mask: tuple, b: int, s: int, where: str) -> tuple:
    cu = torch.as_tensor(cu_given).to("cpu", torch.int64)
    total = int(cu[-1]) if cu.numel() else -1
    if total not in (s, b * s) or (total == s and b > 1 and s > 0):
        raise ValueError(f"{WHO}{where}: cu_seq_lens_q ends at {total}, but the batch holds {b} row(s) of {s} "
                         "tokens (it counts the tokens of all rows laid end to end)")
    mine = (cu, total == b * s and b > 1)
    if (from_mask[0] is not None and not _one_per_row(*from_mask, s)
            and not torch.equal(_stream(*from_mask, b, s), _stream(*mine, b, s))):
        raise ValueError(f"{WHO}{where}: the documents of position_ids and of cu_seq_lens_q differ")
    return mine


def _one_per_row(cu: Tensor, flat: bool, s: int) -> bool:
    """Whether ``(cu, flat)`` holds one document per row: what the mask of transformers 4.5x carries
    from default ``position_ids`` (no restart), which says nothing against ``cu_seq_lens_q``."""
    return not flat and cu.numel() == 2 and int(cu[-1]) == s


def check_runs(module, position_ids: Optional[Tensor], vis, where: str) -> None:
    """First layer, no documents found: ``position_ids`` that restart mean packing that transformers
    did not mask (it detects packing only without a KV cache and without an attention_mask);
    refused rather than attending across the documents."""
    if (position_ids is None or position_ids.is_meta or getattr(module, "layer_idx", 0) not in (0, None)
            or vis.padded or vis.q_length < 2 or torch.compiler.is_compiling()):
        return
    if not bool((position_ids.diff(dim=-1) == 1).all()):
        raise ValueError(f"{WHO}{where}: position_ids restart within a row (packed sequences) but transformers built "
                         "no packed-sequence mask (some models never do; the others only without a KV cache and "
                         "without an attention_mask): pass cu_seq_lens_q/k, or use_cache=False")


def positions(cu: Optional[Tensor], s: int, device) -> Tensor:
    """``(1, S)`` positions ``0..S-1``, restarting at every document start of ``cu``."""
    idx = torch.arange(s)
    if cu is not None:
        cu = torch.as_tensor(cu).cpu().to(torch.int64)
        idx = idx - cu[torch.searchsorted(cu[1:], idx, right=True)]
    return idx.view(1, s).to(device)


def from_inputs(input_ids: Tensor, position_ids: Optional[Tensor], cu_seqlens) -> Optional[Tensor]:
    """The global documents for :func:`shard_inputs`: ``cu_seqlens`` as given, or from
    ``position_ids`` that restart (the same in every row); None for one document per row."""
    s = input_ids.shape[1]
    if cu_seqlens is not None:
        return torch.as_tensor(cu_seqlens).to("cpu", torch.int64)
    if position_ids is None or position_ids.is_meta:
        return None
    new = torch.ones(position_ids.shape, dtype=torch.bool)
    new[:, 1:] = (position_ids.diff(dim=-1) != 1).cpu()
    if not bool((new == new[:1]).all()):
        raise ValueError("shard_inputs: the rows of position_ids pack different documents; sequence-parallel "
                         "packing shares one set of boundaries (pack into one row: batch size 1)")
    return None if not bool(new[0, 1:].any()) else _starts_cu(new[0], s)


def flash_kwargs(cu: Tensor, device) -> dict:
    """The documents as the model's FlashAttention keywords (one tensor for q and k)."""
    dev = cu.to(device=device, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return {"cu_seq_lens_q": dev, "cu_seq_lens_k": dev, "max_length_q": longest, "max_length_k": longest}


def check_shard_positions(module, position_ids: Optional[Tensor], local: int, cu, group, where: str,
                          generating: Optional[str] = None) -> None:
    """First layer, sequence parallel: ``position_ids`` must be this rank's zigzag shard (per
    document) of positions restarting at every document; checked on the gathered whole, so every
    rank reaches the same verdict. ``generating``: the advice to give where a KV cache is in use
    (whole sequences with a cache are what ``generate`` passes), instead of sharding the inputs."""
    if position_ids is None or position_ids.is_meta or getattr(module, "layer_idx", 0) not in (0, None):
        return
    extra = {} if cu is None else {"cu_seqlens": cu}
    full = unshard(position_ids.contiguous(), position_ids.dim() - 1, group=group, layout="zigzag", **extra)
    want = positions(cu, full.shape[-1], full.device)
    if position_ids.shape[-1] != local or not bool((full == want).all()):
        if generating:
            raise ValueError(f"{WHO}{where} (sequence-parallel): position_ids are not the zigzag shards of positions "
                             f"0..S-1 and a KV cache is in use (use_cache=True), as in generate(): {generating}")
        raise ValueError(f"{WHO}{where} (sequence-parallel): position_ids are not the zigzag shards of positions "
                         "0..S-1 (restarting per document); to train, shard input_ids, position_ids and labels with "
                         "splitsoftmax.integrations.transformers.shard_inputs; to run whole sequences on every rank "
                         "(evaluation, generation), use local attention: attn_implementation='splitsoftmax'")
