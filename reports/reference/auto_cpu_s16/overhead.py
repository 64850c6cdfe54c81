"""Fixed per-call time in a generate call's decode_time (embedded pair, one 145-token prompt, no stop tokens):
decode_time = a + b x cycles fitted over max_new_tokens 8 ... 128, 4 timed rounds (a first, compiling, left out).

    python reports/reference/auto_cpu_s16/overhead.py
"""
import numpy as np

import dflash_jax as dj
from dflash_jax import bench

tp, dp = bench.reference_paths()
target, drafter = bench.load_models(tp, dp, "float32")
prompt = [list(range(5, 150))]
rows = []
for rep in range(5):
    for n in (8, 16, 32, 64, 128):
        for d, bs in ((None, None), (drafter, 8)):
            r = dj.generate(target, d, prompt, max_new_tokens=n, stop_token_ids=[], block_size=bs, max_cache_len=1024)
            if rep:
                rows.append((bs or 1, n, r.cycles, r.decode_time))
for bs in (1, 8):
    x = np.array([(c, t) for b, n, c, t in rows if b == bs], float)
    (a, b), *_ = np.linalg.lstsq(np.c_[np.ones(len(x)), x[:, 0]], x[:, 1], rcond=None)
    print(f"{'target-only' if bs == 1 else 'B=8'}: decode_time = {a * 1e3:.2f} ms + {b * 1e3:.3f} ms x cycles; ms per "
          "cycle (median) at max_new_tokens " + ", ".join(
              f"{n}: {np.median([t / c * 1e3 for bb, nn, c, t in rows if bb == bs and nn == n]):.3f}"
              for n in (8, 16, 32, 64, 128)))
