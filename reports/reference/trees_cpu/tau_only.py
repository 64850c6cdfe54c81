"""tau (no timing) of chains and trees on 50 held-out GSM8K prompts with the embedded pair, one pass per shape.

    python reports/reference/trees_cpu/tau_only.py TEMPERATURE "[(BLOCK, TREE_BUDGET or None), ...]"
"""
import sys, time, numpy as np
from dflash_jax import text as textlib
from dflash_jax.bench.models import load_models, reference_paths
from dflash_jax.prompts import load_dataset_prompts
from dflash_jax.decode import generate
tp, dp = reference_paths()
tok = textlib.load_tokenizer(tp)
target, drafter = load_models(tp, dp)
samples = load_dataset_prompts("gsm8k", None, 50)
prompts = [textlib.encode_chat(tok, s.chat(0, [])) for s in samples]
stop = textlib.stop_token_ids(tok, target.config)
T = float(sys.argv[1]); shapes = eval(sys.argv[2])
for blk, n in shapes:
    acc = []; t0 = time.time()
    for i, p in enumerate(prompts):
        r = generate(target, drafter, [p], max_new_tokens=256, temperature=T, stop_token_ids=stop, seed=0, block_size=blk, tree_budget=n, max_cache_len=768, row_ids=[i])
        acc += r.acceptance_lengths[0]
    print(f"T={T} block {blk} tree {n}: tau {np.mean(acc):.3f} ({len(acc)} cycles, {time.time()-t0:.0f}s)", flush=True)
