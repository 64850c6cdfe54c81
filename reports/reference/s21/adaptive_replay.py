import pickle, sys, numpy as np
buckets_all = np.array([3, 7, 15, 23, 31, 47, 63])
cost_all = np.array([2.15, 2.45, 3.12, 3.61, 4.25, 5.53, 6.8])
def load(f):
    log = pickle.load(open(f, "rb")); P, C = [], []
    for lq, paths in log:
        for c in range(len(paths)):
            if paths[c] is None: continue
            P.append(np.exp(lq[c])); C.append([1 + sum(f <= n for f in paths[c]) for n in buckets_all])
    return np.array(P), np.array(C, float)
sets = ["g_tune", "gsm8k", "math500", "mbpp", "humaneval", "mt-bench"]
D = {s: load(f"/tmp/s21/{s}.pkl") for s in sets}
for bsel in [[0,1,2,3,4,5,6], [0,1,2,3], [1,2,3], [0,1,2]]:
    b, cost = buckets_all[bsel], cost_all[bsel]
    print("buckets", b)
    for kappa, lam in [(1.0, 0.8), (1.0, 1.0), (1.2, 1.0), (1.0, "ratio")]:
        line = []
        for s in sets:
            P, C = D[s]; C = C[:, bsel]; cum = np.cumsum(P, 1)[:, b - 1]
            fixed = C.mean(0) / cost
            score = (1 + kappa * cum) / cost if lam == "ratio" else 1 + kappa * cum - lam * cost
            pick = np.argmax(score, 1); t = C[np.arange(len(C)), pick]
            line.append(f"{s} {t.sum()/cost[pick].sum():.3f}/{fixed.max():.3f}(n={b[fixed.argmax()]})")
        print(f"  k{kappa} l{lam}: " + "  ".join(line))
