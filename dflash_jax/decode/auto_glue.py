"""The automatic shape on device: per generate(block_size="auto") call, dflash_jax.auto chooses and this runs it
(the interface: dflash_jax/auto/__init__.py; the reasoning: docs/auto.md).

- Cost curve, per (pair, batch, device kind, cache size): `measure_curve` times a few shapes on device - target
  steps, two chains, two trees (`measured_shapes`), a few short rounds at the call's prompt length and cache, so
  the programs it compiles are the ones the calls run - and derives the others on the line through their family's
  two (`derive_curve`); cached on disk by dflash_jax.auto.store.
- Evidence, per (pair, device kind): read once per process, kept in memory, saved after every call.
- A call: the policy's choice run whole, or as a look of `look_tokens` new tokens whose rows then go on in place
  (runner.run_shape: same decode state, one prefill, the output one run gives) with the shape chosen for the rest.
  Every process runs process 0's curve and choices (store.agree).

Logs through `logging` (logger "dflash_jax.decode.auto_glue"): a choice when it changes, the measurement's
progress, the cache file's location once per process. Never prints.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from ..auto import AutoPolicy, Shape, candidate_shapes, monotone, store
from .runner import run_shape
from .state import prompt_and_cache_len, verify_width

log = logging.getLogger(__name__)

POLICY = AutoPolicy()  # the knobs (dflash_jax.auto.AutoPolicy); tests may swap it
MEASURE_STEPS = 16  # decode cycles per timed run of a measured shape
MEASURE_ROUNDS = 3  # timed runs per measured shape, round-robin (a drift of the machine's load hits all alike)

_EVIDENCE: dict = {}  # evidence key -> Evidence: read from disk once per process
_SHOWN: dict = {}  # evidence key -> the shape last logged (a choice is logged when it changes)
_TOLD: set = set()  # cache files whose location was logged


def width(s: Shape) -> int:
    """Verified rows (cache slots) of one cycle of `s`."""
    return verify_width(s.block, s.tree)


def rows(s: Shape) -> int:
    """Rows one verify of `s` scores: the chain's block, the tree's root + nodes."""
    return s.tree + 1 if s.tree else s.block


def _families(shapes) -> tuple:
    chains = sorted((s for s in shapes if s.block > 1 and not s.tree), key=lambda s: s.block)
    return chains, sorted((s for s in shapes if s.tree), key=lambda s: s.tree)


def measured_shapes(shapes) -> list:
    """What `measure_curve` times: target-only and, per family (chains, trees), its second smallest member (the
    smallest in a family of two or one) and its largest; the others are derived from these (`derive_curve`)."""
    out = [Shape(1)]
    for fam in _families(shapes):
        for s in ([fam[1] if len(fam) > 2 else fam[0], fam[-1]] if fam else []):
            if s not in out:
                out.append(s)
    return out


def derive_curve(timed: dict, shapes) -> dict:
    """{shape key: cycle cost in target steps} of every shape from `timed` (those of `measured_shapes`): within a
    family, on the line through its two measured members by verified rows (a cycle is a drafter pass and a verify
    of its rows, both about linear in the rows: the recorded curves, reports/auto/costs.json, sit within ~5% of
    such lines; a falling line, timing noise, is taken flat), at least one target step; each family then made
    non-decreasing (auto.monotone)."""
    out = {"target": 1.0}
    for fam in _families(shapes):
        pts = sorted((rows(s), max(1.0, float(timed[s.key]))) for s in fam if s.key in timed)
        (w1, c1), (w2, c2) = (pts[0], pts[-1]) if pts else ((1, 1.0), (1, 1.0))
        slope = max(0.0, (c2 - c1) / (w2 - w1)) if w2 > w1 else 0.0  # never falling: timing noise
        for s in fam:
            out[s.key] = max(1.0, float(timed[s.key]) if s.key in timed else c1 + slope * (rows(s) - w1))
    return monotone(out, shapes)


def measure_curve(target, drafter, batch: int, cache_len: int, shapes, *, prompt_len: int, sp, mesh=None,
                  prefill_chunk: int, steps: int | None = None, rounds: int | None = None) -> dict:
    """{shape key: cycle time / target step time}: `measured_shapes` run on random prompts of `prompt_len` tokens
    (the call's longest: attention cost follows the fill) in a cache of `cache_len` slots, no stop tokens: each
    once untimed (it compiles; a program's first run carries one-time costs), then `rounds` (MEASURE_ROUNDS) rounds
    of each for `steps` (MEASURE_STEPS) cycles, each run's cycle time over the target steps timed just before and after it; per shape the
    median over the rounds. The rest: `derive_curve`."""
    t0 = time.perf_counter()
    steps, rounds = steps or MEASURE_STEPS, rounds or MEASURE_ROUNDS
    rng = np.random.default_rng(0)
    room = cache_len - max(width(s) for s in shapes)  # prompt + steps + 1 new tokens must fit
    steps = max(1, min(int(steps), room - 17))  # a small cache: fewer cycles, so a 16-token prompt still fits
    plen = max(1, min(int(prompt_len), room - steps - 1))
    prompts = [rng.integers(0, target.config.vocab_size, size=plen).tolist() for _ in range(batch)]
    todo = measured_shapes(shapes)
    what = f"batch {batch}, cache {cache_len}"

    def run(s):
        r = run_shape(target, drafter if s.block > 1 else None, prompts, sp=sp, max_new_tokens=steps + 1,
                      stop_token_ids=[], seed=0, max_cache_len=cache_len, row_ids=None, mesh=mesh,
                      prefill_chunk=prefill_chunk, Bk=s.block, tree=s.tree)[0]
        return r.decode_time / max(r.cycles, 1)

    for k, s in enumerate(todo):
        log.info(f"auto: measuring cycle costs for {what} ({k + 1} of {len(todo)}: {s.label}) ...")
        run(s)
    ratios = {s.key: [] for s in todo[1:]}
    for _ in range(rounds):  # target steps timed beside each shape: the machine's load moves within seconds
        step = run(todo[0])
        for s in todo[1:]:
            t, after = run(s), run(todo[0])
            ratios[s.key].append(t / (0.5 * (step + after)))
            step = after
    timed = {"target": 1.0, **{k: float(np.median(v)) for k, v in ratios.items()}}
    curve = derive_curve(timed, shapes)
    log.info(f"auto: cycle costs for {what} in {time.perf_counter() - t0:.1f} s (target steps; * derived): "
             + ", ".join(f"{s.label} {curve[s.key]:.2f}{'' if s.key in timed else '*'}" for s in shapes[1:]))
    return curve


def evidence(target, drafter, pair: str | None = None):
    """(key, Evidence) of this pair (`pair`: its store.pair_key) on this device kind: read from disk once per
    process, then kept in memory."""
    key = f"{pair or store.pair_key(target, drafter)}|{store.device_kind()}"
    if key not in _EVIDENCE:
        _EVIDENCE[key] = store.load_evidence(key, drafter.config.block_size)
    return key, _EVIDENCE[key]


def generate_auto(target, drafter, prompts, *, sp, max_cache_len, max_new_tokens, stop_token_ids, seed, row_ids,
                  mesh, prefill_chunk):
    """generate(block_size="auto")'s body (arguments checked by generate): the policy's choice for this call, run
    whole or as a look and then the rest in place; the outcome recorded and saved. The result carries the
    one-line reason (`auto_reason`: the look's, then "; then" the rest's) and `auto_look`: the call explored (its
    first shape was chosen for what it shows, not as the best estimate). The host's choice between the two parts
    counts as decode time."""
    if store.path() not in _TOLD:
        _TOLD.add(store.path())
        log.info(f"auto: cost curves and acceptance evidence cached in {store.path()} (${store.ENV_DIR})")
    shapes = candidate_shapes(drafter.config.block_size)
    longest, B = max(len(p) for p in prompts), len(prompts)
    _, S = prompt_and_cache_len(longest, max_new_tokens, max(width(s) for s in shapes), max_cache_len)
    pair = store.pair_key(target, drafter)
    kw = dict(sp=sp, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed, max_cache_len=S,
              row_ids=row_ids, mesh=mesh, prefill_chunk=prefill_chunk)
    curve = store.cached_curve(store.curve_key(pair, B, S), [s.key for s in shapes], lambda: measure_curve(
        target, drafter, B, S, shapes, prompt_len=longest, sp=sp, mesh=mesh, prefill_chunk=prefill_chunk))
    key, ev = evidence(target, drafter, pair)
    ctx = f"b{B}|S{S}"  # cycle times count for this batch and cache size only
    look = POLICY.look_tokens

    def say(c):
        if _SHOWN.get(key) != c.shape:
            log.info(c.reason)
            _SHOWN[key] = c.shape

    def record(sh, r, offset=0):
        # a run that compiled carries one-time costs (~0.3 s on CPU): its time is not a cycle time
        POLICY.record(ev, shapes, curve, sh, r.acceptance_lengths, r.chain_lengths if sh.block > 1 else None,
                      shadows=r.shadow_lengths, seconds=None if r.compile_time else r.decode_time, cycles=r.cycles,
                      context=ctx, now=time.time(), offset=offset)

    first = ev.calls == 0
    choice = store.agree(POLICY.choose(ev, shapes, curve, context=ctx), shapes)
    explored = first or choice.shape != dataclasses.replace(POLICY, horizon=0).choose(ev, shapes, curve,
                                                                                       context=ctx).shape
    say(choice)
    sh = choice.shape
    shadow = POLICY.shadow_trees(ev, sh, shapes) or None
    # a whole call of one shape: no look, a short call, or a look at target-only (its state holds no drafter context
    # for a drafted rest to go on from: it times target steps over the whole call)
    if not choice.look or sh.block == 1 or max_new_tokens <= 2 * look:
        res = run_shape(target, drafter if sh.block > 1 else None, prompts, Bk=sh.block, tree=sh.tree,
                        shadow=shadow, **kw)[0]
        record(sh, res)
        res.auto_reason, res.auto_look = choice.reason, explored
        store.save_evidence(key, ev)
        return res
    rest = []

    def then(part):  # the look's evidence in, the shape for the rest out
        record(sh, part)
        nxt = store.agree(POLICY.choose(ev, shapes, curve, context=ctx, rest=True), shapes)
        say(nxt)
        rest.append(nxt.shape)
        part.auto_reason = f"{choice.reason}; then {nxt.reason}"  # part is the call's result, carried on
        return nxt.shape.block, nxt.shape.tree, POLICY.shadow_trees(ev, nxt.shape, shapes)

    res, more = run_shape(target, drafter, prompts, Bk=sh.block, tree=sh.tree, look=look, then=then, shadow=shadow,
                          **kw)
    res.auto_look = explored
    if more is None:  # every row ended within the look
        res.auto_reason = choice.reason
        record(sh, res)
    else:
        record(rest[0], more, offset=look)
    store.save_evidence(key, ev)
    return res

