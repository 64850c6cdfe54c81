"""DFlash (v1) vs DFlash2 drafters trained on the embedded reference target with the same data, steps and
seeds; tau of each side by side on held-out GSM8K test questions at T = 0 (the full block's chain).

    python reports/dflash2/compare.py [--steps 300] [--prompts 256] [--eval 64] [--work runs/dflash2_compare]

Data: the target's greedy answers to the first --prompts GSM8K training questions (configs/reference_drafter.yaml
with smaller sizes). Both drafters: 1 layer, block 16, the reference drafter's taps and optimizer; DFlash2 adds the
convs and a selector (rank 64, top 16) trained with train.selector_weight 1. Writes <work>/compare.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--eval", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gsm8k", default=os.path.join(ROOT, "..", "shared", "data", "gsm8k"))
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "dflash2_compare"))
    a = p.parse_args(argv)
    from dflash_jax import generate, load_drafter, load_target
    from dflash_jax.embedded import reference_paths
    from dflash_jax.prompts import format_gsm8k
    from dflash_jax.reference import write_prompt_file
    from dflash_jax.reference_data import read_jsonl
    from dflash_jax.text import load_tokenizer
    from dflash_jax.training import load_config
    from dflash_jax.training.pipeline import run

    tpath, _ = reference_paths()
    os.makedirs(a.work, exist_ok=True)
    prompts = os.path.join(a.work, "prompts.jsonl")
    if not os.path.exists(prompts):
        write_prompt_file(os.path.join(a.gsm8k, "train.jsonl"), prompts, a.prompts)
    common = [f"target.path={tpath}", f"data.prompts={prompts}", f"data.output_dir={a.work}/data",
              f"data.max_prompts={a.prompts}", "data.generation.max_new_tokens=192", "data.max_length=384",
              f"train.steps={a.steps}", "train.num_anchors=16", "train.batch_size=8", "train.loss_chunk=16",
              "train.length_buckets=[192,256,320,384]", "eval.every_steps=0", "eval.generate_prompts=0",
              "export.dtype=float32", "log.every_steps=50"]
    kinds = {"dflash": [], "dflash2": ["drafter.kind=dflash2", "drafter.selector_rank=64", "drafter.selector_top_k=16",
                                       "drafter.conv_group_size=16"]}
    out = {"steps": a.steps, "train_prompts": a.prompts, "eval_questions": a.eval, "times_s": {}}
    for i, (kind, extra) in enumerate(kinds.items()):
        cfg = load_config(os.path.join(ROOT, "configs", "reference_drafter.yaml"), common + extra + [
            f"checkpoint.dir={a.work}/{kind}/ckpt", f"export.dir={a.work}/{kind}/export"])
        t0 = time.time()
        run(cfg, (("generate",) if i == 0 else ()) + ("train", "export"))
        out["times_s"][kind] = round(time.time() - t0, 1)
    target = load_target(tpath)
    tok = load_tokenizer(tpath)
    test = [format_gsm8k(r)[0] for r in read_jsonl(os.path.join(a.gsm8k, "test.jsonl"))[:a.eval]]
    ref = generate(target, None, test, tokenizer=tok, max_new_tokens=a.max_new_tokens)
    for kind in kinds:
        drafter = load_drafter(f"{a.work}/{kind}/export", target)
        res = generate(target, drafter, test, tokenizer=tok, max_new_tokens=a.max_new_tokens, block_size=None)
        assert res.tokens == ref.tokens, f"{kind}: speculative output differs from target-only decoding"
        out[kind] = {"tau": res.tau}
    out["ratio"] = out["dflash2"]["tau"] / out["dflash"]["tau"]
    with open(os.path.join(a.work, "compare.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(f"GSM8K held-out ({a.eval} questions, T=0, B=16): tau DFlash {out['dflash']['tau']:.3f}  "
          f"DFlash2 {out['dflash2']['tau']:.3f}  ratio {out['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
