"""Do shifted continuations help? Where the top-1 chain fails at depth d, how often does the text go on
with the draft's own depth-d token one position late (the target inserted a token) or skip it; and does a tree
whose alternative nodes also get an "inserted" child (the draft's top token of the same depth, scored log c below
its parent plus that token's log q; then the following depths as usual) beat the plain sum of log q?

    python reports/reference/tree_scoring/collect.py gsm8k 0 50 /tmp/tree_scoring/gsm_eval.npy
    python reports/reference/tree_scoring/shift.py
"""
import heapq
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sim import build, load, simulate  # noqa: E402


def failures(recs):
    """(chain failures, share with the draft's depth-d token next, share skipping it, share with depth d+1's next)."""
    fail = ins = skip = same = 0
    for r in recs:
        g = r["full"][r["plen"]:]
        for i in range(len(g) - 4):
            ids = r["ids"][i]
            d = 0
            while d < ids.shape[0] and i + 1 + d < len(g) and g[i + 1 + d] == ids[d, 0]:
                d += 1
            if d >= ids.shape[0] - 3 or i + 3 + d >= len(g):
                continue
            fail += 1
            ins += g[i + 2 + d] == ids[d, 0]
            skip += (g[i + 1 + d] == ids[d + 1, 0]) and (g[i + 2 + d] == ids[d + 2, 0])
            same += g[i + 2 + d] == ids[d + 1, 0]
    return fail, ins / fail, skip / fail, same / fail


def build_shifted(vals, ids, n, c):
    """Best-first over prefixes as sim.build, plus for every alternative (rank > 0) node at row r one candidate
    child: row r's top token, scored parent + log c + its log q, whose children take rows r + 1, ... as usual."""
    D, K = vals.shape
    heap = [(-vals[0, 0], 0, 0, (), 0.0)]  # (-score, row, rank (-1: the inserted child), parent path, parent score)
    nodes = set()
    while heap and len(nodes) < n:
        ns, r, j, par, ps = heapq.heappop(heap)
        key = par + (int(ids[r, max(j, 0)]),)
        if 0 <= j < K - 1:
            heapq.heappush(heap, (-(ps + vals[r, j + 1]), r, j + 1, par, ps))
        if key in nodes:
            continue
        nodes.add(key)
        if r + 1 < D:
            heapq.heappush(heap, (ns - vals[r + 1, 0], r + 1, 0, key, -ns))
        if j > 0:
            heapq.heappush(heap, (ns - math.log(c) - vals[r, 0], r, -1, key, -ns))
    return nodes


def main():
    ev = load("/tmp/tree_scoring/gsm_eval.npy")
    fail, ins, skip, same = failures(ev)
    print(f"chain failures {fail}: next token = the draft's depth-d token (inserted) {ins:.3f}, skipped {skip:.3f}, "
          f"= depth d+1's (as the tree assumes) {same:.3f}")
    for n in (8, 16):
        row = [f"sum of log q {simulate(ev, lambda v, i: build(v, i, n)):.3f}"]
        for c in (0.1, 0.2, 0.3, 0.5):
            row.append(f"c {c}: {simulate(ev, lambda v, i: build_shifted(v, i, n, c)):.3f}")
        print(f"tree {n}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
