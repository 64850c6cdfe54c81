"""Replay of `auto` (dflash_jax.autoshape's own choose / Evidence) over collected drafts, without a model.

At T = 0 speculative output is the target-only text, so what a chain of B or a tree of N nodes commits at
every anchor follows from the drafter's per-depth top-K there (collect.py) and the text. Cycle times come from
a cost model: `true` (cycle time / target step) per shape, a target step of STEP_MS with per-call load noise;
auto is handed a cost curve `bias` x the true costs (the measurement error of one curve). The sweep's order is
replayed: passes of the set's first-turn prompts, sets in order, evidence carried across (as in the sweep).

    python reports/reference/auto_replay/replay.py /tmp/replay.npy [--bias 1.15] [--seeds 5]
"""
from __future__ import annotations

import argparse
import copy
import heapq

import numpy as np
from dflash_jax import autoshape as au

D = 15  # draft depths of the embedded drafter (block 16)
LOOK = au.LOOK_TOKENS
# cycle time / target step per shape: session 11-12 sweeps' GSM8K calls (B=4 / B=8 / tree 8 / tree 16) and the
# session 11 curve for the others (2-core CPU, 150-token prompts, cache 1024)
COSTS = {"s12": {"target": 1.0, "B2": 1.62, "B4": 2.25, "B8": 2.55, "B16": 3.06, "tree4": 2.55, "tree8": 3.0,
                 "tree16": 3.55, "tree32": 4.37, "tree64": 6.33},
         # session 13 (same machine type, target steps ~25% faster): its two curves, and its GSM8K calls (B=4 2.5,
         # B=8 2.9, tree 8 3.45, tree 16 4.1)
         "s13": {"target": 1.0, "B2": 1.79, "B4": 2.5, "B8": 2.9, "B16": 3.87, "tree4": 2.89, "tree8": 3.45,
                 "tree16": 4.1, "tree32": 5.64, "tree64": 8.6},
         # session 15 (a slower day; aligned tree budgets, ../trees_aligned_cpu/ run2 medians: B=4 2.35, B=8 2.63-2.75,
         # B=16 3.46, tree 7 2.86, tree 8 3.08, tree 15 3.50, tree 16 3.53, tree 23 3.94); B=2, tree 3 / 31 / 63 scaled
         # from session 13's ratios
         "s15": {"target": 1.0, "B2": 1.68, "B4": 2.35, "B8": 2.69, "B16": 3.46, "tree3": 2.45, "tree7": 2.86,
                 "tree8": 3.08, "tree15": 3.50, "tree16": 3.53, "tree31": 4.75, "tree63": 7.2},
         # session 17 (slower still: target step 4.4-5.6 ms; ../auto_cpu_s17 runs J and K, GSM8K medians: B=4 2.34,
         # B=8 2.77, tree 7 2.96); the others at session 15's ratios to their neighbours
         "s17": {"target": 1.0, "B2": 1.67, "B4": 2.34, "B8": 2.77, "B16": 3.56, "tree3": 2.54, "tree7": 2.96,
                 "tree15": 3.62, "tree31": 4.92, "tree63": 7.45},
         # session 20 (jax 0.10.2, no row layout, a fast machine: target step 1.22 ms; infer.bench_cycle, 150-token
         # prompts, 5 rounds: B=4 2.07, B=8 2.44, B=16 3.17, tree 7 2.66, tree 15 3.34, tree 31 4.56); B=2, tree 3 /
         # tree 63 at session 17's ratios to their neighbours
         "s20": {"target": 1.0, "B2": 1.48, "B4": 2.07, "B8": 2.44, "B16": 3.17, "tree3": 2.28, "tree7": 2.66,
                 "tree15": 3.34, "tree31": 4.56, "tree63": 6.9},
         # session 22 (the sweeps' fixed runs at a 1024-slot cache, medians over runs B, C, H, I: B=4 2.14, B=8 2.51,
         # tree 7 2.79); the others from the same runs' measured curves (medians: B=2 1.87, B=16 3.46, tree 3 2.5,
         # tree 15 3.6, tree 31 4.75, tree 63 7.8)
         "s22": {"target": 1.0, "B2": 1.87, "B4": 2.14, "B8": 2.51, "B16": 3.46, "tree3": 2.5, "tree7": 2.79,
                 "tree15": 3.6, "tree31": 4.75, "tree63": 7.8}}
# the aligned budgets (autoshape.TREE_BUDGETS since session 15: one row less than 4 / 8 / 16 / 32 / 64 nodes) at
# session 15's ratios to their neighbours (tree 7 / tree 8 = 0.93; tree 15 ~ tree 16), where a set lacks them
for _c in COSTS.values():
    for _n, _f in ((3, 0.96), (7, 0.93), (15, 0.99), (31, 0.98), (63, 0.98)):
        if f"tree{_n}" not in _c:
            _c[f"tree{_n}"] = round(_f * _c[f"tree{_n + 1}"], 2)
TRUE = dict(COSTS["s12"])
STEP_MS = 3.2
ALWAYS_LOOK = False
SHADOWS = True
OWN_BLOCKS = True


def chain_commit(ids, g, i, B):
    """Tokens a chain of B anchored at output index i commits (ids [L, depths, K] or [L, depths]: its drafts)."""
    k = 0
    while k < B - 1 and i + k + 1 < len(g) and (ids[i, k, 0] if ids.ndim == 3 else ids[i, k]) == g[i + k + 1]:
        k += 1
    return k + 1


def tree_nodes(vals, ids, n):
    heap = [(-float(vals[0, 0]), 0, 0, (), 0.0)]
    nodes = set()
    K = vals.shape[1]
    while heap and len(nodes) < n:
        ns, d, j, par, ps = heapq.heappop(heap)
        key = par + (int(ids[d, j]),)
        nodes.add(key)
        if j + 1 < K:
            heapq.heappush(heap, (-(ps + float(vals[d, j + 1])), d, j + 1, par, ps))
        if d + 1 < D:
            heapq.heappush(heap, (-(-ns + float(vals[d + 1, 0])), d + 1, 0, key, -ns))
    return nodes


class Call:
    """One prompt: its text and per-anchor drafts; memoised commits per shape and anchor."""

    def __init__(self, rec):
        self.g = [int(x) for x in rec["full"][rec["plen"]:]]
        self.vals, self.ids = rec["vals"].astype(np.float32), rec["ids"].astype(np.int64)
        # a chain of B < 16 drafts with its own B-token block where collected (else: the full block's, cut at B)
        self.chains = {int(b): v.astype(np.int64) for b, v in rec.get("chains", {}).items()} if OWN_BLOCKS else {}
        self.memo = {}

    def step(self, key, i):
        """(tokens committed, what the decoder records as the full-block chain's commit) of shape `key` at output
        index i."""
        m = self.memo.get((key, i))
        if m is not None:
            return m
        g = self.g
        if key.startswith("B"):
            B = int(key[1:])
            c = chain_commit(self.chains.get(B, self.ids), g, i, B)
            # what the decoder records for a chain (generate._cycle): its own commit, -commit when a block shorter
            # than the drafter's was accepted whole (censored: nothing said of the depths past it)
            out = (c, -c if (c == B and B < D + 1) else c)
        else:
            n = int(key[4:])
            nodes = tree_nodes(self.vals[i], self.ids[i], n)
            acc = 0
            while i + acc + 1 < len(g) and tuple(g[i + 1:i + acc + 2]) in nodes:
                acc += 1
            # chain equivalent: the tree's greedy (top-1) nodes, accepted along the text
            gd = 0
            while gd < D and tuple(int(x) for x in self.ids[i, :gd + 1, 0]) in nodes:
                gd += 1
            k = 0
            while k < gd and i + k + 1 < len(g) and self.ids[i, k, 0] == g[i + k + 1]:
                k += 1
            out = (acc + 1, -(k + 1) if (k == gd and gd < D) else k + 1)
        self.memo[(key, i)] = out
        return out

    def run(self, key, start, budget):
        """Cycles of shape `key` from output index `start` (tokens generated so far = start + 1, the first from
        the prefill) until `budget` tokens are generated or the text ends. -> (commits, chain eq, next start)."""
        i, acc, ch = start, [], []
        end = min(len(self.g) - 1, budget - 1)
        while i < end:
            if key == "target":
                c, f = 1, 1
            else:
                c, f = self.step(key, i)
            c = min(c, end - i)
            acc.append(c)
            ch.append(f)
            i += c
        return acc, ch, i


def call_time(key, cycles, load, rng, noise):
    return cycles * TRUE[key] * STEP_MS * 1e-3 * load * float(np.exp(rng.normal(0, noise)))


def shadows(call, sh, shapes, curve, ev, start, acc):
    """What generate reports of a chain call's shadow trees (autoshape.shadow_trees): per budget, each cycle's
    tree commit at the cycle's anchor (the full block's distributions: the replay's data)."""
    ns = au.shadow_trees(ev, sh, shapes, curve) if SHADOWS and hasattr(au, "shadow_trees") else ()
    if not ns:
        return None
    anchors = list(np.cumsum([start] + list(acc[:-1])))
    return {n: [[call.step(f"tree{n}", int(i))[0] for i in anchors]] for n in ns}


def auto_call(call, shapes, curve, ev, ctx, max_new, load, rng, noise, log):
    """One auto call, as generate._generate_auto runs it. -> decode seconds, tokens, shapes run."""
    def record(sh, acc, ch, secs, offset=0, reference=False, start=0):
        kw = dict(reference=True) if reference else {}  # (older autoshape: no reference calls)
        sd = shadows(call, sh, shapes, curve, ev, start, acc)
        if sd:
            kw["shadows"] = sd
        ev.add(sh, [acc], [ch] if sh.block > 1 else None, seconds=secs, cycles=len(acc), context=ctx, offset=offset,
               **kw)

    choice = au.choose(shapes, curve, ev, context=ctx)
    log(choice.reason)
    sh = choice.shape
    # a reference call (autoshape since session 21) is target-only, whole; older ones drafted a look first
    ref = getattr(choice, "reference", False)
    if (not choice.look and not (ALWAYS_LOOK and sh.block > 1)) or (ref and sh.block == 1) or max_new <= 2 * LOOK:
        acc, ch, _ = call.run(sh.key, 0, max_new)
        t = call_time(sh.key, len(acc), load, rng, noise)
        record(sh, acc, ch, t, reference=ref)
        ev.add_lengths([sum(acc) + 1])
        return t, sum(acc) + 1, [sh.key]
    before = copy.deepcopy(ev)
    acc, ch, i = call.run(sh.key, 0, LOOK)
    t = call_time(sh.key, len(acc), load, rng, noise)
    record(sh, acc, ch, t)
    if i >= len(call.g) - 1:
        ev.add_lengths([sum(acc) + 1])
        return t, sum(acc) + 1, [sh.key]
    sd = shadows(call, sh, shapes, curve, before, 0, acc)
    rest = before.for_the_rest(sh, [acc], [ch] if sh.block > 1 else None, **(dict(shadows=sd) if sd else {}))
    if hasattr(rest, "with_times"):  # as generate._generate_auto: the look and the rest share one time table
        rest = rest.with_times(ev)
    else:  # (older autoshape)
        rest.time = ev.time
    reference = getattr(choice, "reference", False)
    if reference:
        nxt = au.Choice(au.Shape(1), "auto shape: target-only (timing target steps)")
    else:
        nxt = au.choose(shapes, curve, rest, context=ctx, look=False, part=getattr(au, "REST", 1))
    log("  then " + nxt.reason)
    acc2, ch2, _ = call.run(nxt.shape.key, i, max_new)
    t2 = call_time(nxt.shape.key, len(acc2), load, rng, noise)
    record(nxt.shape, acc2, ch2, t2, offset=LOOK, reference=reference, start=i)
    n = sum(acc) + sum(acc2) + 1
    ev.add_lengths([n])
    return t + t2, n, [sh.key, nxt.shape.key]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--sets", default="gsm8k,math500,humaneval,mbpp,mt-bench")
    p.add_argument("--bias", type=float, default=1.0, help="curve = bias x true cost for drafted shapes")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed ... first-seed + seeds - 1")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--noise", type=float, default=0.03, help="per-call timing noise (log sd)")
    p.add_argument("--load", type=float, default=0.05, help="per-call load drift (log sd), shared by shapes")
    p.add_argument("--drift", type=float, default=0.0,
                   help="slow drift of the machine's speed (log sd of an AR(1) over calls, correlation --drift-rho per "
                        "call), shared by the shapes of a prompt: auto compares timings taken at different moments")
    p.add_argument("--drift-rho", type=float, default=0.95)
    p.add_argument("--wall", type=float, default=1.5,
                   help="wall-clock seconds per simulated decode second (prefill, host, compile): the clock autoshape's "
                        "cycle times decay by")
    p.add_argument("--curve-noise", type=float, default=0.0,
                   help="each drafted shape's curve entry x exp(N(0, this)) per seed: one measurement's own error "
                        "(sessions 16-17: tree 7 2.66 / 3.19, B=16 3.2 / 3.8 in two curves an hour apart)")
    p.add_argument("--fixed", default="B4,B8,tree7",
                   help="the fixed shapes auto is compared with (the sessions 20-23 sweeps'; until session 23 the default "
                        "was B4,B8,tree8,tree16, without tree 7: GSM8K read 0.99 of the best where against tree 7 auto "
                        "ran at 0.96)")
    p.add_argument("--costs", default="s12", choices=sorted(COSTS),
                   help="the true cycle costs: s12 (sessions 11-12's machine), s13 (session 13's, target steps 25%% faster), "
                        "s15 / s20 / s22 (those sessions' machines, COSTS)")
    p.add_argument("--set", action="append", default=[], help="NAME=VALUE: an autoshape constant for this replay")
    p.add_argument("--always-look", action="store_true", help="every drafted call decides its rest after 64 tokens")
    p.add_argument("--no-shadows", action="store_true", help="chain calls report no shadow trees (before session 18)")
    p.add_argument("--cut-blocks", action="store_true", help="chains of B < 16 from the full block cut at B")
    p.add_argument("-v", action="store_true")
    a = p.parse_args()
    TRUE.update(COSTS[a.costs])
    global ALWAYS_LOOK, OWN_BLOCKS, SHADOWS
    ALWAYS_LOOK = a.always_look
    SHADOWS = not a.no_shadows
    OWN_BLOCKS = not a.cut_blocks
    for kv in a.set:
        k, v = kv.split("=")
        setattr(au, k, type(getattr(au, k))(float(v)))
    data = np.load(a.data, allow_pickle=True).item()
    shapes = au.candidate_shapes(D + 1)
    curve = base_curve = {s.key: (TRUE[s.key] * (a.bias if s.block > 1 else 1.0)) for s in shapes}
    calls = {name: [Call(r) for r in data[name] if r["turn"] == 0] for name in a.sets.split(",")}
    fixed = a.fixed.split(",")
    ratios = {name: [] for name in calls}
    clock = [0.0]
    au._now = lambda: clock[0]
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        rng = np.random.default_rng(seed)
        if a.curve_noise:  # (its own stream: the seeds' timing draws stay those of earlier replays)
            crng = np.random.default_rng(10_000 + seed)
            curve = au.monotone({k: (v * float(np.exp(crng.normal(0, a.curve_noise))) if k != "target" else v)
                                 for k, v in base_curve.items()}, shapes)  # as cost_curve makes it
        ev = au.Evidence(full_block=D + 1)
        clock[0] = 1e6
        slow = 0.0
        for name, cs in calls.items():
            per_pass = []
            for rep in range(a.passes + 1):  # the first: the sweep's warm-up call (first prompt) only
                tt = {k: 0.0 for k in ["target", "auto"] + fixed}
                nt = 0
                for c in (cs[:1] if rep == 0 else cs):
                    if a.drift:  # (no draw without it: the seeds' streams stay those of earlier replays)
                        slow = a.drift_rho * slow + float(np.sqrt(1 - a.drift_rho ** 2)) * rng.normal(0, a.drift)
                    load = float(np.exp(rng.normal(0, a.load) + slow))
                    t = call_time("target", len(c.g) - 1, load, rng, a.noise)
                    tt["target"] += t
                    clock[0] += a.wall * t
                    for k in fixed:
                        acc, _, _ = c.run(k, 0, 256)
                        t = call_time(k, len(acc), load, rng, a.noise)
                        tt[k] += t
                        clock[0] += a.wall * t
                    t, n, _ = auto_call(c, shapes, curve, ev, "b1|S1024", 256, load, rng, a.noise,
                                        print if a.v else (lambda s: None))
                    tt["auto"] += t
                    clock[0] += a.wall * t
                    nt += n
                if rep:
                    sp = {k: tt["target"] / v for k, v in tt.items()}
                    per_pass.append(sp)
            med = {k: float(np.median([pp[k] for pp in per_pass])) for k in per_pass[0]}
            best = max(v for k, v in med.items() if k != "auto")
            ratios[name].append((med["auto"], best, med["auto"] / best))
            if a.v:
                print(name, " ".join(f"{k} {v:.3f}" for k, v in med.items()), f"(clock {clock[0] - 1e6:.0f} s)")
    for name, rs in ratios.items():
        r = np.array(rs)
        print(f"{name:10s} auto {np.median(r[:, 0]):.3f}x  best {np.median(r[:, 1]):.3f}x  auto/best median "
              f"{np.median(r[:, 2]):.3f} (min {r[:, 2].min():.3f})  [{' '.join(f'{x:.2f}' for x in r[:, 2])}]")


if __name__ == "__main__":
    main()
