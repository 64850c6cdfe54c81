"""Automatic verification shape: target-only, a chain block B, or a draft tree of N nodes.

Expected committed tokens per second of a shape = tau(shape) / cycle_time(shape). Cycle times are
measured once per (pair, batch, device kind, cache size) as a cost curve relative to one target
step, and cached on disk (`$DFLASH_JAX_CACHE`, default ~/.cache/dflash_jax, file shape_costs.json).
Acceptance is estimated from what has been observed on this pair (`Evidence`):
  * chain: from the histogram of tokens committed per cycle at the drafter's full block,
    tau(B) = E[min(n, B)] (a cycle that committed n at the full block commits min(n, B) at B), or
    the block's own observed mean once it has run;
  * tree of N nodes: its own observed mean when it has run, else the chain's tau at depth
    min(N, D) + 1 as a floor (the best-first tree always contains the drafter's greedy chain to
    depth min(N, D)); shapes never observed are tried once when their floor is within `explore` of
    the best estimate, so evidence accumulates;
  * all evidence decays with a half-life of HALF_LIFE row-cycles, so the choice follows the text
    (e.g. to target-only on text the drafter does not know); with target-only chosen, every
    PROBE_EVERY-th call runs the best drafted shape to keep the evidence current.
target-only has tau 1 and cost 1. The choice and its reason are one line (`Choice.reason`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import numpy as np

CHAIN_BLOCKS = (2, 4, 8, 16)
TREE_BUDGETS = (4, 8, 16, 32, 64)
ENV_DIR = "DFLASH_JAX_CACHE"
COST_VERSION = 2  # part of every cost-curve key: bumped when the decode program's cost changes (2: CPU row layout)


def cache_dir() -> str:
    return os.environ.get(ENV_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "dflash_jax")


@dataclasses.dataclass(frozen=True)
class Shape:
    block: int  # 1 = target-only
    tree: int | None = None

    @property
    def label(self) -> str:
        if self.block == 1:
            return "target-only"
        return f"tree {self.tree}" if self.tree else f"B={self.block}"

    @property
    def width(self) -> int:
        """Cache slots one verification of this shape writes (generate.verify_width)."""
        from .generate import verify_width
        return verify_width(self.block, self.tree)

    @property
    def key(self) -> str:
        return "target" if self.block == 1 else (f"tree{self.tree}" if self.tree else f"B{self.block}")


def candidate_shapes(drafter_block: int, blocks=CHAIN_BLOCKS, trees=TREE_BUDGETS) -> list[Shape]:
    out = [Shape(1)] + [Shape(b) for b in blocks if 2 <= b <= drafter_block]
    return out + [Shape(drafter_block, n) for n in trees]


def pair_key(target, drafter) -> str:
    """A fingerprint of the pair: configs + a few weight values (so a retrained drafter re-measures
    nothing, costs depend only on shapes, but different checkpoints stay apart)."""
    import jax
    h = hashlib.sha1(repr((target.config, drafter.config)).encode())
    for leaf in jax.tree.leaves(drafter.params)[:2] + jax.tree.leaves(target.params)[:2]:
        h.update(np.asarray(jax.device_get(leaf)).ravel()[:16].astype(np.float32).tobytes())
    return h.hexdigest()[:16]


def _device_kind() -> str:
    import jax
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')}:{jax.device_count()}"


def _cost_file() -> str:
    return os.path.join(cache_dir(), "shape_costs.json")


def _read_costs() -> dict:
    try:
        with open(_cost_file()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_costs(table: dict) -> None:
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = _cost_file() + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, _cost_file())


def cost_key(target, drafter, batch: int, cache_len: int) -> str:
    """The cost-curve entry of a (pair, batch, device kind, cache size) in the disk cache."""
    return f"{pair_key(target, drafter)}|b{batch}|{_device_kind()}|S{cache_len}|v{COST_VERSION}"


def cost_curve(target, drafter, batch: int, cache_len: int, shapes, steps: int = 48, rounds: int = 3,
               log=None) -> dict:
    """{shape key: cycle time / target step time} for this pair, batch and cache length: read from the
    disk cache, or measured and stored. Measuring: every shape compiles once, then `rounds` rounds
    each time every shape for `steps` cycles on random prompts without stop tokens (round-robin, so
    load drifts hit all shapes alike); per shape the median round. The prompts fill a quarter of the
    cache (attention cost follows the fill: tiny prompts made a target step look cheap and every
    cycle dearer than in real use). A longer chain or a larger tree
    never costs less on any hardware, so within each family the curve is made non-decreasing
    (running maximum over block / budget) to keep timing noise from ranking them backwards."""
    from .generate import generate
    key = cost_key(target, drafter, batch, cache_len)
    table = _read_costs()
    have = table.get(key, {})
    missing = [s for s in shapes if s.key not in have]
    if missing:
        rng = np.random.default_rng(0)
        V = target.config.vocab_size
        room = cache_len - max(s.width for s in shapes)  # prompt + steps + 1 new tokens must fit
        steps = max(1, min(steps, room - 17))  # a small cache: fewer cycles, so a 16-token prompt still fits
        plen = max(1, min(cache_len // 4, room - steps - 1))
        prompts = [rng.integers(0, V, size=plen).tolist() for _ in range(batch)]
        todo = [Shape(1)] + [m for m in missing if m.block > 1]

        def run(s):
            kw = dict(max_new_tokens=steps + 1, stop_token_ids=[], max_cache_len=cache_len)
            d = drafter if s.block > 1 else None
            if d is not None:
                kw.update(block_size=s.block, tree_budget=s.tree)
            r = generate(target, d, prompts, **kw)
            return r.decode_time / max(r.cycles, 1)

        for s in todo:
            run(s)  # compile
        times = {s.key: [] for s in todo}
        for _ in range(rounds):
            for s in todo:
                times[s.key].append(run(s))
        base = float(np.median(times["target"]))
        new = {k: float(np.median(v)) / base for k, v in times.items()}
        new["target"] = 1.0
        allc = {**have, **new}
        for fam in (sorted((s for s in shapes if s.block > 1 and not s.tree), key=lambda s: s.block),
                    sorted((s for s in shapes if s.tree), key=lambda s: s.tree)):
            top = 0.0
            for s in fam:
                top = max(top, allc[s.key])
                allc[s.key] = top
        have = allc
        table = _read_costs()
        table[key] = have
        _write_costs(table)
        if log:
            log(f"auto shape: measured cycle costs for {len(missing)} shape(s) at batch {batch}, cache {cache_len} "
                f"-> {_cost_file()}")
    return {s.key: have[s.key] for s in shapes}


HALF_LIFE = 512  # row-cycles after which older acceptance evidence counts half (the text may change)
PROBE_EVERY = 8  # with target-only chosen, every this many calls one runs the best drafted shape


@dataclasses.dataclass
class Evidence:
    """Acceptance observed on one pair, every count decayed with a half-life of HALF_LIFE row-cycles
    (so the estimates follow the text: code after maths, chat after code).

    hist: the full-block histogram (tokens committed per cycle by the chain at the drafter's block);
    own: per drafted shape, [decayed sum of committed tokens, decayed cycles]."""
    full_block: int
    hist: list = dataclasses.field(default_factory=list)  # hist[n] = (decayed) cycles that committed n
    own: dict = dataclasses.field(default_factory=dict)  # shape key -> [sum of committed, cycles]
    idle: int = 0  # calls in a row that ran target-only

    def add(self, shape: Shape, acceptance_lengths) -> None:
        lens = [int(x) for row in acceptance_lengths for x in row]
        if shape.block == 1:
            self.idle += 1
            return
        self.idle = 0
        if not lens:
            return
        keep = 0.5 ** (len(lens) / HALF_LIFE)
        self.hist = [h * keep for h in self.hist]
        for v in self.own.values():
            v[0] *= keep
            v[1] *= keep
        if shape.block == self.full_block and not shape.tree:
            if not self.hist:
                self.hist = [0.0] * (self.full_block + 1)
            for n in lens:
                self.hist[min(n, self.full_block)] += 1.0
        s = self.own.setdefault(shape.key, [0.0, 0.0])
        s[0] += float(sum(lens))
        s[1] += float(len(lens))

    def tried(self, shape: Shape) -> bool:
        return shape.key in self.own

    def tau(self, shape: Shape) -> float | None:
        """Estimated tokens committed per cycle (None: nothing to go on): the shape's own (decayed) observed
        mean once it has run, else from the full-block histogram - a chain of B
        commits min(n, B) where the full block committed n; a tree of N nodes at least what the
        drafter's greedy chain to depth min(N, D) commits (the tree contains it)."""
        if shape.block == 1:
            return 1.0
        own = self.own.get(shape.key)
        if own and own[1] > 0:
            return own[0] / own[1]
        if self.hist and sum(self.hist) > 0:
            h = np.asarray(self.hist, float)
            n = np.arange(len(h))
            depth = min(shape.tree, shape.block - 1) + 1 if shape.tree else shape.block
            return float((np.minimum(n, depth) * h).sum() / h.sum())
        return None


@dataclasses.dataclass
class Choice:
    shape: Shape
    reason: str


def choose(shapes, costs: dict, ev: Evidence, explore: float = 0.8) -> Choice:
    """The shape of highest expected committed tokens per unit time (target-only included)."""
    full = Shape(ev.full_block)
    if not (ev.hist and sum(ev.hist) > 0):
        return Choice(full, f"auto shape: {full.label} (no acceptance observed yet on this pair: the full block "
                            f"gives the acceptance histogram every chain estimate needs)")
    rate = {}
    for s in shapes:
        t = ev.tau(s)
        if t is not None:
            rate[s] = t / costs[s.key]
    best = max(rate, key=rate.get)
    if best.block == 1 and ev.idle >= PROBE_EVERY - 1:  # keep the evidence fresh: the text may have changed
        spec = max((s for s in rate if s.block > 1), key=rate.get, default=None)
        if spec is not None:
            return Choice(spec, f"auto shape: {spec.label} (probing after {ev.idle} target-only calls: expected "
                                f"{rate[spec]:.2f}x vs target-only 1.00x)")
    for s in shapes:  # a tree never run yet whose floor comes close: try it once
        if s.tree and not ev.tried(s) and s in rate and rate[s] >= explore * rate[best]:
            return Choice(s, f"auto shape: {s.label} (trying it: floor estimate tau {ev.tau(s):.2f} / cost "
                             f"{costs[s.key]:.2f} = {rate[s]:.2f}x vs best {best.label} {rate[best]:.2f}x)")
    ranked = sorted(rate, key=rate.get, reverse=True)
    nxt = ranked[1] if len(ranked) > 1 else best
    return Choice(best, f"auto shape: {best.label} (expected {rate[best]:.2f}x target-only: tau {ev.tau(best):.2f} / "
                        f"cycle cost {costs[best.key]:.2f} target steps; next {nxt.label} {rate[nxt]:.2f}x)")


_EVIDENCE: dict = {}


def evidence_for(target, drafter) -> Evidence:
    k = pair_key(target, drafter)
    if k not in _EVIDENCE:
        _EVIDENCE[k] = Evidence(full_block=drafter.config.block_size)
    return _EVIDENCE[k]
