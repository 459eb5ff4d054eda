"""PROTOTYPE (probe only, not part of the library): attention forward with Q/K/V tiles loaded through TMA.

Same math as ``attention._attn_fwd_kernel`` for the simple case: ``q, k, v`` contiguous
``(B, H, S, D)`` bf16, one kv head per query head, ``Sq == Sk == S``, causal diagonal at
``j <= i``, ``S % BLOCK_M == S % BLOCK_N == 0``. The online recurrence runs in the log2 domain
(``qk_scale = scale * log2(e)``); key tiles every row sees whole run unmasked, only the tiles
crossing the diagonal are masked (``-inf``), tiles above it are never visited; causal programs
start with the heaviest query blocks. ``lse`` is returned in the natural log.

Host-side descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``) over the 2-D views
``(B*H*S, D)``: block ``[BLOCK_M, D]`` for Q/O, ``[BLOCK_N, D]`` for K/V. A descriptor is built
on the host and passed by value (a ``CUtensorMap`` kernel parameter), so no global scratch and no
``triton.set_allocator`` is needed (that is only for device-side ``tl.make_tensor_descriptor``).

Variants (constexpr flags of one kernel), see ``VARIANTS``: which operands go through TMA, the
output store (descriptor or pointers), and ``tl.range(warp_specialize=True)`` on the unmasked loop
(Triton 3.6 runs a Hopper warp-specialization pass, ``nvidia.passes.hopper.add_hopper_warpspec``,
on sm_90 for loops so marked; it fails on a kernel with a second loop after the marked one, so
the WS variant unrolls the fixed number of diagonal tiles instead).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from splitsoftmax.local import interpreting
from splitsoftmax.kernels import _interpreter  # noqa: F401  (interpreter work-arounds, before any kernel)

LOG2E = 1.4426950408889634
# Triton 3.6's interpreter multiplies bf16 tiles as raw integers (see attention._DOT_F32).
_DOT_F32 = tl.constexpr(interpreting())

# name -> flags: Q_TMA, KV_TMA, O_TMA (descriptor store of out), WS (tl.range warp_specialize)
VARIANTS = {
    "tma": {"q_tma": True, "kv_tma": True, "o_tma": True, "ws": False},
    "tma_optr": {"q_tma": True, "kv_tma": True, "o_tma": False, "ws": False},
    "tma_q": {"q_tma": True, "kv_tma": False, "o_tma": False, "ws": False},
    "ptr": {"q_tma": False, "kv_tma": False, "o_tma": False, "ws": False},
    "tma_ws": {"q_tma": True, "kv_tma": True, "o_tma": True, "ws": True},
}


@triton.jit
def _dot(a, b, acc):
    """``acc + a @ b`` with float32 accumulation."""
    if _DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _load_kv(Kd, Vd, kv_row, KV_TMA: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """K and V tiles ``[BLOCK_N, D]`` of rows ``kv_row ..`` of the ``(B*H*S, D)`` views."""
    if KV_TMA:
        k = Kd.load([kv_row, 0])
        v = Vd.load([kv_row, 0])
    else:
        offs = (kv_row + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
        k = tl.load(Kd + offs)
        v = tl.load(Vd + offs)
    return k, v


@triton.jit
def _tile(acc, l_i, m_i, q, k, v, pos, kj, qk_scale, MASKED: tl.constexpr):
    """One key tile of the online recurrence; ``MASKED``: keys ``kj > pos`` of a row get ``-inf``."""
    qk = _dot(q, tl.trans(k), None)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where(kj[None, :] <= pos[:, None], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf - 0) = 0
        p = tl.math.exp2(s - m_use[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # qk_scale > 0
        m_use = m_new
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)  # [BLOCK_M]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = _dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["S"])
def _attn_fwd_tma_kernel(Qd, Kd, Vd, Od, L, S, qk_scale,
                         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                         Q_TMA: tl.constexpr, KV_TMA: tl.constexpr, O_TMA: tl.constexpr,
                         WS: tl.constexpr):
    """Grid ``(S // BLOCK_M, B*H)``. ``Qd, Kd, Vd, Od``: tensor descriptors over the ``(B*H*S, D)``
    views where the matching flag is set, else plain pointers to them; ``L``: ``(B*H*S)`` float32."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # the query blocks with the most visible keys start first: a shorter tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    base = bh * S  # first row of this (batch, head) in the 2-D views (B*H*S < 2**31)
    q_row = base + m0
    pos = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query positions
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if Q_TMA:
        q = Qd.load([q_row, 0])  # [BLOCK_M, D]
    else:
        q = tl.load(Qd + (q_row + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None] * D + offs_d[None, :])
    # key tiles [0, mid) every row sees whole; [mid, hi) cross the diagonal (S % BLOCK_N == 0, so
    # every tile lies inside this head's S rows; keys past the diagonal are masked, never read past S)
    hi = S
    mid = S
    if CAUSAL:
        hi = m0 + BLOCK_M
        mid = ((m0 + 1) // BLOCK_N) * BLOCK_N
    DIAG_TILES: tl.constexpr = BLOCK_M // BLOCK_N if BLOCK_M > BLOCK_N else 1  # == (hi - mid) // BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in tl.range(0, mid, BLOCK_N, warp_specialize=WS):
        start = tl.multiple_of(start, BLOCK_N)
        k, v = _load_kv(Kd, Vd, base + start, KV_TMA, BLOCK_N, D)
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, k, v, pos, start + offs_n, qk_scale, False)
    if CAUSAL:
        if WS:
            # Triton 3.6's Hopper warp-specialization pass fails on a second scf.for after the
            # specialized one; the diagonal tiles are a fixed count, max(1, BLOCK_M // BLOCK_N)
            # (m0 is a multiple of BLOCK_M), so they are unrolled instead
            for t in tl.static_range(DIAG_TILES):
                start = tl.multiple_of(mid + t * BLOCK_N, BLOCK_N)
                k, v = _load_kv(Kd, Vd, base + start, KV_TMA, BLOCK_N, D)
                acc, l_i, m_i = _tile(acc, l_i, m_i, q, k, v, pos, start + offs_n, qk_scale, True)
        else:
            for start in range(mid, hi, BLOCK_N):  # the tiles crossing the diagonal
                start = tl.multiple_of(start, BLOCK_N)
                k, v = _load_kv(Kd, Vd, base + start, KV_TMA, BLOCK_N, D)
                acc, l_i, m_i = _tile(acc, l_i, m_i, q, k, v, pos, start + offs_n, qk_scale, True)
    # epilogue: every row sees key 0, so l > 0 and m is finite
    out = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    tl.store(L + q_row + tl.arange(0, BLOCK_M), lse)
    if O_TMA:
        Od.store([q_row, 0], out.to(Od.dtype))
    else:
        tl.store(Od + (q_row + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None] * D + offs_d[None, :],
                 out.to(Od.dtype.element_ty))


def attn_fwd_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block_m: int, block_n: int,
                 num_warps: int, num_stages: int, *, q_tma: bool = True, kv_tma: bool = True, o_tma: bool = True,
                 ws: bool = False, scale: float | None = None, return_kernel: bool = False):
    """``(out (B, H, S, D) bf16, lse (B, H, S) float32, natural log)`` of softmax attention; with
    ``return_kernel`` also the launched ``CompiledKernel`` (regs, spills, asm)."""
    assert q.dim() == 4 and q.shape == k.shape == v.shape, (q.shape, k.shape, v.shape)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    b, h, s, d = q.shape
    assert d == 128, d
    assert s % block_m == 0 and s % block_n == 0, (s, block_m, block_n)
    assert b * h * s < 2 ** 31
    if scale is None:
        scale = d ** -0.5
    assert scale > 0
    out = torch.empty_like(q)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    rows = b * h * s
    q2, k2, v2, o2 = (t.view(rows, d) for t in (q, k, v, out))

    def arg(t, block_rows, tma):
        return TensorDescriptor(t, [rows, d], [d, 1], [block_rows, d]) if tma else t

    grid = (s // block_m, b * h)
    kern = _attn_fwd_tma_kernel[grid](arg(q2, block_m, q_tma), arg(k2, block_n, kv_tma), arg(v2, block_n, kv_tma),
                                      arg(o2, block_m, o_tma), lse, s, scale * LOG2E, D=d, BLOCK_M=block_m,
                                      BLOCK_N=block_n, CAUSAL=causal, Q_TMA=q_tma, KV_TMA=kv_tma, O_TMA=o_tma, WS=ws,
                                      num_warps=num_warps, num_stages=num_stages)
    return (out, lse, kern) if return_kernel else (out, lse)
