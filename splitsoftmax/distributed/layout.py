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
- ``"balanced"`` (documents required): short documents whole on one rank each, placed to even out
  the causal work per rank; long ones zigzagged as above (:func:`balanced`).

In every layout a rank's positions increase with the local index.

Heads under the heads schedule (:func:`head_split`, :func:`relay_groups`): query heads split like
``torch.tensor_split``, each rank reading the kv heads of its query heads.
"""
from __future__ import annotations

import heapq
from functools import lru_cache
from typing import NamedTuple, Optional

SKIP, FULL, DIAG = "skip", "full", "diag"
BALANCE_SLACK = 10  # "balanced": the busiest rank's causal work within (1 + 1/10) of the mean


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


class Heads(NamedTuple):
    """A rank's query heads ``[q0, q1)`` and the kv heads ``[k0, k1)`` they read."""

    q0: int
    q1: int
    k0: int
    k1: int

    @property
    def nq(self) -> int:
        return self.q1 - self.q0

    @property
    def nkv(self) -> int:
        return self.k1 - self.k0


@lru_cache(maxsize=64)
def head_split(h: int, hkv: int, p: int) -> tuple:
    """Every rank's :class:`Heads` under the heads schedule: query heads as
    ``torch.tensor_split(range(H), P)``, query head ``i`` reading kv head ``i // (H // Hkv)``."""
    g = h // hkv
    sizes = split_sizes(h, p)
    return tuple(Heads(a, a + n, a // g, (a + n - 1) // g + 1) if n else Heads(a, a, 0, 0)
                 for a, n in zip(starts(sizes), sizes))


def kv_shared(split: tuple, hkv: int) -> bool:
    """Whether some kv head is read by more than one rank."""
    return sum(s.nkv for s in split) > hkv


def relay_groups(split: tuple, hkv: int, hosts: tuple) -> Optional[tuple]:
    """The ranks reading each kv head (``hosts[r]``: rank ``r``'s machine) where the heads schedule
    sends K/V and their gradients in two hops (through one reader of each kv head, passed on among
    its readers): every rank reads at most one kv head, some kv head has several readers, each kv
    head's readers share a machine and the group spans several. Else None (one hop)."""
    if len(set(hosts)) < 2 or any(s.nkv > 1 for s in split):
        return None
    readers: list = [[] for _ in range(hkv)]
    for r, s in enumerate(split):
        if s.nkv:
            readers[s.k0].append(r)
    if max(len(g) for g in readers) < 2 or any(len({hosts[r] for r in g}) > 1 for g in readers):
        return None
    return tuple(tuple(g) for g in readers)


def shard_lengths(total: int, size: int, layout: str, docs=None) -> list[int]:
    """Per-rank shard lengths of a sequence of ``total`` positions (``docs``: per-document zigzag)."""
    if layout == "contiguous":
        return split_sizes(total, size)
    if layout == "balanced":
        return [sum(s.n for s in x) for x in _balanced_all(tuple(docs), size)]
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


def causal_work(n: int) -> int:
    """The causal work of a document of ``n`` positions: the (query, key) pairs it holds, ``n(n+1)/2``."""
    return n * (n + 1) // 2


def zigzag_loads(lengths, size: int) -> list[int]:
    """Each rank's causal work (``size`` of them) of documents of ``lengths`` each zigzagged over
    ``size`` ranks: rank ``r`` holds chunks ``r`` and ``2P-1-r`` of ``torch.tensor_split(doc, 2P)``,
    chunk ``i``'s work ``c_i * g_i + c_i (c_i + 1) / 2`` (``g_i``: the positions before it in its
    document). In closed form: with ``q, m = divmod(n, 2P)``, chunk ``i < m`` holds ``q + 1`` positions
    from ``i (q + 1)``, the others ``q`` from ``i q + m``, so each chunk's work is linear in ``i`` on
    either side of ``m``, and a document adds to rank ``r`` a work linear in ``r`` between the breakpoints
    ``m`` and ``2P - m`` (O(documents + P) in all)."""
    p2 = 2 * size
    const, slope = [0] * (size + 1), [0] * (size + 1)

    def add(lo: int, hi: int, a: int, b: int) -> None:  # a + b r on ranks [lo, hi)
        if lo < hi:
            const[lo] += a
            const[hi] -= a
            slope[lo] += b
            slope[hi] -= b
    for n in lengths:
        q, m = divmod(n, p2)
        long_a, long_b = causal_work(q + 1), (q + 1) ** 2  # chunk i < m: long_a + long_b i
        short_a, short_b = q * m + causal_work(q), q * q  # chunk i >= m: short_a + short_b i
        cut = min(m, size)  # chunk r (r < P): long below cut
        add(0, cut, long_a, long_b)
        add(cut, size, short_a, short_b)
        cut = min(p2 - m, size)  # chunk 2P-1-r: long from cut on
        add(0, cut, short_a + short_b * (p2 - 1), -short_b)
        add(cut, size, long_a + long_b * (p2 - 1), -long_b)
    out, a, b = [], 0, 0
    for r in range(size):
        a, b = a + const[r], b + slope[r]
        out.append(a + b * r)
    return out


def _placed(docs: tuple, order: list, split: int, size: int) -> tuple[list, list]:
    """``(owners, loads)``: the first ``split`` documents of ``order`` zigzagged (owner -1), then the
    rest whole, each (in ``order``) onto the rank of least load so far (ties: the lowest rank)."""
    owners = [-1] * (len(docs) - 1)
    loads = zigzag_loads([docs[d + 1] - docs[d] for d in order[:split]], size)
    heap = [(w, r) for r, w in enumerate(loads)]
    heapq.heapify(heap)
    for d in order[split:]:
        w, r = heapq.heappop(heap)
        owners[d] = r
        loads[r] = w + causal_work(docs[d + 1] - docs[d])
        heapq.heappush(heap, (loads[r], r))
    return owners, loads


@lru_cache(maxsize=16)
def balanced_owners(docs: tuple, size: int) -> tuple:
    """Document ``d``'s rank under ``"balanced"`` (-1: zigzagged over every rank); see :func:`balanced`."""
    n = len(docs) - 1
    work = [causal_work(docs[d + 1] - docs[d]) for d in range(n)]
    order = sorted((d for d in range(n) if work[d]), key=lambda d: (-work[d], d))
    tried: dict = {}

    def busiest(k: int) -> int:
        if k not in tried:
            tried[k] = _placed(docs, order, k, size)
        return max(tried[k][1])
    k = _split_count([work[d] for d in order], sum(work), size, busiest)
    busiest(k)
    return tuple(tried[k][0])


def _split_count(works: list, total: int, size: int, busiest) -> int:
    """How many of the largest documents to zigzag (``works``: the documents' work, largest first;
    ``busiest(k)``: the busiest rank's work when the first ``k`` are zigzagged)."""
    fits = lambda load: load * size * BALANCE_SLACK <= total * (BALANCE_SLACK + 1)  # noqa: E731
    lo = sum(1 for w in works if not fits(w))  # alone above the bound: never whole
    if fits(busiest(lo)):
        return lo
    hi = sum(1 for w in works if w * size * BALANCE_SLACK > total)  # the rest at most mean / SLACK
    if not fits(busiest(hi)):
        return min((lo, hi, len(works)), key=lambda k: (busiest(k), k))
    while hi - lo > 1:  # lo misses the bound, hi meets it
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(busiest(mid)) else (mid, hi)
    return hi


@lru_cache(maxsize=16)
def _balanced_all(docs: tuple, size: int) -> tuple:
    """Every rank's ``"balanced"`` segments, in global order."""
    owners = balanced_owners(docs, size)
    segs: list = [[] for _ in range(size)]
    local = [0] * size
    for d, (a, b) in enumerate(zip(docs[:-1], docs[1:])):
        c = split_sizes(b - a, 2 * size)
        g = starts(c)
        parts = [(owners[d], a, b - a)] if owners[d] >= 0 else \
            [(r, a + g[i], c[i]) for r in range(size) for i in (r, 2 * size - 1 - r)]
        for r, glob, n in parts:
            if n:
                segs[r].append(Seg(local[r], glob, n))
                local[r] += n
    return tuple(tuple(joined(x)) for x in segs)


def balanced(docs, size: int, rank: int) -> list[Seg]:
    """Rank ``rank``'s segments under ``"balanced"`` (documents ``[docs[d], docs[d+1])``).

    Long documents are zigzagged over every rank (chunks ``r`` and ``2P-1-r`` of
    ``torch.tensor_split(doc, 2P)``); the others stay whole, each on one rank. The documents split are
    the largest by causal work ``n(n+1)/2`` (ties: the earlier document first), as few as a bisection
    finds such that the busiest rank's work is at most ``(1 + 1/BALANCE_SLACK)`` times the mean: those
    alone above that bound always, those of at most ``mean / BALANCE_SLACK`` only where even splitting
    every larger one misses it. The whole ones are placed largest first onto the rank of least work so
    far (ties: the lowest rank), after the zigzagged ones' work (longest-processing-time first). Where
    the bound is out of reach (sequences short next to ``2P``) the busiest rank does no worse than
    per-document zigzag. A rank's positions are in global order. Pure in ``(docs, size)``.
    """
    return list(_balanced_all(tuple(docs), size)[rank])


def segments(layout: str, lengths: list[int], rank: int, docs=None) -> list[Seg]:
    """The segments of ``rank`` given every rank's shard length (rank order); ``docs`` (a tuple
    of document boundaries) makes ``"zigzag"`` per document; ``"balanced"`` needs them."""
    if layout == "contiguous":
        return [Seg(0, sum(lengths[:rank]), lengths[rank])]
    p = len(lengths)
    if layout == "balanced":
        return balanced(docs, p, rank)
    if docs is not None:
        return doc_zigzag(docs, p, rank)
    c = split_sizes(sum(lengths), 2 * p)
    g = starts(c)
    return [Seg(0, g[rank], c[rank]), Seg(c[rank], g[2 * p - 1 - rank], c[2 * p - 1 - rank])]


def zigzag_mismatch(lengths: list[int], docs=None) -> list[int]:
    """Ranks whose length is not what a zigzag split of ``sum(lengths)`` gives them."""
    return layout_mismatch("zigzag", lengths, docs)


def layout_mismatch(layout: str, lengths: list[int], docs=None) -> list[int]:
    """Ranks whose length is not what ``layout`` gives them of ``sum(lengths)`` (contiguous: none)."""
    if layout == "contiguous":
        return []
    want = shard_lengths(sum(lengths), len(lengths), layout, docs)
    return [r for r, (n, w) in enumerate(zip(lengths, want)) if n != w]


def split_name(layout: str, docs) -> str:
    """What ``layout`` makes of a sequence, for the message of a shard length that is not it."""
    if layout == "balanced":
        return "the balanced placement of the documents of cu_seqlens"
    return "a per-document zigzag split of cu_seqlens" if docs is not None else "a zigzag split"


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

