#!/bin/bash
# Third accelerator call of session 20: the cycle with the layers unrolled (one array per layer, no scan) and the
# dense "reference" attention (one softmax over the whole cache, no while loop over cache blocks), against
# probe.sh's unrolled + "blockwise" run.        run: bash reports/accelerator_cycle/probe2.sh "$OUT"
set -uo pipefail
OUT=${1:-runs/accelerator_probe2}
shift || true
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
"$PY" -m infer.bench_cycle --config configs/models/qwen3-8b --dtype bfloat16 --blocks 8 16 --trees 16 64 256 512 \
    --prompt-len 1536 --steps 32 --repeats 3 --layout unrolled --attention reference --json "$OUT/unrolled_reference.json" "$@" \
    2>&1 | grep -v -E '^[IWE][0-9]{4} ' | tee "$OUT/unrolled_reference.log"
