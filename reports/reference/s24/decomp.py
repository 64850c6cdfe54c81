"""Where auto's time goes against target-only in the replay (../auto_replay/replay.py), per data set and kind of call.

Each auto call's replayed seconds minus what target-only takes for the same answer at the same load (the per-call
timing noise left out), summed per set and kind - the kind read from the call's choice line: `drafted` (a whole call
or a look's rest of the best drafted shape), `target` (target-only chosen), `probe` (a look from target-only),
`timing` (a look run to time a shape's cycles), `try` (a tree's first runs), `ref` (target-only run to time steps),
`deep` (a deeper chain's look), `minev` (a drafted call before MIN_EVIDENCE). Figures are % of the set's
target-only time over every seed (negative: auto faster). Same arguments as replay.py, e.g.

    python reports/reference/s24/decomp.py /tmp/replay.npy --costs s22 --curve-noise 0.08 --drift 0.1 \\
        --drift-rho 0.98 --seeds 48
"""
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "auto_replay"))
import replay as R  # noqa: E402

KINDS = (("probe", "probing"), ("ref", "timing target"), ("try", "trying"), ("timing", "timing it"),
         ("deep", "little seen"), ("minev", "drafted calls seen"))


def main():
    data = np.load(sys.argv[1], allow_pickle=True).item()
    where = {}  # answer text -> its set (answers that two sets share count for the first)
    for name, recs in data.items():
        for r in recs:
            where.setdefault(tuple(int(x) for x in r["full"][r["plen"]:]), name)
    stats = collections.defaultdict(lambda: collections.defaultdict(float))
    replay_call = R.auto_call

    def auto_call(call, shapes, curve, ev, ctx, max_new, load, rng, noise, log):
        lines = []
        t, n, keys = replay_call(call, shapes, curve, ev, ctx, max_new, load, rng, noise,
                                 lambda s: (lines.append(s), log(s)))
        target = (len(call.g) - 1) * R.TRUE["target"] * R.STEP_MS * 1e-3 * load
        kind = next((k for k, w in KINDS if w in lines[0]), None)
        if kind is None:
            kind = "target" if lines[0].startswith("auto shape: target-only") else "drafted"
        s = stats[where[tuple(call.g)]]
        s[kind] += t - target
        s[kind + "#"] += 1
        s[""] += target
        return t, n, keys

    R.auto_call = auto_call
    R.main()
    print("\nauto's extra time against target-only, % of the set's target-only time (calls):")
    for name in data:
        s = stats[name]
        print(f"{name:10s} " + "  ".join(f"{k} {100 * v / s['']:+.1f}% ({int(s[k + '#'])})" for k, v in sorted(s.items())
                                          if k and not k.endswith("#")))


if __name__ == "__main__":
    main()
