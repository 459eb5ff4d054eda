"""Public single-device attention (docs/API.md, "Single device" and "Attention variants"), over the
custom ops of ``op.py``."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...core import checks as _checks, keywords as variants
from ...core.autocast import like_sdpa
from ...core.runtime import Memo, geometry
from .._registry import call, eager_grad, op as local_op
from . import op  # (registers the custom ops)

# plain forwards by their operands' geometry, scale and causal: the runner (``local_op("attn_runner")``)
# their first call left
_RUNNERS = Memo()


@like_sdpa
def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
              return_lse: bool = False, cu_seqlens=None, window_size=None, softcap=None, sinks=None, kv_range=None,
              q_offset=0):
    """Exact softmax attention, laid out like ``scaled_dot_product_attention``.

    Args:
        q: ``(B, H, Sq, D)``; k: ``(B, Hkv, Sk, D)``; v: ``(B, Hkv, Sk, Dv)``, ``H % Hkv == 0``
            (query head ``h`` reads kv head ``h // (H // Hkv)``).
        causal: query ``i`` sees keys ``j <= i`` (top-left aligned, like SDPA's ``is_causal``).
        scale: score scale, default ``1 / sqrt(D)``.
        return_lse: also return ``lse (B, H, Sq)``, float32, natural log.
        cu_seqlens: ``(N+1,)`` ints (tensor or sequence): packed documents ``[cu[d], cu[d+1])``;
            a query sees keys of its own document only (``Sq == Sk``, ``q_offset == 0``).
        window_size: ``(left, right)``: query at position ``p`` sees keys ``p - left <= j <= p + right``
            (``-1``: unbounded), intersected with ``causal``.
        softcap: ``c > 0``: scores become ``c * tanh(s / c)`` (after ``scale``).
        sinks: ``(H,)`` float: one virtual key per head with logit ``sinks[h]`` and value 0
            (differentiable; its gradient comes back in ``sinks.dtype``).
        kv_range: ``(B, 2)`` ints: element ``b`` sees keys ``kv_range[b, 0] <= j < kv_range[b, 1]``.
        q_offset: int or ``(B,)`` ints: query ``i`` sits at key position ``q_offset + i`` for
            ``causal`` and ``window_size``.

    Returns ``out (B, H, Sq, Dv)`` in ``q.dtype`` (or ``(out, lse)``). A query that sees no key
    gets ``out = 0``, ``lse = -inf`` (``sinks[h]`` with sinks) and zero gradients. Under
    ``torch.autocast`` q, k, v are cast to the autocast dtype, as SDPA's are. The rules in full:
    docs/API.md.
    """
    _checks.flag("return_lse", return_lse)
    if (cu_seqlens is None and window_size is None and softcap is None and sinks is None and kv_range is None
            and type(q_offset) is int and q_offset == 0):
        out, lse = _plain_attention(q, k, v, scale, causal)
    else:
        s = _checks.attention_args(q, k, v, scale, causal)
        out, lse = _variant_attention(q, k, v, s, causal, cu_seqlens=cu_seqlens, window_size=window_size,
                                      softcap=softcap, sinks=sinks, kv_range=kv_range, q_offset=q_offset)
    return (out, lse if lse.dtype == torch.float32 else lse.float()) if return_lse else out


def _plain_attention(q: Tensor, k: Tensor, v: Tensor, scale, causal) -> tuple[Tensor, Tensor]:
    """``attn_fwd`` of the plain mask. In plain eager mode (:func:`eager_grad`), a call of a geometry
    that ran before is one lookup of the runner the first call left (no checks: that call passed them
    on the same key; nor route or plan), and where a gradient is recorded the runner's outputs get
    the op's autograd formula (``op.LeanAttention``)."""
    key = None
    if (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and (causal is True or causal is False)
            and (scale is None or type(scale) is float)):
        grad = eager_grad(q, k, v)
        if grad is not None:
            key = (geometry(q, k, v), scale, causal)
            run = _RUNNERS.get(key)
            if run is not None and run.fresh(q):
                return op.LeanAttention.apply(run, q, k, v) if grad else run(q, k, v)
    s = _checks.attention_args(q, k, v, scale, causal)
    res = call("attn_fwd", q, k, v, s, causal, 0)
    if key is not None:
        run = local_op("attn_runner", q)(q, k, v, s, causal)
        if run is not None:
            _RUNNERS.put(key, run)
    return res


def _variant_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, **keywords):
    """``attn_fwd`` with the variant keywords checked and turned into the local op's mask."""
    (b, h, sq, _), sk = q.shape, k.shape[2]
    spec = variants.parse(batch=b, heads=h, sq=sq, sk=sk, device=q.device, causal=causal, **keywords)
    mask, band, diag = variants.local_mask(spec, 0, sq, 0, sk, q.device)
    return call("attn_fwd", q, k, v, scale, band, diag, *mask, spec.sinks)
