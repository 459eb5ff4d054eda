"""The device side of the state algebra: ``log2(e)`` and the base-2 arithmetic of ``(m, l, o)`` states
that the kernels share (merging two states, one step of the online softmax, the ``lse`` of a state).

The kernels keep statistics in the log2 domain (``exp2`` is the GPU's native exponential): a max
``m`` there is ``log2(e)`` times the natural one, and ``lse = lse2 * ln(2)`` at the boundary. Where
every part is empty the max is ``-inf``; it is subtracted as 0 instead, so ``exp2(-inf - 0) = 0``
and never ``exp2(-inf + inf) = NaN``.

:data:`LOG2E` is a ``tl.constexpr`` global: Triton and Gluon kernels read it alike (``gl.constexpr``
is ``tl.constexpr``), and ``LOG2E.value`` is the same number as a Python float for host code (a
score scale in the log2 domain is ``scale * LOG2E.value``). The helpers are ``@triton.jit``
functions of elementwise ops and reductions only, so Gluon kernels call them too, in the layouts of
their arguments.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def ref_max(m):
    """The max to subtract: ``m``, or 0 where it is ``-inf`` (every part empty), so that
    ``exp(-inf - ref) = 0`` and never NaN; any domain."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def inv_or_zero(s):
    """``1 / s`` of a weight sum, 0 where it is exactly 0 (every part empty); NaN stays NaN."""
    some = s != 0
    return tl.where(some, 1.0 / tl.where(some, s, 1.0), 0.0)


@triton.jit
def lse2_of(m, s):
    """``lse`` in the log2 domain from a max ``m`` (0 where every part is empty) and the weight
    sum ``s`` relative to it: ``m + log2(s)``, ``-inf`` where ``s`` is exactly 0, NaN stays NaN."""
    some = s != 0
    return tl.where(some, m + tl.math.log2(tl.where(some, s, 1.0)), float("-inf"))


@triton.jit
def rescale(m_a, m_b):
    """The merge of two states' maxima (or ``lse``) ``m_a, m_b`` in the log2 domain, of one shape:
    ``(m, ref, w_a, w_b)`` with ``m = max(m_a, m_b)``, ``ref`` the max as subtracted (0 where both
    are ``-inf``) and the scale factors ``w_a = exp2(m_a - ref)``, ``w_b = exp2(m_b - ref)``: the
    merged sum is ``w_a * l_a + w_b * l_b`` relative to ``ref``. An empty side has weight 0; two
    empty sides give weights 0 and no NaN."""
    m = tl.maximum(m_a, m_b)
    ref = ref_max(m)
    return m, ref, tl.math.exp2(m_a - ref), tl.math.exp2(m_b - ref)


@triton.jit
def online_step(l, m, ref, s):
    """One tile of the online softmax in the log2 domain: scores ``s [BLOCK_M, BLOCK_N]`` (already
    scaled by ``log2(e)``) folded into the running sum ``l [BLOCK_M]`` relative to the old max ``m``,
    given the new max as subtracted ``ref [BLOCK_M]`` (the new row max, 0 where it is still
    ``-inf``). Returns ``(p, alpha, l')``: ``p = exp2(s - ref)``, the old state's scale
    ``alpha = exp2(m - ref)`` (the accumulator is rescaled by it) and ``l' = l * alpha + sum(p)``."""
    p = tl.math.exp2(s - ref[:, None])
    alpha = tl.math.exp2(m - ref)
    return p, alpha, l * alpha + tl.sum(p, 1)
