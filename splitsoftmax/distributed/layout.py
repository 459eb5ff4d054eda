"""How a global sequence maps to ranks, and which block pairs a causal mask keeps: pure functions.

A rank's shard is a list of segments ``Seg(local, glob, n)``: ``n`` positions stored from local
index ``local``, holding global positions ``glob .. glob + n - 1``.

- ``"contiguous"``: rank ``r`` holds one slice, slices in rank order, any lengths (0 too).
- ``"zigzag"``: the sequence is cut like ``torch.tensor_split(x, 2P)``; rank ``r`` holds chunks
  ``r`` and ``2P-1-r``, concatenated (balances causal work).
- ``"zigzag"`` with documents ``docs`` (``cu_seqlens`` as a tuple of ints): every document is cut
  like ``torch.tensor_split(doc, 2P)`` and rank ``r`` holds chunks ``r`` and ``2P-1-r`` of every
  document, in document order (no divisibility rule). Empty chunks are dropped and chunks that
  meet in global positions are joined, so segments are non-empty and never adjacent.

In every layout a rank's positions increase with the local index.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

SKIP, FULL, DIAG = "skip", "full", "diag"


class Seg(NamedTuple):
    local: int
    glob: int
    n: int


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``torch.tensor_split`` into ``parts``: the first ``total % parts`` get one extra."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def starts(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def shard_lengths(total: int, size: int, layout: str, docs=None) -> list[int]:
    """Per-rank shard lengths of a sequence of ``total`` positions (``docs``: per-document zigzag)."""
    if layout == "contiguous":
        return split_sizes(total, size)
    if docs is not None:
        return [sum(s.n for s in doc_zigzag(docs, size, r)) for r in range(size)]
    c = split_sizes(total, 2 * size)
    return [c[r] + c[2 * size - 1 - r] for r in range(size)]


def joined(segs) -> list[Seg]:
    """``segs`` (consecutive local indices) without empty ones, neighbours in global positions joined."""
    out: list[Seg] = []
    for s in segs:
        if s.n == 0:
            continue
        if out and out[-1].glob + out[-1].n == s.glob and out[-1].local + out[-1].n == s.local:
            out[-1] = Seg(out[-1].local, out[-1].glob, out[-1].n + s.n)
        else:
            out.append(s)
    return out


@lru_cache(maxsize=16)
def _doc_zigzag_all(docs: tuple, size: int) -> tuple:
    """Every rank's per-document zigzag segments, in one pass over the documents."""
    segs: list = [[] for _ in range(size)]
    local = [0] * size
    for a, b in zip(docs[:-1], docs[1:]):
        c = split_sizes(b - a, 2 * size)
        g = starts(c)
        for r in range(size):
            for i in (r, 2 * size - 1 - r):
                if c[i]:
                    segs[r].append(Seg(local[r], a + g[i], c[i]))
                    local[r] += c[i]
    return tuple(tuple(joined(x)) for x in segs)


def doc_zigzag(docs, size: int, rank: int) -> list[Seg]:
    """Rank ``rank``'s segments when each document ``[docs[d], docs[d+1])`` is zigzagged alone."""
    return list(_doc_zigzag_all(tuple(docs), size)[rank])


def segments(layout: str, lengths: list[int], rank: int, docs=None) -> list[Seg]:
    """The segments of ``rank`` given every rank's shard length (rank order); ``docs`` (a tuple
    of document boundaries) makes ``"zigzag"`` per document."""
    if layout == "contiguous":
        return [Seg(0, sum(lengths[:rank]), lengths[rank])]
    p = len(lengths)
    if docs is not None:
        return doc_zigzag(docs, p, rank)
    c = split_sizes(sum(lengths), 2 * p)
    g = starts(c)
    return [Seg(0, g[rank], c[rank]), Seg(c[rank], g[2 * p - 1 - rank], c[2 * p - 1 - rank])]


def zigzag_mismatch(lengths: list[int], docs=None) -> list[int]:
    """Ranks whose length is not what a zigzag split of ``sum(lengths)`` gives them."""
    want = shard_lengths(sum(lengths), len(lengths), "zigzag", docs)
    return [r for r, (n, w) in enumerate(zip(lengths, want)) if n != w]


def global_pieces(layout: str, lengths: list[int], docs=None) -> list[tuple[int, int, int]]:
    """The global sequence as ``(rank, local_start, n)`` pieces in order (for unshard)."""
    p = len(lengths)
    segs = [segments(layout, lengths, r, docs) for r in range(p)]
    pieces = [(r, s.local, s.n, s.glob) for r in range(p) for s in segs[r]]
    return [(r, loc, n) for r, loc, n, _ in sorted(pieces, key=lambda t: (t[3], t[0]))]


def decide(q_start: int, q_len: int, k_start: int, k_len: int, causal: bool) -> tuple[str, int]:
    """Causal decision for a block of queries ``[q_start, +q_len)`` against keys ``[k_start, +k_len)``.

    A query at global ``i`` sees the key at global ``j`` iff ``j <= i`` (when ``causal``).
    Returns ``("skip", 0)`` (no query sees any key), ``("full", 0)`` (every query sees every key)
    or ``("diag", q_start - k_start)``: local query ``a`` sees local key ``b`` iff ``b <= a + diag``.
    """
    if q_len == 0 or k_len == 0:
        return SKIP, 0
    if not causal:
        return FULL, 0
    if k_start > q_start + q_len - 1:
        return SKIP, 0
    if k_start + k_len - 1 <= q_start:
        return FULL, 0
    return DIAG, q_start - k_start


def block_pairs(q_segs: list[Seg], k_segs: list[Seg], causal: bool) -> list[tuple[int, Seg, Seg, str, int]]:
    """The (query segment index, q seg, k seg, decision, diag) pairs that need computing.

    Without ``causal`` positions do not matter: one pair covers the whole shards.
    """
    if not causal:
        q_segs = [Seg(0, 0, sum(s.n for s in q_segs))]
        k_segs = [Seg(0, 0, sum(s.n for s in k_segs))]
    pairs = []
    for i, qs in enumerate(q_segs):
        for ks in k_segs:
            kind, diag = decide(qs.glob, qs.n, ks.glob, ks.n, causal)
            if kind != SKIP:
                pairs.append((i, qs, ks, kind, diag))
    return pairs

