#!/bin/bash
# Why a target step can be far from the weights' read time on an accelerator: the gemv roofline (roofline.py), the
# optimised HLO of the target-only decode loop with stacked layers (XLA_FLAGS dump, the 3 largest modules gzipped),
# and run.sh's cycle with the layers unrolled (Qwen3-8B shape, random bf16 weights).
#     run: bash reports/accelerator_cycle/probe.sh "$OUT"
set -uo pipefail
OUT=${1:-runs/accelerator_probe}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
PY=${PYTHON:-python3}
quiet() { grep -v -E '^[IWE][0-9]{4} '; }
"$PY" reports/accelerator_cycle/roofline.py --json "$OUT/roofline.json" 2>&1 | quiet | tee "$OUT/roofline.log"
rm -rf /tmp/dflash_dump
XLA_FLAGS=--xla_dump_to=/tmp/dflash_dump "$PY" - <<'PYEOF' 2>&1 | quiet
import dflash_jax as dj
from dflash_jax.bench.models import bench_target_config
cfg = bench_target_config("configs/models/qwen3-8b", None, None, "bfloat16")
t = dj.init_target(cfg, rng="device", layout="stacked")
r = dj.generate(t, None, [[1] * 1536], max_new_tokens=4, stop_token_ids=[], block_size=None, tree_budget=None)
print("dump: generated", r.tokens)
PYEOF
i=0
for f in $(ls -S /tmp/dflash_dump/*after_optimizations.txt | head -3); do
  i=$((i + 1)); echo "hlo$i: $f"; gzip -c "$f" > "$OUT/hlo$i.txt.gz"
done
"$PY" -m infer.bench_cycle --config configs/models/qwen3-8b --dtype bfloat16 --blocks 16 --trees 64 256 \
    --prompt-len 1536 --steps 32 --repeats 3 --layout unrolled --json "$OUT/unrolled.json" 2>&1 | quiet | tee "$OUT/unrolled.log"
