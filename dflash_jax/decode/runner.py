"""One decode call on device for a fixed shape, and auto's look-then-continue: the rows of a first part (the look)
that are still going run on in the same decode state with another shape (no second prefill).

`run_shape` pads and places the batch (a mesh: rows over 'data'), compiles or reuses the prefill and loop
programs of decode.programs through a ProgramCache, runs them and collects the GenerationResult.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from .cache import DEFAULT, ProgramCache
from .programs import decode_programs
from .result import collect, join
from .state import mesh_of, prompt_and_cache_len, stop_width, verify_width


def stop_array(stop_token_ids, B, default):
    """[B, K] stop ids (-1: none) of None (`default`: the target's eos ids), a list for all rows or one per row."""
    if stop_token_ids is None:
        rows = [list(default)] * B
    elif len(stop_token_ids) and isinstance(stop_token_ids[0], (list, tuple)):
        if len(stop_token_ids) != B:
            raise ValueError(f"per-row stop_token_ids has {len(stop_token_ids)} rows for {B} prompts")
        rows = [list(r) for r in stop_token_ids]
    else:
        rows = [list(stop_token_ids)] * B
    K = stop_width(max(len(r) for r in rows))
    arr = np.full((B, K), -1, np.int32)
    for i, r in enumerate(rows):
        arr[i, :len(r)] = r
    return arr


def shadow_budgets(shadow, drafter, tree) -> tuple:
    """The sorted tree budgets of `shadow` (an int or a sequence) for a chain with a drafter, else ()."""
    if not shadow or drafter is None or tree is not None:
        return ()
    return tuple(sorted({int(n) for n in ([shadow] if isinstance(shadow, int) else shadow)}))


def run_shape(target, drafter, prompts, *, sp, max_new_tokens, stop_token_ids, seed, max_cache_len, row_ids, mesh,
              prefill_chunk, Bk, tree, look=None, then=None, shadow=None, programs: ProgramCache | None = None):
    """generate()'s body for one shape (Bk, tree) - checked by the caller. With `look` and `then`: the shape
    runs for `look` new tokens per row, `then(partial GenerationResult)` names the shape (Bk, tree) for the
    rest (Bk 1: target-only), and the decode goes on in the same state - the caches, the drafter context and
    the tokens so far - up to max_new_tokens: no second prefill (auto's looks, decode.auto_glue); `then` may
    name a third value, the rest's shadow trees.
    `shadow` (a chain): tree budgets whose commits each cycle reports (GenerationResult.shadow_lengths).
    Every drafted shape of a drafter shares one state layout (token buffer [B, S + the drafter's block]),
    so the prefill and each shape's loop are the programs a fixed-shape call of that shape runs.
    `programs`: the ProgramCache to compile into (default: decode.cache.DEFAULT).
    Returns (the whole call's GenerationResult, the later part's alone or None)."""
    programs = programs if programs is not None else DEFAULT
    width = verify_width(Bk, tree)
    mesh = mesh if mesh is not None else mesh_of(target)
    B = len(prompts)
    longest = max(len(p) for p in prompts)
    if mesh is not None:
        from .. import sharding as shd
        from ..weights import shard_drafter, shard_target
        target = shard_target(target, mesh)
        drafter = shard_drafter(drafter, mesh) if drafter is not None else None
        dp = shd.data_axis(mesh)
        pad = (-B) % dp  # pad the batch to a multiple of the data axis with copies of the last prompt
        prompts = prompts + [prompts[-1]] * pad
        if row_ids is not None:
            row_ids = list(row_ids) + [max(row_ids) + 1 + i for i in range(pad)]
    lens = np.array([len(p) for p in prompts], np.int32)
    P, S = prompt_and_cache_len(longest, max_new_tokens, width, max_cache_len)
    Bp = len(prompts)
    tokens = np.zeros((Bp, P), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    stop = stop_array(stop_token_ids, B, target.config.eos_token_ids)
    stop = np.concatenate([stop, np.repeat(stop[-1:], Bp - B, axis=0)])  # padding rows copy the last row
    rows = np.asarray(row_ids if row_ids is not None else np.arange(Bp), np.int32)
    key = jax.random.PRNGKey(seed)
    first_new = min(int(look), int(max_new_tokens)) if look is not None else int(max_new_tokens)
    budget = np.full((Bp,), first_new, np.int32)

    def put(h, spec):
        if mesh is None:
            return jnp.asarray(h)
        from ..weights import put_global
        return put_global(h, mesh, spec)

    base = (target, drafter)
    target, drafter = programs.rows_pair(target, drafter, width, mesh)
    shadow = shadow_budgets(shadow, drafter, tree)
    progs = decode_programs(target, drafter, mesh, S=S, Bk=Bk, sp=sp, chunk=int(prefill_chunk), tree=tree,
                            shadow=max(shadow) if shadow else None)
    from jax.sharding import PartitionSpec as PS
    specs = progs["row_specs"] or (None,) * 5
    tokens_d, lens_d, rows_d, stop_d, budget_d = (put(h, s) for h, s in zip((tokens, lens, rows, stop, budget), specs))
    key = put(np.asarray(key), PS())
    pre_args = (target, drafter, tokens_d, lens_d, rows_d, key, stop_d, budget_d)
    fn, statics, donate, pspecs = progs["prefill"]
    pre, c1 = programs.compiled("prefill", fn, statics, pre_args, donate, mesh, pspecs)
    t0 = time.perf_counter()
    state = jax.block_until_ready(pre(*pre_args))
    t_prefill = time.perf_counter() - t0

    def run_loop(state, target, drafter, progs, budget_d):
        loop_args = (target, drafter, state, rows_d, key, stop_d, budget_d)
        fn, statics, donate, lspecs = progs["loop"]
        loop, c = programs.compiled("loop", fn, statics, loop_args, donate, mesh, lspecs)
        t0 = time.perf_counter()
        out = jax.block_until_ready(loop(*loop_args))
        t = time.perf_counter() - t0
        return (out if "shadow" in statics else (out, None)) + (c, t)

    state, trees, c2, t_decode = run_loop(state, target, drafter, progs, budget_d)
    res, host = collect(state, B, 0, Bk, tree, trees, shadow)
    res.prefill_time, res.decode_time, res.compile_time = t_prefill, t_decode, c1 + c2
    if then is None or first_new >= max_new_tokens:
        return res, None
    t0 = time.perf_counter()
    out, gen_len = host
    # rows that stopped only at the look's budget go on (a stop token or max_new_tokens ends a row for good)
    last = out[np.arange(Bp), np.maximum(gen_len - 1, 0)]
    done = np.any(last[:, None] == stop, axis=1) | (gen_len >= max_new_tokens)
    if done.all():
        return res, None
    Bk2, tree2, *more_shadow = then(res)
    shadow2 = shadow_budgets(more_shadow[0] if more_shadow and Bk2 > 1 else None, drafter, tree2)
    target, drafter = base
    if Bk2 == 1:  # target-only from here: the drafter's part of the state is dropped (its own program's layout)
        drafter = None
        state = state.replace(dcache=None, chain_hist=None, out=state.out[:, :state.acc_hist.shape[1] + 1])
    state = state.replace(done=put(done, specs[2]))
    budget_d = put(np.full((Bp,), int(max_new_tokens), np.int32), specs[4])
    target, drafter = programs.rows_pair(target, drafter, verify_width(Bk2, tree2), mesh)
    progs = decode_programs(target, drafter, mesh, S=S, Bk=Bk2, sp=sp, chunk=int(prefill_chunk), tree=tree2,
                            shadow=max(shadow2) if shadow2 else None)
    t_host = time.perf_counter() - t0
    state, trees, c3, t_more = run_loop(state, target, drafter, progs, budget_d)
    more, _ = collect(state, B, res.cycles, Bk2, tree2, trees, shadow2)
    more.decode_time, more.compile_time = t_more, c3
    join(res, more)
    res.decode_time += t_host + t_more  # auto's choice between the parts is the caller's time too
    return res, more
