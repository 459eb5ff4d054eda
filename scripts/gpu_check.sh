#!/usr/bin/env bash
# One GPU call that checks everything a single GPU can: the gpu test lane, `verify` on the GPU in
# two dtypes, the sharded ops on CUDA tensors through MPI (2 ranks sharing the GPU; the MPI
# communicator stages through the host), then the benchmarks named in $BENCHES.
# Usage (repository root, CUDA machine):
#   OUT=dir BENCHES="softmax attention" BENCH_ARGS_softmax=--no-sweep scripts/gpu_check.sh
set -uo pipefail
out="${OUT:-bench_out}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-}:$(pwd)" PYTHONUNBUFFERED=1
summary=()
step() {  # step NAME SECONDS CMD...: run with a limit, log to $out/NAME.log, remember the verdict
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-22s rc=%-4s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$out/$name.log" | cut -c1-90)")")
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt"
python3 -m splitsoftmax env >> "$out/gpu.txt" 2>&1
if [ -n "${CHECKS:-1}" ]; then
    step gpu_tests 260 python3 -m pytest -q -m gpu tests -p no:cacheprovider
    step verify_fp32 60 python3 -m splitsoftmax verify
    step verify_bf16 60 python3 -m splitsoftmax verify --dtype bfloat16
    if command -v mpirun > /dev/null; then
        step verify_mpi2_cuda 120 mpirun --allow-run-as-root --oversubscribe -n 2 \
            python3 -m splitsoftmax verify --device cuda
    else
        summary+=("verify_mpi2_cuda       skipped: no mpirun on this machine")
    fi
fi
for b in ${BENCHES:-}; do  # extra arguments of bench NAME in $BENCH_ARGS_NAME
    args_var="BENCH_ARGS_$b"
    step "bench_$b" "${BENCH_LIMIT:-200}" python3 -m splitsoftmax bench "$b" --out "$out" ${!args_var:-}
done
cat "$out/gpu.txt"
printf '%s\n' "${summary[@]}"
