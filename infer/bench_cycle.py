"""Cost of one DFlash cycle relative to one target decode step, and the fused loop's overhead.

    python -m infer.bench_cycle [--config qwen3-0.6b | configs/models/qwen3-8b] [--blocks 4 8 16]
        [--trees 16 64 256] [--prompt-len 32] [--steps N] [--layers N]

A random drafter almost never agrees with the random target, so each cycle commits one token and the
run lasts a fixed number of cycles; the per-cycle cost does not depend on acceptance.
"""
from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv=None):
    from dflash_jax.bench.models import BENCH_CONFIGS
    p = argparse.ArgumentParser(prog="python -m infer.bench_cycle", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--config", default="qwen3-0.6b",
                   help=f"target shape: one of {', '.join(sorted(BENCH_CONFIGS))}, or a Hugging Face config.json (or its "
                        "directory, e.g. configs/models/qwen3-8b); weights are random")
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--trees", type=int, nargs="*", default=[],
                   help="also time the cycle that verifies a draft tree of each of these node budgets")
    p.add_argument("--prompt-len", type=int, default=32, help="random prompt tokens: the context the attention reads")
    p.add_argument("--steps", type=int, default=16, help="cycles per timed run")
    p.add_argument("--layers", type=int, default=None, help="override the number of target layers")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (every shape once per round); medians")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--layout", choices=("auto", "stacked", "unrolled"), default="auto",
                   help="layer layout: 'stacked' (lax.scan over layers), 'unrolled' (one array per layer); auto: "
                        "stacked on TPU, unrolled elsewhere")
    p.add_argument("--attention", choices=("auto", "reference", "blockwise", "pallas"), default="auto",
                   help="attention implementation of every program (dflash_jax.attention; auto: its default_impl)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dflash_jax.bench.cycle_parts import bench_cycle, print_cycle_table
    from dflash_jax.bench.models import bench_target_config
    from dflash_jax.cli import main_error
    if args.steps < 1 or any(b < 2 for b in args.blocks):
        main_error("--steps must be >= 1 and every --blocks entry >= 2")
    if any(n < 1 for n in args.trees) or args.prompt_len < 1:
        main_error("every --trees entry and --prompt-len must be >= 1")
    try:
        cfg = bench_target_config(args.config, args.layers, args.vocab_size, args.dtype)
    except (ValueError, OSError) as e:  # an unknown name, a folder without config.json, a config we cannot read
        main_error(f"--config {args.config}: {e}")
    need = args.prompt_len + args.steps + 1 + max([max(args.blocks)] + [n + 1 for n in args.trees])
    if need > cfg.max_position_embeddings:
        main_error(f"--prompt-len {args.prompt_len} + --steps {args.steps} + the widest verify exceed the "
                         f"model's max_position_embeddings ({cfg.max_position_embeddings})")
    from dflash_jax.attention import use_impl
    with use_impl(None if args.attention == "auto" else args.attention):
        res = bench_cycle(args.config, args.layers, args.vocab_size, tuple(args.blocks), args.steps,
                                args.drafter_layers, args.dtype, args.batch, args.repeats, trees=tuple(args.trees),
                                prompt_len=args.prompt_len, layout=args.layout)
    res["attention"] = args.attention
    print_cycle_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    from dflash_jax.cli import run
    sys.exit(run(main))
