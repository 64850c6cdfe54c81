"""Offline tree / chain tau of the embedded pair from collect.py's drafter distributions (README.md)."""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sim import build, chain_nodes, load, simulate
ev = load("/tmp/tree_scoring/gsm_eval.npy")
for b in (4, 8, 16):
    print("chain", b, round(simulate(ev, lambda v, i: chain_nodes(i, b)), 3))
for n in (4, 8, 16, 32, 64):
    print("tree", n, round(simulate(ev, lambda v, i: build(v, i, n)), 3))
