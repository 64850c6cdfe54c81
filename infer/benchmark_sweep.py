"""Sweep benchmark: data sets x temperatures x shapes (chain blocks, tree budgets), target-only side by side.

    python -m infer.benchmark_sweep [--target DIR --drafter DIR] [--out reports/reference]
        [--sets gsm8k:50,math500:10,humaneval:10,mt-bench:10] [--temperatures 0,1] [--blocks 4,8,16]
        [--trees 4,8,16,32,64]
        [--max-new-tokens 256] [--batch-size 1] [--repeats 3] [--cycle-breakdown]

Without --target/--drafter: the embedded reference pair. Writes OUT/sweep.json, OUT/sweep.md (combined
markdown table, per-cycle costs) and PNG plots. First turns only (MT-Bench's second turn is skipped).
"""
from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.benchmark_sweep", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--out", default="reports/reference")
    p.add_argument("--sets", default="gsm8k:50,math500:10,humaneval:10,mt-bench:10",
                   help="comma list of NAME:NUM_PROMPTS")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--blocks", default="4,8,16")
    p.add_argument("--trees", default="4,8,16,32,64",
                   help="tree budgets (draft-tree nodes, at the drafter's block size) to run beside the chain "
                        "blocks; '' for none")
    p.add_argument("--auto", action="store_true",
                   help="also run block_size / tree_budget 'auto' (the shape chosen per call from the measured cost "
                        "curve and the acceptance observed so far in this run)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1,
                   help="timed passes over the prompts; speedups are reported as median (range)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--cycle-breakdown", action="store_true",
                   help="only time one target step vs one speculative cycle (draft + verify) at batch 1; "
                        "writes OUT/cycle_breakdown.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    from dflash_jax.bench.args import show_library_log
    from dflash_jax.bench.models import reference_paths
    from dflash_jax.cli import main_error
    from dflash_jax.reference_bench import run_sweep
    show_library_log()
    target, drafter = a.target, a.drafter
    if target is None:
        target, drafter = reference_paths()
        if target is None or drafter is None:
            main_error("no --target/--drafter and no embedded reference pair (python -m train.reference)")
    if drafter is None:
        main_error("--drafter is required with --target")
    if a.cycle_breakdown:
        import json
        import os
        from dflash_jax.reference_bench import cycle_breakdown
        res = cycle_breakdown(target, drafter, tuple(int(b) for b in a.blocks.split(",")), dtype=a.dtype)
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "cycle_breakdown.json"), "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {a.out}/cycle_breakdown.json")
        return 0
    try:
        sets = []
        for item in a.sets.split(","):
            name, _, n = item.partition(":")
            sets.append((name.strip(), int(n) if n else 10))
        temps = tuple(float(t) for t in a.temperatures.split(","))
        blocks = tuple(int(b) for b in a.blocks.split(",") if b.strip())
        trees = tuple(int(n) for n in a.trees.split(",") if n.strip())
        from dflash_jax.decode.shape import parse_shape
        for b in blocks:
            parse_shape(block_size=b)
        for n in trees:
            parse_shape(tree_budget=n)
        if not blocks and not trees and not a.auto:
            raise ValueError("nothing to run: --blocks and --trees are both empty")
        rep = run_sweep(target, drafter, a.out, sets, temps, blocks, a.max_new_tokens, a.batch_size, a.data_dir,
                        a.seed, a.dtype, plot=not a.no_plot, repeats=a.repeats, trees=trees,
                        auto=a.auto)
    except (ValueError, FileNotFoundError) as e:
        main_error(str(e))
    from dflash_jax.reference_bench import markdown_table
    print(markdown_table(rep))
    print(f"wrote {a.out}/sweep.json, {a.out}/sweep.md")
    return 0


if __name__ == "__main__":
    from dflash_jax.cli import run
    sys.exit(run(main))
