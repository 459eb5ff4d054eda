"""Sizes of the Triton sampling passes (the torch path's are in ``configs``).

Every streaming pass (records, pivots, draw) reads tiles of ``TILE`` columns with 8 warps, keeps
per-column-position state in registers (no reduction across the program inside the loop) and
keeps ``STAGES - 1`` tiles in flight through shared memory; a row is spread over about
``PROGRAMS_PER_SM`` programs per SM in all.
"""
from __future__ import annotations

from .._triton.configs import TRITON_VERSION

TILE = 1024              # columns per tile of the streaming passes (8 warps: 4 columns a thread)
TILE_EXACT = 64          # the exact pivot rounds (int64 masses and counts at every pivot; rare)
WARPS = 8
STAGES = 4
PROGRAMS_PER_SM = 2
MERGE_MAX = 2048         # partial records per row: splits * records
FEW_ROWS = 32            # a records pass over at most this many rows takes FEW_ROWS_TILE columns a
FEW_ROWS_TILE = 256      # tile and FEW_ROWS_MERGE partial records per row: at batch 1 the span's
FEW_ROWS_MERGE = 1024    # selection and the row's merge, not the read, are the pass's time
NUCLEUS_MISS = 1e-5      # top-p alone: candidates per row so that none is kept with at most this
                         # probability (``sampling_device.nucleus_candidates``)
NUCLEUS_TILE = 512       # columns per tile of the candidates' mass pass
# ... in flight through shared memory, by the Triton version: sm_90 ptxas spills 12 bytes of the
# pass at STAGES on Triton 3.7, none at 2
NUCLEUS_STAGES = 2 if TRITON_VERSION == (3, 7) else STAGES
NUCLEUS_SLACK = 1.0      # factor on that pass's float32 error bound (``sampling_device.nucleus_slack``)
SLOTS = 1024             # bracket tokens a row's list can hold (the draw's finisher sorts them: 80
                         # registers at 8 warps)
CAP = 1024               # bracket tokens listed per row (at most SLOTS; a kernel argument)
PIVOT_ROUNDS = 2         # approximate pivot rounds before the draw (one device; after the first, a
                         # row's last program takes the others alone over the whole row)
EXACT_ROUNDS = 16        # exact pivot rounds at most (they narrow a 2^32-key range 17-fold each)
# relative error allowed to the float32 masses of the approximate rounds (sums of about
# V / TILE + 64 terms each), and the first round's pivots around the threshold guessed from the
# mean and deviation of d under p: SPREAD * 2^(GROWTH j) deviations on either side, j < 8
SLACK = 5e-5
SPREAD = 0.01
GROWTH = 1.14
# under the interpreter
TILE_INTERPRET = 16
INTERPRET_SMS = 4
