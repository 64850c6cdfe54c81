"""Replay of the automatic shape on recorded traces and recorded cost curves (no model, seconds per seed).

At temperature 0 speculative output is the target-only text, so what a chain of B or a draft tree of N nodes
commits at every position of an answer follows from the drafter's per-depth top-K there and the text. The
traces (reports/auto/traces.npz) hold, per answer and position, what every candidate shape commits there, for
the embedded pair's answers to five data sets; the cost curves (reports/auto/costs.json) give each shape's cycle
time in target steps on a machine. A replay runs the sets in order (per set: a warm-up call, then --passes passes
over its prompts; evidence carried across sets), each answer by auto, with cycle times from the curve, per-call
load and timing noise and a slow drift of the machine's speed; on a CPU curve auto is handed the curve with each
drafted entry off by exp(N(0, --curve-noise)) (one measured curve's own error), an accelerator's curve as recorded
(or planned); it learns the rest from its calls' timings. Fixed shapes are scored without noise on the same answers
(target-only steps over the shape's cycles x its cost): the best of them is the yardstick.

    python -m infer.auto_replay                       # the table and the criteria, every curve
    python -m infer.auto_replay --check               # exit 1 when a criterion fails
    python -m infer.auto_replay --collect gsm8k:50,math500:10,humaneval:10,mbpp:10,mt-bench:10   # record the traces
                                                      # anew (embedded pair, ~5 minutes on 2 CPU cores)

Criteria (--check, on the curves in CHECKED): on the CPU curve, auto's throughput (median over seeds of the
median pass) >= 0.95 of the best fixed shape's on every set and >= 0.97x target-only; on the accelerator curves,
the shape auto would run at the end of each set without exploring (the most common over seeds) is the best fixed
shape, or within 1% of it (a tie at the replay's resolution).
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import sys
import time

import numpy as np

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reports", "auto")
TRACES = os.path.join(HERE, "traces.npz")
COSTS = os.path.join(HERE, "costs.json")
SETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
CHAINS = (2, 4, 8, 16)
TREES = (3, 7, 15, 31, 63)
FULL = 16  # the embedded drafter's block: depths 1 .. 15
# trace columns: per position, tokens committed by each shape; for trees also the full-block chain equivalent the
# decoder records (negative -n: at least n, the tree's greedy chain ended accepted)
COLUMNS = tuple(f"B{b}" for b in CHAINS) + tuple(f"tree{n}" for n in TREES) + tuple(f"tree{n}_chain" for n in TREES)
STEP_MS = 3.0  # a target step (the replay's time unit; only ratios matter)
CHECKED = ("cpu-2core-f", "h200-qwen3-8b", "v5p-qwen3-8b")  # the curves the criteria hold on: this CPU's current
# curve and the accelerators' (the other CPU curves are earlier measurements, printed for comparison)


# ---------------------------------------------------------------------------------------------- recording
def _tree_nodes(vals, ids, n, depth):
    """The best-first draft tree of n nodes (paths of token ids) from one position's per-depth top-K."""
    heap = [(-float(vals[0, 0]), 0, 0, (), 0.0)]
    nodes = set()
    K = vals.shape[1]
    while heap and len(nodes) < n:
        ns, d, j, par, ps = heapq.heappop(heap)
        key = par + (int(ids[d, j]),)
        nodes.add(key)
        if j + 1 < K:
            heapq.heappush(heap, (-(ps + float(vals[d, j + 1])), d, j + 1, par, ps))
        if d + 1 < depth:
            heapq.heappush(heap, (-(-ns + float(vals[d + 1, 0])), d + 1, 0, key, -ns))
    return nodes


def collect(spec: str, k: int = 16) -> dict:
    """Run the embedded pair (target-only, greedy, 256 new tokens) on the first turns of `spec`'s prompts
    ("gsm8k:50,math500:10,..."); per answer, the drafter's full-block top-k log-probs at every position and the
    top-1 drafts of the shorter chains' own blocks. Minutes on a CPU."""
    import jax
    import jax.numpy as jnp

    from dflash_jax import text as textlib
    from dflash_jax.decode import generate, taps_of
    from dflash_jax.drafter import draft_hidden_train, draft_logits_from_hidden
    from dflash_jax.embedded import load_reference
    from dflash_jax.model import forward
    from dflash_jax.prompts import load_dataset_prompts
    target, drafter, tok = load_reference()
    stop, Bd = textlib.stop_token_ids(tok, target.config), drafter.config.block_size

    def blocks(full, apos, B):
        _, _, feats = forward(target, full, None, taps_of(drafter))
        h = draft_hidden_train(drafter, target, feats, jnp.take_along_axis(full, apos, 1), apos, B)
        lp = jax.nn.log_softmax(draft_logits_from_hidden(drafter, target, h[:, :, 1:]).astype(jnp.float32), -1)
        return jax.lax.top_k(lp, k) if B == Bd else (None, jnp.argmax(lp, -1))

    blocks = jax.jit(blocks, static_argnums=2)
    out = {}
    for item in spec.split(","):
        name, n = item.split(":")
        calls = []
        for sample in load_dataset_prompts(name, None, int(n)):
            p = textlib.encode_chat(tok, sample.chat(0, []))
            o = generate(target, None, [p], max_new_tokens=256, temperature=0.0, stop_token_ids=stop).tokens[0]
            full = np.asarray(list(p) + list(o), np.int32)
            fp = np.zeros((1, -(-len(full) // 64) * 64 + 64), np.int32)
            fp[0, :len(full)] = full
            apos = np.arange(len(p), len(full), dtype=np.int32)
            ap = np.full((1, -(-len(apos) // 64) * 64), len(p), np.int32)
            ap[0, :len(apos)] = apos
            v, ids = (np.asarray(x[0])[:len(apos)] for x in blocks(jnp.asarray(fp), jnp.asarray(ap), Bd))
            chains = {B: np.asarray(blocks(jnp.asarray(fp), jnp.asarray(ap), B)[1][0])[:len(apos)]
                      for B in CHAINS if B < Bd}
            calls.append({"turn": 0, "plen": len(p), "full": full, "chains": chains, "vals": v, "ids": ids})
        out[name] = calls
        print(f"{name}: {len(calls)} answers collected", flush=True)
    return out


def record(raw, out: str = TRACES) -> None:
    """collect()'s output, or its saved output (a path to a pickled .npy), -> the compact traces:
    first turns only, one int8 row of COLUMNS per generated position."""
    data = raw if isinstance(raw, dict) else np.load(raw, allow_pickle=True).item()
    D = FULL - 1
    arrays = {"columns": np.array(COLUMNS)}
    for name in data:
        rows, lens = [], []
        for rec in data[name]:
            if rec["turn"] != 0:
                continue
            g = [int(x) for x in rec["full"][rec["plen"]:]]
            vals, ids = rec["vals"].astype(np.float32), rec["ids"].astype(np.int64)
            own = {int(b): v.astype(np.int64) for b, v in rec["chains"].items()}
            tab = np.zeros((len(g), len(COLUMNS)), np.int8)
            for i in range(len(g)):
                for j, B in enumerate(CHAINS):
                    top = own[B] if B in own else ids[:, :, 0]
                    k = 0
                    while k < B - 1 and i + k + 1 < len(g) and top[i, k] == g[i + k + 1]:
                        k += 1
                    tab[i, j] = k + 1
                for j, n in enumerate(TREES):
                    nodes = _tree_nodes(vals[i], ids[i], n, D)
                    acc = 0
                    while i + acc + 1 < len(g) and tuple(g[i + 1:i + acc + 2]) in nodes:
                        acc += 1
                    gd = 0  # the tree's greedy chain: top-1 drafts while they are nodes
                    while gd < D and tuple(int(x) for x in ids[i, :gd + 1, 0]) in nodes:
                        gd += 1
                    k = 0
                    while k < gd and i + k + 1 < len(g) and ids[i, k, 0] == g[i + k + 1]:
                        k += 1
                    tab[i, len(CHAINS) + j] = acc + 1
                    tab[i, len(CHAINS) + len(TREES) + j] = -(k + 1) if (k == gd and gd < D) else k + 1
            rows.append(tab)
            lens.append(len(g))
        arrays[f"{name}/lengths"] = np.array(lens, np.int32)
        arrays[f"{name}/commits"] = np.concatenate(rows)
        print(f"{name}: {len(lens)} answers, {sum(lens)} tokens", flush=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    np.savez_compressed(out, **arrays)
    print(f"wrote {out} ({os.path.getsize(out) / 1e3:.0f} kB)")


# ---------------------------------------------------------------------------------------------- the traces
class Answer:
    """One recorded answer: per generated position, what each shape commits there."""

    def __init__(self, tab: np.ndarray):
        self.tab = tab.astype(np.int64)
        self.n = len(tab)  # generated tokens (the first from the prefill)
        self.memo: dict = {}

    def run(self, key: str, start: int = 0, budget: int = 256):
        """Cycles of shape `key` from output index `start` until `budget` tokens are generated or the answer ends
        -> (tokens committed per cycle, the full-block chain equivalent per cycle, next index)."""
        m = self.memo.get((key, start, budget))
        if m is not None:
            return m
        i, acc, ch = start, [], []
        end = min(self.n - 1, budget - 1)
        col = COLUMNS.index(key) if key != "target" else None
        block = int(key[1:]) if key.startswith("B") else None
        while i < end:
            if col is None:
                c = f = 1
            else:
                c = int(self.tab[i, col])
                if block is not None:  # the decoder's record of a chain: censored when a shorter block is accepted
                    f = -c if (c == block and block < FULL) else c
                else:
                    f = int(self.tab[i, COLUMNS.index(key + "_chain")])
            acc.append(min(c, end - i))
            ch.append(f)
            i += acc[-1]
        self.memo[(key, start, budget)] = out = (acc, ch, i)
        return out

    def shadows(self, ns, start: int, acc) -> dict | None:
        """What a chain call reports of its shadow trees: each cycle's tree commit at the cycle's anchor (0 where the
        answer ends inside the tree's walk: unknown)."""
        if not ns:
            return None
        anchors = np.cumsum([start] + list(acc[:-1]))
        out = {}
        for n in ns:
            col = COLUMNS.index(f"tree{n}")
            out[n] = [[int(t) if t < self.n - i else 0 for i, t in ((int(i), self.tab[int(i), col]) for i in anchors)]]
        return out


def load_traces(path: str = TRACES) -> dict:
    z = np.load(path)
    out = {}
    for name in SETS:
        lens, tab = z[f"{name}/lengths"], z[f"{name}/commits"]
        starts = np.concatenate([[0], np.cumsum(lens)])
        out[name] = [Answer(tab[a:b]) for a, b in itertools.pairwise(starts)]
    return out


def load_costs(path: str = COSTS) -> dict:
    with open(path) as f:
        return json.load(f)["curves"]


def expected_speedups(answers, costs: dict, max_new: int = 256) -> dict:
    """Per shape, target-only time over the shape's on the recorded answers (no noise): the best fixed shape."""
    steps = sum(a.run("target", 0, max_new)[2] for a in answers)
    return {k: steps / sum(len(a.run(k, 0, max_new)[0]) * costs[k] for a in answers) for k in costs}


# ---------------------------------------------------------------------------------------------- the policies
class Timer:
    """A call's decode seconds under the replay's cost model, and the clock the policy is handed."""

    def __init__(self, true: dict, rng, noise: float, wall: float):
        self.true, self.rng, self.noise, self.wall = true, rng, noise, wall
        self.clock = 1e6
        self.load = 1.0

    def time(self, key: str, cycles: int) -> float:
        t = cycles * self.true[key] * STEP_MS * 1e-3 * self.load * float(np.exp(self.rng.normal(0, self.noise)))
        self.clock += self.wall * t
        return t


class NewDriver:
    """dflash_jax.auto as the decode glue drives it (`auto` package docstring)."""

    def __init__(self, curve: dict, policy=None):
        from dflash_jax.auto import AutoPolicy, Evidence, candidate_shapes
        self.p = policy or AutoPolicy()
        self.shapes = candidate_shapes(FULL)
        self.curve = curve
        self.ev = Evidence(full_block=FULL)

    def call(self, ans: Answer, ctx: str, max_new: int, timer: Timer, log) -> tuple:
        p, ev, shapes, curve = self.p, self.ev, self.shapes, self.curve

        def part(sh, start, budget, offset=0):
            acc, ch, i = ans.run(sh.key, start, budget)
            sd = ans.shadows(p.shadow_trees(ev, sh, shapes), start, acc)
            t = timer.time(sh.key, len(acc))
            return acc, ch, i, sd, t

        def record(sh, acc, ch, sd, t, offset=0):
            p.record(ev, shapes, curve, sh, [acc], [ch] if sh.block > 1 else None, shadows=sd, seconds=t,
                     cycles=len(acc), context=ctx, now=timer.clock, offset=offset)

        choice = p.choose(ev, shapes, curve, context=ctx)
        log(choice.reason)
        sh = choice.shape
        if not choice.look or max_new <= 2 * p.look_tokens:
            acc, ch, _, sd, t = part(sh, 0, max_new)
            record(sh, acc, ch, sd, t)
            return t, {sh.key: sum(acc)}
        acc, ch, i, sd, t = part(sh, 0, p.look_tokens)
        if i >= ans.n - 1:
            record(sh, acc, ch, sd, t)
            return t, {sh.key: sum(acc)}
        record(sh, acc, ch, sd, t)
        nxt = p.choose(ev, shapes, curve, context=ctx, rest=True)
        log("  then " + nxt.reason)
        acc2, ch2, _, sd2, t2 = part(nxt.shape, i, max_new)
        record(nxt.shape, acc2, ch2, sd2, t2, offset=p.look_tokens)
        done = {sh.key: sum(acc)}
        done[nxt.shape.key] = done.get(nxt.shape.key, 0) + sum(acc2)
        return t + t2, done


    def steady(self, ctx: str) -> str:
        """The shape a call would run now without exploring (the greedy choice)."""
        import dataclasses
        p = dataclasses.replace(self.p, horizon=0)
        return p.choose(self.ev, self.shapes, self.curve, context=ctx).shape.key


# ---------------------------------------------------------------------------------------------- the replay
def replay_seed(traces: dict, true: dict, seed: int, sets=SETS, passes: int = 3,
                max_new: int = 256, noise: float = 0.03, load: float = 0.05, drift: float = 0.1,
                drift_rho: float = 0.98, curve_noise: float = 0.08, wall: float = 1.5, policy=None,
                log=None) -> dict:
    """One seed: {set: (auto's speedup per pass, the shape auto would run at the end of the set without exploring)}.
    Per answer, target-only and auto run under one load (exp(N(0, load)) x a drift of the machine's speed, an AR(1)
    over answers), each call's time x exp(N(0, noise)); the clock moves as if every fixed shape ran the answer too."""
    log = log or (lambda s: None)
    rng = np.random.default_rng(seed)  # load, drift and target-only's timings
    crng = np.random.default_rng(10_000 + seed)  # the curve auto is handed
    timer = Timer(true, np.random.default_rng(20_000 + seed), noise, wall)  # auto's timings
    curve = {k: (v * float(np.exp(crng.normal(0, curve_noise))) if k != "target" else 1.0) for k, v in true.items()}
    driver = NewDriver(curve, policy)
    slow, out = 0.0, {}
    for name in sets:
        answers = traces[name]
        per_pass = []
        for rep in range(passes + 1):  # the first: a warm-up call (the set's first answer)
            t_target = t_auto = 0.0
            for a in (answers[:1] if rep == 0 else answers):
                slow = drift_rho * slow + float(np.sqrt(1 - drift_rho ** 2)) * rng.normal(0, drift)
                timer.load = float(np.exp(rng.normal(0, load) + slow))
                steps = a.run("target", 0, max_new)[2]
                t_target += steps * STEP_MS * 1e-3 * timer.load * float(np.exp(rng.normal(0, noise)))
                timer.clock += wall * timer.load * STEP_MS * 1e-3 * sum(
                    len(a.run(k, 0, max_new)[0]) * c for k, c in true.items())  # the fixed shapes' calls
                t, _ = driver.call(a, "b1|S1024", max_new, timer, log)
                t_auto += t
            if rep:
                per_pass.append(t_target / t_auto)
        out[name] = (per_pass, driver.steady("b1|S1024"))
    return out


def run(traces, costs, curves, seeds, **kw) -> dict:
    """{curve: {set: {"auto": [median pass's speedup per seed], "steady": [shape key per seed], "best": (key,
    speedup), "expected": {shape: speedup}}}}."""
    res = {}
    for cname in curves:
        true = costs[cname]["costs"]
        acc = {s: {"auto": [], "steady": []} for s in kw.get("sets", SETS)}
        accel = costs[cname]["kind"] != "cpu"
        for seed in seeds:
            # an accelerator's curve is a recorded (or the planner's) figure, handed to auto as it is
            kws = dict(kw, curve_noise=0.0) if accel else kw
            for name, (per_pass, steady) in replay_seed(traces, true, seed, **kws).items():
                acc[name]["auto"].append(float(np.median(per_pass)))
                acc[name]["steady"].append(steady)
        for name, r in acc.items():
            exp = expected_speedups(traces[name], true)
            best = max(exp, key=exp.get)
            r.update(best=(best, exp[best]), expected=exp)
        res[cname] = acc
    return res


def _label(key: str) -> str:
    return "target-only" if key == "target" else (f"tree {key[4:]}" if key.startswith("tree") else f"B={key[1:]}")


def report(res: dict, costs: dict, checked=CHECKED, out=print) -> list:
    """Print the table; return the failures of the criteria on the `checked` curves (one line each)."""
    fails = []
    out("auto / best fixed shape (median over seeds, min), auto / target-only (median); on "
        "accelerator curves, the shape auto would run at the end of the set without exploring (most seeds)")
    for cname, sets in res.items():
        accel = costs[cname]["kind"] != "cpu"
        out(f"\n{cname}" + ("" if cname in checked else " (not a criterion)"))
        fails_here = []
        for name, r in sets.items():
            best, bsp = r["best"]
            a = np.array(r["auto"])
            rel = a / bsp
            line = (f"  {name:10s} best {_label(best):11s} {bsp:5.3f}x  auto {np.median(a):5.3f}x  auto/best "
                    f"{np.median(rel):.3f} (min {rel.min():.3f})  auto/target-only {np.median(a):.3f}")
            if accel:
                keys, counts = np.unique(r["steady"], return_counts=True)
                st = str(keys[np.argmax(counts)])
                ok = st == best or r["expected"][st] >= 0.99 * bsp
                line += (f"  steady {_label(st)} ({counts.max()}/{len(a)} seeds, {r['expected'][st] / bsp:.3f} of "
                         f"best) {'ok' if ok else 'MISS'}")
                if not ok:
                    fails_here.append(f"{cname} {name}: steady state {_label(st)} ({r['expected'][st] / bsp:.3f} "
                                      f"of the best, {_label(best)})")
            else:
                if np.median(rel) < 0.95:
                    fails_here.append(f"{cname} {name}: auto / best {np.median(rel):.3f} < 0.95")
                if np.median(a) < 0.97:
                    fails_here.append(f"{cname} {name}: auto / target-only {np.median(a):.3f} < 0.97")
            out(line)
        if cname in checked:
            fails += fails_here
    return fails


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--curves", default="all", help="comma-separated names from reports/auto/costs.json, or 'all', "
                                                   "'cpu', 'accelerator'")
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--seeds", type=int, default=48)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--noise", type=float, default=0.03, help="per-call timing noise (log sd)")
    p.add_argument("--load", type=float, default=0.05, help="per-answer load (log sd), shared by the shapes")
    p.add_argument("--drift", type=float, default=0.1, help="slow drift of the machine's speed (log sd of an AR(1) "
                                                            "over answers)")
    p.add_argument("--drift-rho", type=float, default=0.98, help="the drift's correlation from one answer to the next")
    p.add_argument("--curve-noise", type=float, default=0.08, help="each drafted entry of auto's curve x exp(N(0, "
                                                                   "this)) per seed: one measured curve's error")
    p.add_argument("--wall", type=float, default=1.5, help="wall seconds per decode second (prefill, host): the "
                                                           "clock auto is handed")
    p.add_argument("--check", action="store_true", help="exit 1 when a criterion fails")
    p.add_argument("--check-curves", default=",".join(CHECKED), help="the curves the criteria are checked on")
    p.add_argument("--record", metavar="RAW", help="convert collect()'s saved output into the traces and exit")
    p.add_argument("--collect", metavar="SPEC", help="run the embedded pair on SPEC's prompts (e.g. "
                                                     "gsm8k:50,math500:10,humaneval:10,mbpp:10,mt-bench:10), write the "
                                                     "traces (--traces) and exit")
    p.add_argument("--traces", default=TRACES)
    p.add_argument("--costs", default=COSTS)
    p.add_argument("-v", action="store_true", help="print every choice (use with --seeds 1)")
    a = p.parse_args(argv)
    if a.record or a.collect:
        record(a.record or collect(a.collect), a.traces)
        return 0
    costs = load_costs(a.costs)
    if a.curves in ("all", "cpu", "accelerator"):
        curves = [c for c, v in costs.items() if a.curves == "all" or (v["kind"] == "cpu") == (a.curves == "cpu")]
    else:
        curves = a.curves.split(",")
        for c in curves:
            if c not in costs:
                p.error(f"unknown curve {c!r}: {', '.join(costs)}")
    traces = load_traces(a.traces)
    t0 = time.time()
    res = run(traces, costs, curves, range(a.first_seed, a.first_seed + a.seeds), sets=a.sets.split(","),
              passes=a.passes, noise=a.noise, load=a.load, drift=a.drift, drift_rho=a.drift_rho,
              curve_noise=a.curve_noise, wall=a.wall, log=print if a.v else None)
    fails = report(res, costs, a.check_curves.split(","))
    print(f"\n{a.seeds} seeds, {time.time() - t0:.0f} s; criteria: " + ("all hold" if not fails else
                                                                         "FAILED: " + "; ".join(fails)))
    return 1 if (a.check and fails) else 0


if __name__ == "__main__":
    sys.exit(main())
