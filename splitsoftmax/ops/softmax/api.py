"""The softmax family's public single-device functions (docs/API.md, "Single device"): softmax,
log-softmax and logsumexp along any dim, over the custom ops of ``op.py``."""
from __future__ import annotations

import math
from typing import Optional

from torch import Tensor

from ...core import checks as _checks
from .._registry import call, direct_one, op as local_op
from .._triton import configs
from . import op  # noqa: F401  (registers the custom ops)


def _rows(x: Tensor, dim: int) -> tuple[Tensor, Optional[tuple]]:
    """``x`` as ``(R, N)`` rows along ``dim`` (a view where possible), and the shape of ``x`` with
    ``dim`` moved last (``None``: ``x`` is those rows already)."""
    n = x.dim()
    if n == 2 and dim == 1:
        return x, None
    xm = x.reshape(1) if n == 0 else x if dim == n - 1 else x.movedim(dim, -1)
    return xm.reshape(math.prod(xm.shape[:-1]), xm.shape[-1]), tuple(xm.shape)


def _unrows(y: Tensor, x: Tensor, dim: int, shape: Optional[tuple]) -> Tensor:
    """Rows ``y (R, N)`` from :func:`_rows` back in the layout of ``x``."""
    if shape is None:
        return y
    y = y.reshape(shape)
    n = x.dim()
    return y.reshape(()) if n == 0 else y if dim == n - 1 else y.movedim(-1, dim)


def _softmax(x: Tensor, dim: int, log: bool) -> Tensor:
    lean = direct_one(x)
    key = None
    if lean and type(dim) is int:  # an input of a geometry whose rows ran whole before: one lookup, one launch
        key = ("along", x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() % 16 == 0, dim, log)
        run = configs.SOFTMAX.memo.get(key)
        if run is not None:
            return run(x)
    _checks.tensor("x", x)
    d = _checks.dim("dim", dim, x.dim())
    x2, shape = _rows(x, d)
    if not lean:
        return _unrows(call("softmax_fwd", x2, log)[0], x, d, shape)
    # no gradient: no lse; contiguous rows of the last dim are x itself, a later call takes them by `key`
    along = key if key is not None and d == x.dim() - 1 and x.is_contiguous() else None
    return _unrows(local_op("softmax_out", x2)(x2, log, along), x, d, shape)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax of ``x`` along ``dim``, in ``x.dtype`` (float32 statistics).

    A row of all ``-inf`` gives all zeros (and zero gradient), never NaN.
    """
    return _softmax(x, dim, log=False)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Log-softmax of ``x`` along ``dim``, in ``x.dtype``; a row of all ``-inf`` gives ``-inf``."""
    return _softmax(x, dim, log=True)


def logsumexp(x: Tensor, dim: int = -1) -> Tensor:
    """``log(sum(exp(x)))`` along ``dim`` (removed), float32; ``-inf`` for a row of all ``-inf``."""
    _checks.tensor("x", x)
    d = _checks.dim("dim", dim, x.dim())
    x2, shape = _rows(x, d)
    lse = call("logsumexp_fwd", x2).float()
    return lse if shape is None else lse.reshape(shape[:-1])
