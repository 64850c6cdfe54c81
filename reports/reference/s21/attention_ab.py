import sys, contextlib, numpy as np
from dflash_jax import text as textlib, attention as att
from dflash_jax.bench import load_models
from dflash_jax.prompts import load_dataset_prompts
from dflash_jax.generate import generate
tp = "dflash_jax/assets/reference/target"
tok = textlib.load_tokenizer(tp)
target, drafter = load_models(tp, "dflash_jax/assets/reference/drafter")
n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
S = int(sys.argv[2]) if len(sys.argv) > 2 else 512
samples = load_dataset_prompts("gsm8k", "/work/shared/data", n)
prompts = [textlib.encode_chat(tok, s.chat(0, [])) for s in samples]
stop = textlib.stop_token_ids(tok, target.config)
@contextlib.contextmanager
def old():
    b = att.CPU_BLOCK; att.CPU_BLOCK = 512
    try:
        with att.use_impl("blockwise"):
            yield
    finally:
        att.CPU_BLOCK = b
variants = {"old": old, "new": contextlib.nullcontext}
shapes = {"target": (None, None, None), "B=4": (drafter, 4, None), "tree7": (drafter, None, 7), "tree23": (drafter, None, 23)}
res = {(v, s): [] for v in variants for s in shapes}
for rnd in range(4):
    for s, (d, b, t) in shapes.items():
        for v, ctx in variants.items():
            with ctx():
                tt = tokc = 0
                for p in prompts:
                    r = generate(target, d, [p], max_new_tokens=256, block_size=b, tree_budget=t, max_cache_len=S, stop_token_ids=stop)
                    tt += r.decode_time; tokc += r.num_generated
            if rnd > 0:  # round 0 = compile
                res[(v, s)].append(1e3 * tt / tokc)
for s in shapes:
    o, nw = np.array(res[("old", s)]), np.array(res[("new", s)])
    print(f"{s:>7}: ms/token old {np.median(o):.3f} ({o.min():.3f}-{o.max():.3f}) new {np.median(nw):.3f} ({nw.min():.3f}-{nw.max():.3f}) new/old {np.median(nw / o):.3f}", flush=True)
for s in list(shapes)[1:]:
    for v in variants:
        print(f"speedup {v} {s}: {np.median(np.array(res[(v, 'target')]) / np.array(res[(v, s)])):.3f}")
