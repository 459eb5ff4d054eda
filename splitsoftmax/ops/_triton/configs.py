"""Every tile size and launch configuration, as data in one place.

Each setting carries a one-line reason and the run that set it: a run id (``F11``, ``R1``) is one of
the runs tables of ``docs/benchmarks/<area>.md``, a commit (``c2ca8a7``) an entry of an area's earlier
history there; "not timed" where no run chose it. The measurements themselves are in those files and,
as this module's comments carried them, in ``docs/benchmarks/settings.md``.
"""

try:
    from triton import __version__ as _triton
except ImportError:  # a Linux-only dependency: the torch path runs without it
    _triton = "0.0"

# The Triton in use, (major, minor): a few settings below depend on what its compiler makes of a kernel.
TRITON_VERSION = tuple(int(n) for n in _triton.split(".")[:2])

# Torch (CPU) path: columns per block of a softmax row, keys per block of attention (a correctness
# path: not timed).
CPU_BLOCK_COLS = 8192
CPU_BLOCK_KEYS = 256

# ---- attention: Triton attention, split-KV decode and the fused N-way merge ----
# A tile config is (BLOCK_M, BLOCK_N, num_warps, num_stages), keyed by (kind, element size of the
# inputs, head dim); `decode.attn_tile` takes the smallest listed head dim >= the padded one,
# else ATTN_TILE_DEFAULT. Chosen from sm_90 ptxas reports (registers, no spills) and timings.
ATTN_TILES = {
    # forward over many queries (prefill, ring steps)
    ("fwd", 2, 64): (128, 64, 4, 3),     # not timed
    ("fwd", 2, 128): (128, 128, 8, 3),   # the fastest of an H200 sweep at S=8k (4dcf985, attention-forward)
    # ... or, on sm_90 (ATTN_FWD_GLUON), the Gluon kernel's: each consumer's (BLOCK_M, BLOCK_N, 4, STAGES
    # buffers each of K and V); 64-key tiles lose at every length (F16), 3 buffers beat 2 once they fit (F11)
    ("fwd_gluon", 2, 128): (64, 128, 4, 3),
    ("fwd", 2, 256): (64, 64, 8, 2),     # not timed
    ("fwd", 4, 64): (16, 32, 4, 2),      # not timed
    ("fwd", 4, 256): (16, 16, 4, 2),     # float32 runs exact (no tf32) FMA products: small tiles (not timed)
    # causal forward over at most ATTN_SHORT_CAUSAL_SQ queries: short programs, a diagonal tile in each;
    # faster than 128x128 at 1k and 2k (c2ca8a7, attention-forward), kept when swept again (F18)
    ("fwd_causal_short", 2, 128): (64, 64, 4, 3),
    # decode: few query rows (GQA heads packed into BLOCK_M), long key streams
    ("decode", 2, 128): (16, 64, 4, 4),   # the best decode tile of the sweeps (27e894a, f65ce63; decode-merge)
    ("decode", 2, 256): (16, 64, 4, 3),   # not timed
    ("decode", 4, 256): (16, 16, 4, 2),   # not timed
    # backward: dK/dV programs hold a key block and walk query blocks ...
    ("bwd_kv", 2, 64): (32, 128, 8, 3),   # not timed
    # faster than 32x128 w8 at S=1k and 8k, few spills on sm_90 (run not recorded: settings.md)
    ("bwd_kv", 2, 128): (32, 64, 4, 3),
    ("bwd_kv", 2, 256): (16, 64, 8, 2),   # not timed
    # ... or, on sm_90 (ATTN_BWD_GLUON), the warp-specialized Gluon kernel's (BLOCK_M, BLOCK_N,
    # num_warps of each of its three warpgroups, STAGES): 64x64 with 3 buffers the fastest (W4, W5)
    ("bwd_kv_ws", 2, 128): (64, 64, 4, 3),
    ("bwd_kv", 4, 256): (16, 16, 4, 2),   # not timed
    # ... and dQ programs hold a query block and walk key blocks (the deterministic backward); no other
    # tile faster, 128x128 does not fit in shared memory (T1, T2)
    ("bwd_q", 2, 128): (128, 64, 8, 4),
    # ... or, on sm_90 (ATTN_BWD_GLUON), the Gluon kernel's (BLOCK_M, BLOCK_N, num_warps, STAGES):
    # 3 buffers beat 2 and 64x64 (G2)
    ("bwd_q_gluon", 2, 128): (128, 64, 8, 3),
    # ... or, where the dK/dV kernel writes dS (ATTN_BWD_DS), the kernel reading it: (BLOCK_M, num_warps,
    # num_stages[, maxnreg]); its key blocks are the dK/dV kernel's. 128 registers per thread let two
    # programs share an SM (R1, attention-backward); Triton 3.7 and 3.8 take 64x8x3, where 128x8x3
    # spills on sm_90 (ptxas counts, not timed)
    ("bwd_q_ds", 2, 128): (64, 8, 3, 128) if TRITON_VERSION in ((3, 7), (3, 8)) else (128, 8, 3, 128),
    ("bwd_q", 2, 256): (64, 32, 8, 2),    # not timed
    ("bwd_q", 4, 64): (32, 32, 4, 2),     # not timed
    ("bwd_q", 4, 256): (16, 16, 4, 2),    # not timed
    # the five-product backward: a key block (BLOCK_N) and its dK/dV in registers walks query blocks
    # (BLOCK_M), adding their dQ into a float32 buffer through TMA reductions; the fastest of the tiles
    # timed at B=4 H=16 8k causal (attn_bwd_paths.py sweep, run not recorded: settings.md)
    ("bwd", 2, 64): (32, 128, 8, 3),
    ("bwd", 2, 128): (32, 128, 8, 3),
    # ... or, on sm_90 (ATTN_BWD_FUSED), the fused Gluon kernel's (BLOCK_M, BLOCK_N, num_warps of each
    # MMA warpgroup, STAGES of Q/dO and dS^T, maxnreg): two warpgroups of 64 keys each, 240 registers
    # each and 24 for the producer warp (three warpgroups' worth of 168 per thread); not timed
    ("bwd_fused", 2, 128): (64, 128, 4, 2, 168),
}
ATTN_TILE_DEFAULT = (16, 16, 4, 2)
# The five-product backward (dQ added through TMA reductions; never under deterministic algorithms):
# off, slower than the atomic-free pair at every shape timed (B2, X1). It runs for head dims up to
# ATTN_BWD_ATOMIC_MAX_DIM (its dK/dV accumulators stay in registers).
ATTN_BWD_ATOMIC = False
ATTN_BWD_ATOMIC_MAX_DIM = 128
# The fused backward on sm_90 (ops/attention/gluon/bwd_fused.py): one Gluon kernel of five products per
# tile pair (dS handed to the dQ product in shared memory, P^T and dS^T fed to dV and dK from registers,
# dQ reduce-added in float32 by TMA), for 2-byte inputs of a head dim with a "bwd_fused" tile, the masks
# of ATTN_BWD_FUSED_MASKS, no sinks; never under deterministic algorithms (the pair runs). Off: on
# one H100 (Triton 3.9.0) 1.13-1.28x the pair's speed and 0.93-1.08x cuDNN's at 8k-32k, but its NaN/Inf
# pattern differed from the pair's (tests/test_gpu_attention_bwd.py::test_fused_backward): a tile masked
# for one half of a key block had its Q and dO guarded for both warpgroups, so a NaN row of dO missed
# the other half's visible keys (docs/benchmarks/attention-backward-fused.md, F2). Each warpgroup now
# takes a masked tile as the pair takes it for its 64 keys; that form, documents and softcap have not
# yet run on a GPU ...
ATTN_BWD_FUSED = False
# ... for these visibilities ("full", "causal") and mask fields ("lo", "kv_range", "q_offset", "rows",
# "softcap"): those whose launches compile for sm_90 without spilling, by the Triton version (3.6-3.8
# spill 196-560 bytes in every one; tests/test_attention_bwd_compile.py, and
# docs/benchmarks/attention-backward-fused.md has each count); the others take the pair.
ATTN_BWD_FUSED_MASKS = (frozenset({"full", "causal", "lo", "kv_range", "q_offset", "rows", "softcap"})
                        if TRITON_VERSION >= (3, 9) else frozenset())
# ... where at least this many of its programs (one per SM at a time) fill each SM: on one H100
# (Triton 3.9.0, bf16 D=128, beside the pair in one call) 1x16x2k (1.9 programs an SM) ran 0.64x the
# pair's speed causal and 0.98x full, 16x16x2k (31) 1.07x / 1.12x, 1x16x8k (7.8) 1.22x / 1.13x,
# 1x16x32k 1.28x / 1.17x (docs/benchmarks/attention-backward-fused.md); between 2 and 7.8 not timed.
ATTN_BWD_FUSED_MIN_WAVES = 3
# ... and both backwards split a key block's work across programs (query heads, then query range)
# while fewer than this many dK/dV programs per SM would run, each range piece at least this many
# query blocks long (not timed).
ATTN_BWD_PROGRAMS_PER_SM = 2
ATTN_BWD_SPLIT_MIN_BLOCKS = 4
# The dK/dV kernel's masked tiles keep a NaN/Inf in a row of Q or dO from the keys that row does not
# see (torch's own attention lets it through: 0 * NaN): the contract, whatever its registers cost (run
# not recorded: settings.md).
ATTN_BWD_GUARD = True
# The plain backward pair (ops/attention/bwd_plain.py) reads the tiles it streams (Q and dO in the
# dK/dV kernel, K and V in the dQ kernel) through TMA descriptors where it can, the pointer path's
# results bit for bit and faster (T1, T2).
ATTN_BWD_TMA = True
# On sm_90 the plain pair's launches, and the variants' masks in bfloat16, are the Gluon kernels, which
# overlap their products, where ATTN_TILES lists a "bwd_kv_ws" / "bwd_q_gluon" tile for the head dim:
# the warp-specialized dK/dV kernel (ops/attention/gluon/bwd_kv.py) and the dQ kernel
# (ops/attention/gluon/bwd.py), faster than the Triton pair (G1, G2, W4).
ATTN_BWD_GLUON = True
# ... the dK/dV kernel's register limit per thread: four warpgroups' worth (its producer warp takes a
# warpgroup's place) within an SM's 64K registers, which it moves between them (setmaxnreg)
ATTN_BWD_KV_WS_MAXNREG = 128
# The Gluon dK/dV kernel writes each tile's dS^T (bfloat16) and the dQ kernel reads it: one product per
# tile pair in place of three (D1, D2), for a buffer of B * H * Sk * Sq * 2 bytes held during the
# backward (fewer rows under a causal window or causal documents), up to ATTN_BWD_DS_MAX_BYTES: past
# it the backward runs in pieces of batch elements, kv heads or a kv head's query heads that fit, each
# piece's dK/dV grid at least ATTN_BWD_DS_MIN_WAVES waves (D6, QP2); where none fits, the dQ kernel
# recomputes dS.
ATTN_BWD_DS = True
ATTN_BWD_DS_MAX_BYTES = 2 << 30
ATTN_BWD_DS_MIN_WAVES = 3
# The plain forward (causal or full, bf16, one split written directly) in Gluon on sm_90
# (ops/attention/gluon/fwd.py): two consumer warpgroups each take a key block's softmax while the
# tensor cores run the next block's scores and the last block's values, one producer warp streams
# Q, K, V; without warp specialization the same loop lost to the Triton kernel (F1-F4) ...
ATTN_FWD_GLUON = True
# ... under this register limit per thread: 12 warps' worth within an SM's 64K registers, which the
# kernel moves between its warpgroups (setmaxnreg) ...
ATTN_FWD_GLUON_MAXNREG = 168
# ... where each partition reads its int32 scalars (output strides, Sk, diag) where it uses them
# (attention_fwd_gluon._own), by the Triton version's (major, minor): Triton 3.7 and 3.8 otherwise
# spill them on sm_90 (ptxas counts, not timed; every timing was taken on 3.6).
ATTN_FWD_GLUON_OWN_SCALARS = TRITON_VERSION in ((3, 7), (3, 8))
# ... from this many queries on, (full, causal): shorter rows keep the Triton kernel (and its short
# causal tile), faster there (F4; causal from 2048 since F9; at 1k causal a tie, F16)
ATTN_FWD_GLUON_MIN_SQ = (1024, 2048)
# ... and launched persistent: one program per SM, each taking the next tile from a counter and
# streaming its Q, K and V while it finishes the last (False: one program per tile) (F5, F6)
ATTN_FWD_GLUON_PERSISTENT = True
# ... and with the variants' masks (a window, kv_range, q_offset, documents, softcap) as well as the
# plain one: each tile walks the key blocks its rows see, those every row sees whole first, unmasked
# (K2, K3, V5)
ATTN_FWD_GLUON_VARIANTS = True
# ... and for a ring step's forward (``attn_fwd_acc``): each tile's rows merged into the running
# float32 state as they are stored (its ``ACC``), as the Triton kernel's are (R5, R6, ring)
ATTN_FWD_GLUON_ACC = True
ATTN_SHORT_CAUSAL_SQ = 2048  # the causal length up to which the short tile runs (c2ca8a7)
# The forward reads Q/K/V tiles through TMA descriptors where it can (2-byte inputs, unpadded head
# dims, 16-byte strides, Hopper on), rows not packed: faster at short causal rows (0342777 / b3ef55a).
ATTN_TMA = True
# ... and, where the forward writes its output directly (not merging in place, one key split), it
# stores the output tile through a descriptor too ...
ATTN_TMA_STORE = True
# ... and where every operand is contiguous and no tile crosses the end of a head (Sq and Sk
# multiples of the tile), the descriptors are (B * H * S, D) row views instead of (B, H, S, D).
ATTN_TMA_ROWS = True
# Softcapped scores (16-bit inputs on NVIDIA GPUs) take tanh from the special-function unit's
# tanh.approx.f32 (one op, about 2^-11 relative error) instead of exp2 and a division (two); not timed.
ATTN_SOFTCAP_APPROX = True
# Under TRITON_INTERPRET=1 small tiles, so tiny test shapes still cross several tiles.
ATTN_TILE_INTERPRET = (16, 16, 4, 1)
# Split-KV: split the keys when fewer programs than this many per SM would run, the best of 1-8
# (27e894a, bb4b890; decode-merge) ...
ATTN_SPLIT_PROGRAMS_PER_SM = 2
# ... and give each split at least this many key tiles.
ATTN_SPLIT_MIN_TILES = 4
# Decode splits of at most this many key tiles pipeline at most this many stages: 3 beat 4 at 128k
# keys (5386fb8, decode-merge).
ATTN_SHORT_SPLIT_TILES = 128
ATTN_SHORT_SPLIT_STAGES = 3
# Launch order of the causal attention kernels (forward, both backward passes): heads in groups,
# within a group the row (key) blocks major and the heads minor, so that the longest programs of
# the group's heads start first, in one wave; a group holds the fewest heads whose blocks fill
# this many waves (0: the grid's own order, the blocks of one head side by side, which non-causal
# grids keep: their programs are all alike and share the head's rows in L2) (O1-O3) ...
ATTN_ORDER_WAVES = 4
# ... where the grid fills fewer than this many waves (a longer grid's tail is short already and
# keeps its blocks side by side) (O2, O3).
ATTN_ORDER_MAX_WAVES = 16
# SM count assumed under the interpreter (no device to ask), so tests reach the split path.
ATTN_INTERPRET_SMS = 4
# Queries per head at or under which GQA heads are packed into one program's rows (not timed).
ATTN_PACK_MAX_SQ = 16
# Ring steps over documents (distributed.plan.pieces by rows): rows that see no key of a step, this
# many or more between two runs of rows that do, are left out of its pieces (a run a launch); fewer
# are walked inside one piece, not worth a launch: the forward's row tile (not timed).
ATTN_PLAN_MIN_GAP = ATTN_TILES[("fwd", 2, 128)][0]
# Fused merge: rows per program, head-dim columns per program, num_warps (not timed against others).
MERGE_TILE = (32, 128, 4)
MERGE_TILE_INTERPRET = (8, 16, 1)
# ... and when that tiling gives fewer programs than this per SM (decode's tens of rows), one
# program per row loads every part at once, if the parts x columns tile has at most this many
# elements (c2ca8a7, decode-merge)
MERGE_PARTS_PROGRAMS_PER_SM = 2
MERGE_PARTS_MAX_ELEMS = 8192
# ... holding the parts in a tile of next_pow2(N) rows, at least this many (masked parts merge as
# empty ones), so that a split-KV forward's few splits share one compiled kernel whatever their number.
MERGE_PARTS_MIN_BLOCK = 16
# On Hopper and later the merge kernel is launched with programmatic dependent launch: it may start
# while the kernel before it (the split-KV forward, say) finishes, and waits on the GPU for its
# results (griddepcontrol.wait) instead of the launch waiting on the stream (a43472e, decode-merge).
MERGE_PDL = True
# ... and the split-KV forward lets it start as soon as every split program is running
# (griddepcontrol.launch_dependents), not when the last one ends (f65ce63, decode-merge).
ATTN_SPLIT_TRIGGER = True
# Check each launch that `ops._triton.launch.Launcher` takes from its cache against the kernel Triton's
# own lookup picks (costs that lookup again; the GPU tests turn it on).
LAUNCH_VERIFY = False
# Launches bound to a geometry (`Launcher.bind`) go straight to the compiled kernel's C launcher with
# integer pointers and cached TMA descriptors; False: every launch takes `Launcher.__call__`'s path
# (the compiled kernel's Python launcher, which reads each tensor's pointer and encodes each
# descriptor again). Host time per call: docs/benchmarks/host.md.
LAUNCH_DIRECT = True
# ... each bound TMA descriptor keeps the encodings of at most this many base pointers
LAUNCH_DESCRIPTORS = 16

# ---- softmax: Triton softmax / log-softmax / logsumexp, forward and backward ----
from dataclasses import dataclass  # noqa: E402
from typing import Optional  # noqa: E402


@dataclass
class SoftmaxConfig:
    """Tiles and path thresholds of the softmax family; tests shrink them to reach every path.

    ``memo`` (not a field) is the host code's cache of plans and launch arguments per shape,
    emptied whenever a field is set (as ``monkeypatch.setattr`` does); a replaced config starts
    with its own.
    """

    one_pass_max_cols: int = 32768    # rows up to this length stay on chip: one read, one write (2N)
    one_pass_tile_elems: int = 4096   # short rows are batched until a tile holds this many elements
    loop_tile_bytes: int = 16384      # one tile of the looped passes (4096 fp32, 8192 bf16)
    elems_per_warp: int = 512         # one-pass tiles: num_warps = tile elements / this, in [1, max_warps]
    loop_elems_per_warp: int = 2048   # looped tiles likewise: 4 warps per 8192-wide bf16 tile beat 8 (604d71c)
    loop_stages: int = 3              # loop tiles in flight (tl.range num_stages)
    max_warps: int = 16
    split_rows_per_sm: float = 1.0    # long rows are split across programs when R < SMs * this
    split_programs_per_sm: int = 4    # programs the split path aims for, per SM
    split_min_tiles: int = 8          # each split program takes at least this many loop tiles
    split_max_chunks: int = 2048      # at most this many partial states per row
    coop_chunk_elems: int = 16384     # coop: a row too long for one program is held on chip by C sibling
    coop_elems_per_warp: int = 2048   # programs of a chunk each (2N traffic); num_warps = chunk / this
    coop_max_chunks: int = 64         # rows of more chunks than this (or than resident programs) take
                                      # the two-pass or split path
    coop_programs_per_sm: float = 1   # coop grid: this many programs per SM, all resident, each walking rows
    coop_min_elem_bytes: int = 2      # narrower inputs take coop only where the split path would run: 2-byte
                                      # rows beat the two-pass path on coop at any row count (df1b05d / d9f527d)
    coop_spin: int = 100000           # polls a coop program waits for its siblings' states before it
                                      # computes the row's state from the input itself
    sm_count: Optional[int] = None    # None: read off the device (INTERPRET_SMS on the CPU)

    def __setattr__(self, name: str, value) -> None:
        """Set a field and forget :attr:`memo`, what the host code worked out from the old values."""
        object.__setattr__(self, name, value)
        object.__setattr__(self, "memo", {})


SOFTMAX = SoftmaxConfig()
SOFTMAX_INTERPRET_SMS = 4


@dataclass(frozen=True)
class SoftmaxPlan:
    """How one launch covers ``(R, N)``: ``path`` in one_pass / coop / two_pass / split; a program
    covers ``block_r`` rows and ``chunk`` columns in ``[block_r, block_n]`` tiles; ``splits``
    programs per row (``splits * chunk >= N``, ``chunk % block_n == 0``); looped tiles are
    ``stages`` deep in flight; coop runs ``resident`` programs at once (its persistent grid)."""

    path: str
    block_r: int
    block_n: int
    splits: int
    chunk: int
    num_warps: int
    stages: int = 1
    resident: int = 0


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), for host code: ``triton.next_power_of_2``
    and ``triton.cdiv`` are constexpr functions, a few microseconds of host time per call."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code (see :func:`next_pow2`)."""
    return -(-a // b)


def _warps(tile_elems: int, per_warp: int, cfg: SoftmaxConfig) -> int:
    return max(1, min(cfg.max_warps, tile_elems // per_warp))


def softmax_is_split(rows: int, cols: int, sms: int, cfg: SoftmaxConfig) -> bool:
    """The split-row predicate: few rows, each long enough to feed several programs."""
    return cols > cfg.one_pass_max_cols and rows < sms * cfg.split_rows_per_sm


def _coop_plan(rows: int, cols: int, elem_bytes: int, sms: int, cfg: SoftmaxConfig) -> Optional[SoftmaxPlan]:
    """The coop plan of a row too long for one program, or None where coop does not apply: too
    many chunks for the resident programs, or a narrow input outside the split predicate."""
    if cols <= cfg.one_pass_max_cols:
        return None
    if elem_bytes < cfg.coop_min_elem_bytes and not softmax_is_split(rows, cols, sms, cfg):
        return None
    chunk = next_pow2(cfg.coop_chunk_elems)
    resident = int(sms * cfg.coop_programs_per_sm)
    splits = -(-cols // chunk)
    if splits > min(cfg.coop_max_chunks, resident):  # a row's siblings must all be resident
        return None
    return SoftmaxPlan("coop", 1, chunk, splits, chunk, _warps(chunk, cfg.coop_elems_per_warp, cfg), 1, resident)


def softmax_plan(rows: int, cols: int, elem_bytes: int, sms: int, cfg: SoftmaxConfig = SOFTMAX,
                 stats_only: bool = False) -> SoftmaxPlan:
    """The launch plan of a softmax-family op over ``(rows, cols)``; ``stats_only``: a pass that
    need not hold the row (logsumexp, row sums, normalising) keeps to loop-sized tiles."""
    loop_n = max(16, 1 << (max(1, cfg.loop_tile_bytes // elem_bytes).bit_length() - 1))
    if cols <= cfg.one_pass_max_cols and not (stats_only and cols > loop_n):
        block_n = max(16, next_pow2(cols))
        block_r = min(next_pow2(rows), max(1, cfg.one_pass_tile_elems // block_n))
        per_warp = cfg.loop_elems_per_warp if stats_only else cfg.elems_per_warp
        return SoftmaxPlan("one_pass", block_r, block_n, 1, block_n, _warps(block_r * block_n, per_warp, cfg))
    coop = None if stats_only else _coop_plan(rows, cols, elem_bytes, sms, cfg)
    if coop is not None:
        return coop
    loop_warps = _warps(loop_n, cfg.loop_elems_per_warp, cfg)
    stages = cfg.loop_stages if cols >= 2 * loop_n else 1
    if softmax_is_split(rows, cols, sms, cfg):
        tiles = -(-cols // loop_n)
        want = max(1, (sms * cfg.split_programs_per_sm) // max(rows, 1))
        splits = max(1, min(want, tiles // cfg.split_min_tiles, cfg.split_max_chunks))
        chunk = -(-tiles // splits) * loop_n
        splits = -(-cols // chunk)
        if splits > 1:
            return SoftmaxPlan("split", 1, loop_n, splits, chunk, loop_warps, stages)
    return SoftmaxPlan("two_pass", 1, loop_n, 1, -(-cols // loop_n) * loop_n, loop_warps, stages)


# --- cross-entropy --------------------------------------------------------------------------
# (BLOCK_V, num_warps, stages) of the forward and backward passes (stages: tiles in flight in the
# forward's loop, Triton's num_stages of the backward launch); small tiles under the interpreter.
# The fastest of the tiles timed (8529093, cross-entropy; C1).
CE_FWD_TILE = (8192, 8, 3)
CE_BWD_TILE = (4096, 16, 3)
CE_TILE_INTERPRET = (16, 1, 1)
# split a row over several programs while fewer than this many programs per SM would run
CE_PROGRAMS_PER_SM = 4
# SM count assumed under the interpreter, so small tests reach the split path
CE_INTERPRET_SMS = 4

# attention backward row statistics (attn_prep.py): elements of out/dout per program
ATTN_PREP_TILE_ELEMS = 4096

# --- vocabulary statistics: log-probabilities, entropy, KL (ops/vocab/kernel.py) ----------------
# (widest BLOCK_V, elements per tile, num_warps, stages): a tile is [BLOCK_R, BLOCK_V] with
# BLOCK_V = min(widest, next power of 2 >= V) and BLOCK_R rows filling the elements (short rows
# batch several per program). The forward reads (stages: tiles in flight in its loop), the
# backward reads and writes (stages: Triton's num_stages). Taken from the cross-entropy passes' tiles
# (the same access pattern: 8529093, cross-entropy), not timed on their own; the KL passes hold two
# input tiles.
VOCAB_FWD_TILE = (8192, 8192, 8, 3)
VOCAB_BWD_TILE = (4096, 4096, 16, 3)
VOCAB_KL_FWD_TILE = (4096, 4096, 8, 3)
VOCAB_KL_BWD_TILE = (2048, 2048, 8, 3)
VOCAB_TILE_INTERPRET = (16, 64, 1, 1)
# split a row over several programs (and batch fewer short rows per program) while fewer than
# this many programs per SM would run
VOCAB_PROGRAMS_PER_SM = 4
# a tile gets at most one warp per this many elements (small tiles of short rows: fewer warps)
VOCAB_ELEMS_PER_WARP = 256
# SM count assumed under the interpreter, so small tests reach the split path
VOCAB_INTERPRET_SMS = 4
# rows per program of the elementwise kernel turning merged records into statistics
VOCAB_FINISH_ROWS = 1024

# --- vocabulary sampling (sampling.py) ----------------------------------------------------------
# Records: the filtered draws keep per row the top SAMPLE_RECORDS_MIN (value, id) pairs, or the
# next power of two above top_k; a top_k needing more than SAMPLE_RECORDS_MAX takes its threshold
# from a full sort instead. The records pass ranks groups of SAMPLE_GROUP columns by their maxima
# and sorts only the best groups' columns.
SAMPLE_RECORDS_MIN = 64
SAMPLE_RECORDS_MAX = 256
SAMPLE_GROUP = 16
SAMPLE_GROUP_INTERPRET = 2
# at most this many partial records per row (splits * records) for the merge
SAMPLE_MERGE_MAX = 2048
# columns per tile of the mass and refinement passes and of the draw (8 warps each; the widest
# without spills on sm_90, ptxas counts: settings.md); programs per SM a row is spread over (a batch
# of one row then runs on every SM); the SM count assumed under the interpreter (not timed)
SAMPLE_TILE = 2048
SAMPLE_DRAW_TILE = 1024
SAMPLE_TILE_INTERPRET = 16
SAMPLE_PROGRAMS_PER_SM = 4
SAMPLE_INTERPRET_SMS = 4
# Top-p without a small top-k: a first histogram of d = log2(p / p_max) over SAMPLE_BINS bins
# (the last one holds d <= -SAMPLE_BIN_SPAN) brackets the crossing of top_p * Z; a bracket of at
# most SAMPLE_CAP tokens is listed by the sampling pass, a larger one refined by histograms of its
# order keys (sample_refine_rounds: enough for a 2^31-key bracket to narrow to one key).
SAMPLE_BINS = 2048
SAMPLE_BIN_SPAN = 16.0
SAMPLE_CAP = 4096
# Top-p's mass "reaches" top_p when it comes within this relative margin of it: the masses carry the
# float32 rounding of the scaled logits (about 1e-7 per unit of |logit / T| in log2), so a mass that
# is top_p in exact arithmetic (probabilities 0.5, 0.3, 0.2 and top_p = 0.8) counts as reaching it.
SAMPLE_TOP_P_REACH = 2.0 ** -16


def sample_refine_rounds(bins: int) -> int:
    return -(-31 // max(1, bins.bit_length() - 1)) + 1
