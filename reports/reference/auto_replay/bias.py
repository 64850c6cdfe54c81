"""Is auto's acceptance model biased? Feed `autoshape.Evidence` one shape's calls over collected answers (collect.py)
and compare its whole-call estimate before each call with the tokens per cycle that call then committed; then the same
with 64-token looks only (every call, or every 4th with target-only between), as while auto runs target-only.

    python reports/reference/auto_replay/bias.py /tmp/replay.npy [gsm8k]
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replay as R  # noqa: E402
from dflash_jax import autoshape as au  # noqa: E402


def shape(key):
    return next(s for s in au.candidate_shapes(R.D + 1) if s.key == key)


def main():
    data = np.load(sys.argv[1], allow_pickle=True).item()
    name = sys.argv[2] if len(sys.argv) > 2 else "gsm8k"
    calls = [R.Call(r) for r in data[name] if r["turn"] == 0]
    print(f"{name}, {len(calls)} answers; whole calls of one shape (a pass to fill the evidence, then a pass measured):")
    for key in ["B4", "B8", "B16", "tree7", "tree15"]:
        sh, ev = shape(key), au.Evidence(full_block=R.D + 1)
        est, toks, cyc = [], 0, 0
        for rep in range(2):
            for c in calls:
                acc, ch, _ = c.run(key, 0, 256)
                if rep:
                    est.append(ev.tau(sh))
                    toks, cyc = toks + sum(acc) + 1, cyc + len(acc)
                ev.add(sh, [acc], [ch] if sh.block > 1 else None)
                ev.add_lengths([sum(acc) + 1])
        print(f"  {key:7s} estimate before each call {np.mean(est):.3f}, committed {toks / cyc:.3f} tokens per cycle")
    print("64-token looks only, the rest of each call target-only:")
    for key in ["B4", "B8"]:
        sh = shape(key)
        for every in (1, 4):
            ev, est = au.Evidence(full_block=R.D + 1), []
            for rep in range(2):
                for i, c in enumerate(calls):
                    if i % every == 0:
                        acc, ch, _ = c.run(key, 0, au.LOOK_TOKENS)
                        ev.add(sh, [acc], [ch] if sh.block > 1 else None)
                    else:
                        ev.add(au.Shape(1), [[1] * (len(c.g) - 1)])
                    ev.add_lengths([len(c.g)])
                    if rep:
                        est.append(ev.tau(sh))
            print(f"  {key:7s} a look every {every} calls: whole-call estimate {np.mean(est):.3f} (sd {np.std(est):.3f})")


if __name__ == "__main__":
    main()
