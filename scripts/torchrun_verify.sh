#!/usr/bin/env bash
# One node: every sharded op on NPROC ranks (NCCL with a GPU per rank, else Gloo on CPU processes),
# forward and backward against the single-device result; non-zero exit on any mismatch.
#   NPROC=4 scripts/torchrun_verify.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TORCHRUN=${TORCHRUN:-$( [ -x .venv/bin/torchrun ] && echo .venv/bin/torchrun || echo torchrun )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SPLITSOFTMAX_TIMEOUT=${SPLITSOFTMAX_TIMEOUT:-120}
exec "$TORCHRUN" --standalone --nproc-per-node="${NPROC:-2}" -m splitsoftmax verify "$@"
