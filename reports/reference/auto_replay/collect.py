"""Collect, for the sweep's prompts (every turn), the target-only greedy output and the drafter's top-K
log-probs per (anchor, depth): what any chain or draft tree would accept at every position (T = 0).

    python reports/reference/auto_replay/collect.py gsm8k:50,math500:10,humaneval:10,mbpp:10,mt-bench:10 OUT.npy
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from dflash_jax import text as textlib
from dflash_jax.bench.models import load_models, reference_paths
from dflash_jax.prompts import load_dataset_prompts
from dflash_jax.decode import generate, taps_of
from dflash_jax.model import forward
from dflash_jax.drafter import draft_hidden_train, draft_logits_from_hidden

K = 16
CHAINS = (2, 4, 8)  # chains shorter than the drafter's block draft with a block of their own (not the full one cut)
tp, dp = reference_paths()
tok = textlib.load_tokenizer(tp)
target, drafter = load_models(tp, dp)
stop = textlib.stop_token_ids(tok, target.config)
Bd = drafter.config.block_size


@jax.jit
def dl(full, apos):
    _, _, feats = forward(target, full, None, taps_of(drafter))
    h = draft_hidden_train(drafter, target, feats, jnp.take_along_axis(full, apos, 1), apos, Bd)
    lp = jax.nn.log_softmax(draft_logits_from_hidden(drafter, target, h[:, :, 1:]).astype(jnp.float32), -1)
    v, i = jax.lax.top_k(lp, K)
    return v[0], i[0]


def top1(full, apos, B):
    """The drafter's top-1 per depth with a B-token block: [anchors, B - 1]."""
    _, _, feats = forward(target, full, None, taps_of(drafter))
    h = draft_hidden_train(drafter, target, feats, jnp.take_along_axis(full, apos, 1), apos, B)
    return jnp.argmax(draft_logits_from_hidden(drafter, target, h[:, :, 1:]), -1)[0]


top1 = jax.jit(top1, static_argnums=2)


out = {}
for spec in sys.argv[1].split(","):
    name, n = spec.split(":")
    samples = load_dataset_prompts(name, None, int(n))
    enc = lambda m: textlib.encode_chat(tok, m)
    answers = [[] for _ in samples]
    calls = []
    for turn in range(max(s.num_turns for s in samples)):
        rows = [i for i, s in enumerate(samples) if s.num_turns > turn]
        for i in rows:
            p = enc(samples[i].chat(turn, answers[i]))
            o = generate(target, None, [p], max_new_tokens=256, temperature=0.0, stop_token_ids=stop).tokens[0]
            answers[i].append(textlib.decode(tok, o, stop))
            full = np.asarray(list(p) + list(o), np.int32)
            L = len(full)
            T = -(-L // 64) * 64 + 64
            fp = np.zeros((1, T), np.int32)
            fp[0, :L] = full
            apos = np.arange(len(p), L, dtype=np.int32)
            A = -(-len(apos) // 64) * 64
            ap = np.full((1, A), len(p), np.int32)
            ap[0, :len(apos)] = apos
            v, ids = dl(jnp.asarray(fp), jnp.asarray(ap))
            chains = {B: np.asarray(top1(jnp.asarray(fp), jnp.asarray(ap), B))[:len(apos)].astype(np.int16)
                      for B in CHAINS if B < Bd}
            calls.append(dict(sample=i, turn=turn, plen=len(p), full=full, chains=chains,
                              vals=np.asarray(v)[:len(apos)].astype(np.float16), ids=np.asarray(ids)[:len(apos)].astype(np.int16)))
    # the sweep's order: sample by sample, turns in order
    calls.sort(key=lambda c: (c["sample"], c["turn"]))
    out[name] = calls
    print(name, len(calls), "calls", sum(len(c["full"]) - c["plen"] for c in calls), "tokens", flush=True)
np.save(sys.argv[2], np.array(out, dtype=object), allow_pickle=True)
