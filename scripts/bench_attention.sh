#!/usr/bin/env bash
# GPU lane of the attention kernels, then their benchmark (SDPA flash / cuDNN / Flex beside
# splitsoftmax in the same run). Extra arguments go to the benchmark (e.g. --sweep, --seqs 8192).
# Usage: scripts/bench_attention.sh [OUT_DIR] [bench args...]   (repository root, CUDA machine)
set -uo pipefail
out="${1:-${OUT:-bench_out}}"
shift || true
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-}:$(pwd)" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu_attention.txt"
python3 -m pytest -q -x -m gpu tests/test_gpu_attention.py -p no:cacheprovider 2>&1 | tee "$out/gpu_tests_attention.log"
python3 -m splitsoftmax bench attention --out "$out" "$@" 2>&1 | tee "$out/bench_attention.log"
