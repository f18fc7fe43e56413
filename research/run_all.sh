#!/usr/bin/env bash
# Regenerate every research/ table on CPU: results.json, results.md (headed by the commit it was made at) and
# the PNG next to each run.py. Bulky outputs go to $RESEARCH_OUT (default /tmp/mindvl_research). Runs are
# cached by the code's source hash and the resolved config (research/common.py), so the base (the demo at
# seed 0) is trained once and shared, and a changed code or config retrains.
#   bash research/run_all.sh                 # all seven, 3 seeds per arm: budget 90 min on 2 cores (README.md)
#   bash research/run_all.sh packing         # only some of them
#   SMOKE=1 bash research/run_all.sh         # every experiment's --smoke (one seed, a few steps; results
#                                            # under $RESEARCH_OUT/smoke, nothing committed is touched)
# How the 2 cores are shared: the torch references (f) and (g) (one process on one thread each) run one after
# the other in the background, beside the demo-based experiments (a), (b), (c), (e), whose demo runs go
# RESEARCH_JOBS (default 2) at a time, all of them first in one pool (research/prefetch.py); packing (d)
# measures throughput, so it runs last, alone.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
# The interpreter's bin first on PATH: packing's dp=2 arm starts `msrun` and `mindvl` by name
# (scripts/msrun_train.sh), which must come from the same environment as $PY, activated or not.
if py_path=$(command -v "$PY"); then
  PATH="$(cd "$(dirname "$py_path")" && pwd):$PATH"
  export PATH
fi
OUT=${RESEARCH_OUT:-/tmp/mindvl_research}
ALL="merge_vs_sft resolution_search balanced_loss grounding_share packing easy_vqa_reference shape_views"
EXPS=${*:-$ALL}
BACKGROUND="easy_vqa_reference shape_views"   # torch on one thread: beside the demo runs
ALONE="packing"                               # timed: after everything else
FLAGS=()
[[ -n "${SMOKE:-}" ]] && FLAGS=(--smoke)
for e in $EXPS; do
  [[ " $ALL " == *" $e "* ]] || { echo "unknown experiment '$e' (one of: $ALL)" >&2; exit 2; }
done
pick() {  # the experiments of EXPS in group $1 (bg, fg or alone), in the order given
  for e in $EXPS; do
    case " $BACKGROUND " in *" $e "*) g=bg ;; *) case " $ALONE " in *" $e "*) g=alone ;; *) g=fg ;; esac ;; esac
    [[ $g == "$1" ]] && echo "$e"
  done
}
one() {  # run experiment $1; print its start, end and the first line of the results.md it wrote
  local e=$1 s md
  s=$(date +%s)
  echo "=== $e at commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- mindvl_ms configs scripts research/*.py research/*/*.py research/*.yaml || echo -dirty), $(date -u +%H:%M:%S) UTC"
  if "$PY" "research/$e/run.py" "${FLAGS[@]}"; then
    md="research/$e/results.md"
    [[ -n "${SMOKE:-}" ]] && md="$OUT/smoke/$e/results.md"
    echo "=== $e done in $(( $(date +%s) - s ))s: $(head -1 "$md")"
  else
    echo "=== $e FAILED after $(( $(date +%s) - s ))s"; return 1
  fi
}
t0=$(date +%s)
status=0
mkdir -p "$OUT/logs"
bg_log="$OUT/logs/run_all_background.log"
bg_pid=
if [[ -n "$(pick bg)" ]]; then
  ( st=0; for e in $(pick bg); do one "$e" || st=1; done; exit $st ) > "$bg_log" 2>&1 &
  bg_pid=$!
  echo "=== in the background: $(pick bg | tr '\n' ' ')(output: $bg_log)"
fi
if [[ -n "$(pick fg)" ]]; then  # their demo runs, in one pool across the experiments (research/prefetch.py)
  s=$(date +%s)
  echo "=== prefetch of the demo runs of: $(pick fg | tr '\n' ' ')$(date -u +%H:%M:%S) UTC"
  "$PY" research/prefetch.py "${FLAGS[@]}" $(pick fg) || status=1
  echo "=== prefetch done in $(( $(date +%s) - s ))s"
fi
for e in $(pick fg); do one "$e" || status=1; done
if [[ -n "$bg_pid" ]]; then
  wait "$bg_pid" || status=1
  echo "=== background output:"; cat "$bg_log"
fi
for e in $(pick alone); do one "$e" || status=1; done
echo "=== total $(( $(date +%s) - t0 ))s for: $EXPS"
exit $status
