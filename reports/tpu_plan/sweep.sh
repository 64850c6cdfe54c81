#!/usr/bin/env bash
# The planner grid of reports/tpu_plan/sweep/: Qwen3-8B (B=16 drafter) and LLaMA-3.1-8B (B=10) on
# v5p-8 and v6e-8, batch 1 and 32, cache 2k / 8k / 32k, prefill included; the runtime's default mesh (data = chips).
# Each run writes one JSON (skipped when it exists: delete it to redo); then the table is printed. A program that
# fails to compile (not a capacity limit) makes its run exit non-zero and the sweep stop there.
#   bash reports/tpu_plan/sweep.sh            # from the repository root; needs libtpu ([plan] extra)
#   COST_METHOD=layers NO_LARGEST=1 bash reports/tpu_plan/sweep.sh   # per-layer costing, no largest-batch search
#   COST_METHOD=none NO_LARGEST=1 bash reports/tpu_plan/sweep.sh     # memory, fit and compile errors only
set -euo pipefail
OUT=${OUT:-reports/tpu_plan/sweep}
NEW=256
COST_METHOD=${COST_METHOD:-full}
mkdir -p "$OUT"
for model in qwen3-8b llama-3.1-8b; do
  block=16; [ "$model" = llama-3.1-8b ] && block=10
  for tpu in v5p-8 v6e-8; do
    for batch in 1 32; do
      for cache in 2048 8192 32768; do
        f="$OUT/${model}_${tpu}_b${batch}_c${cache}.json"
        [ -e "$f" ] && continue
        extra=()
        if [ "$COST_METHOD" = none ]; then extra+=(--no-cost); else extra+=(--cost-method "$COST_METHOD"); fi
        [ "$batch" = 1 ] && [ "$cache" = 2048 ] && [ -z "${NO_LARGEST:-}" ] || extra+=(--no-largest-batch)
        python -m infer.plan --target "configs/models/$model" --tpu "$tpu" --batch "$batch" \
          --prompt-len $((cache - NEW - block)) --max-new-tokens $NEW --cache-len "$cache" \
          --block-size "$block" "${extra[@]}" --json "$f"
      done
    done
  done
done
python -m infer.plan --table "$OUT"/*.json
