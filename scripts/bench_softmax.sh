#!/usr/bin/env bash
# GPU lane of the softmax family, then its benchmark (torch beside splitsoftmax in the same run).
# Usage: scripts/bench_softmax.sh [OUT_DIR]   (run from the repository root on a CUDA machine)
set -euo pipefail
out="${1:-${OUT:-bench_out}}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-}:$(pwd)" PYTHONUNBUFFERED=1
python3 -m pytest -q -m gpu tests/test_gpu_softmax.py -p no:cacheprovider 2>&1 | tee "$out/gpu_tests_softmax.log" || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -m splitsoftmax bench softmax --out "$out" --variants 2>&1 | tee "$out/bench_softmax.log"
