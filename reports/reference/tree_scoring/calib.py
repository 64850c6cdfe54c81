"""Offline tree-scoring variant: per-depth logistic calibration of the drafter's q, fitted on other prompts (README.md)."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sim import build, load, simulate
import numpy as np
from scipy.optimize import minimize

def dataset(recs, J=16, cond_rank=None):
    X = {d: [] for d in range(15)}; Y = {d: [] for d in range(15)}
    for r in recs:
        g = r["full"][r["plen"]:]
        for i in range(len(g) - 1):
            vals, ids = r["vals"][i], r["ids"][i]
            ok = True
            for d in range(15):
                if i + d + 1 >= len(g) or not ok:
                    break
                t = g[i + d + 1]
                X[d].append(vals[d, :J]); Y[d].append(ids[d, :J] == t)
                w = np.where(ids[d] == t)[0]
                ok = len(w) > 0 and (cond_rank is None or w[0] < cond_rank)
    return {d: (np.concatenate(X[d]), np.concatenate(Y[d])) for d in range(15) if X[d]}

def fit(data):
    ab = np.zeros((15, 2)); ab[:, 1] = 1.0
    for d, (x, y) in data.items():
        def nll(p):
            z = p[0] + p[1] * x
            return np.sum(np.logaddexp(0, -z) * y + np.logaddexp(0, z) * (~y)) / len(x)
        ab[d] = minimize(nll, [0.0, 1.0], method="Nelder-Mead").x
    return ab

if __name__ == "__main__":
    cal = load("/tmp/tree_scoring/gsm_cal.npy"); ev = load("/tmp/tree_scoring/gsm_eval.npy")
    for cr in (None, 4, 1):
        ab = fit(dataset(cal, cond_rank=cr))
        print("cond", cr, np.round(ab, 2).tolist())
        f = lambda s: -np.logaddexp(0, -(ab[:, :1] + ab[:, 1:] * s))
        for n in (8, 16, 20):
            print("  calib", n, round(simulate(ev, lambda v, i: build(v, i, n, f)), 3), "base", round(simulate(ev, lambda v, i: build(v, i, n)), 3))
