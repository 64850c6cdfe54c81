import sys, time, numpy as np
from dflash_jax import bench, text as textlib
from dflash_jax.bench import _gen, cache_len_for
from dflash_jax.prompts import load_dataset_prompts
from dflash_jax.reference_bench import _widest
tp, dp = bench.reference_paths()
tok = textlib.load_tokenizer(tp)
target, drafter = bench.load_models(tp, dp)
name = sys.argv[1] if len(sys.argv) > 1 else "mbpp"
samples = load_dataset_prompts(name, None, 20)
stop = textlib.stop_token_ids(tok, target.config)
gk = dict(max_new_tokens=256, temperature=0.0, top_k=0, top_p=1.0, stop_token_ids=stop, seed=0)
prompts = [textlib.encode_chat(tok, s.chat(0, [])) for s in samples]
S = cache_len_for([max(len(p) for p in prompts)], 256, _widest([4, 8], [7], 16, True))
for i, p in enumerate(prompts[:1]):
    _gen(target, None, [p], gk, S, None, [0]); _gen(target, drafter, [p], gk, S, 16, [0], 7); _gen(target, drafter, [p], gk, S, 4, [0])
res = {"after_T": [], "after_tree7": [], "after_B4": []}
for rep in range(3):
    tot = {k: 0.0 for k in res}; toks = 0
    for i, p in enumerate(prompts):
        for k in res:
            if k == "after_T": _gen(target, None, [p], gk, S, None, [i])
            elif k == "after_tree7": _gen(target, drafter, [p], gk, S, 16, [i], 7)
            else: _gen(target, drafter, [p], gk, S, 4, [i])
            r = _gen(target, None, [p], gk, S, None, [i])
            tot[k] += r.decode_time
    for k in res: res[k].append(tot[k])
    print(rep, {k: round(v, 4) for k, v in tot.items()}, flush=True)
for k in res: print(k, np.median(res[k]), [round(x/np.median(res['after_T']), 3) for x in res[k]])
