#!/usr/bin/env bash
# Sharded attention across the GPUs of one node: `verify` on them first, then `bench ring`
# (splitsoftmax ring/allgather vs torch context parallel and one GPU, in the same run).
# Usage: scripts/bench_ring.sh [NPROC] [OUT_DIR] [bench args...]   (repository root, CUDA machine)
#   e.g. scripts/bench_ring.sh 2 bench_out --seqs 32768,131072
# Stage limits (seconds) from VERIFY_LIMIT / BENCH_LIMIT; each stage's log is kept under OUT_DIR.
set -uo pipefail
nproc="${1:-2}"
out="${2:-${OUT:-bench_out}}"
shift 2 || shift $#
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-}:$(pwd)" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu_ring.txt"
nvidia-smi topo -m >> "$out/gpu_ring.txt" 2>&1 || true
python3 -m splitsoftmax env 2>&1 | tee "$out/env_ring.txt"
timeout "${VERIFY_LIMIT:-150}" python3 -m splitsoftmax verify --nproc "$nproc" 2>&1 \
    | tee "$out/verify_ring.log"
echo "verify exit: ${PIPESTATUS[0]}" | tee -a "$out/verify_ring.log"
timeout "${BENCH_LIMIT:-480}" python3 -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
    -m splitsoftmax bench ring --out "$out" "$@" 2>&1 | tee "$out/bench_ring.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$out/bench_ring.log"
