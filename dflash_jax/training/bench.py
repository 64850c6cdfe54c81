"""Benchmarks of the training pipeline on CPU (figures printed; nothing asserted).

  python -m train.bench data   [--prompts N --slots B --refill R --reps 3]
      data-generation tokens/s with continuous batching (refill) vs a static batch (no refill), the
      same GSM8K prompts through the same engine shapes, on the embedded GSM8K-pretrained reference
      target (its answers end with eos at realistic, varied lengths); median of --reps with range.
  python -m train.bench train  --config configs/tiny_cpu.yaml [--steps N]
      training sequences/s, tokens/s and padding with length-grouped batches vs random batches.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fmt(xs: list[float], unit: str = "") -> str:
    return f"{statistics.median(xs):.1f}{unit} [{min(xs):.1f}, {max(xs):.1f}]"


def gsm8k_prompt_ids(tok, n: int, split: str = "train") -> list[list[int]]:
    """Chat-formatted GSM8K questions (the reference target's training format) as token ids."""
    from ..prompts import format_gsm8k
    from ..reference import read_jsonl
    rows = read_jsonl(os.path.join(ROOT, "..", "shared", "data", "gsm8k", f"{split}.jsonl"))[:n]
    out = []
    for r in rows:
        text = tok.apply_chat_template([{"role": "user", "content": format_gsm8k(r)[0]}], tokenize=False,
                                       add_generation_prompt=True)
        out.append([int(i) for i in tok(text, add_special_tokens=False)["input_ids"]])
    return out


def bench_data(args) -> dict:
    from ..engine import Engine, Request
    from ..model import load_target
    from ..reference import ASSETS
    from ..text import load_tokenizer, stop_token_ids
    path = os.path.join(ASSETS, "target")
    target = load_target(path, dtype="float32")
    tok = load_tokenizer(path)
    stops = tuple(stop_token_ids(tok, target.config, path))
    prompts = gsm8k_prompt_ids(tok, args.prompts)
    prompts.sort(key=len, reverse=True)  # as generate_data does
    P = max(len(p) for p in prompts)
    reqs = [Request(p, i, args.max_new, stops) for i, p in enumerate(prompts)]
    res = {}
    outputs = {}
    for mode, refill in (("refill", args.refill), ("static", args.slots)):
        eng = Engine(target, None, slots=args.slots, prompt_len=P, max_new_tokens=args.max_new, refill=refill,
                     max_stop_ids=len(stops))
        tps, secs = [], []
        for rep in range(args.reps + 1):  # the first run compiles (not counted)
            eng.stats = type(eng.stats)()
            t0 = time.perf_counter()
            outs = sorted(eng.run(reqs), key=lambda c: c.index)
            wall = time.perf_counter() - t0 - eng.stats.compile_time
            if rep:
                tps.append(eng.stats.tokens / wall)
                secs.append(wall)
        outputs[mode] = [c.tokens for c in outs]
        res[mode] = {"tokens_per_s": tps, "seconds": secs, "tokens": eng.stats.tokens,
                     "compilations": dict(eng.compilations), "prefill_calls": eng.stats.prefill_calls,
                     "decode_calls": eng.stats.decode_calls}
    lens = [len(t) for t in outputs["refill"]]
    print(f"data generation, reference target (GSM8K-pretrained, {sum(x.size for x in _leaves(target.params)) / 1e6:.1f}M "
          f"params, float32) on {args.prompts} GSM8K train prompts ({min(map(len, prompts))}..{P} tokens), "
          f"max_new {args.max_new}, {args.slots} slots, greedy; responses {min(lens)}..{max(lens)} tokens "
          f"(median {int(np.median(lens))}); median of {args.reps} runs [min, max], compile excluded")
    print(f"{'mode':8} {'tokens/s':>24} {'seconds':>22} {'tokens':>7} {'prefills':>8} {'decodes':>8} compilations")
    for mode in ("refill", "static"):
        r = res[mode]
        print(f"{mode:8} {_fmt(r['tokens_per_s']):>24} {_fmt(r['seconds'], ' s'):>22} {r['tokens']:>7} "
              f"{r['prefill_calls']:>8} {r['decode_calls']:>8} {r['compilations']}")
    same = outputs["refill"] == outputs["static"]
    print(f"refill / static: {statistics.median(res['refill']['tokens_per_s']) / statistics.median(res['static']['tokens_per_s']):.2f}x; "
          f"identical outputs: {same}")
    res["identical_outputs"] = same
    return res


def _leaves(tree):
    import jax
    return jax.tree_util.tree_leaves(tree)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("data", help="data generation: continuous batching vs static batches")
    d.add_argument("--prompts", type=int, default=128)
    d.add_argument("--slots", type=int, default=32)
    d.add_argument("--refill", type=int, default=8)
    d.add_argument("--max-new", type=int, default=256)
    d.add_argument("--reps", type=int, default=3)
    t = sub.add_parser("train", help="training throughput and padding")
    t.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny_cpu.yaml"))
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--reps", type=int, default=3)
    t.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.what == "data":
        bench_data(args)
    else:
        bench_train(args)
    return 0


def bench_train(args) -> dict:
    raise NotImplementedError


if __name__ == "__main__":
    sys.exit(main())
