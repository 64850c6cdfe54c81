"""The automatic shape's policy: per generate() call, target-only, a chain of B or a draft tree of N nodes, whichever
is expected to commit the most tokens per second (rate = tau / cost). Pure Python and numpy: no other dflash_jax
module, no clock of its own. The model and its reasoning: docs/auto.md; the replay benchmark: python -m
infer.auto_replay (recorded traces and curves in reports/auto/).

The decode glue (dflash_jax/decode/auto_glue.py), per generate(block_size="auto") call, with
shapes = candidate_shapes(drafter block):

    policy = AutoPolicy()                                    # knobs (frozen); ValueError on a bad one
    curve = store.cached_curve(store.curve_key(store.pair_key(t, d), batch, cache_len), keys, measure)
    ev = store.load_evidence(f"{pair}|{store.device_kind()}", full_block)   # once per process, kept in memory
    c = store.agree(policy.choose(ev, shapes, curve, context=ctx), shapes)  # ctx: f"b{batch}|S{cache_len}"
    shadow = policy.shadow_trees(ev, c.shape, shapes)        # tree budgets the chain's cycles report
    # whole call (c.look False, or max_new_tokens <= 2 * look_tokens): run c.shape, then
    policy.record(ev, shapes, curve, c.shape, r.acceptance_lengths, r.chain_lengths, shadows=r.shadow_lengths,
                  seconds=r.decode_time if not r.compile_time else None, cycles=r.cycles, context=ctx,
                  now=time.time())
    # look (c.look): run c.shape for look_tokens tokens, record(...) the look, then
    nxt = store.agree(policy.choose(ev, shapes, curve, context=ctx, rest=True), shapes)
    # ... continue in place with nxt.shape, record(..., offset=policy.look_tokens) the rest
    store.save_evidence(key, ev)
"""
from . import store
from .policy import (
                     CHAIN_BLOCKS,
                     TREE_BUDGETS,
                     AutoPolicy,
                     Choice,
                     Evidence,
                     Shape,
                     candidate_shapes,
                     monotone,
)

__all__ = [
                     "CHAIN_BLOCKS",
                     "TREE_BUDGETS",
                     "AutoPolicy",
                     "Choice",
                     "Evidence",
                     "Shape",
                     "candidate_shapes",
                     "monotone",
                     "store",
]
