"""Offline decode simulator: best-first trees over per-depth top-K lists, acceptance against the target's text."""
import heapq, numpy as np

def load(path):
    return list(np.load(path, allow_pickle=True))

def build(vals, ids, n, f=None):
    """best-first tree: vals/ids [D, K] (desc per depth). f(d, v) -> transformed per-depth log-score (monotone).
    Returns dict node_path(tuple of tokens) set."""
    D, K = vals.shape
    sc = vals if f is None else f(vals)
    # frontier entries: (-score, depth d (0-based), rank j, parent_key, parent_score)
    heap = [(-sc[0, 0], 0, 0, (), 0.0)]
    nodes = set()
    while heap and len(nodes) < n:
        ns, d, j, par, ps = heapq.heappop(heap)
        key = par + (int(ids[d, j]),)
        nodes.add(key)
        if j + 1 < K:
            heapq.heappush(heap, (-(ps + sc[d, j + 1]), d, j + 1, par, ps))
        if d + 1 < D:
            heapq.heappush(heap, (-(-ns + sc[d + 1, 0]), d + 1, 0, key, -ns))
    return nodes

def chain_nodes(ids, b):
    return {tuple(int(x) for x in ids[:k, 0]) for k in range(1, b)}

def simulate(recs, make, limit=None):
    """make(vals, ids) -> set of node paths. Returns tau = committed/cycles."""
    com = cyc = 0
    for r in recs[:limit]:
        g = r["full"][r["plen"]:]
        i = 0
        while i < len(g) - 1:
            nodes = make(r["vals"][i], r["ids"][i])
            acc = 0
            while i + acc + 1 < len(g) and tuple(int(x) for x in g[i + 1:i + acc + 2]) in nodes:
                acc += 1
            c = min(acc + 1, len(g) - 1 - i)
            com += c; cyc += 1; i += acc + 1
    return com / cyc
