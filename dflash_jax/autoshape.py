"""Automatic verification shape: target-only, a chain block B, or a draft tree of N nodes.

Expected committed tokens per second of a shape = tau(shape) / cycle_time(shape). Cycle times are
measured once per (pair, batch, device kind, cache size) as a cost curve relative to one target
step, and cached on disk (`$DFLASH_JAX_CACHE`, default ~/.cache/dflash_jax, file shape_costs.json).
Acceptance is estimated from what has been observed on this pair:
  * chain: from the histogram of tokens committed per cycle at the drafter's full block,
    tau(B) = E[min(n, B)] (a cycle that committed n at the full block commits min(n, B) at B);
  * tree of N nodes: its own observed mean when it has run, else the chain's tau at depth
    min(N, D) + 1 as a floor (the best-first tree always contains the drafter's greedy chain to
    depth min(N, D)); shapes never observed are tried once when their floor is within `explore` of
    the best estimate, so evidence accumulates.
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


def cost_curve(target, drafter, batch: int, cache_len: int, shapes, steps: int = 12, log=None) -> dict:
    """{shape key: cycle time / target step time} for this pair, batch and cache length: read from the
    disk cache, or measured (each shape: one compiling run, then the best of two timed runs of
    `steps` cycles on random prompts without stop tokens) and stored."""
    from .generate import generate
    key = f"{pair_key(target, drafter)}|b{batch}|{_device_kind()}|S{cache_len}"
    table = _read_costs()
    have = table.get(key, {})
    missing = [s for s in shapes if s.key not in have]
    if missing:
        rng = np.random.default_rng(0)
        V = target.config.vocab_size
        prompts = [rng.integers(0, V, size=16).tolist() for _ in range(batch)]
        secs = {}
        for s in [Shape(1)] + [m for m in missing if m.block > 1]:
            kw = dict(max_new_tokens=steps + 1, stop_token_ids=[], max_cache_len=cache_len)
            d = drafter if s.block > 1 else None
            if d is not None:
                kw.update(block_size=s.block, tree_budget=s.tree)
            generate(target, d, prompts, **kw)  # compile
            t = min((lambda r: r.decode_time / max(r.cycles, 1))(generate(target, d, prompts, **kw))
                    for _ in range(2))
            secs[s.key] = t
        base = secs["target"]
        have = {**have, **{k: v / base for k, v in secs.items()}}  # target -> 1.0
        table = _read_costs()
        table[key] = have
        _write_costs(table)
        if log:
            log(f"auto shape: measured cycle costs for {len(missing)} shape(s) at batch {batch}, cache {cache_len} "
                f"-> {_cost_file()}")
    return {s.key: have[s.key] for s in shapes}


@dataclasses.dataclass
class Evidence:
    """Acceptance observed on one pair: full-block histogram (tokens committed per cycle, chain at
    the drafter's block) and per-tree-budget sums."""
    full_block: int
    hist: list = dataclasses.field(default_factory=list)  # hist[n] = cycles that committed n
    tree_sum: dict = dataclasses.field(default_factory=dict)  # budget -> [sum of committed, cycles]

    def add(self, shape: Shape, acceptance_lengths) -> None:
        lens = [int(x) for row in acceptance_lengths for x in row]
        if shape.tree:
            s = self.tree_sum.setdefault(shape.tree, [0, 0])
            s[0] += sum(lens)
            s[1] += len(lens)
        elif shape.block == self.full_block:
            if not self.hist:
                self.hist = [0] * (self.full_block + 1)
            for n in lens:
                self.hist[min(n, self.full_block)] += 1

    def tau(self, shape: Shape) -> float | None:
        """Estimated tokens committed per cycle (None: nothing to go on)."""
        if shape.block == 1:
            return 1.0
        chain = None
        if self.hist and sum(self.hist):
            h = np.asarray(self.hist, float)
            n = np.arange(len(h))
            depth = min(shape.tree, shape.block - 1) + 1 if shape.tree else shape.block
            chain = float((np.minimum(n, depth) * h).sum() / h.sum())
        if shape.tree:
            s = self.tree_sum.get(shape.tree)
            if s and s[1]:
                return s[0] / s[1]
        return chain


@dataclasses.dataclass
class Choice:
    shape: Shape
    reason: str


def choose(shapes, costs: dict, ev: Evidence, explore: float = 0.8) -> Choice:
    """The shape of highest expected committed tokens per unit time (target-only included)."""
    full = Shape(ev.full_block)
    if not (ev.hist and sum(ev.hist)):
        return Choice(full, f"auto shape: {full.label} (no acceptance observed yet on this pair: the full block "
                            f"gives the acceptance histogram every chain estimate needs)")
    rate = {}
    for s in shapes:
        t = ev.tau(s)
        if t is not None:
            rate[s] = t / costs[s.key]
    best = max(rate, key=rate.get)
    for s in shapes:  # a tree never run yet whose floor comes close: try it once
        if s.tree and s.tree not in ev.tree_sum and s in rate and rate[s] >= explore * rate[best]:
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
