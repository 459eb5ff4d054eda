"""Public merge of partial results (docs/API.md, "Single device"), over the custom op of ``op.py``."""
from __future__ import annotations


import torch
from torch import Tensor

from ...core import checks as _checks
from ...core.runtime import Memo, geometry
from .._registry import call, op as local_op, plain_eager
from . import op  # noqa: F401  (registers the custom ops)

# merges that record no gradient, by their operands' geometry: the runner (``local_op("merge_runner")``)
# their first call left
_RUNNERS = Memo()


def merge_states(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Merge N partial results along dim 0.

    Args:
        outs: ``(N, *rows, Dv)`` normalised partial outputs, any float dtype.
        lses: ``(N, *rows)`` their log-sum-exps (natural log). A partial with ``lse = -inf``
            contributes nothing, whatever its ``out`` holds (NaN included).

    Returns ``(out (*rows, Dv) in outs.dtype, lse (*rows) float32)``; associative and commutative.
    """
    key = None
    if type(outs) is Tensor and type(lses) is Tensor and plain_eager(outs, lses):
        # a geometry that ran before: one lookup of its runner (no checks: that call passed them)
        key = geometry(outs, lses)
        run = _RUNNERS.get(key)
        if run is not None and run.fresh():
            return run(outs, lses)
    _checks.merge_args(outs, lses)
    if outs.shape[0] == 0:
        rows = tuple(outs.shape[1:-1])
        return outs.new_zeros(outs.shape[1:]), torch.full(rows, float("-inf"), device=outs.device)
    out, lse = call("merge_fwd", outs, lses)
    if key is not None:
        run = local_op("merge_runner", outs)(outs, lses)
        if run is not None:
            _RUNNERS.put(key, run)
    # (``Tensor.to`` costs host time even where it changes nothing)
    return (out if out.dtype == outs.dtype else out.to(outs.dtype),
            lse if lse.dtype == torch.float32 else lse.float())
