#!/usr/bin/env bash
# Two nodes. Run on every node with the same RDZV_ENDPOINT (host:port of one of them) and its own
# NODE_RANK; with LOCAL=1 both agents start here and rendezvous on 127.0.0.1 (a two-node test on
# one machine).
#   node0$ RDZV_ENDPOINT=node0:29500 NODE_RANK=0 NPROC=8 scripts/torchrun_two_nodes.sh
#   node1$ RDZV_ENDPOINT=node0:29500 NODE_RANK=1 NPROC=8 scripts/torchrun_two_nodes.sh
#   LOCAL=1 NPROC=2 scripts/torchrun_two_nodes.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TORCHRUN=${TORCHRUN:-$( [ -x .venv/bin/torchrun ] && echo .venv/bin/torchrun || echo torchrun )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SPLITSOFTMAX_TIMEOUT=${SPLITSOFTMAX_TIMEOUT:-300}
agent() {
  "$TORCHRUN" --nnodes=2 --nproc-per-node="${NPROC:-2}" --node-rank="$1" --rdzv-backend=c10d \
    --rdzv-id="${RDZV_ID:-splitsoftmax}" --rdzv-endpoint="$2" --max-restarts=0 -m splitsoftmax verify
}
if [ "${LOCAL:-0}" = 1 ]; then
  endpoint="127.0.0.1:${PORT:-29531}"
  agent 1 "$endpoint" & other=$!
  trap 'kill "$other" 2>/dev/null || true' EXIT
  agent 0 "$endpoint"
  wait "$other"
else
  agent "${NODE_RANK:?set NODE_RANK}" "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port}"
fi
