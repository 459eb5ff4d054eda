"""What each rank of a sequence group computes, step by step, under each layout (modelled from the
layouts' definitions in the contract; the balanced layout's placement is the package's own,
``distributed.layout.balanced_owners``, so that one rule decides it).

A :class:`Split` is the work of ``P`` ranks that share the sequence: ``own`` (step 0, a rank's queries
against its own keys) and ``at(t)`` (step ``t`` of the ring: rank ``r`` holds the keys of rank
``(r - t) mod P``), each a :class:`~.model.Work` whose fields are arrays over the ranks; ``rows`` and
``send_rows`` are each rank's query rows and the key rows it passes on per step. The sequence is a
tuple of document lengths (one document when nothing is packed).

- ``"zigzag"``: every document cut like ``torch.tensor_split(doc, 2P)``, rank ``r`` holding chunks ``r``
  and ``2P-1-r`` (chunk sizes taken as ``L / 2P``, exact up to one row a chunk). Causal: the own step
  is one causal piece of ``2c`` rows a document; any other step one full piece a document, ``2c x c``
  where the keys come from a lower rank, ``c x 2c`` from a higher one.
- ``"contiguous"``: rank ``r`` holds one slice (``torch.tensor_split`` of the sequence); a document
  spanning several slices gives full pieces between them.
- ``"balanced"``: the documents the package zigzags (``balanced_owners``: the fewest of the largest
  that keep the busiest rank's causal work within ``1 + 1 / BALANCE_SLACK`` of the mean) are
  zigzagged as above, and only their rows travel; every other document stays whole on the rank that
  function gives it.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..distributed.layout import balanced_owners
from .model import FIELDS, Work, piece
from .tiles import rectangle, walk

LAYOUTS = ("contiguous", "zigzag", "balanced")


def keys_join(a: Work, b: Work) -> Work:
    """The work of one launch whose rows see the keys of ``a`` and then those of ``b`` (same rows)."""
    return Work(a.visible + b.visible, a.touched + b.touched, np.maximum(a.rowtiles, b.rowtiles),
                a.chain + b.chain, np.maximum(a.launches, b.launches))


def full_sequence(docs: tuple, causal: bool, tiles) -> Work:
    """One launch over the whole sequence (documents packed side by side): one GPU, or ``"heads"``."""
    if tiles.packed:
        length = np.array([d for d in docs if d], dtype=np.int64)
        at = np.cumsum(length) - length
        return walk(at, length, at, at + (1 if causal else length), np.full(length.size, int(causal)), tiles.size)
    out = Work()
    for length, m in Counter(docs).items():
        out = out + piece(length, length, causal, tiles, m, aligned=len(docs) == 1)
    return out


def zigzag_segments(docs: tuple, p: int, r: int, u: int, causal: bool) -> tuple:
    """Segments (``tiles.walk``'s) of rank ``r``'s rows against rank ``u``'s keys under per-document
    zigzag: chunk sizes as ``torch.tensor_split(doc, 2P)`` gives them, documents in order. The key
    buffer is what the ring brings (``distributed.plan.make_plan``: the keys the rows see): from a lower
    rank, causal, only its first chunk of each document; else all of it."""
    length = np.array([d for d in docs if d], dtype=np.int64)
    q, rem = np.divmod(length, 2 * p)

    def size(i):
        return q + (i < rem)
    a, b, ka, kb = size(r), size(2 * p - 1 - r), size(u), size(2 * p - 1 - u)
    row = np.cumsum(a + b) - (a + b)
    if causal and u < r:  # only chunk u of each document is seen, so only it travels: a buffer of them
        kb = np.zeros_like(kb)
    key = np.cumsum(ka + kb) - (ka + kb)
    if not causal:
        hi = (key + ka + kb, key + ka + kb)
        slope = (0, 0)
    elif u == r:
        hi, slope = (key + 1, key + a + 1), (1, 1)
    elif u < r:
        hi, slope = (key + ka, key + ka), (0, 0)
    else:
        hi, slope = (key, key + ka + kb), (0, 0)
    n = (np.where(hi[0] > key, a, 0), np.where(hi[1] > key, b, 0))
    segs = ((row, n[0], key, hi[0], np.full(a.size, slope[0])), (row + a, n[1], key, hi[1], np.full(a.size, slope[1])))
    return tuple(np.stack([segs[0][k], segs[1][k]], axis=1).reshape(-1) for k in range(5))


def row_cover(owner, start, n, ranks: int, tiles) -> tuple:
    """``(span, launches)`` per rank (arrays of ``ranks``): the rows a ring step's launches cover and
    how many there are, given the runs of rows that see keys (``owner``: each run's rank, ``start`` its
    first row in the rank's buffer, ``n`` its rows; sorted by rank, then start). The rule of
    :class:`~.model.Tiles` (``min_gap``, ``most``) as ``distributed.plan.row_groups`` applies it: gaps of
    at least ``min_gap`` rows are cut, the widest first (the earliest of equal ones), at most
    ``most - 1`` of them; a launch covers its first run's first row to its last run's last."""
    owner, start, n = (np.asarray(x, dtype=np.int64) for x in (owner, start, n))
    keep = n > 0
    owner, start, n = owner[keep], start[keep], n[keep]
    span, launches = np.zeros(ranks), np.zeros(ranks)
    if not owner.size:
        return span, launches
    end = start + n
    first = np.r_[True, owner[1:] != owner[:-1]]
    last = np.r_[owner[1:] != owner[:-1], True]
    np.add.at(span, owner[last], end[last])
    np.add.at(span, owner[first], -start[first])
    gap = np.where(first[1:], -1, start[1:] - end[:-1])  # the gap before run i + 1, -1 across ranks
    cand = gap >= max(int(tiles.min_gap), 1)
    if tiles.most > 1 and cand.any():
        idx = np.nonzero(cand)[0]
        g, o = gap[idx], owner[idx + 1]
        order = np.lexsort((idx, -g, o))
        g, o = g[order], o[order]
        pos = np.arange(o.size) - np.searchsorted(o, o, side="left")
        cut = pos < tiles.most - 1
        np.add.at(span, o[cut], -g[cut].astype(float))
        np.add.at(launches, o[cut], 1.0)
    np.add.at(launches, owner[first], 1.0)
    return span, launches


def _broadcast(w: Work, p: int) -> Work:
    return Work(*(np.full(p, float(np.asarray(getattr(w, f)))) for f in FIELDS))


@dataclass
class Costed:
    """Step times of a :class:`Split`: ``c0`` (own step, per rank), ``steps`` (the active ``t``),
    ``total`` (per rank, the active steps summed), ``step_max`` (per active step, the slowest rank's)
    and ``at(t)`` (per rank)."""
    c0: np.ndarray
    steps: list
    total: np.ndarray
    step_max: np.ndarray
    at: Callable


class Split:
    """The per-step work of ``p`` ranks sharing one sequence (see the module's docstring)."""

    def __init__(self, p: int, own: Work, rows, send_rows, active: list[int]):
        self.p, self.own, self.active = p, own, active
        self.rows, self.send_rows = np.asarray(rows, dtype=float), np.asarray(send_rows, dtype=float)
        self.rank = np.arange(p)

    def at(self, t: int) -> Work:
        raise NotImplementedError

    def costed(self, cost) -> "Costed":
        """The seconds of every step per rank under ``cost`` (a :class:`Work` -> seconds per rank)."""
        return self.costed_many([cost])[0]

    def costed_many(self, costs: list) -> list:
        """:meth:`costed` for each of ``costs`` (layouts with rank classes answer in closed form)."""
        return self.walk(costs)

    def at_block(self, ts: list) -> Work:
        """The work of steps ``ts`` at once: fields of shape ``(len(ts), P)``."""
        ws = [self.at(t) for t in ts]
        return Work(*(np.stack([np.broadcast_to(getattr(w, f), (self.p,)) for w in ws]) for f in FIELDS))

    def walk(self, costs: list, block: int = 64) -> list:
        """:meth:`costed` for each of ``costs`` by walking every step of every rank once (``block``
        steps at a time). A cost is elementwise, so it takes the block's fields at the (step, rank)
        entries that hold any work, and an empty Work's cost everywhere else."""
        tables = [{} for _ in costs]
        empty = Work(*(np.zeros(1) for _ in FIELDS))
        idle = [float(np.broadcast_to(cost(empty), (1,))[0]) for cost in costs]
        for i in range(0, len(self.active), block):
            ts = self.active[i:i + block]
            w = self.at_block(ts)
            held = np.zeros((len(ts), self.p), dtype=bool)
            for f in FIELDS:
                held |= np.asarray(getattr(w, f)) != 0
            busy = np.nonzero(held)
            some = Work(*(np.broadcast_to(getattr(w, f), (len(ts), self.p))[busy] for f in FIELDS))
            for table, cost, zero in zip(tables, costs, idle):
                out = np.full((len(ts), self.p), zero)
                out[busy] = np.broadcast_to(cost(some), busy[0].shape)
                table.update(zip(ts, out))
        out = []
        for table, cost in zip(tables, costs):
            c0 = np.broadcast_to(cost(self.own), (self.p,)).astype(float)
            total = np.sum(list(table.values()), axis=0) if table else np.zeros(self.p)
            out.append(Costed(c0, self.active, total, np.array([v.max() for v in table.values()]), table.__getitem__))
        return out

    def all_keys(self) -> Work:
        """Every step's work as one launch per rank (the all-gather's)."""
        if getattr(self, "_all_keys", None) is None:
            self._all_keys = self._join_steps()
        return self._all_keys

    def _join_steps(self) -> Work:
        out = self.own
        for i in range(0, len(self.active), 64):
            w = self.at_block(self.active[i:i + 64])
            out = keys_join(out, Work(w.visible.sum(0), w.touched.sum(0), w.rowtiles.max(0), w.chain.sum(0),
                                      w.launches.max(0)))
        return out


class ZigzagSplit(Split):
    """Per-document zigzag (``docs``: the documents it cuts), ``lower``/``higher``: a document's piece
    at a step whose keys come from a lower / higher rank."""

    def __init__(self, p, docs, causal, tiles, own_extra=None, rows_extra=0.0):
        c_work, lower, higher, zig_rows = Work(), Work(), Work(), 0.0
        edge = len(docs) == 1 and own_extra is None  # one document alone: chunks start on tile edges
        for length, m in Counter(docs).items():
            c = length / (2 * p)
            zig_rows += 2 * c * m
            if causal:  # a document takes 2c rows and 2c keys in every buffer, whichever of them meet
                c_work = c_work + piece(2 * c, 2 * c, True, tiles, m, aligned=edge)
                lower = lower + _covering(piece(2 * c, c, False, tiles, m, stride=(2 * c, 2 * c), aligned=edge),
                                          2 * c * m, c * m)
                higher = higher + _covering(piece(c, 2 * c, False, tiles, m, stride=(2 * c, 2 * c), aligned=edge),
                                            c * m, 2 * c * m)
            else:
                full = piece(2 * c, 2 * c, False, tiles, m, aligned=edge)
                c_work = c_work + full
                lower = lower + _covering(full, 2 * c * m, 2 * c * m)
                higher = higher + _covering(full, 2 * c * m, 2 * c * m)
        if tiles.packed and docs:
            c_work, lower, higher = self._walked(docs, p, causal, tiles, (c_work, lower, higher))
        rows = np.full(p, zig_rows) + rows_extra
        own = _broadcast(c_work, p) if own_extra is None else own_extra + _broadcast(c_work, p)
        own = replace(own, span=np.zeros(p), keyrows=rows)  # the own step: the one-call kernel, its keys copied
        active = list(range(1, p)) if docs and p > 1 else []
        super().__init__(p, own, rows, np.full(p, zig_rows), active)
        self.lower, self.higher = lower, higher

    @staticmethod
    def _walked(docs, p, causal, tiles, works) -> tuple:
        """``works`` (own, lower, higher) with their tiles walked exactly on a middle rank's buffers
        (pairs stay the average over ranks, so that they sum to the sequence's), and the rows the
        steps' launches cover (:func:`row_cover`) and their keys counted on the same buffers (every
        rank taken as that one: chunk sizes differ by at most a row between ranks, except those of
        documents shorter than ``2P``, whose empty chunks fall on different ranks)."""
        r = p // 2
        pairs = ((r, r), (r, r - 1), (r - 1, r)) if p > 1 else ((0, 0),)
        out = []
        for w, (a, b) in zip(works, pairs):
            segs = zigzag_segments(docs, p, a, b, causal)
            t = walk(*segs, tiles.size)
            span, launches = row_cover(np.zeros(segs[0].size), segs[0], segs[1], 1, tiles)
            keys = float(np.max(segs[3], initial=0))  # the key buffer ends at its last document's reach
            out.append(Work(w.visible, t.touched, t.rowtiles, t.chain, float(launches[0]), float(span[0]), keys))
        return tuple(out) + tuple(works[len(out):])

    def cover(self, lower: tuple, higher: tuple) -> None:
        """Set each rank's ``(span, launches)`` of a step whose keys come from a lower / higher rank
        (arrays over ranks, :func:`row_cover`'s)."""
        self.lower = replace(self.lower, span=lower[0], launches=lower[1])
        self.higher = replace(self.higher, span=higher[0], launches=higher[1])

    def at(self, t: int) -> Work:
        low = t <= self.rank
        return self.lower.scaled(low.astype(float)) + self.higher.scaled((~low).astype(float))

    def costed_many(self, costs: list) -> list:
        return [self._costed(c) for c in costs]

    def _costed(self, cost) -> Costed:
        c0 = np.broadcast_to(cost(self.own), (self.p,)).astype(float)
        a, b = (np.broadcast_to(cost(w), (self.p,)).astype(float) for w in (self.lower, self.higher))
        r = self.rank
        if not self.active:
            return Costed(c0, [], np.zeros(self.p), np.zeros(0), None)
        # step t: ranks r >= t take keys from a lower rank, the others from a higher one
        from_a = np.maximum.accumulate(a[::-1])[::-1]  # max of a over ranks >= t
        from_b = np.maximum.accumulate(b)  # max of b over ranks <= t - 1
        t = np.asarray(self.active)
        return Costed(c0, self.active, r * a + (self.p - 1 - r) * b, np.maximum(from_a[t], from_b[t - 1]),
                      lambda t: np.where(t <= r, a, b))

    def all_keys(self) -> Work:
        below = self.rank.astype(float)
        return keys_join(keys_join(self.own, _keys_scaled(self.lower, below)),
                         _keys_scaled(self.higher, self.p - 1 - below))


def _covering(w: Work, span, keys) -> Work:
    """``w`` whose launch covers ``span`` query rows against ``keys`` key rows."""
    return replace(w, span=w.span + span, keyrows=w.keyrows + keys)


def _keys_scaled(w: Work, k) -> Work:
    """``k`` copies of ``w`` one after another in keys (same rows)."""
    some = np.asarray(k) > 0
    return Work(w.visible * k, w.touched * k, np.where(some, w.rowtiles, 0.0), w.chain * k,
                np.where(some, w.launches, 0.0))


class ContiguousSplit(Split):
    """One slice a rank; documents that span slices make full pieces between them."""

    def __init__(self, p, docs, causal, tiles):
        self.bounds = _split_bounds(sum(docs), p)
        self.causal, self.tiles, self.docs = causal, tiles, tuple(d for d in docs if d)
        # every (document, slice) meeting, flattened: its rank, its rows, its index within the document
        hi = np.cumsum(self.docs, dtype=float)
        lo = hi - np.array(self.docs, dtype=float)
        r0 = np.searchsorted(self.bounds, lo, side="right") - 1
        span = np.searchsorted(self.bounds, hi - 1, side="right") - r0
        first = np.repeat(np.cumsum(span) - span, span)
        self.m_index = np.arange(int(span.sum())) - first
        self.m_ranks = np.repeat(r0, span) + self.m_index
        self.m_span = np.repeat(span, span)
        self.m_rows = (np.minimum(self.bounds[self.m_ranks + 1], np.repeat(hi, span))
                     - np.maximum(self.bounds[self.m_ranks], np.repeat(lo, span)))
        self.m_off = np.maximum(np.repeat(lo, span), self.bounds[self.m_ranks]) - self.bounds[self.m_ranks]
        self.edge = len(self.docs) == 1  # one document in slices: pieces start on tile edges
        if tiles.packed:  # each slice its own buffer: its documents' parts walked exactly
            t = tiles.size
            base = np.concatenate([[0], np.cumsum(np.ceil(np.diff(self.bounds) / t) * t + t)[:-1]]).astype(np.int64)
            at = base[self.m_ranks] + self.m_off.astype(np.int64)
            own = walk(at, self.m_rows, at, at + (1 if causal else self.m_rows.astype(np.int64)),
                       np.full(at.size, int(causal)), t, base=base)
        else:
            own = _add_at(_zeros(p), self.m_ranks, piece(self.m_rows, self.m_rows, causal, tiles, aligned=self.edge), p)
        longest = int(span.max(initial=1))
        active = [t for t in range(1, p) if t < longest or (not causal and p - t < longest)]
        lengths = np.diff(self.bounds)
        super().__init__(p, own, lengths, lengths, active)

    def costed_many(self, costs: list) -> list:
        if len(self.docs) != 1 or self.p == 1:
            return self.walk(costs)
        return [self._one_document(c) for c in costs]

    def _one_document(self, cost) -> Costed:
        # one document over every slice: slices differ by at most a row, each step's pieces are alike
        n = float(self.bounds[-1]) / self.p
        f = float(np.asarray(cost(piece(n, n, False, self.tiles))))
        c0 = np.broadcast_to(cost(self.own), (self.p,)).astype(float)
        r = self.rank
        if self.causal:
            return Costed(c0, self.active, r * f, np.full(len(self.active), f), lambda t: np.where(r >= t, f, 0.0))
        return Costed(c0, self.active, np.full(self.p, f * (self.p - 1)), np.full(len(self.active), f),
                      lambda t: np.full(self.p, f))

    def all_keys(self) -> Work:
        if len(self.docs) != 1 or self.p == 1:
            return super().all_keys()
        n = float(self.bounds[-1]) / self.p
        keys = n * (self.rank if self.causal else np.full(self.p, self.p - 1))
        return keys_join(self.own, piece(np.full(self.p, n), keys, False, self.tiles))

    def at(self, t: int) -> Work:
        """Rank ``r`` against the keys of rank ``r - t`` (mod P)."""
        w = self.at_block([t])
        return Work(*(getattr(w, f)[0] for f in FIELDS))

    def at_block(self, ts: list) -> Work:
        """Rank ``r`` at step ``t`` against the keys of rank ``r - t`` (mod P): the meetings of one
        document ``t`` slices apart (and, not causal, ``P - t`` slices ahead), for every ``t`` of ``ts``."""
        t = np.asarray(ts)[:, None]
        pairs = [np.nonzero(self.m_index >= t)]
        shifts = [t]
        if not self.causal:
            pairs.append(np.nonzero(self.m_index + self.p - t < self.m_span))
            shifts.append(t - self.p)
        shape = (len(ts), self.p)
        out = {f: np.zeros(shape) for f in FIELDS}
        for (row, i), shift in zip(pairs, shifts):
            k = i - shift[row, 0]
            if self.tiles.packed:  # one document meets a slice pair: a block at known offsets
                w = rectangle(self.m_off[i], self.m_rows[i], self.m_off[k], self.m_rows[k], self.tiles.size)
            else:
                w = piece(self.m_rows[i], self.m_rows[k], False, self.tiles, aligned=self.edge)
            flat = row * self.p + self.m_ranks[i]
            w = replace(w, span=self.m_rows[i].astype(float), keyrows=self.m_rows[k].astype(float))
            for f in ("visible", "touched", "rowtiles", "span", "keyrows"):
                out[f] += np.bincount(flat, weights=getattr(w, f), minlength=shape[0] * shape[1]).reshape(shape)
            np.maximum.at(out["chain"].reshape(-1), flat, w.chain)
            out["launches"] = np.maximum(out["launches"], out["touched"] > 0)
        return Work(*(out[f] for f in FIELDS))


def _zeros(p: int) -> Work:
    return Work(np.zeros(p), np.zeros(p), np.zeros(p), np.zeros(p), np.zeros(p))


def _split_bounds(total: int, p: int) -> np.ndarray:
    sizes = [total // p + (1 if i < total % p else 0) for i in range(p)]
    return np.concatenate([[0.0], np.cumsum(sizes, dtype=float)])


def _add_at(acc: Work, ranks, w: Work, p: int) -> Work:
    """``acc`` plus ``w`` (arrays aligned with ``ranks``) at those ranks, as pieces of one launch."""
    fields = []
    for name in ("visible", "touched", "rowtiles"):
        a = np.array(getattr(acc, name), dtype=float)
        np.add.at(a, ranks, np.broadcast_to(getattr(w, name), np.shape(ranks)))
        fields.append(a)
    for name in ("chain", "launches"):
        a = np.array(getattr(acc, name), dtype=float)
        np.maximum.at(a, ranks, np.broadcast_to(getattr(w, name), np.shape(ranks)))
        fields.append(a)
    return Work(*fields)


def balanced(p: int, docs: tuple, causal: bool, tiles) -> ZigzagSplit:
    """The balanced layout over ``p`` ranks (``docs``: document lengths): which documents are zigzagged
    and which rank holds each other one whole are ``distributed.layout.balanced_owners``'s (placed by
    causal work, whatever the mask, as the layout places them). A rank holds its documents and chunks
    in the sequence's order, so a step's rows that see keys (the zigzagged chunks') lie between its
    whole documents: each rank's launches cover them as :func:`row_cover` says."""
    length = np.array(docs, dtype=np.int64)
    owner = np.array(balanced_owners(tuple(itertools.accumulate((int(d) for d in docs), initial=0)), p),
                     dtype=np.int64).reshape(-1)
    zigzagged = (owner < 0) & (length > 0)
    split = tuple(int(d) for d in length[zigzagged])
    whole = np.nonzero(owner >= 0)[0]
    rank, length = owner[whole], length[whole]
    rows = np.bincount(rank, weights=length, minlength=p).astype(float)
    if tiles.packed:
        acc = _whole_documents(rank, length, rows, causal, tiles.size, p)
    else:
        acc = _add_at(_zeros(p), rank, piece(length, length, causal, tiles, aligned=False), p)
    out = ZigzagSplit(p, split, causal, tiles, own_extra=acc, rows_extra=rows)
    if tiles.packed and split and p > 1:
        out.cover(*_balanced_cover(p, docs, owner, zigzagged, causal, tiles))
    return out


def _balanced_cover(p: int, docs: tuple, owner, split, causal: bool, tiles) -> tuple:
    """Each rank's ``(span, launches)`` (:func:`row_cover`) of a step whose keys come from a lower rank
    (``r - 1`` standing for them) and of one whose keys come from a higher one (``r + 1``): its buffer
    in the sequence's order, whole documents (``owner[d] >= 0``) seeing nothing, the chunks of the
    ``split`` documents seeing what :func:`zigzag_segments` says."""
    length = np.asarray(docs, dtype=np.int64)
    d_split = np.nonzero(split)[0]
    q, rem = np.divmod(length[d_split], 2 * p)  # (S,)
    r = np.arange(p)

    def chunk(i, j):  # the rows of chunk i of split document j (arrays alike)
        return q[j] + (i < rem[j])
    # the chunks that take rows, rank by rank (documents shorter than 2P leave most of theirs empty)
    (fr, fs) = np.nonzero((q[None, :] > 0) | (r[:, None] < rem[None, :]))
    (br, bs) = np.nonzero((q[None, :] > 0) | (2 * p - 1 - r[:, None] < rem[None, :]))
    whole = np.nonzero((owner >= 0) & (length > 0))[0]
    rk = np.concatenate([owner[whole], fr, br])
    doc = np.concatenate([whole, d_split[fs], d_split[bs]])
    sub = np.concatenate([np.full(whole.size, -1), np.zeros(fr.size, dtype=np.int64), np.ones(br.size, dtype=np.int64)])
    j = np.concatenate([np.zeros(whole.size, dtype=np.int64), fs, bs])
    n = np.concatenate([length[whole], chunk(fr, fs), chunk(2 * p - 1 - br, bs)])
    order = np.lexsort((sub, doc, rk))
    rk, sub, j, n = rk[order], sub[order], j[order], n[order]
    at = np.cumsum(n) - n
    start = at - at[np.searchsorted(rk, rk, side="left")]
    out = []
    for lower in (True, False):
        u = rk - 1 if lower else rk + 1
        there = (sub >= 0) & (u >= 0) & (u < p)
        uc = np.clip(u, 0, p - 1)
        kf = np.where(there, chunk(uc, j), 0)  # its first chunk, and all of its chunks
        ku = kf + np.where(there, chunk(2 * p - 1 - uc, j), 0)
        if not causal:
            seen = ku > 0
        elif lower:  # from a lower rank: both chunks see its first chunk
            seen = kf > 0
        else:  # from a higher rank: the second chunk sees all of its, the first nothing
            seen = (sub == 1) & (ku > 0)
        out.append(row_cover(rk[seen], start[seen], n[seen], p, tiles))
    return tuple(out)


def _whole_documents(rank, length, rows, causal: bool, tile: int, p: int) -> Work:
    """Each rank's whole documents, one after another in its buffer, walked exactly (all ranks at once)."""
    order = np.argsort(rank, kind="stable")
    rank, length = rank[order], length[order]
    base = np.concatenate([[0], np.cumsum(np.ceil(rows / tile) * tile + tile)[:-1]]).astype(np.int64)
    within = np.cumsum(length) - length
    first = np.searchsorted(rank, np.arange(p))
    at = base[rank] + within - within[np.minimum(first, len(within) - 1)][rank] if len(rank) else within
    return walk(at, length, at, at + (1 if causal else length), np.full(length.size, int(causal)), tile, base=base)


def split(layout: str, p: int, docs: tuple, causal: bool, tiles) -> Split:
    """The :class:`Split` of ``docs`` (document lengths) over ``p`` ranks under ``layout``."""
    if layout == "zigzag":
        return ZigzagSplit(p, docs, causal, tiles)
    if layout == "contiguous":
        return ContiguousSplit(p, docs, causal, tiles)
    if layout == "balanced":
        return balanced(p, docs, causal, tiles)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
