"""Generate text for one prompt, target-only or with a DFlash drafter (speedup shown by default).

    python -m infer.generate --target DIR [--drafter DIR] --prompt "..." [--prompt-format auto|math|raw]
        [--block-size N|auto] [--tree-budget N|auto] [--temperature T] [--top-k K] [--top-p P] [--max-new-tokens N] [--no-chat-template]
        [--compare | --no-compare] [--repeats N] [--seed S] [--dtype float32|bfloat16]

Without --target: the embedded reference pair (dflash_jax/assets/reference) when present, else a tiny
random demo pair built in a temporary directory (gibberish output).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import warnings

# A held-out GSM8K test question (the reference pair never saw it). `--prompt-format auto` sends it in
# the paper's math prompt format (dflash_jax.prompts.MATH_SUFFIX), as the pair was trained on.
DEFAULT_PROMPT = ("Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
                  "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 "
                  "per fresh duck egg. How much in dollars does she make every day at the farmers' market?")
PROMPT_FORMATS = ("auto", "math", "raw")


def parse_args(argv=None):
    from dflash_jax.bench.args import add_shape_args
    p = argparse.ArgumentParser(prog="python -m infer.generate", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--target", help="target model directory (HF format); default: reference pair or random demo")
    p.add_argument("--drafter", help="DFlash drafter directory (z-lab format)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the target directory)")
    p.add_argument("--prompt", default=None, help="user prompt (default: a held-out GSM8K question)")
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="auto",
                   help="math: append the paper's math instruction ('Please reason step by step, ... \\boxed{}'); "
                        "raw: the prompt as given; auto (default): math for the default GSM8K question, raw for "
                        "--prompt")
    add_shape_args(p)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="at most this many new tokens (capped so that prompt + new tokens fit the model's "
                        "max_position_embeddings)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the raw prompt text")
    p.add_argument("--thinking", choices=("auto", "on", "off"), default="auto",
                   help="pass enable_thinking to the chat template (Qwen3); auto = template default")
    cmp = p.add_mutually_exclusive_group()
    cmp.add_argument("--compare", dest="compare", action="store_true", default=None,
                     help="also run target-only on the same prompt and print the speedup (default with a drafter)")
    cmp.add_argument("--no-compare", dest="compare", action="store_false")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed rounds of both modes; the speedup printed is their median (default 3)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    from dflash_jax.bench.args import add_mesh_args, add_quant_args
    add_mesh_args(p)
    add_quant_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dflash_jax import text
    from dflash_jax.bench.args import check_generation_args, mesh_from_args, show_library_log
    from dflash_jax.bench.datasets import compare_prompt
    from dflash_jax.bench.models import build_demo_models, demo_banner, load_models, reference_paths
    from dflash_jax.cli import main_error
    from dflash_jax.prompts import MATH_SUFFIX

    if args.drafter and not args.target:
        main_error("--drafter needs --target")
    if args.prompt is not None and not args.prompt.strip():
        main_error("--prompt is empty")
    check_generation_args(args)
    tmp = None
    demo = False
    target_path, drafter_path = args.target, args.drafter
    if target_path is None:
        target_path, drafter_path = reference_paths()
        if target_path is None:
            tmp = tempfile.TemporaryDirectory(prefix="dflash_demo_")
            print(demo_banner(), flush=True)
            from dflash_jax.prompts import default_data_dir
            target_path, drafter_path = build_demo_models(tmp.name, data_dir=default_data_dir())
            demo = True
        else:
            print(f"using the embedded reference pair: {target_path}" + (f" + {drafter_path}" if drafter_path else ""))
    compare = args.compare if args.compare is not None else drafter_path is not None
    if compare and drafter_path is None:
        main_error("--compare needs a drafter (--drafter DIR): there is nothing to compare target-only with")
    try:
        mesh = mesh_from_args(args)
        show_library_log()
        target, drafter = load_models(target_path, drafter_path, args.dtype, mesh, args.quant, args.kv_quant,
                                      args.drafter_quant)
        tok = text.load_tokenizer(args.tokenizer or target_path)
    except (FileNotFoundError, ValueError) as e:
        main_error(str(e))
    if args.quant or args.kv_quant or args.drafter_quant:
        print(f"quantized: target weights {args.quant or args.dtype}, KV cache {args.kv_quant or args.dtype}; "
              f"drafter weights {args.drafter_quant or args.dtype}")
    from dflash_jax.decode.shape import Auto, parse_shape
    auto = isinstance(parse_shape(args.block_size, args.tree_budget), Auto)
    block_size, block_note = args.block_size, ""
    if auto:
        block_size, block_note = "auto", (" (target-only, chain or tree, chosen per call from the measured cost curve "
                                          "and the acceptance so far; --block-size N or --tree-budget N fix it)")
    elif block_size == "auto" and drafter is not None:  # --tree-budget N: a tree of the drafter's depth
        block_size, block_note = drafter.config.block_size, " (the drafter's block size)"
    fmt = args.prompt_format
    if fmt == "auto":
        fmt = "math" if args.prompt is None else "raw"
    prompt = (args.prompt if args.prompt is not None else DEFAULT_PROMPT).strip()
    if fmt == "math":
        prompt += MATH_SUFFIX
    thinking = {"auto": None, "on": True, "off": False}[args.thinking]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ids = text.encode_chat(tok, prompt, use_chat_template=not args.no_chat_template, enable_thinking=thinking)
        except ValueError as e:
            main_error(str(e))
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    stop = text.stop_token_ids(tok, target.config, target_path)
    from dflash_jax.decode.state import capped_new_tokens
    try:
        max_new = capped_new_tokens(target.config.max_position_embeddings, len(ids), args.max_new_tokens)
    except ValueError as e:
        main_error(str(e))
    if max_new < args.max_new_tokens:
        print(f"note: --max-new-tokens {args.max_new_tokens} capped to {max_new}: the prompt ({len(ids)} tokens) and "
              f"the new tokens must fit the model's max_position_embeddings ({target.config.max_position_embeddings})",
              file=sys.stderr)
    gk = dict(max_new_tokens=max_new, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              stop_token_ids=stop, seed=args.seed)
    print(f"prompt ({fmt} format{', in the chat template' if not args.no_chat_template else ''}):")
    print("\n".join("  " + line for line in prompt.splitlines()))
    if args.tree_budget is not None and drafter is None:
        main_error("--tree-budget needs a drafter")
    if drafter is not None:
        tree_note = f", tree of {args.tree_budget} nodes" if args.tree_budget and not auto else ""
        print(f"block size {block_size}{block_note}{tree_note}", flush=True)
    try:
        res = compare_prompt(target, drafter, ids, gen_kwargs=gk, block_size=block_size if drafter else None,
                                   compare=compare, warmup=not args.no_warmup, repeats=args.repeats,
                                   tree_budget=args.tree_budget if drafter else None)
    except ValueError as e:
        main_error(str(e))
    main_res = res["spec"] or res["target"]
    print(f"prompt: {len(ids)} tokens; stop ids {stop}")
    print("=" * 30 + " output " + "=" * 30)
    print(text.decode(tok, main_res.tokens[0], stop))
    print("=" * 68)
    if res["spec"] is not None:
        r = res["spec"]
        label = ("auto: target-only" if r.block_size == 1  # auto found no drafted shape that pays here
                 else f"dflash B={r.block_size}{f' tree {r.tree_budget}' if r.tree_budget else ''}")
        print(f"[{label}] {len(r.tokens[0])} tokens, decode {r.decode_tokens_per_second:.2f} tok/s "
              f"({1e3 * r.time_per_output_token:.2f} ms/token), prefill {1e3 * r.prefill_time:.1f} ms, "
              f"tau {r.tau:.3f} over {r.cycles} cycles")
        if r.block_size > 1:
            print(f"acceptance-length histogram (cycles that committed 1, 2, ..., {r.block_size} tokens): "
                  f"{r.histogram()[1:]}")
    if res["target"] is not None:
        r = res["target"]
        print(f"[target-only] {len(r.tokens[0])} tokens, decode {r.decode_tokens_per_second:.2f} tok/s "
              f"({1e3 * r.time_per_output_token:.2f} ms/token), prefill {1e3 * r.prefill_time:.1f} ms")
    if res["speedup"] is not None:
        from dflash_jax.bench.datasets import first_difference
        part = first_difference(res["target"].tokens[0], res["spec"].tokens[0])
        same = "yes" if part is None else f"no, they part at output token {part}"
        sp = res["speedups"]
        if len(sp) > 1:
            print(f"speedup per round: {', '.join(f'{x:.3f}x' for x in sp)}")
        print(f"speedup: {res['speedup']:.3f}x" + (f" (median of {len(sp)} rounds, range {min(sp):.3f}-{max(sp):.3f}x; "
                                                    if len(sp) > 1 else " (") +
              "decode time per output token, prefill and compile excluded"
              + ("; after untimed warm-up calls while auto looked or compiled" if block_size == "auto" and not args.no_warmup else "")
              + f"); outputs identical: {same}")
    if demo:
        print("(demo: random weights - the text above is meaningless)")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    from dflash_jax.cli import run
    sys.exit(run(main))
