#!/usr/bin/env bash
# Rerun every research/ experiment, one at a time, on CPU. Bulky outputs go to $RESEARCH_OUT
# (default /tmp/mindvl_research); each experiment writes results.json, results.md and its PNG next to
# its run.py. Runs shared between experiments (the seed-0 demo run) are trained once and reused.
#   bash research/run_all.sh            # all six, ~50 min on an idle 2-core machine (see README.md)
#   bash research/run_all.sh packing    # only some of them
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
EXPS=${*:-merge_vs_sft resolution_search balanced_loss grounding_share packing easy_vqa_reference}
t0=$(date +%s)
status=0
for e in $EXPS; do
  s=$(date +%s)
  echo "=== $e (commit $(git rev-parse --short HEAD), $(date -u +%H:%M:%S) UTC)"
  if "$PY" "research/$e/run.py"; then
    echo "=== $e done in $(( $(date +%s) - s ))s"
  else
    echo "=== $e FAILED after $(( $(date +%s) - s ))s"; status=1
  fi
done
echo "=== total $(( $(date +%s) - t0 ))s for: $EXPS"
exit $status
