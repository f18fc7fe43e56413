#!/usr/bin/env bash
# Compile-only dry run of a parallel layout on one machine with CANN (MindSpore's DryRun, as MindFormers
# uses it): every chosen rank runs `mindvl train` alone with MS_SIMULATION_LEVEL=1, RANK_SIZE = the layout's
# device count and RANK_ID = that rank. MindSpore mocks the device and the collectives, builds and compiles
# the rank's semi-auto-parallel graph and logs its memory ("Actual peak memory usage"), so strategy,
# pipeline and memory errors show up without the cluster. By default one rank per pipeline stage (the
# first rank of each stage: its devices hold the same shapes) is simulated.
#
#   scripts/dryrun.sh RUN.yaml [mindvl train arguments ...]
#   scripts/dryrun.sh configs/run/mindvl-671b-512npu.yaml --set "data.sources=[{path: train.jsonl}]" \
#       --set stages.0.max_steps=1
#   scripts/dryrun.sh --list RUN.yaml [...]     # print the commands only
#
# Environment (optional): RANKS ("0 64" overrides the ranks), LOG_DIR (default dryrun_log; one
# rank_<r>.log each), MS_SIMULATION_LEVEL (default 1; 0 compiles only, 2 adds operator workspaces).
# Every argument after RUN.yaml is passed to `mindvl train` unchanged ("$@").
#
# This cannot run in this repository's CI: DryRun needs an Ascend software stack (CANN) on the host, and
# the CI machine has only the CPU build of MindSpore. Compare the logged peaks with `mindvl plan`.
set -euo pipefail
LIST=0
if [[ "${1:-}" == "--list" ]]; then LIST=1; shift; fi
if [[ $# -lt 1 ]]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 2
fi
CONFIG=$1; shift
HERE=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
# world size and the first rank of every pipeline stage, from the run config's parallel_config
read -r WORLD STAGE_RANKS <<<"$(python - "$CONFIG" <<'PY'
import sys
from mindvl_ms.config.train import load_run_config
from mindvl_ms.parallel.layout import Layout
lay = Layout.from_run_config(load_run_config(sys.argv[1]))
print(lay.world, " ".join(str(lay.rank_of(pp=s)) for s in range(lay.pp)))
PY
)"
RANKS=${RANKS:-$STAGE_RANKS}
LOG_DIR=${LOG_DIR:-dryrun_log}
LEVEL=${MS_SIMULATION_LEVEL:-1}
status=0
for r in $RANKS; do
  if [[ $LIST == 1 ]]; then
    printf 'MS_SIMULATION_LEVEL=%s RANK_SIZE=%s RANK_ID=%s mindvl train --config %s' "$LEVEL" "$WORLD" "$r" "$CONFIG"
    [[ $# -gt 0 ]] && printf ' %q' "$@"
    printf '\n'
    continue
  fi
  mkdir -p "$LOG_DIR"
  echo "rank $r of $WORLD: $LOG_DIR/rank_$r.log"
  if MS_SIMULATION_LEVEL=$LEVEL RANK_SIZE=$WORLD RANK_ID=$r GLOG_v=${GLOG_v:-1} \
      python -m mindvl_ms train --config "$CONFIG" --out "$LOG_DIR/run_$r" --no-progress "$@" \
      >"$LOG_DIR/rank_$r.log" 2>&1; then
    grep -h "peak memory usage" "$LOG_DIR/rank_$r.log" | tail -2 || true
  else
    echo "rank $r failed; see $LOG_DIR/rank_$r.log" >&2
    status=1
  fi
done
exit $status
