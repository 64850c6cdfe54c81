"""Offline tree-scoring variants: DDTree sum-of-log-q vs a per-node bonus and drafter temperatures (README.md)."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sim import build, load, simulate
import numpy as np
ev = load("/tmp/tree_scoring/gsm_eval.npy")
for n in (8, 16):
    for c in (0.0, 0.1, 0.2, 0.3, 0.5, 0.8):
        print("bonus", n, c, round(simulate(ev, lambda v, i: build(v, i, n, lambda s: s + c)), 3))
    for t in (0.7, 1.0, 1.3, 1.6, 2.0):
        def f(s, t=t):
            z = s / t
            m = z.max(1, keepdims=True)
            return z - (m + np.log(np.exp(z - m).sum(1, keepdims=True)))
        print("temp", n, t, round(simulate(ev, lambda v, i: build(v, i, n, f)), 3))
