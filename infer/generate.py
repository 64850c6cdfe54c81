"""Generate text for one prompt, target-only or with a DFlash drafter (speedup shown by default).

    python -m infer.generate --target DIR [--drafter DIR] --prompt "..." [--block-size N]
        [--temperature T] [--top-k K] [--top-p P] [--max-new-tokens N] [--no-chat-template]
        [--compare | --no-compare] [--seed S] [--dtype float32|bfloat16]

Without --target: the embedded reference pair (dflash_jax/assets/reference) when present, else a tiny
random demo pair built in a temporary directory (gibberish output).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

# A held-out GSM8K test question in the paper's math prompt format (the reference pair never saw it).
DEFAULT_PROMPT = ("Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
                  "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 "
                  "per fresh duck egg. How much in dollars does she make every day at the farmers' market?"
                  "\nPlease reason step by step, and put your final answer within \\boxed{}.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.generate", description=__doc__.split("\n")[0])
    p.add_argument("--target", help="target model directory (HF format); default: reference pair or random demo")
    p.add_argument("--drafter", help="DFlash drafter directory (z-lab format)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the target directory)")
    p.add_argument("--prompt", default=None, help="user prompt (default: a GSM8K question)")
    p.add_argument("--block-size", type=int, default=None, help="drafter block size (default: the drafter's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--no-chat-template", action="store_true", help="feed the raw prompt text")
    p.add_argument("--thinking", choices=("auto", "on", "off"), default="auto",
                   help="pass enable_thinking to the chat template (Qwen3); auto = template default")
    cmp = p.add_mutually_exclusive_group()
    cmp.add_argument("--compare", dest="compare", action="store_true", default=None,
                     help="also run target-only on the same prompt and print the speedup (default with a drafter)")
    cmp.add_argument("--no-compare", dest="compare", action="store_false")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    from dflash_jax.bench import add_mesh_args
    add_mesh_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dflash_jax import bench, text

    if args.drafter and not args.target:
        bench.main_error("--drafter needs --target")
    tmp = None
    demo = False
    target_path, drafter_path = args.target, args.drafter
    if target_path is None:
        target_path, drafter_path = bench.reference_paths()
        if target_path is None:
            tmp = tempfile.TemporaryDirectory(prefix="dflash_demo_")
            print(bench.demo_banner(), flush=True)
            from dflash_jax.prompts import default_data_dir
            target_path, drafter_path = bench.build_demo_models(tmp.name, data_dir=default_data_dir())
            demo = True
        else:
            print(f"using the embedded reference pair: {target_path}" + (f" + {drafter_path}" if drafter_path else ""))
    try:
        mesh = bench.mesh_from_args(args)
        tok = text.load_tokenizer(args.tokenizer or target_path)
        target, drafter = bench.load_models(target_path, drafter_path, args.dtype, mesh)
    except (FileNotFoundError, ValueError) as e:
        bench.main_error(str(e))
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if not prompt:
        bench.main_error("--prompt is empty")
    thinking = {"auto": None, "on": True, "off": False}[args.thinking]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ids = text.encode_chat(tok, prompt, use_chat_template=not args.no_chat_template, enable_thinking=thinking)
        except ValueError as e:
            bench.main_error(str(e))
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    stop = text.stop_token_ids(tok, target.config, target_path)
    compare = args.compare if args.compare is not None else drafter is not None
    gk = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              stop_token_ids=stop, seed=args.seed)
    try:
        res = bench.compare_prompt(target, drafter, ids, gen_kwargs=gk, block_size=args.block_size,
                                   compare=compare, warmup=not args.no_warmup)
    except ValueError as e:
        bench.main_error(str(e))
    main_res = res["spec"] or res["target"]
    print(f"prompt: {len(ids)} tokens; stop ids {stop}")
    print("=" * 30 + " output " + "=" * 30)
    print(text.decode(tok, main_res.tokens[0], stop))
    print("=" * 68)
    if res["spec"] is not None:
        r = res["spec"]
        print(f"[dflash B={r.block_size}] {len(r.tokens[0])} tokens, decode {r.decode_tokens_per_second:.2f} tok/s "
              f"({1e3 * r.time_per_output_token:.2f} ms/token), prefill {1e3 * r.prefill_time:.1f} ms, "
              f"tau {r.tau:.3f} over {r.cycles} cycles")
        print(f"acceptance lengths: {r.histogram()[1:]}")
    if res["target"] is not None:
        r = res["target"]
        print(f"[target-only] {len(r.tokens[0])} tokens, decode {r.decode_tokens_per_second:.2f} tok/s "
              f"({1e3 * r.time_per_output_token:.2f} ms/token), prefill {1e3 * r.prefill_time:.1f} ms")
    if res["speedup"] is not None:
        same = res["spec"].tokens[0] == res["target"].tokens[0]
        print(f"speedup: {res['speedup']:.3f}x (decode time per output token, prefill and compile excluded); "
              f"outputs identical: {same}")
    if demo:
        print("(demo: random weights - the text above is meaningless)")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
