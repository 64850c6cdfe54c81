"""Does auto's per-depth acceptance model, fed by a chain's own cycles, price that chain right? (session 22)

Runs B=8 on 30 GSM8K prompts (embedded pair, T=0), feeds every call to an Evidence without decay, and prints per
part of a row (0: first EARLY_TOKENS generated tokens, 1: up to LOOK_TOKENS, 2: later) the chain's own mean commit
(1 + accepted drafts, before stop cuts, at most 8) beside the model's chain_tau(8, part), its per-depth
acceptance and the histogram. Run from the repository root: python reports/reference/s22/model_vs_chain.py
"""
import numpy as np

import dflash_jax as dj
from dflash_jax import autoshape as au, text as textlib
from dflash_jax.bench import load_models, reference_paths
from dflash_jax.prompts import load_dataset_prompts

B = 8
tp, dp = reference_paths()
target, drafter = load_models(tp, dp)
tok = textlib.load_tokenizer(tp)
stop = textlib.stop_token_ids(tok, target.config)
au.CALL_HALF_LIFE = au.HALF_LIFE = 1e9  # no decay: the model sees every cycle alike
ev = au.Evidence(full_block=drafter.config.block_size)
per = [[] for _ in range(au.NPARTS)]
for s in load_dataset_prompts("gsm8k", None, 30):
    prompt = textlib.encode_chat(tok, s.chat(0, []))
    r = dj.generate(target, drafter, [prompt], max_new_tokens=256, block_size=B, stop_token_ids=stop,
                    max_cache_len=1024)
    ev.add(au.Shape(B), r.acceptance_lengths, r.chain_lengths)
    for part, c in zip(au._parts(r.acceptance_lengths[0]), r.chain_lengths[0]):
        per[part].append(min(abs(c), B))
for q in range(au.NPARTS):
    print(f"part {q}: chain's own {np.mean(per[q]):.3f}, model {ev.chain_tau(B, q):.3f} ({len(per[q])} cycles)")
    print("   acceptance per depth", [round(x, 3) for x in ev.accept_probs(q)[:B]])
    print("   histogram of commits 1..B", np.bincount(per[q], minlength=B + 1)[1:].tolist())
