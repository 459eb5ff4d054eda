#!/usr/bin/env bash
# Every sharded op over mpi4py (group = MPI.COMM_WORLD, CPU tensors; CUDA staged through the host),
# forward and backward against the single-device result.
#   NPROC=3 scripts/mpirun_verify.sh            (as root, --allow-run-as-root is added)
#   HOSTS=node0:4,node1:4 NPROC=8 scripts/mpirun_verify.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MPIRUN=${MPIRUN:-$( [ -x .venv/bin/mpirun ] && echo .venv/bin/mpirun || echo mpirun )}
PY=${PY:-$( [ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python3 )}
args=(-n "${NPROC:-2}" --oversubscribe -x PYTHONPATH="$PWD" -x SPLITSOFTMAX_TIMEOUT="${SPLITSOFTMAX_TIMEOUT:-120}")
[ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)
[ -n "${HOSTS:-}" ] && args+=(--host "$HOSTS")
exec "$MPIRUN" "${args[@]}" "$PY" -m splitsoftmax verify "$@"
