"""Torch path of the vocabulary statistics (blockwise over V, float32 statistics), with the
signatures of the Triton launchers in ``ops/vocab/kernel.py``; and the merge of per-slice records,
which every path (column blocks, split programs, ranks) shares.

A row of logits ``x`` at temperature ``T`` is ``z = x * (1/T)``. A slice of its columns gives a
record, float32 (float64 for float64 logits):

- statistics ``(m, l, u, z_t)``: ``m = max z``, ``l = sum e^(z-m)``, ``u = sum e^(z-m) (z-m)``,
  ``z_t = z[target]`` on the slice that holds the target, else 0;
- KL ``(m_p, l_p, u, m_q, l_q)`` of two logit sets ``p, q``: ``u = sum e^(p-m_p) ((p-m_p) - (q-m_q))``.

``(m, l, u)`` is the attention state whose value is ``z`` (for KL ``p - q``) measured from the
slice's own origin (``m``; for KL ``m_p - m_q``, 0 standing for an empty side's ``-inf``), so no
large values cancel (the entropy's terms all share one sign). Records merge by moving every ``u``
to the origin of the merged maxima (``u_i + (origin_i - origin) l_i``) and merging with
``state.merge_stack``; then

    logp = (z_t - m) - log l,   entropy = log l - u / l,   KL = u / l_p - log l_p + log l_q.

A row with no finite logit (``l = 0``) gives ``logp = -inf``, entropy 0, KL 0 (no mass in ``p``);
NaN stays NaN. Gradients (per element, ``P = softmax(z) = exp((z - m) - log l)``, ``E = E_P[z]``,
``c = E_P[p - q]``):

    d logp / dz = onehot(target) - P,   d entropy / dz = -P (z - E),
    d KL / dp = P_p ((p - q) - c),      d KL / dq = P_q - P_p,

each times ``1/T`` for the raw logits.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...core.state import NEG_INF, State, merge_stack, safe_max, stat_dtype
from .._triton.configs import CPU_BLOCK_COLS


def _scaled(x: Tensor, inv_t: float, dt: torch.dtype) -> Tensor:
    """``z = x * (1/T)`` in the statistics dtype (``x`` itself when T = 1)."""
    z = x.to(dt)
    return z if inv_t == 1.0 else z * inv_t


def _block_state(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, l, u)`` of a block ``z (N, b)`` (``u`` from the block's own max)."""
    m = z.amax(-1) if z.shape[-1] else z.new_full(z.shape[:-1], NEG_INF)
    d = z - safe_max(m).unsqueeze(-1)
    p = torch.exp(d)
    return m, p.sum(-1), torch.where(p > 0, p * d, 0.0).sum(-1)


def _target_logit(logits: Tensor, target: Tensor, col0: int, inv_t: float, dt: torch.dtype) -> Tensor:
    """``z[target]`` where this slice ``[col0, col0 + V)`` holds the target, else 0: ``(N,)``."""
    local = target - col0
    own = (local >= 0) & (local < logits.shape[1])
    if not logits.shape[1]:
        return torch.zeros(logits.shape[0], dtype=dt, device=logits.device)
    picked = logits.gather(1, torch.where(own, local, 0).unsqueeze(1)).squeeze(1)
    return torch.where(own, _scaled(picked, inv_t, dt), 0.0)


def vocab_records(logits: Tensor, target: Optional[Tensor], col0: int, inv_t: float, entropy: bool) -> Tensor:
    """Statistics record ``(N, 4) = (m, l, u, z_t)`` of ``logits (N, V)``, merged block by block.

    ``target (N,)`` global class ids (None: ``z_t = 0``), ``col0`` the global id of column 0;
    ``u`` is computed whatever ``entropy`` says (the Triton kernel skips it when False).
    """
    n, v = logits.shape
    dt = stat_dtype(logits.dtype)
    blocks = [torch.tensor([NEG_INF, 0.0, 0.0, 0.0], dtype=dt, device=logits.device).expand(n, 4)]
    for j in range(0, v, CPU_BLOCK_COLS):  # (the empty record first: the merge's identity)
        m, l, u = _block_state(_scaled(logits[:, j:j + CPU_BLOCK_COLS], inv_t, dt))
        blocks.append(torch.stack((m, l, u, torch.zeros_like(m)), -1))
    rec = merge_records(torch.stack(blocks))
    if target is not None:
        rec[:, 3] = _target_logit(logits, target, col0, inv_t, dt)
    return rec


def merge_records(parts: Tensor) -> Tensor:
    """Merge statistics records of column slices ``parts (S, N, 4)`` (in slice order) -> ``(N, 4)``.

    ``u`` of every part moves to the origin of the merged max, then ``state.merge_stack`` merges
    ``(m, l, u)``; the target logits (non-zero on one slice only) add.
    """
    m, l, u, zt = parts.unbind(-1)
    top = safe_max(m.amax(0))  # (N,): the merged max, 0 in empty rows
    o = torch.where(l == 0, 0.0, u + (m - top) * l)  # empty parts: exactly 0 (not -inf * 0)
    s = merge_stack(State(m, l, o.unsqueeze(-1)))
    return torch.stack((s.m, s.l, s.o.squeeze(-1), zt.sum(0)), -1)


def vocab_finish(rec: Tensor, target: Optional[Tensor], ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(logp (N,), entropy (N,), rows (N, 3))`` from merged records ``rec (N, 4)``.

    ``rows = (m, log l, E_P[z] - m)`` (``m`` 0 and ``log l = -inf`` in empty rows) is what the
    backward needs: ``P = exp((z - m) - log l)`` keeps the precision of torch's log-softmax, where
    ``exp(z - lse)`` would lose that of ``lse``'s last bit at every large logit. Rows with
    ``target == ignore_index`` give ``logp = entropy = 0`` (no target: no row is ignored).
    """
    m, l, u, zt = rec.unbind(-1)
    full = l != 0  # NaN rows count as full: NaN flows to every statistic
    l1 = torch.where(full, l, 1.0)
    log_l = torch.where(full, torch.log(l1), NEG_INF)
    rel = torch.where(full, u / l1, 0.0)
    ref = safe_max(m)
    logp = torch.where(full, (zt - ref) - log_l, NEG_INF)
    ent = torch.where(full, log_l - rel, 0.0)
    if target is not None:
        skip = target == ignore_index
        logp, ent = torch.where(skip, 0.0, logp), torch.where(skip, 0.0, ent)
    return logp, ent, torch.stack((ref, log_l, rel), -1)


def stats_coefs(rows: Tensor, target: Optional[Tensor], ignore_index: int, g_logp: Optional[Tensor],
                g_ent: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Per-row coefficients ``(gl, gh)`` of the backward: the upstream gradients of logp and entropy
    (None where there is none), 0 in ignored rows and in rows with no finite logit (whose gradient
    is exactly 0). ``rows (N, 3)`` from :func:`vocab_finish`."""
    dead = rows[:, 1] == NEG_INF
    if target is not None:
        dead = dead | (target == ignore_index)
    gl = None if g_logp is None else torch.where(dead, 0.0, g_logp.to(rows.dtype))
    gh = None if g_ent is None else torch.where(dead, 0.0, g_ent.to(rows.dtype))
    return gl, gh


def vocab_bwd(logits: Tensor, target: Optional[Tensor], rows: Tensor, gl: Optional[Tensor], gh: Optional[Tensor],
              inv_t: float, col0: int) -> Tensor:
    """``dlogits (N, V)`` in ``logits.dtype``: ``(gl (onehot - P) - gh P (z - E_P[z])) / T`` per row.

    ``rows (N, 3)`` of the full rows (:func:`vocab_finish`); ``gl, gh (N,)`` from
    :func:`stats_coefs` (None: that term is absent; ``gl`` needs ``target``); rows where every
    coefficient is 0 get exactly 0. Written block by block over V.
    """
    n, v = logits.shape
    dt = stat_dtype(logits.dtype)
    dx = torch.empty_like(logits)
    ref, log_l, rel = (c.unsqueeze(1) for c in rows.to(dt).unbind(-1))
    coef = {k: c.to(dt).unsqueeze(1) for k, c in (("l", gl), ("h", gh)) if c is not None}
    dead = torch.ones((n, 1), dtype=torch.bool, device=logits.device)
    for c in coef.values():
        dead = dead & (c == 0)
    local = (target - col0).unsqueeze(1) if gl is not None else None
    for j in range(0, v, CPU_BLOCK_COLS):
        d = _scaled(logits[:, j:j + CPU_BLOCK_COLS], inv_t, dt) - ref  # [N, block]: z - m
        p = torch.exp(d - log_l)
        g = torch.zeros_like(d)
        if "h" in coef:
            g = g - coef["h"] * torch.where(d == NEG_INF, 0.0, p * (d - rel))
        if local is not None:
            hit = local == torch.arange(j, j + d.shape[1], device=logits.device)
            g = g + coef["l"] * (hit.to(dt) - p)
        dx[:, j:j + CPU_BLOCK_COLS] = torch.where(dead, 0.0, g * inv_t).to(logits.dtype)
    return dx


def _kl_block(zp: Tensor, zq: Tensor) -> Tensor:
    """KL record ``(N, 5)`` of one block of both logit sets (``(N, b)`` each)."""
    mp, lp, _ = _block_state(zp)
    mq, lq, _ = _block_state(zq)
    dp, dq = zp - safe_max(mp).unsqueeze(-1), zq - safe_max(mq).unsqueeze(-1)
    e = torch.exp(dp)
    u = torch.where(e > 0, e * (dp - dq), 0.0).sum(-1)
    return torch.stack((mp, lp, u, mq, lq), -1)


def kl_records(p: Tensor, q: Tensor, inv_t: float) -> Tensor:
    """KL record ``(N, 5) = (m_p, l_p, u, m_q, l_q)`` of ``p, q (N, V)``, merged block by block."""
    n, v = p.shape
    dt = stat_dtype(torch.promote_types(p.dtype, q.dtype))
    empty = torch.tensor([NEG_INF, 0.0, 0.0, NEG_INF, 0.0], dtype=dt, device=p.device)
    blocks = [empty.expand(n, 5)]
    for j in range(0, v, CPU_BLOCK_COLS):
        sl = slice(j, j + CPU_BLOCK_COLS)
        blocks.append(_kl_block(_scaled(p[:, sl], inv_t, dt), _scaled(q[:, sl], inv_t, dt)))
    return merge_kl_records(torch.stack(blocks))


def merge_kl_records(parts: Tensor) -> Tensor:
    """Merge KL records of column slices ``parts (S, N, 5)`` -> ``(N, 5)``: ``u`` moves to the origin
    ``m_p - m_q`` of the merged maxima, then both states merge with ``state.merge_stack``."""
    mp, lp, u, mq, lq = parts.unbind(-1)
    top_p, top_q = safe_max(mp.amax(0)), safe_max(mq.amax(0))
    shift = (safe_max(mp) - top_p) - (safe_max(mq) - top_q)
    o = torch.where(lp == 0, 0.0, u + shift * lp)
    sp, sq = merge_stack(State(mp, lp, o.unsqueeze(-1))), merge_stack(State(mq, lq))
    return torch.stack((sp.m, sp.l, sp.o.squeeze(-1), sq.m, sq.l), -1)


def kl_finish(rec: Tensor) -> tuple[Tensor, Tensor]:
    """``(kl (N,), rows (N, 5))`` from merged KL records ``rec (N, 5)``; ``rows = (m_p, log l_p, m_q,
    log l_q, E_P[(p - m_p) - (q - m_q)])`` for the backward (``m`` 0 where a side is empty).

    No mass in ``p``: KL 0; mass in ``p`` but none in ``q``: ``+inf``; NaN stays NaN.
    """
    mp, lp, u, mq, lq = rec.unbind(-1)
    pf, qf = lp != 0, lq != 0
    lp1, lq1 = torch.where(pf, lp, 1.0), torch.where(qf, lq, 1.0)
    log_p, log_q = torch.where(pf, torch.log(lp1), NEG_INF), torch.where(qf, torch.log(lq1), NEG_INF)
    rel = torch.where(pf, u / lp1, 0.0)
    kl = torch.where(pf, torch.where(qf, rel - log_p + log_q, float("inf")), 0.0)
    return kl, torch.stack((safe_max(mp), log_p, safe_max(mq), log_q, rel), -1)


def kl_coef(rows: Tensor, g: Tensor) -> Tensor:
    """The upstream gradient of each row's KL, 0 where ``p`` has no mass (KL is 0 there whatever
    the logits do); ``rows (N, 5)`` from :func:`kl_finish`."""
    return torch.where(rows[:, 1] == NEG_INF, 0.0, g.to(rows.dtype))


def kl_bwd(p: Tensor, q: Tensor, rows: Tensor, g: Tensor, inv_t: float) -> tuple[Tensor, Tensor]:
    """``(dp, dq)`` in the dtypes of ``p, q (N, V)``: ``g P_p ((p - q) - E_P[p - q]) / T`` and
    ``g (P_q - P_p) / T``; ``rows (N, 5)`` from :func:`kl_finish`, ``g (N,)`` from :func:`kl_coef`
    (rows where it is 0 get exactly 0)."""
    n, v = p.shape
    dt = stat_dtype(torch.promote_types(p.dtype, q.dtype))
    dp, dq = torch.empty_like(p), torch.empty_like(q)
    rp, log_p, rq, log_q, rel = (c.unsqueeze(1) for c in rows.to(dt).unbind(-1))
    g_ = g.to(dt).unsqueeze(1)
    for j in range(0, v, CPU_BLOCK_COLS):
        sl = slice(j, j + CPU_BLOCK_COLS)
        ep, eq = _scaled(p[:, sl], inv_t, dt) - rp, _scaled(q[:, sl], inv_t, dt) - rq  # [N, block]
        pp = torch.where(ep == NEG_INF, 0.0, torch.exp(ep - log_p))
        pq = torch.where(eq == NEG_INF, 0.0, torch.exp(eq - log_q))
        gp = torch.where(ep == NEG_INF, 0.0, pp * ((ep - eq) - rel))
        dp[:, sl] = torch.where(g_ == 0, 0.0, g_ * inv_t * gp).to(p.dtype)
        dq[:, sl] = torch.where(g_ == 0, 0.0, g_ * inv_t * (pq - pp)).to(q.dtype)
    return dp, dq
