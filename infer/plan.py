"""python -m infer.plan: compile the project's programs for a TPU slice on this machine (no TPU needed).

    python -m infer.plan --target configs/models/qwen3-8b --tpu v5p-8 --batch 1 --prompt-len 2048 \
        --max-new-tokens 512 --block-sizes 16 --json out.json
    python -m infer.plan --train --config configs/qwen3_8b_v5p8.yaml --target configs/models/qwen3-8b --tpu v5p-8 \
        [train.batch_size=32 train.remat=layer ...]

Prints per-chip memory, flops, bytes accessed and roofline per program (dflash_jax.planner); needs
libtpu (pip install "dflash-jax[plan]").
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target config.json (or its directory); for --train: overrides target.path")
    p.add_argument("--drafter", help="drafter config.json (or its directory); default: --drafter-layers/--block-size")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16, help="the drafter's block size (without --drafter)")
    p.add_argument("--block-sizes", help="comma list of block sizes to cost the cycle at (default: the drafter's)")
    p.add_argument("--tree-budgets", help="comma list of draft-tree node budgets to cost the tree cycle at "
                                           "(at the drafter's block size), e.g. 16,64,256,512")
    p.add_argument("--tpu", default="v5p-8", help="gcloud accelerator type: v5p-8, v5p-16, v5litepod-8, v6e-8, ...")
    p.add_argument("--mesh", help="data=D,model=M (default: model=1, data=every chip, as the runtime)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--cache-len", type=int, default=None,
                   help="KV slots per row (default: generate()'s rule: prompt bucket + new tokens + block)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill program")
    p.add_argument("--no-largest-batch", action="store_true", help="skip the largest-batch search")
    p.add_argument("--engine", action="store_true",
                   help="also compile the serving engine's programs (python -m infer.serve): its prefill of new "
                        "prompts into free slots and its decode call per shape (memory and fit)")
    p.add_argument("--max-probes", type=int, default=8, help="compiles allowed for the largest-batch search")
    p.add_argument("--no-cost", action="store_true",
                   help="skip the unrolled compiles that give whole-model flops / bytes (memory only)")
    p.add_argument("--cost-method", choices=("full", "layers"), default="full",
                   help="whole-model flops / bytes: 'full' compiles the whole unrolled model (the compiler's own "
                        "figure; 0.5-7 minutes per program for an 8B model); 'layers' compiles it at three and four "
                        "layer periods and extends the per-layer difference (seconds, but bytes can be off by 2x)")
    p.add_argument("--moe-combine", choices=("psum", "all_to_all"), default="psum",
                   help="MoE targets under expert parallelism (--mesh model=M): how expert outputs return, psum of "
                        "partial outputs (the runtime's default) or all-to-all dispatch + return + all-gather")
    p.add_argument("--quant", choices=("int8", "fp8"), help="target weights quantized (per-output-channel scales)")
    p.add_argument("--kv-quant", choices=("int8", "fp8"), help="the target's KV cache quantized (per-token scales)")
    p.add_argument("--drafter-quant", choices=("int8", "fp8"), help="the drafter's weights quantized (drafts only)")
    p.add_argument("--train", action="store_true", help="plan the training step of --config instead")
    p.add_argument("--config", help="training YAML (with --train)")
    p.add_argument("overrides", nargs="*", help="with --train: YAML overrides, e.g. train.batch_size=32")
    p.add_argument("--json", help="write the report as JSON to this file")
    p.add_argument("--table", nargs="+", metavar="JSON", help="print a markdown table of saved JSON reports and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # only the TPU compiler is used; no device is touched
    from dflash_jax import planner as pl
    if args.table:
        import json
        reps = []
        for f in args.table:
            with open(f) as fh:
                reps.append(json.load(fh))
        print(pl.markdown_table(reps))
        return 0
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if args.train:
            if not args.config:
                raise pl.PlanError("--train needs --config configs/X.yaml")
            rep = pl.plan_train(args.config, args.tpu, target=args.target, mesh=args.mesh, overrides=args.overrides,
                                cost=not args.no_cost, log=log)
        else:
            if args.overrides:
                raise pl.PlanError(f"unexpected arguments {' '.join(args.overrides)} (YAML overrides go with --train)")
            if not args.target:
                raise pl.PlanError("--target is required (a config.json or its directory)")
            blocks = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else None
            rep = pl.plan(args.target, args.tpu, drafter=args.drafter, drafter_layers=args.drafter_layers,
                          block_size=args.block_size, block_sizes=blocks, mesh=args.mesh, batch=args.batch,
                          prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens, cache_len=args.cache_len,
                          dtype=args.dtype, prefill=not args.no_prefill, largest_batch=not args.no_largest_batch,
                          max_probes=args.max_probes, cost=not args.no_cost, cost_method=args.cost_method, log=log,
                          tree_budgets=[int(n) for n in args.tree_budgets.split(",")] if args.tree_budgets else (),
                          moe_combine=args.moe_combine, quant=args.quant, kv_quant=args.kv_quant,
                          drafter_quant=args.drafter_quant, engine=args.engine)
    except (ValueError, FileNotFoundError) as e:  # PlanError, config errors
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(pl.format_report(rep))
    if args.json:
        pl.write_json(rep, args.json)
        print(f"wrote {args.json}")
    errors = pl.compile_errors(rep)
    for e in errors:
        print(f"error: a program failed to compile: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
