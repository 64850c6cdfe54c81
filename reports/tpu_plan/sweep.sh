#!/usr/bin/env bash
# The planner grid of reports/tpu_plan/sweep/: Qwen3-8B (B=16 drafter) and LLaMA-3.1-8B (B=10) on
# v5p-8 and v6e-8, batch 1 and 32, cache 2k / 8k / 32k; the runtime's default mesh (data = chips).
# Each run writes one JSON (skipped when it exists: delete it to redo); then the table is printed.
#   bash reports/tpu_plan/sweep.sh            # from the repository root; needs libtpu ([plan] extra)
set -euo pipefail
OUT=${OUT:-reports/tpu_plan/sweep}
NEW=256
mkdir -p "$OUT"
for model in qwen3-8b llama-3.1-8b; do
  block=16; [ "$model" = llama-3.1-8b ] && block=10
  for tpu in v5p-8 v6e-8; do
    for batch in 1 32; do
      for cache in 2048 8192 32768; do
        f="$OUT/${model}_${tpu}_b${batch}_c${cache}.json"
        [ -e "$f" ] && continue
        extra=()
        [ "$batch" = 1 ] || extra+=(--no-prefill)           # prefill depends on the batch too; costed at batch 1
        [ "$batch" = 1 ] && [ "$cache" = 2048 ] && [ -z "${NO_LARGEST:-}" ] || extra+=(--no-largest-batch)
        python -m infer.plan --target "configs/models/$model" --tpu "$tpu" --batch "$batch" \
          --prompt-len $((cache - NEW - block)) --max-new-tokens $NEW --cache-len "$cache" \
          --block-size "$block" "${extra[@]}" --json "$f"
      done
    done
  done
done
python -m infer.plan --table "$OUT"/*.json
