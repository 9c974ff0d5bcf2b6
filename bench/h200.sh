#!/usr/bin/env bash
# The single-GPU benchmarks of BENCHMARKS.md, in three parts that each fit a 10-minute window:
#   bench/h200.sh OUT a   generation, training log-probabilities (fused kernels), and the GRPO
#                         training call of part b alone with its kernel profile
#   bench/h200.sh OUT b   one GRPO iteration against TRL, and where a decode step's time goes
#   bench/h200.sh OUT c   adaptive TP (one-GPU parts), planner accuracy, the training step, and
#                         where a decode step of the GRPO iteration's shape goes
# TRL and what it needs beside the machine's packages are installed from .whl/ when present.
# Every script's output goes to OUT/log.txt; the JSON files (and pictures) land flat in OUT.
set -u
OUT=${1:?usage: bench/h200.sh OUT a|b|c}
PART=${2:?usage: bench/h200.sh OUT a|b|c}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
WORK=$(mktemp -d)
LOG=$OUT/log.txt
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
run() {  # name, time limit in seconds, files to keep (comma-separated), command...
  local name=$1 limit=$2 keep=$3; shift 3
  echo "== $name ($(date +%T), limit ${limit}s): $*" | tee -a "$LOG"
  timeout "$limit" "$@" --out "$WORK/$name" >> "$LOG" 2>&1
  echo "== $name exit $? ($(date +%T))" | tee -a "$LOG"
  for f in ${keep//,/ }; do cp "$WORK/$name/$f" "$OUT/" 2>/dev/null; done  # at most 8 files come back
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers",
transformers.__version__, "triton", triton.__version__)'; } >> "$LOG" 2>&1
case $PART in
  a)
    run generation 290 generation.json python3 bench/generation.py --steps 24 --hf-steps 16
    run token_stats 60 token_stats.json python3 bench/token_stats.py
    run train_call 150 train_step.json python3 bench/train_step.py --model qwen3-1.7b --batch 256 --max-len 576 \
      --equal-lengths --compile --profile --steps 3
    ;;
  b)
    run iteration 330 iteration.json python3 bench/iteration.py --iterations 3 --trl-steps 3
    run decode_profile 150 decode_profile.json python3 bench/decode_profile.py
    ;;
  c)
    run adaptive 120 adaptive_tp.json,adaptive_trace_simulated.png,decode_steps.json python3 bench/adaptive_tp.py
    run planner_accuracy 150 planner_accuracy.json python3 bench/planner_accuracy.py
    run train_step 100 train_step.json python3 bench/train_step.py --steps 5
    run decode_profile_grpo 100 decode_profile.json python3 bench/decode_profile.py --model qwen3-1.7b \
      --profile-cases 256x320
    ;;
esac
grep -E "^== |Traceback|Error|FAILED" "$LOG" | tail -40
