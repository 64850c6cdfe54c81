"""Target-only decode throughput of a Qwen3-0.6B-shaped model with random weights, against the
measured memory bandwidth of this machine.

    python -m infer.bench_decode [--config qwen3-0.6b] [--batch-sizes 1 8] [--steps N] [--layers N]
"""
from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv=None):
    from dflash_jax.bench.models import BENCH_CONFIGS
    p = argparse.ArgumentParser(prog="python -m infer.bench_decode", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--config", default="qwen3-0.6b", choices=sorted(BENCH_CONFIGS))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers (quick checks)")
    p.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary (quick checks)")
    p.add_argument("--copy-mb", type=int, default=1024, help="array size of the bandwidth measurement")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per batch size (best is kept)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dflash_jax.bench.bandwidth import bench_decode, print_decode_table
    from dflash_jax.cli import main_error
    if args.steps < 1 or any(b < 1 for b in args.batch_sizes):
        main_error("--steps and --batch-sizes must be >= 1")
    res = bench_decode(args.config, args.layers, args.vocab_size, tuple(args.batch_sizes), args.steps,
                             args.copy_mb, args.dtype, args.repeats)
    print_decode_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    from dflash_jax.cli import run
    sys.exit(run(main))
