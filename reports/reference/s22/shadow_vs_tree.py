"""Shadow tree 7 in B=8 calls (paired with B=8's own commits) vs the two shapes' own runs: GSM8K test[:30], embedded
pair, T=0 (session 22). Run from the repository root: python reports/reference/s22/shadow_vs_tree.py"""
import numpy as np
import dflash_jax as dj
from dflash_jax import text as textlib
from dflash_jax.bench import load_models, reference_paths
from dflash_jax.prompts import load_dataset_prompts
tp, dp = reference_paths(); T, D = load_models(tp, dp); tok = textlib.load_tokenizer(tp)
stop = textlib.stop_token_ids(tok, T.config)
ss = load_dataset_prompts("gsm8k", None, 30)
sh = ch = 0.0; n_sh = 0
t7 = c7 = 0; b8 = c8 = 0
for s in ss:
    p = textlib.encode_chat(tok, s.chat(0, []))
    r = dj.generate(T, D, [p], max_new_tokens=256, block_size=8, stop_token_ids=stop, max_cache_len=1024, shadow_trees=7)
    for c, x in zip(r.chain_lengths[0], r.shadow_lengths[7][0]):
        if x > 0 and (c > 0 or -c >= 8):
            sh += x; ch += min(abs(c), 8); n_sh += 1
    b8 += sum(r.acceptance_lengths[0]); c8 += len(r.acceptance_lengths[0])
    r7 = dj.generate(T, D, [p], max_new_tokens=256, tree_budget=7, stop_token_ids=stop, max_cache_len=1024)
    t7 += sum(r7.acceptance_lengths[0]); c7 += len(r7.acceptance_lengths[0])
print(f"shadow tree 7 / B=8 own commits, paired: {sh / ch:.3f} over {n_sh} cycles")
print(f"tree 7 runs tau {t7 / c7:.3f}, B=8 runs tau {b8 / c8:.3f}: ratio {(t7 / c7) / (b8 / c8):.3f}")
