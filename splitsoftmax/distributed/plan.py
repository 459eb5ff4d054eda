"""Masks as plans: which (query, key) pairs of two buffers are visible, as pieces to compute.

The rule (docs/API.md, "Attention variants", in global positions): query ``p`` sees key ``j``
iff both lie in the same document and ``p + lo <= j <= p + hi``, the :class:`Band` that
``causal`` and ``window_size`` give (``lo = -left``, ``hi = min(0 if causal, right)``, ``None``:
unbounded; so ``lo <= 0 <= hi`` and every query sees itself). ``kv_range`` and ``q_offset``
tensors live on the device and only hide more: the plan ignores them, the kernels apply them.

A buffer is a list of ``Seg(local, glob, n)`` (``distributed.layout``) whose global positions
increase with the local index: every layout's shard is one, and so is every subset of one. For
one query row the visible keys of a buffer are then one run of local indices, so documents,
causal and window reduce to per-row intervals (``Mask.rows``) for any pair of buffers.

- :func:`seen`: the positions of one buffer that some position of another sees (what must
  travel; with the mirrored band, which query rows see anything).
- :func:`pieces`: the work of one query buffer against one key buffer: banded pieces per
  segment pair (no documents, or few pairs within documents), else pieces by rows, one per group
  of the rows that see keys (:func:`row_groups`), so rows that see nothing in a step are walked
  only where they lie between such rows closer than ``min_gap`` (the kernel's row tile).
- :func:`make_plan`: per rank and ring step, the keys received, the keys sent and the pieces.

Every function here is pure (host integers in, tuples out) except :func:`positions` and
:func:`rows`, which build the small tensors of a plan.
"""
from __future__ import annotations

from bisect import bisect_right
from itertools import permutations
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .layout import DIAG, Seg, block_pairs, segments

MAX_BAND_PIECES = 4
MAX_ROW_PIECES = 16  # pieces by rows of one step at most (launches), the narrowest gaps joined first
FAR = 1 << 62  # a document bound beyond any position (no documents)


class Band(NamedTuple):
    """Key ``j`` is visible to query ``p`` iff ``p + lo <= j <= p + hi`` (``None``: unbounded)."""

    lo: Optional[int] = None
    hi: Optional[int] = None

    def mirror(self) -> "Band":
        """The band of the transposed question: ``p - j`` in ``[-hi, -lo]``."""
        return Band(None if self.hi is None else -self.hi, None if self.lo is None else -self.lo)


class Piece(NamedTuple):
    """Local query rows ``[q, q + nq)`` against local key rows ``[k, k + nk)`` of a buffer.

    Banded (``rows=False``): query ``a`` of the piece sees key ``c`` iff ``c <= a + diag`` (when
    ``causal``) and ``c >= a + lo`` (when ``lo`` is not None). By rows (``rows=True``):
    :func:`rows` gives each row's interval (documents + band); ``causal`` then says that the
    intervals also keep to ``c <= a + diag`` (hiding nothing more).
    """

    q: int
    nq: int
    k: int
    nk: int
    causal: bool
    diag: int
    lo: Optional[int]
    rows: bool


class Plan(NamedTuple):
    """One rank's part of a sharded attention: at step ``s`` it computes on the keys of rank
    ``(rank - s) % size`` and sends to rank ``(rank + s) % size`` (step 0: its own keys).

    direct:  transfers carry what the receiver sees (``recv``/``send``), straight from the keys'
             owner; else every buffer travels whole (the forwarding ring, the full all-gather).
    q:       this rank's query segments.
    keys:    ``keys[s]``, the segments of the buffer computed on at step ``s`` (compact local
             indices for a received subset).
    send:    ``send[s]``, the segments of this rank's own keys sent at step ``s`` (own local indices).
    pieces:  ``pieces[s]``, the work of step ``s``; empty: no launch.
    """

    rank: int
    size: int
    direct: bool
    docs: Optional[tuple]
    band: Band
    q: tuple
    keys: tuple
    send: tuple
    pieces: tuple


def band(causal: bool, window: Optional[tuple] = None) -> Band:
    """The band of ``causal`` and ``window_size=(left, right)`` (-1: unbounded)."""
    left, right = window if window is not None else (-1, -1)
    his = [h for h in (0 if causal else None, right if right >= 0 else None) if h is not None]
    return Band(-left if left >= 0 else None, min(his) if his else None)


def doc_bounds(docs: Optional[Sequence[int]], pos: int) -> tuple[int, int]:
    """``[start, end)`` of the document holding position ``pos`` (everything without documents)."""
    if docs is None:
        return -FAR, FAR
    d = bisect_right(docs, pos) - 1
    return docs[d], docs[d + 1]


def doc_runs(segs: Sequence[Seg], docs: Optional[Sequence[int]]):
    """``(glob, n, doc_start, doc_end)`` for the parts of ``segs`` cut at document boundaries."""
    for s in segs:
        g, end = s.glob, s.glob + s.n
        while g < end:
            ds, de = doc_bounds(docs, g)
            n = min(end, de) - g
            yield g, n, ds, de
            g += n


def _reach(src: Sequence[Seg], docs, b: Band) -> list[tuple[int, int]]:
    """Sorted disjoint global ``[a, e)`` ranges that some position of ``src`` sees."""
    out: list[list[int]] = []
    for g, n, ds, de in doc_runs(src, docs):
        a = ds if b.lo is None else max(ds, g + b.lo)
        e = de if b.hi is None else min(de, g + n + b.hi)
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        elif a < e:
            out.append([a, e])
    return [(a, e) for a, e in out]


def seen(src: Sequence[Seg], dst: Sequence[Seg], docs, b: Band) -> tuple:
    """The sub-segments of ``dst`` (its local indices) holding positions that some position of
    ``src`` sees under ``docs`` and band ``b``; ``seen(dst, src, docs, b.mirror())`` is the part
    of ``src`` that sees anything in ``dst``."""
    return _within(_reach(src, docs, b), dst)


def _within(reach: Sequence[tuple[int, int]], dst: Sequence[Seg]) -> tuple:
    """The sub-segments of ``dst`` (its local indices) holding positions of ``reach`` (:func:`_reach`'s)."""
    out, i = [], 0
    for s in (s for s in dst if s.n):
        while i < len(reach) and reach[i][1] <= s.glob:
            i += 1
        j = i
        while j < len(reach) and reach[j][0] < s.glob + s.n:
            a, e = max(reach[j][0], s.glob), min(reach[j][1], s.glob + s.n)
            out.append(Seg(s.local + a - s.glob, a, e - a))
            j += 1
    return tuple(out)


def coalesced(segs: Sequence[Seg]) -> list:
    """``segs`` without empty ones, each run of segments that continue one another in both local
    index and position as one (a one-rank zigzag shard's two chunks, adjacent received ranges)."""
    out: list = []
    for s in (s for s in segs if s.n):
        if out and out[-1].local + out[-1].n == s.local and out[-1].glob + out[-1].n == s.glob:
            out[-1] = out[-1]._replace(n=out[-1].n + s.n)
        else:
            out.append(s)
    return out


def compact(segs: Sequence[Seg]) -> tuple:
    """``segs`` as a buffer of their own: local indices from 0, in order."""
    out, local = [], 0
    for s in segs:
        out.append(Seg(local, s.glob, s.n))
        local += s.n
    return tuple(out)


def band_piece(q: Seg, k: Seg, b: Band) -> Optional[Piece]:
    """The banded piece of one query and one key segment (contiguous positions, one document):
    trimmed to the rows that see a key and the keys that a row sees; None when nothing is visible.
    An edge that hides no pair of the piece is dropped (``causal=False`` / ``lo=None``)."""
    q0, q1, k0, k1 = q.glob, q.glob + q.n, k.glob, k.glob + k.n
    if b.hi is not None:
        q0 = max(q0, k0 - b.hi)
    if b.lo is not None:
        q1 = min(q1, k1 - b.lo)
    if q0 >= q1:
        return None
    if b.lo is not None:
        k0 = max(k0, q0 + b.lo)
    if b.hi is not None:
        k1 = min(k1, q1 + b.hi)
    if k0 >= k1:
        return None
    upper = b.hi is not None and k1 - 1 > q0 + b.hi
    lower = b.lo is not None and k0 < q1 - 1 + b.lo
    return Piece(q.local + q0 - q.glob, q1 - q0, k.local + k0 - k.glob, k1 - k0, upper,
                 q0 - k0 + b.hi if upper else 0, q0 - k0 + b.lo if lower else None, False)


def doc_split(segs: Sequence[Seg], docs):
    """``segs`` cut at document boundaries, each part with its document's start (as they are read)."""
    for s in segs:
        for g, n, ds, _ in doc_runs((s,), docs):
            yield Seg(s.local + g - s.glob, g, n), ds


def _banded(qbuf: Sequence[Seg], kbuf: Sequence[Seg], docs, b: Band, limit: Optional[int]) -> Optional[list]:
    """Banded pieces of every same-document pair of segment parts; None once more than ``limit``
    are visible (then one piece by rows serves better)."""
    by_doc: dict = {}
    for ks, c in doc_split(kbuf, docs):
        by_doc.setdefault(c, []).append(ks)
    out = []
    for qs, a in doc_split(qbuf, docs):
        for ks in by_doc.get(a, ()):
            piece = band_piece(qs, ks, b)
            if piece is not None:
                out.append(piece)
                if limit is not None and len(out) > limit:
                    return None
    return out


def _span(segs: Sequence[Seg]) -> tuple[int, int]:
    return segs[0].local, segs[-1].local + segs[-1].n - segs[0].local


def row_groups(qs: Sequence[Seg], min_gap: int, most: int) -> list:
    """``qs`` (sub-segments of a query buffer, in order) in groups, each the rows of one piece by
    rows: runs of rows that continue one another in local index, runs closer than ``min_gap`` rows
    joined, then the closest joined until at most ``most`` groups remain (the narrowest gaps first,
    the earliest of equal ones)."""
    if not qs:
        return []
    gaps = [b.local - (a.local + a.n) for a, b in zip(qs[:-1], qs[1:])]
    open_ = [i for i in range(len(gaps)) if gaps[i] > 0 and gaps[i] >= min_gap]
    cut = sorted(sorted(open_, key=lambda i: (-gaps[i], i))[:max(most, 1) - 1])
    out, at = [], 0
    for i in cut:
        out.append(list(qs[at:i + 1]))
        at = i + 1
    out.append(list(qs[at:]))
    return out


def pieces(qbuf: Sequence[Seg], kbuf: Sequence[Seg], docs, b: Band, max_band: int = MAX_BAND_PIECES,
           min_gap: int = 1, max_rows: int = MAX_ROW_PIECES) -> tuple:
    """The pieces of query buffer ``qbuf`` against key buffer ``kbuf``: banded pieces of the
    same-document segment parts when at most ``max_band`` are visible (always without documents),
    else pieces by rows: one per group of the rows that see a key (:func:`row_groups`: rows that see
    nothing between two groups, at least ``min_gap`` of them, are in no piece; at most ``max_rows``
    pieces), over the span of its rows and of the keys they see, each marked causal where its
    intervals keep to the main diagonal. Segments that continue one another count as one
    (:func:`coalesced`)."""
    qbuf, kbuf = coalesced(qbuf), coalesced(kbuf)
    banded = _banded(qbuf, kbuf, docs, b, None if docs is None else max_band)
    if banded is not None:
        return tuple(banded)
    out, kglob = [], [s.glob for s in kbuf]
    for group in row_groups(seen(kbuf, qbuf, docs, b.mirror()), min_gap, max_rows):
        (q, nq), (k, nk) = _span(group), _key_span(group, kbuf, kglob, docs, b)
        # under a band that hides later keys the intervals may keep to the main diagonal (a rank's own
        # step always does): marked causal (hiding nothing more), the piece's backward bounds its dS buffer
        causal = b.hi is not None and _keeps_diagonal(group, kbuf, kglob, q, k, docs, b)
        out.append(Piece(q, nq, k, nk, causal, 0, None, True))
    return tuple(out)


def _last_key(kbuf: Sequence[Seg], kglob: list, pos: int) -> int:
    """The local index of the last key of ``kbuf`` at or before position ``pos`` (one is)."""
    ks = kbuf[bisect_right(kglob, pos) - 1]
    return ks.local + min(pos - ks.glob, ks.n - 1)


def _key_span(group: Sequence[Seg], kbuf: Sequence[Seg], kglob: list, docs, b: Band) -> tuple[int, int]:
    """``(k, nk)``: the span of the keys of ``kbuf`` that the rows of ``group`` (rows that see keys,
    in order) see. A row's first and last visible positions never decrease along the buffer (documents
    in order, positions rising with the local index): the first row's first key to the last row's last."""
    g0, g1 = group[0].glob, group[-1].glob + group[-1].n - 1
    ds, _ = doc_bounds(docs, g0)
    first = ds if b.lo is None else max(ds, g0 + b.lo)
    i = bisect_right(kglob, first) - 1
    k0 = kbuf[i].local + first - kglob[i] if i >= 0 and first < kglob[i] + kbuf[i].n else kbuf[i + 1].local
    _, de = doc_bounds(docs, g1)
    k1 = _last_key(kbuf, kglob, de - 1 if b.hi is None else min(de - 1, g1 + b.hi))
    return k0, k1 + 1 - k0


def _keeps_diagonal(group: Sequence[Seg], kbuf: Sequence[Seg], kglob: list, q: int, k: int, docs, b: Band) -> bool:
    """Whether no row of ``group`` (rows that see keys of ``kbuf``) sees a key past the main diagonal
    of the piece at rows ``q``, keys ``k`` (row ``a`` no key past ``a``, piece-local), under a band
    with ``hi``. Along rows of one segment within one document the last visible position grows by
    at most one a row, so the index of the last visible key does too, no faster than the row's: the
    first row of each such run decides."""
    for s in group:
        for g, _, _, de in doc_runs((s,), docs):
            if _last_key(kbuf, kglob, min(de - 1, g + b.hi)) - k > s.local + g - s.glob - q:
                return False
    return True


def plain_pieces(qbuf: Sequence[Seg], kbuf: Sequence[Seg], causal: bool) -> tuple:
    """Full / causal visibility without documents or window: one causal piece when the queries are
    the keys' own positions (a rank's own step: positions rise with the local index, so key ``c``
    is visible to query ``a`` iff ``c <= a``), else ``layout.block_pairs``' pairs with the full ones
    that lie side by side joined: one launch where the pairs would take several."""
    if causal and tuple(qbuf) == tuple(kbuf):
        n = sum(s.n for s in qbuf)
        return (Piece(0, n, 0, n, True, 0, None, False),) if n else ()
    return _joined([Piece(qs.local, qs.n, ks.local, ks.n, kind == DIAG, diag, None, False)
                    for _, qs, ks, kind, diag in block_pairs(list(qbuf), list(kbuf), causal)])


def _joined(pcs: Sequence[Piece]) -> tuple:
    """``pcs`` with any two that :func:`_join` makes one made one, until no two are."""
    pcs = list(pcs)
    while True:
        pair = next(((a, b, j) for a, b in permutations(range(len(pcs)), 2)
                     if (j := _join(pcs[a], pcs[b])) is not None), None)
        if pair is None:
            return tuple(pcs)
        a, b, j = pair
        pcs[a] = j
        del pcs[b]


def _join(a: Piece, b: Piece) -> Optional[Piece]:
    """Full pieces ``a`` and ``b`` as one: the same query rows and ``b``'s keys right after ``a``'s,
    or the same keys and ``b``'s rows right after ``a``'s; else None."""
    if a.causal or b.causal or a.lo is not None or b.lo is not None or a.rows or b.rows:
        return None
    if (a.q, a.nq) == (b.q, b.nq) and a.k + a.nk == b.k:
        return a._replace(nk=a.nk + b.nk)
    if (a.k, a.nk) == (b.k, b.nk) and a.q + a.nq == b.q:
        return a._replace(nq=a.nq + b.nq)
    return None


def make_plan(rank: int, q_lens: Sequence[int], k_lens: Sequence[int], layout: str, causal: bool,
              docs: Optional[tuple] = None, window: Optional[tuple] = None,
              max_band: int = MAX_BAND_PIECES, min_gap: int = 1, max_rows: int = MAX_ROW_PIECES) -> Plan:
    """Rank ``rank``'s plan given every rank's query and key lengths (rank order). Without
    documents and window, today's ring: whole buffers, :func:`plain_pieces` (a launch a step). Otherwise
    each rank receives from each owner only the keys its queries see (none: no transfer, no
    launch), so a window's traffic is a halo to the neighbours that hold it; ``max_band``,
    ``min_gap`` and ``max_rows`` as :func:`pieces` takes them (``min_gap``: the callers pass the
    kernel's row tile, a gap narrower than it not worth a launch)."""
    p, b = len(q_lens), band(causal, window)
    qsegs = [tuple(segments(layout, list(q_lens), r, docs)) for r in range(p)]
    ksegs = [tuple(segments(layout, list(k_lens), r, docs)) for r in range(p)]
    mine, direct = qsegs[rank], docs is not None or window is not None
    reach = _reach(mine, docs, b) if direct else ()  # what this rank's queries see, every step alike
    keys, send, work = [], [], []
    for s in range(p):
        o, t = (rank - s) % p, (rank + s) % p
        if not direct:
            keys.append(ksegs[o])
            work.append(plain_pieces(mine, ksegs[o], causal))
            continue
        got = ksegs[o] if s == 0 else compact(_within(reach, ksegs[o]))
        keys.append(got)
        send.append(() if s == 0 else seen(qsegs[t], ksegs[rank], docs, b))
        work.append(pieces(mine, got, docs, b, max_band, min_gap, max_rows))
    return Plan(rank, p, direct, docs, b, mine, tuple(keys), tuple(send), tuple(work))


def tree_piece(sq: int, k_glob: int, k_len: int, b: Band, q_offset: Optional[int]) -> Optional[Piece]:
    """The split-KV piece of replicated queries (query ``i`` at position ``q_offset + i``) against
    this rank's keys ``[k_glob, k_glob + k_len)``; None when nothing is visible. A ``q_offset``
    read on the device (None here) gives the untrimmed piece, banded relative to ``q_offset - k_glob``."""
    if q_offset is None:
        if sq == 0 or k_len == 0:
            return None
        return Piece(0, sq, 0, k_len, b.hi is not None, b.hi or 0, b.lo, False)
    return band_piece(Seg(0, q_offset, sq), Seg(0, k_glob, k_len), b)


def positions(segs: Sequence[Seg], start: int, n: int, device=None) -> Tensor:
    """Global positions ``(n,)`` int64 of local indices ``[start, start + n)`` of a buffer."""
    parts = []
    for s in segs:
        a, e = max(start, s.local), min(start + n, s.local + s.n)
        if a < e:
            parts.append(torch.arange(s.glob + a - s.local, s.glob + e - s.local, dtype=torch.int64))
    out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return out.to(device)


def rows(qbuf: Sequence[Seg], kbuf: Sequence[Seg], piece: Piece, docs, b: Band, device=None) -> Tensor:
    """``Mask.rows`` of a piece by rows: ``(2, nq)`` int32, row ``a`` sees the piece's keys
    ``[rows[0, a], rows[1, a])`` (its document and band, as local indices of the piece)."""
    qpos = positions(qbuf, piece.q, piece.nq, device)  # [nq]
    kpos = positions(kbuf, piece.k, piece.nk, device)  # [nk], increasing
    if docs is None:
        ds, de = torch.full_like(qpos, -FAR), torch.full_like(qpos, FAR)
    else:
        cu = torch.tensor(docs, dtype=torch.int64).to(device)
        d = torch.searchsorted(cu, qpos, right=True) - 1
        ds, de = cu[d], cu[d + 1]
    first = ds if b.lo is None else torch.maximum(ds, qpos + b.lo)
    last = de - 1 if b.hi is None else torch.minimum(de - 1, qpos + b.hi)
    lo = torch.searchsorted(kpos, first, out_int32=True)
    hi = torch.searchsorted(kpos, last, right=True, out_int32=True)
    return torch.stack((lo, hi))
