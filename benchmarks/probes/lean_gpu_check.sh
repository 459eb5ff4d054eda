#!/usr/bin/env bash
# The GPU checks of the bound launch path (Launcher.bind, docs/ARCHITECTURE.md "Host time per call"),
# by section, each under a timeout (180 + 120 + 60 + 120 + 60 s: all five fit in one 9-minute call):
#
#   tests      the GPU tests that launch through the bound path (conftest sets configs.LAUNCH_VERIFY:
#              every bound launch is checked against Triton's own lookup), and the CPU launch tests
#   bench      python -m splitsoftmax bench host (bound, unbound and the peer in one run; targets)
#   engine     benchmarks/probes/host_engine_choice.py (engine threads off, run_backward)
#   cpp        benchmarks/probes/host_cpp.py (Python, Python around C++, a C++ autograd Function)
#   attention  python -m splitsoftmax bench attention, a short prefill/decode subset (nothing slower)
#
# From the repository root:
#   PYTHON=python3 OUT=$OUT bash benchmarks/probes/lean_gpu_check.sh tests bench
# Writes each section's log and results under $OUT and prints $OUT/summary.txt last.
set -u
PYTHON=${PYTHON:-python3}
OUT=${OUT:-lean_gpu_out}
export PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
[ $# -gt 0 ] || set -- tests bench engine cpp attention

run() {  # run SECTION SECONDS COMMAND...: the command's output to $OUT/SECTION.log, its status to the summary
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local verdict=ok
  [ $rc -eq 0 ] || verdict="FAILED rc=$rc"
  [ $rc -eq 124 ] && verdict="TIMED OUT after ${limit}s"
  echo "== $name: $verdict ($((SECONDS - t0)) s)" >> "$SUMMARY"
}

for section in "$@"; do
  case $section in
    tests)
      run tests 180 "$PYTHON" -m pytest -x -q -p no:cacheprovider --each-value \
        tests/test_launch_direct.py tests/test_launch_cache.py tests/test_gpu_host.py tests/test_gpu_softmax.py \
        tests/test_gpu_attention.py tests/test_gpu_attention_fwd_gluon.py tests/test_gpu_attention_bwd.py \
        tests/test_gpu_dsinks.py
      tail -n 3 "$OUT/tests.log" >> "$SUMMARY" ;;
    bench)
      run bench 120 "$PYTHON" -m splitsoftmax bench host --out "$OUT/bench"
      grep -A 20 "^case" "$OUT/bench.log" >> "$SUMMARY" ;;
    engine)
      run engine 60 "$PYTHON" benchmarks/probes/host_engine_choice.py "$OUT/engine"
      grep -A 5 "^shape" "$OUT/engine.log" >> "$SUMMARY" ;;
    cpp)
      run cpp 120 "$PYTHON" benchmarks/probes/host_cpp.py "$OUT/cpp"
      grep -E "^way|^(python|C\+\+)|build failed" "$OUT/cpp.log" >> "$SUMMARY" ;;
    attention)
      run attention 60 "$PYTHON" -m splitsoftmax bench attention --out "$OUT/attention" --seqs 1024 4096 \
        --decode-keys 131072 --no-flex --no-variants --no-gqa
      tail -n 25 "$OUT/attention.log" >> "$SUMMARY" ;;
    *)
      echo "== $section: unknown section (tests bench engine cpp attention)" >> "$SUMMARY" ;;
  esac
done
cat "$SUMMARY"
