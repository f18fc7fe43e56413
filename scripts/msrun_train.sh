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
#   FAILURE_TIMEOUT  seconds a worker may stay silent (killed, crashed, frozen) before the job ends
#                 (default: MS_NODE_TIMEOUT if set, else 30); passed to MindSpore as MS_NODE_TIMEOUT
#   BIND_CORE     True: msrun --bind_core=True (default: context.bind_core of a `mindvl train` command's
#                 --config and --set)
# Every argument after WORKERS is passed through unchanged ("$@"). The workers inherit PATH with the
# active venv's bin first, so `mindvl` and `python` resolve to the same environment as this shell.
#
# A worker that dies ends the job: msrun kills the other local workers at once, the scheduler declares the
# dead worker lost after FAILURE_TIMEOUT and exits, and this script exits 1, FAILURE_TIMEOUT to
# FAILURE_TIMEOUT + 6 s after the death (workers on other nodes block in their collective until the
# scheduler's verdict, which ends them).
# SIGTERM, SIGINT or SIGHUP to this script ends msrun, its workers, log tails and scheduler, and exits
# 128 + the signal; if msrun itself is killed, its workers and scheduler die with it (parallel/runtime.py).
# Checkpoints are atomic: rerun the same command with `--resume OUT` (README, "Data parallel and worker
# failures").
set -euo pipefail
if [[ $# -lt 2 ]]; then
  sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
WORKERS=$1; shift
NODES=${NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
LOG_DIR=${LOG_DIR:-msrun_log}
CLUSTER_TIMEOUT=${CLUSTER_TIMEOUT:-600}
export MS_NODE_TIMEOUT=${FAILURE_TIMEOUT:-${MS_NODE_TIMEOUT:-30}}
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
  # msrun's --bind_core applies to the workers it spawns: read context.bind_core before they start
  if [[ -z "${BIND_CORE:-}" ]]; then
    BIND_CORE=$(python -c 'import sys; from mindvl_ms.config.train import msrun_bind_core
sys.exit(msrun_bind_core(sys.argv[1:]))' "$@") || exit 2
  fi
fi
BIND=()
if [[ "${BIND_CORE:-False}" == "True" ]]; then
  BIND=(--bind_core=True)
fi
# msrun runs as a child of this script, in a process group of its own (setsid) with its scheduler and its
# log tails; its workers, each in a session of its own, get its pid as MINDVL_LAUNCHER_PID and ask Linux to
# kill them when that process goes (parallel/runtime.py). A signal to this script goes to msrun as SIGINT,
# whose handler kills the workers' process groups, the tails and the scheduler, then exits 0 (so the status
# here is 128 + the signal); msrun ignores SIGINT until it has spawned every worker: after 10 s it gets
# SIGKILL. Whatever is left of msrun's group when it has gone (the tails of a killed msrun) is killed.
( export MINDVL_LAUNCHER_PID=$BASHPID
  exec setsid msrun --worker_num="$WORKERS" --local_worker_num="$LOCAL" --master_addr="$MASTER_ADDR" \
    --master_port="$MASTER_PORT" --node_rank="$NODE_RANK" --log_dir="$LOG_DIR" --join=True \
    --cluster_time_out="$CLUSTER_TIMEOUT" ${BIND[@]+"${BIND[@]}"} "$CMD" "$@" ) &
MSRUN=$!
end_group() { kill -KILL -- "-$MSRUN" 2>/dev/null || true; }
stop() {
  trap '' TERM INT HUP
  kill -INT "$MSRUN" 2>/dev/null || true
  for _ in $(seq 20); do kill -0 "$MSRUN" 2>/dev/null || break; sleep 0.5; done
  end_group
  wait "$MSRUN" 2>/dev/null || true
  exit $(( 128 + $1 ))
}
trap 'stop 15' TERM
trap 'stop 2' INT
trap 'stop 1' HUP
status=0
wait "$MSRUN" || status=$?
end_group
exit "$status"
