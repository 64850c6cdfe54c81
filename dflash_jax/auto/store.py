"""On-disk state of the automatic shape, and agreement across processes.

One JSON file, $DFLASH_JAX_CACHE/auto.json (default ~/.cache/dflash_jax), {"version", "curves", "evidence"}:
cost curves keyed by (pair, batch, device, cache size), evidence keyed by (pair, device). A file of another
VERSION is ignored (it is only a cache: curves are measured again, evidence starts afresh). Writes are atomic.
Multi-host: every process must run the same programs, so process 0's curve and choices are everyone's.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from .policy import Choice, Evidence

ENV_DIR = "DFLASH_JAX_CACHE"
VERSION = 1  # bumped when a stored curve's measurement or Evidence's fields change meaning
FILE = "auto.json"


def cache_dir() -> str:
    return os.environ.get(ENV_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "dflash_jax")


def path() -> str:
    return os.path.join(cache_dir(), FILE)


def pair_key(target, drafter) -> str:
    """A fingerprint of the pair: the configs and a few weight values (never a whole array fetched)."""
    import jax
    h = hashlib.sha1(repr((target.config, drafter.config)).encode())
    for leaf in jax.tree.leaves(drafter.params)[:2] + jax.tree.leaves(target.params)[:2]:
        head = leaf[(0,) * (leaf.ndim - 1)][:16] if leaf.ndim else leaf
        h.update(np.asarray(jax.device_get(head)).ravel().astype(np.float32).tobytes())
    return h.hexdigest()[:16]


def device_kind() -> str:
    import jax
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')}:{jax.device_count()}"


def curve_key(pair: str, batch: int, cache_len: int, device: str | None = None) -> str:
    return f"{pair}|b{batch}|{device or device_kind()}|S{cache_len}"


def load() -> dict:
    try:
        with open(path()) as f:
            table = json.load(f)
        if table.get("version") == VERSION:
            return table
    except (OSError, ValueError, AttributeError):
        pass
    return {"version": VERSION, "curves": {}, "evidence": {}}


def save(table: dict) -> None:
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{path()}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(table, f)
    os.replace(tmp, path())


def process_count() -> int:
    import jax
    return jax.process_count()


def from_process_0(values) -> list:
    """Process 0's values of a float list every process holds one of."""
    from jax.experimental import multihost_utils
    return [float(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.float32))]


def cached_curve(key: str, keys, measure, log=None) -> dict:
    """{shape key: cycle cost in target steps} stored under `key`, or measure() -> the same, stored. With several
    processes, process 0's stored curve (or, where it has none, every process measures and takes process 0's)."""
    table = load()
    have = table["curves"].get(key, {})
    keys = list(keys)
    if process_count() > 1:
        theirs = from_process_0([have.get(k, -1.0) for k in keys])
        have = dict(zip(keys, theirs)) if min(theirs) > 0 else {}
    if not all(k in have for k in keys):
        new = measure()
        if process_count() > 1:
            new = dict(zip(keys, from_process_0([new[k] for k in keys])))
        have = {**have, **new}
        table = load()
        table["curves"][key] = have
        save(table)
        if log:
            log(f"auto shape: cycle costs measured for {key} -> {path()}")
    return {k: float(have[k]) for k in keys}


def load_evidence(key: str, full_block: int) -> Evidence:
    """The evidence stored under `key` (pair | device), or a fresh one."""
    d = load()["evidence"].get(key)
    try:
        if d and d.get("full_block") == full_block:
            return Evidence(**d)
    except TypeError:
        pass
    return Evidence(full_block=full_block)


def save_evidence(key: str, ev: Evidence) -> None:
    table = load()
    table["evidence"][key] = dataclasses.asdict(ev)
    save(table)


def agree(choice: Choice, shapes) -> Choice:
    """Across processes, process 0's choice (processes running different programs in one mesh would stall)."""
    if process_count() == 1:
        return choice
    shapes = list(shapes)
    i, look = (int(x) for x in from_process_0([shapes.index(choice.shape), int(choice.look)]))
    if shapes[i] == choice.shape and bool(look) == choice.look:
        return choice
    return Choice(shapes[i], choice.expected_speedup, f"auto shape: {shapes[i].label} (process 0's choice; here: "
                                                      f"{choice.reason})", bool(look))
