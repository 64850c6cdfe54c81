import sys, numpy as np
sys.path.insert(0, "reports/reference/auto_replay")
import replay as R
data = np.load(sys.argv[1] if len(sys.argv) > 1 else "/tmp/replay.npy", allow_pickle=True).item()
calls = [R.Call(r) for r in data["gsm8k"] if r["turn"] == 0]
def walk(c, key):
    i, out = 0, []
    end = len(c.g) - 1
    prev = None
    while i < end:
        cm, _ = c.step(key, i)
        cm = min(cm, end - i)
        out.append((i, prev))
        prev = cm
        i += cm
    return out
from collections import defaultdict
for key in ("B8", "tree7"):
    anchors = [(c, i, prev) for c in calls for i, prev in walk(c, key)]
    b8 = np.array([min(c.step("B8", i)[0], len(c.g)-1-i) for c, i, _ in anchors])
    t7 = np.array([min(c.step("tree7", i)[0], len(c.g)-1-i) for c, i, _ in anchors])
    print(f"{key} walk: {len(anchors)} cycles, B8 at its anchors {b8.mean():.3f}, tree7 at its anchors {t7.mean():.3f}, ratio {t7.mean()/b8.mean():.3f}")
    byprev = defaultdict(list)
    for (c, i, prev), x, y in zip(anchors, b8, t7):
        byprev[min(prev, 9) if prev else 0].append((x, y))
    print("   prev commit -> n, B8, tree7:", {k: (len(v), round(np.mean([a for a, _ in v]), 2), round(np.mean([b for _, b in v]), 2)) for k, v in sorted(byprev.items())})
print("---- tree7 walk: chain eq vs truth")
anchors = [(c, i) for c in calls for i, _ in walk(c, "tree7")]
tr, ceq, b16 = [], [], []
for c, i in anchors:
    end = len(c.g) - 1
    a, ch = c.step("tree7", i)
    tr.append(min(a, end - i)); ceq.append(ch)
    b16.append(min(R.chain_commit(c.ids, c.g, i, 16), 8, end - i))
tr, ceq, b16 = map(np.array, (tr, ceq, b16))
cens = ceq < 0
print("tree", tr.mean(), "chain16 cut 8 (truth)", b16.mean(), "censored frac", cens.mean(), "uncensored chain eq mean", ceq[~cens].mean(), "truth there", b16[~cens].mean(), "censored n mean", (-ceq[cens]).mean(), "truth there", b16[cens].mean())
