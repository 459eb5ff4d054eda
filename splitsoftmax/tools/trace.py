"""``python -m splitsoftmax trace``: the online-softmax lesson's exercise, printed.

The state trace of ``[1, 2, -3, 12, 11, 4]`` (scalar and vectorised), the comparison with a
stable two-pass softmax, the no-rescale bug and its error over 1,000 random rows with
occasional logits in [50, 100], the numbers behind that error at the maximum change, and the
lesson's worked merge of two blocks.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..core import reference as ref
from ..core import state
from ..ops.softmax.api import softmax

ROW = [1.0, 2.0, -3.0, 12.0, 11.0, 4.0]


def random_rows(n_rows: int = 1000, n_cols: int = 64, seed: int = 0) -> np.ndarray:
    """Standard-normal logits with about 3% of entries replaced by values in [50, 100]."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n_rows, n_cols))
    spikes = rng.random((n_rows, n_cols)) < 0.03
    rows[spikes] = rng.uniform(50.0, 100.0, spikes.sum())
    return rows


def errors(p: np.ndarray, ref_p: np.ndarray) -> tuple[float, float]:
    """Max absolute error and max relative error (over entries whose reference is non-zero)."""
    diff = np.abs(p - ref_p)
    nz = ref_p > 0
    return float(diff.max()), float((diff[nz] / ref_p[nz]).max())


def trace_table() -> list[str]:
    _, good = ref.online_softmax_scalar(ROW)
    _, bad = ref.online_softmax_scalar(ROW, rescale=False)
    _, vec = ref.online_softmax_vectorised(np.array([ROW]))
    lines = [f"{'step':>4} {'x':>6} {'m':>6} {'l (scalar)':>14} {'l (vectorised)':>15} {'l (no rescale)':>15}"]
    for i, (g, (vm, vl), b) in enumerate(zip(good, vec, bad), 1):
        lines.append(f"{i:>4} {g.x:>6.1f} {g.m:>6.1f} {g.l:>14.8f} {vl[0]:>15.8f} {b.l:>15.8f}")
    return lines


def comparison_table() -> list[str]:
    two_pass = ref.two_pass_softmax_np(np.array([ROW]))[0]
    scalar, _ = ref.online_softmax_scalar(ROW)
    vec, _ = ref.online_softmax_vectorised(np.array([ROW]), block=2)
    wrong, _ = ref.online_softmax_scalar(ROW, rescale=False)
    lines = [f"{'x':>6} {'two-pass':>12} {'scalar':>12} {'vectorised':>12} {'no rescale':>12}"]
    for x, a, b, c, d in zip(ROW, two_pass, scalar, vec[0], wrong):
        lines.append(f"{x:>6.1f} {a:>12.6e} {b:>12.6e} {c:>12.6e} {d:>12.6e}")
    return lines


def random_error_table(rows: np.ndarray) -> list[str]:
    want = ref.two_pass_softmax_np(rows)
    versions = {
        "scalar online": np.array([ref.online_softmax_scalar(r)[0] for r in rows]),
        "vectorised online (block 8)": ref.online_softmax_vectorised(rows, block=8)[0],
        "no rescale (wrong)": np.array([ref.online_softmax_scalar(r, rescale=False)[0] for r in rows]),
        "splitsoftmax.softmax (float64)": softmax(torch.from_numpy(rows)).numpy(),
    }
    lines = [f"{'version':<32} {'max abs err':>12} {'max rel err':>12}"]
    for name, p in versions.items():
        a, r = errors(p, want)
        lines.append(f"{name:<32} {a:>12.3e} {r:>12.3e}")
    return lines


def explanation() -> list[str]:
    good = ref.online_softmax_scalar(ROW)[1]
    bad = ref.online_softmax_scalar(ROW, rescale=False)[1]
    m_old, m_new = good[2].m, good[3].m
    factor = math.exp(m_old - m_new)
    kept_good, kept_bad = good[2].l * factor, bad[2].l
    return [
        f"After 3 elements m = {m_old:g} and the correct l = {good[2].l:.8f} holds terms relative to exp({m_old:g}).",
        f"x = 12.0 raises the maximum to {m_new:g}: the old sum must be multiplied by "
        f"exp({m_old:g} - {m_new:g}) = {factor:.6e}.",
        f"  correct:    l = {good[2].l:.8f} * {factor:.6e} + exp(0) = {good[3].l:.8f}",
        f"  no rescale: l = {bad[2].l:.8f} + exp(0) = {bad[3].l:.8f}",
        f"The first three elements are worth {kept_good:.6e} in the new frame but the wrong sum counts "
        f"them as {kept_bad:.8f}, {kept_bad / kept_good:.0f} times too much (it also skipped the rescale at "
        f"step 2, when the maximum went from 1 to 2).",
        f"Final sums: correct {good[-1].l:.8f}, no rescale {bad[-1].l:.8f}: every probability of the wrong "
        f"version is too small by the factor {good[-1].l / bad[-1].l:.6f} "
        f"(relative error {1 - good[-1].l / bad[-1].l:.4%}).",
    ]


def worked_merge() -> list[str]:
    a = state.State(torch.tensor([10.0], dtype=torch.float64), torch.tensor([1.8], dtype=torch.float64))
    b = state.State(torch.tensor([12.0], dtype=torch.float64), torch.tensor([1.3], dtype=torch.float64))
    s = state.merge(a, b)
    return [
        "block 1: m = 10, l = 1.8;  block 2: m = 12, l = 1.3",
        f"merged: m = {s.m.item():g}, l = exp(10 - 12) * 1.8 + 1.3 = {s.l.item():.4f}  (adding without "
        f"rescaling would give {1.8 + 1.3:.1f})",
    ]


def main() -> int:
    sections = [
        ("State trace of [1, 2, -3, 12, 11, 4] (running max m and running sum l after each element)", trace_table()),
        ("Probabilities against a stable two-pass softmax", comparison_table()),
        ("1,000 random rows of 64 logits, ~3% of them in [50, 100], against the two-pass softmax",
         random_error_table(random_rows())),
        ("Why the no-rescale version is wrong: the step where 12.0 becomes the maximum", explanation()),
        ("The lesson's worked merge of two blocks", worked_merge()),
    ]
    for title, lines in sections:
        print(f"\n{title}\n" + "\n".join("  " + line for line in lines))
    return 0
