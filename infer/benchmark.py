"""Benchmark DFlash against target-only decoding on a paper data set or a prompt file.

    python -m infer.benchmark [--target DIR --drafter DIR] --dataset {gsm8k,math500,humaneval,mbpp,mt-bench}
        | --prompts FILE.jsonl  [--max-samples N] [--data-dir DIR] [--block-size N|auto] [--temperature T]
        [--max-new-tokens N] [--batch-size N] [--fixed-shapes 4,8,tree:16 | --no-fixed] [--out DIR]

Without --target/--drafter: the embedded reference pair. Prints tau, the speedup (decode time per
output token, prefill and compile excluded) and the acceptance-length histogram; with the automatic
shape (the default) also the fixed chains 4 and 8 run on the same prompts, beside auto's choice; writes
OUT/report.json and OUT/acceptance_histogram.png (OUT default: runs/benchmark/<data set> under the
current directory).
"""
from __future__ import annotations

import argparse
import sys
import warnings

from dflash_jax.prompts import DATASETS


def parse_args(argv=None):
    from dflash_jax.bench.args import add_shape_args
    p = argparse.ArgumentParser(prog="python -m infer.benchmark", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--target", help="target model directory (default: the embedded reference pair)")
    p.add_argument("--drafter", help="DFlash drafter directory (required with --target)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the target directory)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help=f"one of {', '.join(DATASETS)}")
    src.add_argument("--prompts", help="JSONL of objects with 'prompt', 'messages' or 'turns'")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--data-dir", default=None,
                   help="local data sets (default: $DFLASH_DATA_DIR, else ../shared/data beside the repo)")
    add_shape_args(p, tree_auto=False)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--thinking", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    fx = p.add_mutually_exclusive_group()
    fx.add_argument("--fixed-shapes", default=None, metavar="LIST",
                    help="comma list of fixed shapes (B, chain:B, tree:N) to run beside the main one on the same "
                         "prompts, e.g. 4,8,tree:16; default with the automatic shape: the chains 4 and 8 (those "
                         "within the drafter's block), printed beside auto's choice")
    fx.add_argument("--no-fixed", action="store_true", help="run no fixed shapes beside the automatic one")
    p.add_argument("--out", default=None,
                   help="output directory for report.json and the plot (default: runs/benchmark/<data set>)")
    from dflash_jax.bench.args import add_mesh_args, add_quant_args
    add_mesh_args(p)
    add_quant_args(p)
    return p.parse_args(argv)


DEFAULT_FIXED = (4, 8)  # the chains run beside the automatic shape unless --no-fixed


def fixed_shapes(args, auto: bool, drafter_block: int) -> list:
    """The fixed shapes to run beside the main one: --fixed-shapes as given (checked), else with the automatic
    shape DEFAULT_FIXED within the drafter's block; none with --no-fixed."""
    from dflash_jax.cli import main_error
    from dflash_jax.decode.shape import Chain, Shape, Tree
    if args.no_fixed or (args.fixed_shapes is None and not auto):
        return []
    if args.fixed_shapes is None:
        return [b for b in DEFAULT_FIXED if b <= drafter_block]
    out = []
    for item in (x.strip() for x in args.fixed_shapes.split(",")):
        if not item:
            continue
        try:
            s = Shape.parse(item)
            if not isinstance(s, (Chain, Tree)):
                raise ValueError("expected B, chain:B or tree:N")
            s.resolve(drafter_block)
        except ValueError as e:
            main_error(f"--fixed-shapes {item}: {e}")
        out.append(item)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from dflash_jax import prompts, text
    from dflash_jax.bench.args import check_generation_args, mesh_from_args, show_library_log
    from dflash_jax.bench.datasets import (auto_against_fixed, describe_differences, format_histogram,
                                           run_benchmark, write_report)
    from dflash_jax.bench.models import load_models, reference_paths
    from dflash_jax.cli import main_error

    check_generation_args(args)
    if args.max_samples is not None and args.max_samples < 1:
        main_error(f"--max-samples must be >= 1, got {args.max_samples}")
    if args.target is None:
        if args.drafter:
            main_error("--drafter needs --target")
        args.target, args.drafter = reference_paths()
        if args.target is None or args.drafter is None:
            main_error("no --target/--drafter given and no embedded reference pair in this install")
        print(f"using the embedded reference pair: {args.target} + {args.drafter}")
    elif args.drafter is None:
        main_error("--drafter is required with --target (the benchmark compares DFlash with target-only)")
    try:
        if args.dataset:
            samples = prompts.load_dataset_prompts(args.dataset, args.data_dir, args.max_samples)
            name = prompts.canonical_name(args.dataset)
        else:
            samples = prompts.load_prompt_file(args.prompts, args.max_samples)
            name = args.prompts
        mesh = mesh_from_args(args)
        show_library_log()
        target, drafter = load_models(args.target, args.drafter, args.dtype, mesh, args.quant, args.kv_quant,
                                      args.drafter_quant)
        tok = text.load_tokenizer(args.tokenizer or args.target)
        from dflash_jax.decode.shape import Auto, parse_shape
        shape = parse_shape(args.block_size, args.tree_budget)
        shape.resolve(drafter.config.block_size, target.config.vocab_size)
    except (FileNotFoundError, ValueError) as e:
        main_error(str(e))
    fixed = fixed_shapes(args, isinstance(shape, Auto), drafter.config.block_size)
    if args.out is None:
        import os
        args.out = os.path.join("runs", "benchmark", prompts.canonical_name(args.dataset) if args.dataset else
                                os.path.splitext(os.path.basename(args.prompts))[0])
    if not args.no_chat_template and not text.has_chat_template(tok):
        print("warning: the tokenizer has no chat_template; prompts are sent as raw text", file=sys.stderr)
        args.no_chat_template = True
    stop = text.stop_token_ids(tok, target.config, args.target)
    gk = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              stop_token_ids=stop, seed=args.seed)
    n_turns = sum(s.num_turns for s in samples)
    block = args.block_size if args.tree_budget is None or args.block_size != "auto" else drafter.config.block_size
    print(f"data set {name}: {len(samples)} sample(s), {n_turns} generation(s); block {block}"
          f"{f', tree of {args.tree_budget} nodes' if args.tree_budget else ''}, T={args.temperature}, max_new_tokens "
          f"{args.max_new_tokens}, batch {args.batch_size}", flush=True)
    thinking = {"auto": None, "on": True, "off": False}[args.thinking]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            rep = run_benchmark(target, drafter, tok, samples, gen_kwargs=gk, block_size=args.block_size,
                                batch_size=args.batch_size, use_chat_template=not args.no_chat_template,
                                enable_thinking=thinking, warmup=not args.no_warmup,
                                tree_budget=args.tree_budget, fixed_shapes=fixed)
    except ValueError as e:
        main_error(str(e))
    rep = dict(dataset=name, target=args.target, drafter=args.drafter, temperature=args.temperature,
               top_k=args.top_k, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed,
               dtype=args.dtype, chat_template=not args.no_chat_template, **rep)
    t, s = rep["target_only"], rep["speculative"]
    print("")
    print(f"target-only : {t['tokens_per_second']:.2f} tok/s ({1e3 * t['time_per_output_token_s']:.2f} ms/token, "
          f"{t['decode_tokens']} decode tokens)")
    print(f"dflash      : {s['tokens_per_second']:.2f} tok/s ({1e3 * s['time_per_output_token_s']:.2f} ms/token, "
          f"{s['decode_tokens']} decode tokens, {rep['cycles']} cycles)")
    print(f"tau         : {rep['tau']:.3f}")
    print(f"speedup     : {rep['speedup']:.3f}x (decode time per output token, prefill and compile excluded)")
    print(f"identical   : {describe_differences(rep['first_differences'], rep['num_generations'])}")
    against = auto_against_fixed(rep)
    if against:
        print(f"vs fixed    : {against}")
    print("acceptance-length histogram (length | cycles):")
    print(format_histogram(rep["histogram"]["counts"]))
    from dflash_jax.distributed import is_main_process
    if not is_main_process():  # every process computed the same report; process 0 writes it
        return 0
    paths = write_report(rep, args.out, plot=not args.no_plot)
    print(f"wrote {', '.join(paths.values())}")
    return 0


if __name__ == "__main__":
    from dflash_jax.cli import run
    sys.exit(run(main))
