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
    from ..reference_data import read_jsonl
    rows = read_jsonl(os.path.join(ROOT, "..", "shared", "data", "gsm8k", f"{split}.jsonl"))[:n]
    out = []
    for r in rows:
        text = tok.apply_chat_template([{"role": "user", "content": format_gsm8k(r)[0]}], tokenize=False,
                                       add_generation_prompt=True)
        out.append([int(i) for i in tok(text, add_special_tokens=False)["input_ids"]])
    return out


def bench_data(args) -> dict:
    from ..engine import Engine, Request
    from ..weights import load_target
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


def gsm8k_reference_lengths(n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(sequence lengths, prompt lengths) of GSM8K train chats (question + worked solution) in the
    embedded reference tokenizer: the shape of GSM8K self-distillation data."""
    from ..reference import ASSETS
    from ..reference_data import encode_example, read_jsonl
    from ..text import load_tokenizer
    tok = load_tokenizer(os.path.join(ASSETS, "target"))
    rows = read_jsonl(os.path.join(ROOT, "..", "shared", "data", "gsm8k", "train.jsonl"))[:n]
    enc = [encode_example(tok, r) for r in rows]
    return np.array([len(ids) for ids, _ in enc]), np.array([pl for _, pl in enc])


def _lengths_data(lens, plens):
    from ..training.data import SequenceData
    return SequenceData.from_lists([np.zeros(int(n), np.int32) for n in lens], plens)


def epoch_padding(data, batch_size, grad_accum, buckets, group_steps, seed=0) -> float:
    from ..training.blocks import BatchSchedule, padding_fraction
    s = BatchSchedule(data, batch_size, grad_accum, 1, seed, buckets, group_steps)
    return padding_fraction(s.batch(i) for i in range(s.steps_per_epoch))


def bench_train(args) -> dict:
    import jax

    from ..model import relayout
    from ..weights import load_target
    from ..training.blocks import BatchSchedule, default_buckets, padding_fraction
    from ..training.config import load_config
    from ..training.data import data_is_complete, generate_data, load_sequences, split_train_eval
    from ..training.loss import DrafterObjective
    from ..training.optim import make_optimizer
    from ..training.pipeline import drafter_config, ensure_target, frozen_target_shardings, initial_drafter_params, \
        make_training_mesh
    from ..training.trainer import Trainer
    cfg = load_config(args.config, args.overrides)
    t = cfg.train
    out = {}
    # padding on GSM8K-shaped data (real GSM8K chat lengths, reference tokenizer), one epoch
    lens, plens = gsm8k_reference_lengths()
    g = _lengths_data(lens, plens)
    gb = default_buckets(int(lens.max()))
    group = t.length_grouping or 64
    print(f"GSM8K train chats in the reference tokenizer: {len(lens)} sequences, {lens.min()}..{lens.max()} tokens "
          f"(median {int(np.median(lens))}); default buckets {gb}")
    for bs, acc in ((16, 1), (32, 4)):
        r, gr = epoch_padding(g, bs, acc, gb, 0), epoch_padding(g, bs, acc, gb, group)
        print(f"  padding over an epoch, batch {bs} x accum {acc}: random batches {100 * r:.1f}%, "
              f"length-grouped ({group} steps/window) {100 * gr:.1f}%")
        out[f"gsm8k_padding_{bs}x{acc}"] = {"random": r, "grouped": gr}
    # the tiny config: data (generated if missing) and training throughput
    ensure_target(cfg, log=print)
    if not data_is_complete(cfg):
        generate_data(cfg, progress=False)
    data = load_sequences(cfg.data.output_dir)
    train_data, _ = split_train_eval(data, cfg.eval.num_sequences)
    buckets = sorted(t.length_buckets) if t.length_buckets else default_buckets(
        max(cfg.data.max_length, int(data.lengths.max())))
    target = relayout(load_target(cfg.target.path, dtype=cfg.target.dtype, layout="stacked"), "stacked")
    dcfg = dataclasses_replace(drafter_config(cfg, target.config, t.param_dtype), dtype=t.compute_dtype)
    mesh = make_training_mesh(cfg)
    print(f"{args.config}: {len(train_data)} training sequences, {train_data.lengths.min()}..{train_data.lengths.max()} "
          f"tokens; batch {t.batch_size} x accum {t.grad_accum}, {t.num_anchors} anchors, {args.steps} steps x "
          f"{args.reps} runs (compile excluded), {jax.device_count()} {jax.devices()[0].platform} device(s)")
    print(f"{'batching':10} {'padding':>8} {'programs':>8} {'sequences/s':>22} {'tokens/s':>24}")
    for name, gs in (("grouped", group), ("random", 0)):
        sched = BatchSchedule(train_data, t.batch_size, t.grad_accum, t.num_anchors, t.seed, buckets, gs)
        pad = padding_fraction(sched.batch(i) for i in range(sched.steps_per_epoch))
        tx, lr_fn = make_optimizer(cfg.optimizer, 1000)
        trainer = Trainer(DrafterObjective(dcfg, cfg.gamma, t.loss_chunk, t.anchor_chunk, t.remat),
                          initial_drafter_params(cfg, target), target,
                          tx, mesh=mesh, schedule=lr_fn, param_dtype=t.param_dtype,
                          frozen_shardings=frozen_target_shardings(target, mesh))
        state = trainer.init_state(t.seed)
        batches = [sched.batch(i) for i in range(args.steps)]
        real = sum(int(b["lengths"].sum()) for b in batches)
        seqs = sum(int((b["lengths"] > 0).sum()) for b in batches)
        for b in batches:  # compile every length once
            state, aux, _ = trainer.train_step(state, b)
        jax.block_until_ready(aux)
        sps, tps = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for b in batches:
                state, aux, _ = trainer.train_step(state, b)
            jax.block_until_ready((state, aux))
            dt = time.perf_counter() - t0
            sps.append(seqs / dt)
            tps.append(real / dt)
        n_prog = len({b["tokens"].shape for b in batches})
        print(f"{name:10} {100 * pad:7.1f}% {n_prog:8d} {_fmt(sps):>22} {_fmt(tps):>24}")
        out[name] = {"padding": pad, "sequences_per_s": sps, "tokens_per_s": tps, "programs": n_prog}
    return out


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


if __name__ == "__main__":
    sys.exit(main())
