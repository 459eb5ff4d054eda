"""transformers' masks as the keywords of ``ss.attention`` (docs/API.md, "Hugging Face").

transformers builds one mask per layer type and forward through its ``AttentionMaskInterface``:
the registered function gets the sizes (query and key lengths, where the queries and keys sit),
the 2-D padding mask and a *mask function* composed from a few known pieces (causal,
bidirectional, sliding window, packed documents, position remapping; ``and_masks`` /
``or_masks``). :func:`build` reads those pieces and returns a :class:`Visibility` instead of a
dense mask: causal, the window, where query 0 sits among the keys (``q_offset``), the padding as
one key interval per batch element (``kv_range``) and the packed documents. The model hands it
to every layer of that type as ``attention_mask``; the attention function turns it into keywords.

Nothing here raises: a pattern the keywords cannot express (a custom ``or_mask_function``,
chunked attention, padding with holes) is recorded in ``Visibility.refused`` and raised by the
first layer that uses the mask, so a model whose other layers need nothing unusual still builds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

UNBOUNDED = 1 << 62


@dataclass
class Visibility:
    """What a layer may see, in the coordinates of the keys it gets (``kv_length`` rows).

    ``window = (left, right)``: query at key position ``p`` sees ``p - left <= j <= p + right``
    (``UNBOUNDED``: no bound); ``q_offset``: the key position of query 0 (int, or ``(B,)`` tensor
    read on the device); ``kv_range (B, 2)``: the padding; ``docs (B, Sq)``: document ids of packed
    rows; ``holes (B,)``: rows whose padding is not one interval (checked when first used);
    ``padded``: the model gave a 2-D attention mask (even one that hides nothing).
    """

    causal: bool
    batch: int
    q_length: int
    kv_length: int
    window: tuple = (UNBOUNDED, UNBOUNDED)
    q_offset: Union[int, Tensor] = 0
    kv_range: Optional[Tensor] = None
    holes: Optional[Tensor] = None
    docs: Optional[Tensor] = None
    refused: Optional[str] = None
    padded: bool = False
    ndim = 4  # transformers passes a prepared mask whose ndim is not 2 on without re-reading it

    @property
    def shape(self) -> tuple:
        return (self.batch, 1, self.q_length, self.kv_length)

    def window_size(self) -> Optional[tuple]:
        """The ``window_size`` keyword (``-1`` = unbounded), None when there is no window."""
        left, right = self.window
        if self.causal:
            right = min(right, 0)
        if left >= UNBOUNDED and (right >= UNBOUNDED or (self.causal and right == 0)):
            return None
        return (-1 if left >= UNBOUNDED else left, -1 if right >= UNBOUNDED else right)


# mask pieces transformers composes that the keywords cannot express, as the refusal names them
_UNSUPPORTED = {"or_masks": "a union of mask patterns (or_mask_function)", "chunked_overlay": "chunked attention",
                "blockwise_overlay": "blockwise (bidirectional block) attention",
                "padding_mask_function": "a padding mask inside the mask pattern"}


class _Pattern:
    """The pieces of a mask function, read from its closure: ``causal``, ``window``, ``docs``, or why not."""

    def __init__(self):
        self.causal = self.full = self.remapped = False
        self.window = [UNBOUNDED, UNBOUNDED]
        self.docs: Optional[Tensor] = None
        self.refused: Optional[str] = None

    def read(self, fn) -> "_Pattern":
        name = getattr(fn, "__qualname__", type(fn).__name__).split(".<locals>")[0]
        cells = _closure(fn)
        if name == "causal_mask_function":
            self.causal = True
        elif name == "bidirectional_mask_function":
            self.full = True
        elif name == "and_masks" and "mask_functions" in cells:
            for part in cells["mask_functions"]:
                self.read(part)
        elif name == "sliding_window_overlay" and "sliding_window" in cells:
            self.window[0] = min(self.window[0], int(cells["sliding_window"]) - 1)  # kv > q - W
        elif name == "sliding_window_bidirectional_overlay" and "sliding_window" in cells:
            w = int(cells["sliding_window"])  # |q - kv| <= W
            self.window = [min(self.window[0], w), min(self.window[1], w)]
        elif name == "packed_sequence_mask_function" and "packed_sequence_mask" in cells:
            self.docs = cells["packed_sequence_mask"]
        elif name == "remap_positions_for_packed_sequence" and "mask_function" in cells:
            self.remapped = True  # positions within a document differ from indices by a constant
            self.read(cells["mask_function"])
        else:
            self.refused = self.refused or f"cannot express {_UNSUPPORTED.get(name, f'the mask pattern {name}')}"
        return self

    def check(self) -> Optional[str]:
        if self.refused:
            return self.refused
        if self.causal == self.full:
            return "cannot express a mask pattern that is neither causal nor bidirectional"
        if self.remapped and self.docs is None:
            return "cannot express position-remapped masks outside packed sequences"
        return None


def _closure(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


def _padding(attention_mask: Optional[Tensor], kv_length: int, kv_offset) -> tuple:
    """``(kv_range (B, 2) int32, holes (B,) bool)`` of the 2-D padding mask over the keys
    ``kv_offset .. kv_offset + kv_length - 1`` (positions past the mask are padding, as in
    transformers); ``(None, None)`` without a mask, or a CPU mask that hides nothing."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None, None
    pm = attention_mask.to(torch.bool)
    if not pm.is_meta and pm.device.type == "cpu" and kv_offset == 0 and pm.shape[1] == kv_length and bool(pm.all()):
        return None, None
    pm = torch.nn.functional.pad(pm, (0, kv_length))  # [B, L + kv_length]: indices below stay in range
    idx = torch.arange(kv_length, device=pm.device)
    pm = pm.index_select(1, idx + kv_offset)  # [B, kv_length]
    lo = torch.where(pm, idx, kv_length).amin(1)
    hi = torch.where(pm, idx + 1, 0).amax(1)
    some = pm.any(1)
    lo, hi = torch.where(some, lo, 0), torch.where(some, hi, 0)
    return torch.stack((lo, hi), 1).to(torch.int32), pm.sum(1) != hi - lo


def _q_offset(batch, q_length, kv_length, q_offset, kv_offset, cache_position):
    """The key position of query 0: ``q_offset - kv_offset`` (transformers 5) or
    ``cache_position[0] - kv_offset`` (4.5x), an int or a ``(B,)`` tensor (no host read)."""
    if kv_length == q_length and isinstance(kv_offset, int) and kv_offset == 0:
        return 0  # the keys are exactly the queries' positions (self-attention includes itself)
    first = cache_position.reshape(-1)[:1] if q_offset is None and cache_position is not None else q_offset
    if first is None:
        first = 0
    off = first - kv_offset
    if isinstance(off, Tensor):
        off = off.reshape(-1)[:1].to(torch.int64).expand(batch)
        if off.device.type == "cpu" and not off.is_meta:
            return int(off[0])
    return off


def build(batch_size: int, q_length: Optional[int] = None, kv_length: Optional[int] = None, q_offset=None,
          kv_offset=0, mask_function=None, attention_mask=None, cache_position: Optional[Tensor] = None,
          use_vmap: bool = False, **kwargs) -> Visibility:
    """transformers' mask interface (4.53 and later, 4.x and 5.x): the :class:`Visibility` of the
    mask that ``mask_function`` and the padding ``attention_mask`` describe. A mask already built
    (transformers' generate prepares it once, then the model asks again) is returned as it is."""
    if isinstance(attention_mask, Visibility):
        return attention_mask
    if q_length is None:
        q_length = cache_position.shape[0]
    pattern = _Pattern().read(mask_function)  # (use_vmap only says that custom pieces may be in it)
    refused = pattern.check()
    kv_range, holes = _padding(attention_mask, kv_length, kv_offset)
    docs = pattern.docs
    offset = 0 if docs is not None else _q_offset(batch_size, q_length, kv_length, q_offset, kv_offset,
                                                 cache_position)
    padded = isinstance(attention_mask, Tensor) and attention_mask.dim() == 2
    return Visibility(pattern.causal, batch_size, q_length, kv_length, tuple(pattern.window), offset, kv_range,
                      holes, docs, refused, padded)
