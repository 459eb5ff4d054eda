"""The cost model: a profile's measured rates turned into the time of a kernel launch and of a transfer.

Kernel time. The local attention kernel walks tiles of ``tile_rows`` query rows by ``tile_keys`` keys;
a piece of work (rows x keys, full or causal, for each head) costs the tiles it touches, not the pairs
it keeps. A tile runs at the rate the profile measured for a full (non-causal) square problem whose
key loop is as long as this work's: ``R(kbar)``, ``kbar`` the keys one row tile walks on average. The
profile's tables come from ``B*S = 32768`` runs (thousands of row tiles), so ``R`` holds the key loop's
efficiency and nothing of the GPU's fill; the fill is the second bound: no launch is shorter than its
longest row tile's chain of key tiles on one SM. Below the table's shortest length ``R`` falls like
``k / (k + k0)`` (fitted to its two shortest points). The causal tables are not used by the model:
they check it (tests/test_plan_model.py).

Step kernel. A launch of a ring step (or an all-gather's visit of one rank's keys) merges into a running
float32 state instead of writing a final output, and may be another kernel than the one-call one (this
package: the forward's merge in the Gluon kernel's epilogue; before it, a Triton kernel of its own). The
profile's ``step_rate`` (per pass, default 1) scales the kernel's rates for such launches: measured as a
ring of one rank, or as a ring whose communicator moves nothing, against one GPU's call on the same work.
A ring whose steps merge in kernels of their own (separate corrections of the output and its
statistics, dQ sums, copies of half of the rows; FlashAttention's backward pre- and post-processing
per call) moves ``step_bytes`` (per pass, per query row and head of a rank) through HBM each step, at
the profile's ``hbm_gbs``. This package's step launches move, besides their tiles, the running state
of every row they cover (``kernel.step_state``, counted from its kernels' code; :meth:`Profile.state_s`):
the forward's epilogue reads the query and reads and writes the float32 output and its statistics of
each covered row, whether the row sees a key of the step or not; the backward writes the step's
float32 dQ of each covered row and adds it to the running sum (a read, a read and a write); the
step's float32 dK/dV are copied out (one launch) or zeroed and added to (several), per key row.
The state of rows in row tiles that walk keys overlaps those tiles (measured: docs/benchmarks/plan.md,
R13, a zigzag rank's forward is its tiles' time); the rows a step's launches cover outside such row
tiles (whole documents of a span that see none of the step's keys) add theirs to the tiles' time.
The host issues a ring step while the device runs the one before, so a step takes the longer of
its device time and its host time (``kernel.step_us``, measured on steps too small to keep the
device busy).
How a step's rows are cut into launches is the profile's ``kernel.row_pieces`` (:class:`Tiles`).
``grad_bytes``: bytes per element of the dK/dV sums a ring passes on and an all-gather
reduce-scatters (this package: float32).

Transfers. ``t = latency + bytes / rate`` for the link class (``"intra"``: inside a host, ``"inter"``:
across hosts) and the collective (``"p2p"``, ``"alltoall"``, ``"allgather"``).
"""
from __future__ import annotations

import copy
import json
import pathlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

PROFILES = pathlib.Path(__file__).resolve().parent / "profiles"
PASSES = ("fwd", "fwd_bwd")
LINKS = ("intra", "inter")
FIELDS = ("visible", "touched", "rowtiles", "chain", "launches", "span", "keyrows")
STATE_KINDS = ("inputs", "float32", "stats")  # the row vectors of :meth:`Profile.state_s`'s counts
COLLECTIVES = ("p2p", "alltoall", "allgather")
STATE_WHAT = ("fwd", "bwd", "keys_bwd", "keys_bwd_pieces")


@dataclass
class Work:
    """Tile work of one launch, per head (numpy arrays over ranks, or floats).

    ``visible``: (query, key) pairs the mask keeps; ``touched``: tile pairs the kernel walks;
    ``rowtiles``: row tiles; ``chain``: key tiles of the longest row tile; ``launches``: kernel calls
    (1 where there is work: pieces added together run in one launch; a ring step's pieces by rows
    count one each). ``span``: query rows a ring step's launches cover, those that see no key of the
    step among them (their running state read and written all the same, :meth:`Profile.state_s`);
    ``keyrows``: key rows of the step's buffer (their dK/dV copied out of the launch). Both 0 where
    nothing merges into a running state (one GPU's call, a peer's kernel)."""
    visible: object = 0.0
    touched: object = 0.0
    rowtiles: object = 0.0
    chain: object = 0.0
    launches: object = 0.0
    span: object = 0.0
    keyrows: object = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.visible + other.visible, self.touched + other.touched, self.rowtiles + other.rowtiles,
                    np.maximum(self.chain, other.chain), np.maximum(self.launches, other.launches),
                    self.span + other.span, self.keyrows + other.keyrows)

    def scaled(self, k) -> "Work":
        """``k`` copies of this work in one launch (``k`` may be an array over ranks)."""
        some = np.asarray(k) > 0
        return Work(self.visible * k, self.touched * k, self.rowtiles * k, np.where(some, self.chain, 0.0),
                    np.where(some, self.launches, 0.0), self.span * k, self.keyrows * k)


class Tiles(NamedTuple):
    """The kernel's tile (rows = keys) and whether pieces of different documents share a tile
    (``packed``: this package's kernels, whose row bounds let a tile hold several documents) or each
    document's piece has tiles of its own (varlen kernels that walk one document at a time).

    ``min_gap``, ``most``: how a ring step's rows that see keys are cut into launches (pieces by
    rows): runs of such rows closer than ``min_gap`` joined, then the closest joined until at most
    ``most`` remain; ``most = 1``: one launch over the span of every such row. The package's rule is
    ``distributed.plan.row_groups`` with ``configs.ATTN_PLAN_MIN_GAP`` and ``plan.MAX_ROW_PIECES``;
    planning imports nothing of the package but ``distributed.layout``, so a profile carries their values (``kernel.row_pieces``,
    written by ``calibrate`` from those constants; tests/test_plan_model.py checks that the shipped
    profiles hold them)."""
    size: int
    packed: bool = True
    min_gap: int = 1
    most: int = 1


def piece(rows, keys, causal: bool, tiles: Tiles, count=1.0, stride=None, aligned: bool = True) -> Work:
    """``count`` pieces of ``rows`` x ``keys`` (``causal``: square diagonal pieces, ``keys`` ignored)
    in one launch. Scalars or numpy arrays (one entry per rank).

    ``aligned``: the pieces start on tile edges (one document cut in equal chunks); otherwise
    (packed documents) they fall anywhere against the tiles, and a piece of ``n`` rows spans
    ``(n + tile - 1) / tile`` tiles on average. Packed, documents whose rows in the buffer
    (``row_stride``) are shorter than a row tile share it: a row tile holds ``tile / row_stride`` of
    them and walks every key tile between the first key of its first piece and the last of its last,
    which lie ``key_stride`` apart (``stride = (row_stride, key_stride)``: the rows and keys a piece's
    document takes in the row and key buffers, where only part of them may meet; default ``(rows,
    keys)``). Unpacked, each piece has tiles of its own."""
    tile = tiles.size
    rows = np.asarray(rows, dtype=float)
    keys = rows if causal else np.asarray(keys, dtype=float)
    row_stride, key_stride = (rows, keys) if stride is None else (np.asarray(x, dtype=float) for x in stride)
    count = np.where((rows > 0) & (keys > 0), np.asarray(count, dtype=float), 0.0)
    alone = (row_stride >= tile) | (not tiles.packed)

    def span(n):  # tiles a run of n rows (or keys) covers
        return np.ceil(n / tile) if aligned else (n + tile - 1) / tile
    rt = np.where(alone, span(rows), row_stride / tile)
    shared = key_stride / np.maximum(row_stride, 1e-9) + (0.0 if aligned else (tile - 1) / tile)
    if causal:
        visible = rows * (rows + 1) / 2
        touched = np.where(alone, rt * (rt + 1) / 2, rt * shared)
        chain = np.where(alone, rt, np.ceil(shared))
    else:
        visible = rows * keys
        kt = np.where(alone, span(keys), shared)
        touched, chain = rt * kt, np.ceil(kt)
    some = count > 0
    return Work(count * visible, count * touched, count * rt, np.where(some, chain, 0.0), np.where(some, 1.0, 0.0))


class Profile:
    """Measured rates of one GPU kind and its links (a profile JSON, see ``profiles/``)."""

    def __init__(self, data: dict):
        self.data = data
        k = data["kernel"]
        self.name = data["name"]
        self.tile = int(k["tile_rows"])
        rp = k.get("row_pieces", {})
        self.tiles = Tiles(self.tile, bool(k.get("packs_documents", True)), int(rp.get("min_gap", 1)),
                           int(rp.get("most", 1)))
        if self.tiles.min_gap < 1 or self.tiles.most < 1:
            raise ValueError(f"profile {self.name!r}: kernel.row_pieces needs min_gap >= 1 and most >= 1, got {rp}")
        self.state = {w: {c: float(k.get("step_state", {}).get(w, {}).get(c, 0.0)) for c in STATE_KINDS}
                      for w in STATE_WHAT}
        if any(v < 0 for d in self.state.values() for v in d.values()):
            raise ValueError(f"profile {self.name!r}: kernel.step_state needs counts >= 0, got {k.get('step_state')}")
        self.sms = int(data["sms"])
        self.memory = float(data["memory_gib"]) * 2 ** 30
        self.scale = {p: 1.0 for p in PASSES}
        self.step_rate = {p: float(k.get("step_rate", {}).get(p, 1.0)) for p in PASSES}
        if any(not v > 0 for v in self.step_rate.values()):
            raise ValueError(f"profile {self.name!r}: kernel.step_rate needs positive values, got {self.step_rate}")
        self.step_bytes = {p: float(k.get("step_bytes", {}).get(p, 0.0)) for p in ("fwd", "bwd")}
        self.grad_bytes = float(k.get("grad_bytes", 4))
        self.hbm = float(data.get("hbm_gbs", 0.0)) * 1e9
        if any(v < 0 for v in self.step_bytes.values()) or self.grad_bytes <= 0 or (
                (any(self.step_bytes.values()) or any(v for d in self.state.values() for v in d.values()))
                and not self.hbm > 0):
            raise ValueError(f"profile {self.name!r}: kernel.step_bytes needs values >= 0 and hbm_gbs > 0, "
                             f"kernel.grad_bytes > 0; got {self.step_bytes}, {data.get('hbm_gbs')}, {self.grad_bytes}")
        self._tables = {p: sorted((float(s), float(r)) for s, r in k[p]["full"]) for p in PASSES}
        for p, t in self._tables.items():
            if len(t) < 2 or any(r <= 0 for _, r in t):
                raise ValueError(f"profile {self.name!r}: kernel table {p!r} needs >= 2 positive points, got {t}")
        for cls in LINKS:
            for kind in COLLECTIVES:
                e = data.get("links", {}).get(cls, {}).get(kind)
                if not e or not e.get("gbs", 0) > 0 or not e.get("latency_us", -1) >= 0:
                    raise ValueError(f"profile {self.name!r}: links.{cls}.{kind} needs gbs > 0 and latency_us >= 0, "
                                     f"got {e!r}")

    def rate(self, pas: str, keys) -> np.ndarray:
        """TFLOP/s of a full tile whose row tile walks ``keys`` keys (interpolated in log keys)."""
        t = self._tables[pas]
        keys = np.maximum(np.asarray(keys, dtype=float), 1.0)
        out = interp_rate(t, keys)
        (k1, r1), (k2, r2) = t[0], t[1]
        k0 = max((r2 - r1) / (r1 / k1 - r2 / k2), 0.0) if r1 / k1 > r2 / k2 else 0.0
        low = r1 * (keys / (keys + k0)) / (k1 / (k1 + k0))
        return np.where(keys < k1, low, out) * self.scale[pas]

    def kernel_s(self, work: Work, heads: float, head_dim: int, pas: str, step: bool = False) -> np.ndarray:
        """Seconds of the forward (``pas="fwd"``) or the backward (``"bwd"``) of ``work`` for ``heads`` heads
        (``step``: launches of a ring step, at the profile's ``step_rate``)."""
        touched = np.asarray(work.touched, dtype=float)
        if touched.size > 256:  # many ranks (and steps), most of them idle: time only those with work
            out = np.zeros(touched.shape)
            some = np.nonzero(touched > 0)
            out[some] = self._kernel_s(Work(*(np.broadcast_to(np.asarray(getattr(work, f), dtype=float),
                                                               touched.shape)[some] for f in FIELDS)),
                                       heads, head_dim, pas, step)
            return out
        return self._kernel_s(work, heads, head_dim, pas, step)

    def _kernel_s(self, work: Work, heads: float, head_dim: int, pas: str, step: bool) -> np.ndarray:
        tile_flops = 4.0 * head_dim * self.tile * self.tile
        touched = np.asarray(work.touched, dtype=float)
        kbar = self.tile * touched / np.maximum(np.asarray(work.rowtiles, dtype=float), 1e-9)
        walk = np.maximum(touched * heads, np.asarray(work.chain, dtype=float) * self.sms * (heads > 0))
        sr = self.step_rate if step else {p: 1.0 for p in PASSES}
        fwd = walk * tile_flops / (self.rate("fwd", kbar) * sr["fwd"] * 1e12)
        k = self.data["kernel"]
        if pas == "fwd":
            return fwd + np.asarray(work.launches) * k["launch_us"]["fwd"] * 1e-6
        both = 3.5 * walk * tile_flops / (self.rate("fwd_bwd", kbar) * sr["fwd_bwd"] * 1e12)
        return np.maximum(both - fwd, 0.0) + np.asarray(work.launches) * k["launch_us"]["bwd"] * 1e-6

    def step_bytes_s(self, rows, heads: float, pas: str) -> np.ndarray:
        """Seconds of a ring step's merge passes outside its kernel for ``rows`` query rows and ``heads``
        heads (``step_bytes`` at ``hbm_gbs``; 0 where the profile has none)."""
        b = self.step_bytes["fwd" if pas == "fwd" else "bwd"]
        return np.asarray(rows, dtype=float) * heads * b / self.hbm if b else np.zeros(np.shape(rows))

    def state_bytes(self, what: str, head_dim: int, elem: int) -> float:
        """Bytes of one row (and head) of ``kernel.step_state[what]``: its counts of row vectors in the
        inputs' dtype (``head_dim * elem`` bytes), of float32 row vectors (``head_dim * 4``) and of
        float32 statistics (4)."""
        c = self.state[what]
        return c["inputs"] * head_dim * elem + c["float32"] * head_dim * 4 + c["stats"] * 4

    def state_s(self, work: Work, heads: float, kv_heads: float, head_dim: int, elem: int, pas: str) -> np.ndarray:
        """Seconds, at ``hbm_gbs``, of what a ring step's launches move besides the tiles the rates
        price (``kernel.step_state``, counted from the kernels' code): every row of the step's ``span``
        outside its row tiles that walk keys moves ``fwd`` (``bwd``) per head (the others' state
        overlaps their tiles); every key row of the step's buffer moves ``keys_bwd`` (one launch) or
        ``keys_bwd_pieces`` (several) per kv head in the backward. 0 where the profile has no counts."""
        span = np.asarray(work.span, dtype=float)
        if not np.any(span) and not np.any(work.keyrows):
            return np.zeros(np.shape(span))
        b = pas if pas == "fwd" else "bwd"
        walking = np.minimum(span, np.asarray(work.rowtiles, dtype=float) * self.tile)
        out = (span - walking) * self.state_bytes(b, head_dim, elem) * heads
        if pas != "fwd":
            many = np.asarray(work.launches, dtype=float) > 1
            per_key = np.where(many, self.state_bytes("keys_bwd_pieces", head_dim, elem),
                               self.state_bytes("keys_bwd", head_dim, elem))
            out = out + np.asarray(work.keyrows, dtype=float) * kv_heads * per_key
        return out / self.hbm if self.hbm > 0 else np.zeros(np.shape(out))

    def overhead_s(self, what: str, pas: str) -> float:
        """Host seconds of one ``what`` (``"step_us"``: a ring step, ``"call_us"``: a call) in pass ``pas``."""
        return self.data["kernel"][what]["fwd" if pas == "fwd" else "bwd"] * 1e-6

    def link(self, cls: str, kind: str) -> tuple[float, float]:
        """(bytes per second, latency seconds) of collective ``kind`` on link class ``cls``."""
        e = self.data["links"][cls][kind]
        return float(e["gbs"]) * 1e9, float(e["latency_us"]) * 1e-6

    def transfer_s(self, nbytes, cls: str, kind: str) -> np.ndarray:
        """Seconds to move ``nbytes`` (per rank, the busiest direction) over ``cls`` by ``kind``."""
        bw, lat = self.link(cls, kind)
        nbytes = np.asarray(nbytes, dtype=float)
        return np.where(nbytes > 0, lat + nbytes / bw, 0.0)

    def with_tiles(self, packed: bool) -> "Profile":
        """A copy whose kernel packs documents into shared tiles (``True``) or gives each its own."""
        data = copy.deepcopy(self.data)
        data["kernel"]["packs_documents"] = bool(packed)
        out = Profile(data)
        out.scale = dict(self.scale)
        return out

    def with_step_rate(self, **rate: float) -> "Profile":
        """A copy whose ring-step launches run at ``rate`` times the one-call kernel's rates, per pass
        (``fwd=..., fwd_bwd=...``; the others kept)."""
        data = copy.deepcopy(self.data)
        for p, v in rate.items():
            if p not in PASSES:
                raise ValueError(f"with_step_rate: unknown pass {p!r}, expected one of {PASSES}")
            data["kernel"].setdefault("step_rate", {})[p] = float(v)
        out = Profile(data)
        out.scale = dict(self.scale)
        return out

    def with_row_pieces(self, most: int, min_gap: int = None) -> "Profile":
        """A copy whose ring steps cut their rows into at most ``most`` launches (``1``: one span over
        the rows that see keys, the rule before pieces by rows were cut at gaps), gaps of at least
        ``min_gap`` rows (default: kept)."""
        data = copy.deepcopy(self.data)
        rp = data["kernel"].setdefault("row_pieces", {})
        rp["most"] = int(most)
        if min_gap is not None:
            rp["min_gap"] = int(min_gap)
        out = Profile(data)
        out.scale = dict(self.scale)
        return out

    def with_kernel_scale(self, **scale: float) -> "Profile":
        """A copy whose kernel rates are multiplied per pass (``fwd=..., fwd_bwd=...``; the others kept): a profile
        brought to one GPU's time measured in another run (the machine of a run being checked)."""
        out = Profile(copy.deepcopy(self.data))
        out.scale = dict(self.scale)
        for p, v in scale.items():
            if p not in PASSES:
                raise ValueError(f"with_kernel_scale: unknown pass {p!r}, expected one of {PASSES}")
            out.scale[p] = float(v)
        return out


def load_profile(profile=None) -> Profile:
    """A :class:`Profile` from ``None`` (the shipped H100 profile), a shipped name (``"h100"``,
    ``"h200"``), a path to a JSON file, a dict, or a Profile."""
    if isinstance(profile, Profile):
        return profile
    if profile is None:
        profile = "h100"
    if isinstance(profile, dict):
        return Profile(profile)
    if not isinstance(profile, (str, pathlib.Path)):
        raise TypeError(f"profile must be None, a name, a path, a dict or a Profile, got {type(profile).__name__}")
    path = PROFILES / f"{profile}.json" if str(profile) in shipped() else pathlib.Path(profile)
    if not path.is_file():
        raise ValueError(f"profile {str(profile)!r}: no such file and not one of the shipped {shipped()}")
    return Profile(json.loads(path.read_text()))


def shipped() -> list[str]:
    """Names of the profiles shipped with the package."""
    return sorted(p.stem for p in PROFILES.glob("*.json"))



def interp_rate(table, length):
    """A profile table's rate at ``length`` (``[[length, TFLOP/s], ...]``; scalar or array), linear in
    log length, clamped at its ends."""
    xs = np.log([float(a) for a, _ in table])
    return np.interp(np.log(np.maximum(np.asarray(length, dtype=float), 1.0)), xs, [float(b) for _, b in table])
