#!/usr/bin/env bash
# The single-GPU benchmarks of BENCHMARKS.md, in parts that each fit a 10-minute window:
#   bench/h200.sh OUT a   the decode products (cuBLAS, cuBLASLt, weights transposed) and decode
#                         attention's split counts at batch 1 and 16; generation (parity of the fast path, decode
#                         attention, the engine against its roofline and transformers)
#   bench/h200.sh OUT b   one GRPO iteration against TRL, and the training log-probabilities
#   bench/h200.sh OUT c   the GRPO training call with its kernel profile, and where a decode step goes
#                         (LLaMA-3.1-8B shape, and the GRPO iteration's groups on the Qwen3 shape)
#   bench/h200.sh OUT d   adaptive TP (one-GPU parts), planner accuracy, the training step
#   bench/h200.sh OUT e   the decode attention's split count and knobs, and the projections (cuBLAS,
#                         cuBLASLt, weights transposed; LLaMA-3.1-8B shape, and the GRPO iteration's Qwen3 shape)
#   bench/h200.sh OUT f   the engine at batch 1, 64 and 256 x 1K with the decode weights stored
#                         transposed, then as stored
#   bench/h200.sh OUT g   parity of the fast path with the weights transposed; the GRPO iteration
#                         (no TRL) with them, then without
#   bench/h200.sh OUT h   batch 64 x 1K with the weights transposed under cuBLASLt, then cuBLAS; batch
#                         1, 16 and 64 x 8K with the weights transposed, then as stored
#   bench/h200.sh OUT i   batch 1, 64 and 256 x 1K with the weights transposed under cuBLASLt, then
#                         the default; the GRPO iteration (no TRL) with both options
#   bench/h200.sh OUT j   shared prompts: parity against padded rows, attention and the training call's
#                         time on the GRPO shape and with 1K-token prompts; the GRPO iteration (no TRL)
#                         with prompts shared (the default), then padded
#   bench/h200.sh OUT k   shared prompts (parity, attention, the training call) on the GRPO shape; one
#                         GRPO iteration against TRL
#   bench/h200.sh OUT l   decode attention reading a prompt once for its samples (the default): the
#                         kernel alone; one GRPO iteration against TRL; the iteration (no TRL) without it
#   bench/h200.sh OUT m   one GRPO iteration against TRL; the engine at batch 1 and 64 x 1K with parity
#   bench/h200.sh OUT n   the engine at batch 1, 64 and 256 x 1K with inductor's combo kernels (independent
#                         kernels of the decode step launched as one), then without
#   bench/h200.sh OUT o   one GRPO iteration against TRL; the engine at batch 1 and 64 x 1K with combo kernels
#   bench/h200.sh OUT p   the GRPO iteration against TRL over more steps (5 and 6), then the training call's kernel profile
#   bench/h200.sh OUT q   the engine at batch 1 and 64 x 1K with parity, then with the weights transposed under cuBLASLt
#   bench/h200.sh OUT r   the GRPO iteration against TRL at its default micro-batch (8) and at 32
# TRL and what it needs beside the machine's packages are installed from .whl/ when present
# (bash bench/fetch_trl_wheels.sh puts them there).
# Every script's output goes to OUT/log.txt; the JSON files (and pictures) land flat in OUT.
set -u
OUT=${1:?usage: bench/h200.sh OUT a|b|c|d|e|f|g|h|i|j|k|l|m|n|o|p|q|r}
PART=${2:?usage: bench/h200.sh OUT a|b|c|d|e|f|g|h|i|j|k|l|m|n|o|p|q|r}
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
engine() {  # name, time limit, bench/generation.py arguments: the engine alone, kept as generation_NAME.json
  local name=$1 limit=$2; shift 2
  run "$name" "$limit" generation.json python3 bench/generation.py --steps 24 --skip-transformers --skip-parity "$@"
  mv "$OUT/generation.json" "$OUT/generation_$name.json" 2>/dev/null
}
iteration() {  # name, --set overrides: the GRPO iteration without TRL, kept as iteration_NAME.json
  local name=$1; shift
  run "iteration_$name" 200 iteration.json python3 bench/iteration.py --iterations 3 --skip-trl --skip-planner "$@"
  mv "$OUT/iteration.json" "$OUT/iteration_$name.json" 2>/dev/null
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers",
transformers.__version__, "triton", triton.__version__)'; } >> "$LOG" 2>&1
case $PART in
  a)
    run projections 120 decode_profile.json python3 bench/decode_profile.py --sweep-only --sweep-cases 1x1024,16x1024,16x8192
    mv "$OUT/decode_profile.json" "$OUT/decode_projections.json" 2>/dev/null
    run generation 420 generation.json python3 bench/generation.py --steps 24 --hf-steps 16
    ;;
  b)
    run iteration 420 iteration.json python3 bench/iteration.py --iterations 3 --trl-steps 3 --skip-planner
    run token_stats 60 token_stats.json python3 bench/token_stats.py
    ;;
  c)
    run train_call 150 train_step.json python3 bench/train_step.py --model qwen3-1.7b --batch 256 --max-len 576 \
      --equal-lengths --compile --profile --steps 3
    run decode_profile 180 decode_profile.json python3 bench/decode_profile.py
    mv "$OUT/decode_profile.json" "$OUT/decode_profile_llama.json" 2>/dev/null
    run decode_profile_grpo 180 decode_profile.json python3 bench/decode_profile.py --model qwen3-1.7b \
      --profile-cases 256x320 --samples-per-prompt 8 --prompt-tokens 64 --temperature 1.0
    ;;
  d)
    run adaptive 120 adaptive_tp.json,adaptive_trace_simulated.png,decode_steps.json python3 bench/adaptive_tp.py
    run planner_accuracy 240 planner_accuracy.json python3 bench/planner_accuracy.py
    run train_step 120 train_step.json python3 bench/train_step.py --steps 5
    ;;
  e)
    run sweep_llama 300 decode_profile.json python3 bench/decode_profile.py --sweep-only \
      --sweep-cases 1x1024,1x8192,16x1024,64x1024,64x8192,256x1024
    mv "$OUT/decode_profile.json" "$OUT/decode_sweep_llama.json" 2>/dev/null
    run sweep_qwen 200 decode_profile.json python3 bench/decode_profile.py --model qwen3-1.7b --sweep-only \
      --sweep-cases 64x320,256x320,256x576
    mv "$OUT/decode_profile.json" "$OUT/decode_sweep_qwen.json" 2>/dev/null
    ;;
  f)
    engine transposed 270 --batches 1,64,256 --contexts 1024 --transposed-weights
    engine as_stored 270 --batches 1,64,256 --contexts 1024
    ;;
  g)
    run parity 150 generation.json python3 bench/generation.py --batches 1 --contexts 1024 --steps 8 \
      --skip-transformers --transposed-weights
    mv "$OUT/generation.json" "$OUT/parity_transposed.json" 2>/dev/null
    iteration transposed --set generation.transposed_weights=true
    iteration as_stored
    ;;
  h)
    engine transposed_lt 120 --batches 64 --contexts 1024 --transposed-weights --blas-library cublaslt
    engine transposed_64 120 --batches 64 --contexts 1024 --transposed-weights
    engine transposed_8k 170 --batches 1,16,64 --contexts 8192 --transposed-weights
    engine as_stored_8k 170 --batches 1,16,64 --contexts 8192
    ;;
  i)
    engine transposed_lt 200 --batches 1,64,256 --contexts 1024 --transposed-weights --blas-library cublaslt
    engine default 200 --batches 1,64,256 --contexts 1024
    iteration transposed_lt --set generation.transposed_weights=true --set generation.blas_library=cublaslt
    ;;
  j)
    run shared_prompts 160 shared_prompts.json python3 bench/shared_prompts.py
    mv "$OUT/shared_prompts.json" "$OUT/shared_grpo.json" 2>/dev/null
    run shared_long_prompts 130 shared_prompts.json python3 bench/shared_prompts.py --skip-parity --prompts 16 \
      --prompt-tokens 1024 --response-tokens 512
    mv "$OUT/shared_prompts.json" "$OUT/shared_long_prompts.json" 2>/dev/null
    iteration shared
    iteration padded --set algorithm.share_prompts=false
    ;;
  k)
    run shared_prompts 150 shared_prompts.json python3 bench/shared_prompts.py
    run iteration 400 iteration.json python3 bench/iteration.py --iterations 3 --trl-steps 3 --skip-planner
    ;;
  l)
    run prompt_kv 60 prompt_kv_attention.json python3 bench/prompt_kv_attention.py
    run iteration 330 iteration.json python3 bench/iteration.py --iterations 3 --trl-steps 3 --skip-planner
    mv "$OUT/iteration.json" "$OUT/iteration_trl.json" 2>/dev/null  # the next run writes iteration.json too
    iteration own_kv --set generation.share_prompt_kv=false
    ;;
  m)
    run iteration 330 iteration.json python3 bench/iteration.py --iterations 3 --trl-steps 3 --skip-planner
    run generation 240 generation.json python3 bench/generation.py --batches 1,64 --contexts 1024 --steps 24 \
      --skip-transformers
    ;;
  n)
    engine combo 240 --batches 1,64,256 --contexts 1024 --inductor combo_kernels=True
    engine plain 200 --batches 1,64,256 --contexts 1024
    ;;
  o)
    run iteration 330 iteration.json python3 bench/iteration.py --iterations 3 --trl-steps 3 --skip-planner
    engine combo 240 --batches 1,64 --contexts 1024 --inductor combo_kernels=True
    ;;
  p)
    run iteration 400 iteration.json python3 bench/iteration.py --iterations 5 --trl-steps 6 --skip-planner
    run train_call 150 shared_prompts.json python3 bench/shared_prompts.py --skip-parity --profile
    ;;
  q)
    run generation 300 generation.json python3 bench/generation.py --batches 1,64 --contexts 1024 --steps 24 \
      --skip-transformers
    mv "$OUT/generation.json" "$OUT/generation_default.json" 2>/dev/null  # the next run writes generation.json too
    engine transposed_lt 200 --batches 1,64 --contexts 1024 --transposed-weights --blas-library cublaslt
    ;;
  r)
    run iteration 540 iteration.json python3 bench/iteration.py --iterations 3 --trl-steps 4 \
      --trl-micro-batches 8,32 --skip-planner
    ;;
esac
grep -E "^== |Traceback|Error|FAILED" "$LOG" | tail -40
