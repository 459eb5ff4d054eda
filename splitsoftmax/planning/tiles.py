"""The kernel's tiles over a rank's pieces, counted exactly from where the pieces lie in the buffers.

A rank's rows are one buffer cut into row tiles; each row sees one range of keys ``[lo, hi)`` of the
key buffer (its document's visible keys). A row tile walks every key tile from the one holding its
first row's ``lo`` to the one holding its last row's ``hi - 1`` (``lo`` and ``hi`` never fall along a
buffer, whichever layout: documents are stored in order). Runs of rows are described as segments:
``start``, ``n`` rows, ``lo``, ``hi0`` (the first row's ``hi``) and ``slope`` (``hi`` grows by it a
row: 1 on a causal diagonal, 0 for a full block). Several ranks' buffers are walked at once by
placing each at a tile edge of one long buffer (``base``); what a rank walks is summed per rank.
"""
from __future__ import annotations

import numpy as np

from .model import Work


def walk(start, n, lo, hi0, slope, tile: int, base=None) -> Work:
    """Tiles walked by the segments (numpy arrays, sorted by ``start``, not overlapping, every row
    seeing at least one key). Without ``base``: one buffer, a Work of floats; with ``base`` (the
    sorted tile-aligned offsets where each rank's buffer begins): arrays over ranks. ``visible``
    counts the pairs exactly."""
    start, n, lo, hi0, slope = (np.asarray(a, dtype=np.int64) for a in (start, n, lo, hi0, slope))
    keep = n > 0
    start, n, lo, hi0, slope = start[keep], n[keep], lo[keep], hi0[keep], slope[keep]
    ranks = 1 if base is None else len(base)
    if start.size == 0:
        return _per_rank(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64), ranks, base is None)
    end = start + n
    t0 = np.arange(int(start[0] // tile), int((end[-1] - 1) // tile) + 1, dtype=np.int64) * tile
    first = np.searchsorted(end, t0, side="right")
    last = np.searchsorted(start, t0 + tile, side="left") - 1
    ok = (first < start.size) & (first <= last)
    t0, first, last = t0[ok], first[ok], last[ok]
    row = np.minimum(t0 + tile, end[last]) - 1
    hi = hi0[last] + slope[last] * (row - start[last])
    kt = (hi - 1) // tile - lo[first] // tile + 1
    pairs = n * (hi0 - lo) + slope * n * (n - 1) // 2
    owner = np.zeros(t0.size, dtype=np.int64) if base is None else np.searchsorted(base, t0, side="right") - 1
    seg_owner = np.zeros(start.size, dtype=np.int64) if base is None else np.searchsorted(base, start, side="right") - 1
    visible = np.bincount(seg_owner, weights=pairs.astype(float), minlength=ranks)
    return _per_rank(visible, kt.astype(float), np.ones(t0.size), owner, ranks, base is None)


def _per_rank(visible, kt, rowtiles, owner, ranks: int, scalar: bool) -> Work:
    touched = np.bincount(owner, weights=kt, minlength=ranks)
    rows = np.bincount(owner, weights=rowtiles, minlength=ranks)
    chain = np.zeros(ranks)
    np.maximum.at(chain, owner, kt)
    vis = visible if len(visible) else np.zeros(ranks)
    out = Work(vis, touched, rows, chain, (touched > 0).astype(float))
    return Work(*(float(getattr(out, f)[0]) for f in ("visible", "touched", "rowtiles", "chain", "launches"))) \
        if scalar else out


def rectangle(row_off, rows, key_off, keys, tile: int) -> Work:
    """Full blocks of ``rows`` x ``keys`` starting ``row_off`` / ``key_off`` into their buffers
    (arrays, one block per entry, each alone in its row tiles)."""
    row_off, rows, key_off, keys = (np.asarray(a, dtype=np.int64) for a in (row_off, rows, key_off, keys))
    some = (rows > 0) & (keys > 0)
    rt = np.where(some, (row_off + rows - 1) // tile - row_off // tile + 1, 0)
    kt = np.where(some, (key_off + keys - 1) // tile - key_off // tile + 1, 0)
    return Work((rows * keys).astype(float) * some, (rt * kt).astype(float), rt.astype(float), kt.astype(float),
                some.astype(float))
