"""auto alone, call after call (no fixed shapes interleaved as in the sweep): GSM8K's 50 prompts once, then MATH-500's
10 prompts three times, on a fresh evidence file and the cost curve of a run (copied into the cache dir given),
printing every call's choice and, after each set, the evidence's estimates and the cycle times it has seen.

    mkdir -p /tmp/auto_seq && cp ~/.cache/dflash_jax/shape_costs.json /tmp/auto_seq/
    python reports/reference/auto_cpu_s16/sequential.py /tmp/auto_seq
"""
import os
import sys

os.environ["DFLASH_JAX_CACHE"] = sys.argv[1]
if os.path.exists(os.path.join(sys.argv[1], "evidence.json")):
    sys.exit(f"{sys.argv[1]}/evidence.json exists: this run starts from fresh evidence")

import dflash_jax as dj  # noqa: E402
from dflash_jax import autoshape as au, bench, text as textlib  # noqa: E402
from dflash_jax.prompts import load_dataset_prompts  # noqa: E402

tp, dp = bench.reference_paths()
tok = textlib.load_tokenizer(tp)
target, drafter = bench.load_models(tp, dp, "float32")
gk = dict(max_new_tokens=256, temperature=0.0, stop_token_ids=textlib.stop_token_ids(tok, target.config))
shapes = {s.key: s for s in au.candidate_shapes(drafter.config.block_size)}
for name, n, passes in [("gsm8k", 50, 1), ("math500", 10, 3)]:
    prompts = [textlib.encode_chat(tok, s.chat(0, [])) for s in load_dataset_prompts(name, None, n)]
    for p in range(passes):
        for i, pr in enumerate(prompts):
            r = dj.generate(target, drafter, [pr], block_size="auto", tree_budget="auto", max_cache_len=1024, **gk)
            print(f"{name} pass {p + 1} #{i}: {len(r.tokens[0])} tokens, tau {r.tau:.2f} | {r.auto_reason}", flush=True)
    ev = au.evidence_for(target, drafter)
    times = {k: f"{v[0] / v[1] * 1e3:.2f} ms x {v[1]:.0f}" for k, v in ev.time.items() if v[1] > 0}
    print(f"after {name}: whole-call tau estimates B=4 {ev.tau(shapes['B4']):.2f}, B=8 {ev.tau(shapes['B8']):.2f}; "
          f"mean length {ev.lengths[0] / ev.lengths[1]:.0f}; cycle times seen (decayed) {times}", flush=True)
