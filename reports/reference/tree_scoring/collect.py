"""Collect, for target-only greedy outputs, the drafter's top-K log-probs per (anchor, depth) and the true tokens."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from dflash_jax import text as textlib
from dflash_jax.bench.models import load_models, reference_paths
from dflash_jax.prompts import load_dataset_prompts
from dflash_jax.decode import draft_logits, generate, taps_of
from dflash_jax.model import forward
from dflash_jax.drafter import draft_hidden_train, draft_logits_from_hidden

name, lo, hi, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
K = 64
tp, dp = reference_paths()
tok = textlib.load_tokenizer(tp)
target, drafter = load_models(tp, dp)
stop = textlib.stop_token_ids(tok, target.config)
samples = load_dataset_prompts(name, None, hi)[lo:hi]
prompts = [textlib.encode_chat(tok, s.chat(0, [])) for s in samples]
Bd = drafter.config.block_size
res = generate(target, None, prompts, block_size=None, max_new_tokens=256, temperature=0.0, stop_token_ids=stop)

@jax.jit
def dl(full, apos):
    _, _, feats = forward(target, full, None, taps_of(drafter))
    h = draft_hidden_train(drafter, target, feats, jnp.take_along_axis(full, apos, 1), apos, Bd)
    lg = draft_logits_from_hidden(drafter, target, h[:, :, 1:]).astype(jnp.float32)
    lp = jax.nn.log_softmax(lg, -1)
    v, i = jax.lax.top_k(lp, K)
    return v[0], i[0]

recs = []
for k, (p, o) in enumerate(zip(prompts, res.tokens)):
    full = np.asarray(list(p) + list(o), np.int32)
    L = len(full)
    T = -(-L // 64) * 64 + 64
    fp = np.zeros((1, T), np.int32); fp[0, :L] = full
    apos = np.arange(len(p), L, dtype=np.int32)  # anchors: every generated token (the committed one)
    A = -(-len(apos) // 64) * 64
    ap = np.full((1, A), len(p), np.int32); ap[0, :len(apos)] = apos
    v, i = dl(jnp.asarray(fp), jnp.asarray(ap))
    recs.append(dict(plen=len(p), full=full, vals=np.asarray(v)[:len(apos)], ids=np.asarray(i)[:len(apos)]))
    if k == 0:  # check against the decode-path draft logits
        ref = np.asarray(draft_logits(target, drafter, list(full[:len(p) + 5])))
        refi = np.argsort(-ref, -1)[:, :5]
        print("check top5 equal:", np.array_equal(refi, recs[0]["ids"][4, :, :5]), flush=True)
np.save(out, np.array(recs, dtype=object), allow_pickle=True)
print("saved", out, len(recs), sum(len(r["full"]) - r["plen"] for r in recs))
