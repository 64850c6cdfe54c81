#!/bin/bash
# What a DFlash chain cycle and a draft-tree cycle cost relative to one target step at Qwen3-8B's shape (random
# bf16 weights, a 5-layer block-16 drafter, 1536-token context (the planner's fill at cache 2048), batch 1), on
# whatever accelerator runs it. On the lent H200 (device tool), from the repo root:
#     run: bash reports/accelerator_cycle/run.sh "$OUT"          (timeout_s 540)
# Extra arguments go to infer.bench_cycle (CPU smoke test: ... run.sh /tmp/x --layers 1 --vocab-size 1024 --dtype float32).
set -euo pipefail
OUT=${1:-runs/accelerator_cycle}
shift || true
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
"$PY" -c "import jax, platform; print('jax', jax.__version__, 'python', platform.python_version(), jax.devices())" \
    | tee "$OUT/devices.txt"
"$PY" -m infer.bench_cycle --config configs/models/qwen3-8b --dtype bfloat16 --blocks 16 --trees 16 64 256 \
    --prompt-len 1536 --steps 32 --repeats 3 --json "$OUT/qwen3_8b_cycle.json" "$@" 2>&1 | tee "$OUT/qwen3_8b_cycle.log"
