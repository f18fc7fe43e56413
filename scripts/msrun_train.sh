#!/usr/bin/env bash
# Launch data-parallel training workers with msrun (MindSpore's launcher; mccl on CPU, hccl on Ascend).
#
#   scripts/msrun_train.sh WORKERS COMMAND [ARGS...]
#   scripts/msrun_train.sh 2 mindvl train --config run.yaml --out runs/dp2
#
# Environment (all optional):
#   MASTER_PORT   scheduler port (default: a free port picked here)
#   MASTER_ADDR   scheduler address (default 127.0.0.1; set it on multi-node runs)
#   NODES         number of nodes (default 1); WORKERS is the total, WORKERS/NODES run on this node
#   NODE_RANK     this node's rank (default 0)
#   LOG_DIR       worker logs (default: msrun_log); worker_<rank>.log per rank
#   CLUSTER_TIMEOUT  seconds to wait for all workers to join the cluster (default 600)
# Every argument after WORKERS is passed through unchanged ("$@"). The workers inherit PATH with the
# active venv's bin first, so `mindvl` and `python` resolve to the same environment as this shell.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
WORKERS=$1; shift
NODES=${NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
LOG_DIR=${LOG_DIR:-msrun_log}
CLUSTER_TIMEOUT=${CLUSTER_TIMEOUT:-600}
HERE=$(cd "$(dirname "$0")/.." && pwd)
if [[ -n "${VIRTUAL_ENV:-}" ]]; then
  export PATH="$VIRTUAL_ENV/bin:$PATH"
elif [[ -x "$HERE/.venv/bin/python" ]]; then
  export PATH="$HERE/.venv/bin:$PATH"
fi
if [[ -z "${MASTER_PORT:-}" ]]; then
  MASTER_PORT=$(python -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1]); s.close()')
fi
LOCAL=$(( WORKERS / NODES ))
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
# msrun launches a python script: the `mindvl` console command goes through scripts/mindvl_worker.py.
CMD=$1; shift
if [[ "$CMD" == "mindvl" ]]; then
  CMD="$HERE/scripts/mindvl_worker.py"
fi
exec msrun --worker_num="$WORKERS" --local_worker_num="$LOCAL" --master_addr="$MASTER_ADDR" \
  --master_port="$MASTER_PORT" --node_rank="$NODE_RANK" --log_dir="$LOG_DIR" --join=True \
  --cluster_time_out="$CLUSTER_TIMEOUT" "$CMD" "$@"
