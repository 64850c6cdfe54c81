#!/bin/bash
# One process of infer.bench_cycle on the embedded pair under the XLA flags given as $1 (none: ""): the target-only
# step and the B=4 / B=8 / tree 7 / tree 23 cycles (ms, x step). Run from the repository root, nothing else running:
#   for r in 1 2 3; do for f in "" "--xla_cpu_multi_thread_eigen=false"; do reports/reference/s24/xla_flags.sh "$f"; done; done
out=$(XLA_FLAGS="$1" JAX_PLATFORMS=cpu python -m infer.bench_cycle --config dflash_jax/assets/reference/target \
      --drafter-layers 1 --blocks 4 8 --trees 7 23 --prompt-len 150 --repeats 5 --steps 64 2>&1)
step=$(echo "$out" | grep -m1 "target-only step" | grep -o "[0-9.]* ms")
cyc=$(echo "$out" | grep -E "^  (B=4|B=8|tree 7|tree 23): cycle" | sed -E 's/: cycle ([0-9.]+) ms = ([0-9.]+) x.*/ \1 \2/' | tr '\n' ' ')
echo "[$1] step $step | $cyc"
echo "$out" | grep -i "error" | head -3
