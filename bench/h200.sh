#!/usr/bin/env bash
# The single-GPU benchmarks of BENCHMARKS.md, in two parts that each fit a 10-minute window:
#   bench/h200.sh OUT a   generation, adaptive TP (one-GPU parts), planner accuracy
#   bench/h200.sh OUT b   one GRPO iteration against TRL (TRL and its needs installed from .whl/)
# Each script's JSON and log land flat in OUT.
set -u
OUT=${1:?usage: bench/h200.sh OUT a|b}
PART=${2:?usage: bench/h200.sh OUT a|b}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
WORK=$(mktemp -d)
run() {  # name, time limit, files to keep (comma-separated), command...
  local name=$1 limit=$2 keep=$3; shift 3
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" --out "$WORK/$name" > "$OUT/$name.log" 2>&1
  echo "$name exit $?"
  for f in ${keep//,/ }; do cp "$WORK/$name/$f" "$OUT/" 2>/dev/null; done  # few files come back
  tail -25 "$OUT/$name.log"
}
case $PART in
  a)
    run generation 260 generation.json python3 bench/generation.py --steps 24 --hf-steps 16
    run adaptive 120 adaptive_tp.json,adaptive_trace_simulated.png python3 bench/adaptive_tp.py
    run planner_accuracy 90 planner_accuracy.json python3 bench/planner_accuracy.py
    ;;
  b)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site
    run iteration 480 iteration.json python3 bench/iteration.py --iterations 3 --trl-steps 3
    ;;
esac
