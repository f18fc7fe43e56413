#!/usr/bin/env bash
# Run every stage of a run YAML (warm-up -> multitask -> SFT), resuming automatically after a failure.
#
#   scripts/run_stages.sh CONFIG OUT_DIR [--workers N] [--retries R] [-- extra `mindvl train` args]
#   scripts/run_stages.sh configs/stage/tiny-cpu.yaml runs/tiny --workers 2 -- --set "data.sources=[{path: t.jsonl}]"
#
# Each attempt after the first passes `--resume OUT_DIR`, so training continues from OUT_DIR/latest.json
# (the newest complete checkpoint). Exit code 1 from the trainer (stopped on non-finite steps) is not
# retried; other failures are retried up to R times (default 2). With --workers N > 1 the workers are
# started by scripts/msrun_train.sh.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
CONFIG=$1; OUT=$2; shift 2
WORKERS=1; RETRIES=2; EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workers) WORKERS=$2; shift 2 ;;
    --retries) RETRIES=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown option $1 (extra trainer arguments go after --)" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")/.." && pwd)
[[ -x "$HERE/.venv/bin/python" ]] && export PATH="$HERE/.venv/bin:$PATH"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
run() {
  if [[ "$WORKERS" -gt 1 ]]; then
    LOG_DIR="$OUT/msrun_log" "$HERE/scripts/msrun_train.sh" "$WORKERS" mindvl train --config "$CONFIG" --out "$OUT" \
      --no-progress "$@" "${EXTRA[@]}"
  else
    python -m mindvl_ms train --config "$CONFIG" --out "$OUT" "$@" "${EXTRA[@]}"
  fi
}
attempt=0
RESUME=()
while true; do
  set +e; run "${RESUME[@]}"; rc=$?; set -e
  if [[ $rc -eq 0 ]]; then echo "all stages done: $OUT (summary.json, metrics.jsonl)"; exit 0; fi
  if [[ $rc -eq 1 || $rc -eq 2 ]]; then echo "training stopped (exit $rc), not retrying; see the message above" >&2; exit $rc; fi
  attempt=$((attempt + 1))
  if [[ $attempt -gt $RETRIES ]]; then echo "failed $attempt times, giving up" >&2; exit $rc; fi
  if [[ -f "$OUT/latest.json" ]]; then RESUME=(--resume "$OUT"); fi
  echo "attempt $attempt failed (exit $rc); retrying ${RESUME[*]:-from scratch}" >&2
done
