#!/usr/bin/env bash
# Regenerate every research/ table, one experiment at a time, on CPU: results.json, results.md (headed by the
# commit it was made at) and the PNG next to each run.py. Bulky outputs go to $RESEARCH_OUT (default
# /tmp/mindvl_research). Runs are cached by the code's source hash and the resolved config
# (research/common.py), so the base (the demo at seed 0) is trained once and shared, and a changed code or
# config retrains.
#   bash research/run_all.sh                 # all seven, 3 seeds per arm: budget 90 min on 2 cores (README.md)
#   bash research/run_all.sh packing         # only some of them
#   SMOKE=1 bash research/run_all.sh         # every experiment's --smoke (one seed, a few steps; results
#                                            # under $RESEARCH_OUT/smoke, nothing committed is touched)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
EXPS=${*:-merge_vs_sft resolution_search balanced_loss grounding_share packing easy_vqa_reference shape_views}
FLAGS=()
[[ -n "${SMOKE:-}" ]] && FLAGS=(--smoke)
t0=$(date +%s)
status=0
for e in $EXPS; do
  s=$(date +%s)
  echo "=== $e at commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- mindvl_ms configs scripts research/*.py research/*/*.py research/*.yaml || echo -dirty), $(date -u +%H:%M:%S) UTC"
  if "$PY" "research/$e/run.py" "${FLAGS[@]}"; then
    md="research/$e/results.md"
    [[ -n "${SMOKE:-}" ]] && md="${RESEARCH_OUT:-/tmp/mindvl_research}/smoke/$e/results.md"
    echo "=== $e done in $(( $(date +%s) - s ))s: $(head -1 "$md")"
  else
    echo "=== $e FAILED after $(( $(date +%s) - s ))s"; status=1
  fi
done
echo "=== total $(( $(date +%s) - t0 ))s for: $EXPS"
exit $status
