"""Each shape's own walk vs the estimates auto forms from other shapes' cycles (session 22).

30 GSM8K prompts (embedded pair, T=0), each run as B=8 (with shadow tree 7) and as tree 7; three Evidence objects
without decay fed with the tree runs only, the B=8 runs only (their shadow trees give tree 7's gain), or both; prints
each one's tree-7 gain and its tau estimates of tree 7 and B=8 (their own runs: tree 7 3.615, B=8 3.172 tokens a
cycle). Run from the repository root: python reports/reference/s22/walk_check.py
"""
import numpy as np, sys
import dflash_jax as dj
from dflash_jax import text as textlib, autoshape as au
from dflash_jax.bench import load_models, reference_paths
from dflash_jax.prompts import load_dataset_prompts
tp, dp = reference_paths(); T, D = load_models(tp, dp); tok = textlib.load_tokenizer(tp)
stop = textlib.stop_token_ids(tok, T.config)
ss = load_dataset_prompts("gsm8k", None, 30)
au.CALL_HALF_LIFE = au.HALF_LIFE = 1e9
evs = {m: au.Evidence(full_block=16) for m in ("tree_only", "chain_shadow", "mixed")}
for i, s in enumerate(ss):
    p = textlib.encode_chat(tok, s.chat(0, []))
    r8 = dj.generate(T, D, [p], max_new_tokens=256, block_size=8, stop_token_ids=stop, max_cache_len=1024, shadow_trees=7)
    r7 = dj.generate(T, D, [p], max_new_tokens=256, tree_budget=7, stop_token_ids=stop, max_cache_len=1024)
    for m, ev in evs.items():
        if m in ("tree_only", "mixed"):
            ev.add(au.Shape(16, 7), r7.acceptance_lengths, r7.chain_lengths)
        if m in ("chain_shadow", "mixed"):
            ev.add(au.Shape(8), r8.acceptance_lengths, r8.chain_lengths, shadows=r8.shadow_lengths)
        for ev2 in [ev]:
            ev2.add_lengths([len(r7.tokens[0])])
for m, ev in evs.items():
    print(m, "gain", round(ev.tree_gain(au.Shape(16, 7)), 3), "tau tree7", round(ev.tau(au.Shape(16, 7)), 3), "tau B8", round(ev.tau(au.Shape(8)), 3), "ratio", round(ev.tau(au.Shape(16, 7)) / ev.tau(au.Shape(8)), 3))
