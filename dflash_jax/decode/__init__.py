"""Decoding: target-only and DFlash speculative (chain or draft tree), on device, with a host API.

Modules, in import order (each imports only those above it, and dflash_jax's model-level modules):

    shape     the typed shape of a cycle - TargetOnly(), Chain(b), Tree(n), Auto() - and its one parser
              `parse_shape(block_size=, tree_budget=, shape=)` / `Shape.parse("auto" | "chain:8" | "tree:16" | "off")`
    state     DecodeState (what the device programs carry) and the sizes they are built for: prompt bucket,
              cache slots, verify width, stop-id columns, the context cap; shard_map specs of state and models
    programs  the device programs: prefill, cycle / tree_cycle, commit, loop; `decode_programs` names what one
              decode runs (function, statics, donated args, specs), `program` jits one (the planner lowers these)
    cache     ProgramCache: compiled executables per static shape, and the row-layout copies of the latest pair;
              DEFAULT is generate()'s, DEFAULT.counts is dflash_jax.COMPILE_COUNTS
    result    GenerationResult, read from the final state; joining a call's two parts; shadow-tree commits
    runner    run_shape: one call of a fixed shape on device (batch padding, mesh placement, compile or reuse,
              time), and auto's look-then-continue in the same decode state
    auto_glue generate_auto: the automatic shape on device - dflash_jax.auto (a pure policy) chooses; this
              measures the cost curve, keeps the evidence, runs the choice (a look, then the rest in place)
    api       generate() (argument checks, prompts as ids / arrays / a tokenizer's output / strings, decoded
              texts), draft_logits()

dflash_jax.engine (continuous batching) builds on state and programs.

Per-layer decode state (design; today every layer holds one uniform KV cache, cache.KVCache [L, B, KV, S, D]).
The next targets mix layer kinds: KV caches of different head sizes and sliding windows, recurrent states that
must roll back to the accepted length, KV shared between layers. Each kind is one module offering the loop:

    init(config, batch, slots, dtype) -> state          the empty state of one layer (or a stack of like layers)
    prefill(state, x, positions, lens) -> (y, state)    write a prompt chunk (chunked prefill: positions start
                                                        mid-prompt; rows are right-padded, `lens` their lengths)
    verify(state, x, positions, mask) -> (y, pending)   read for a block of W rows per batch row: a chain (mask:
                                                        causal) or a tree (mask: [W, W] ancestors, positions =
                                                        start + depth); returns what commit needs, writes nothing
                                                        that commit cannot undo
    commit(state, pending, n, path=None) -> state       keep the first n of the W rows (chain), or the rows on
                                                        `path` (tree, [B, D + 1] flattened node per depth) moved
                                                        to contiguous positions; a KV cache moves its fill index
                                                        (and compacts the path), a recurrent state keeps the
                                                        state after row n - 1 of the path (verify returns every
                                                        row's state, or the inputs to recompute it)
    spec(mesh axes) -> PartitionSpec pytree             rows over 'data', heads / channels over 'model'
    bytes(config, batch, slots) -> int                  resident bytes (the planner's memory check), and
    read_bytes(config, batch, fill, W) -> int           bytes one verify reads (its cost model)

DecodeState then holds a tuple of per-kind states (the target's and the drafter context's) instead of two
KVCaches; prefill / cycle / tree_cycle / commit call these methods per layer group and stay unchanged
otherwise; state_specs and the planner's byte counts sum the kinds'. Adding a layer kind is its module plus its
entry in the model's layer list.
"""
from .api import draft_logits, generate, token_prompts
from .auto_glue import generate_auto
from .cache import COMPILE_COUNTS, DEFAULT, ProgramCache, clear_compile_cache
from .programs import (commit, cycle, decode_programs, loop, prefill, program, rows_layout, rows_pay,
                       tree_cycle)
from .result import GenerationResult
from .runner import run_shape, stop_array
from .shape import MAX_TREE_NODES, Auto, Chain, Shape, TargetOnly, Tree, parse_shape
from .state import (CACHE_ALIGN, PREFILL_CHUNK, DecodeState, bucket, capped_new_tokens, model_specs,
                    prompt_and_cache_len, resolve_block_size, round_up, state_specs, stop_width, taps_of,
                    verify_width)

__all__ = [
    "Auto", "CACHE_ALIGN", "COMPILE_COUNTS", "Chain", "DEFAULT", "DecodeState", "GenerationResult", "MAX_TREE_NODES",
    "PREFILL_CHUNK", "ProgramCache", "Shape", "TargetOnly", "Tree", "bucket", "capped_new_tokens",
    "clear_compile_cache", "commit", "cycle", "decode_programs", "draft_logits", "generate", "generate_auto", "loop",
    "model_specs", "parse_shape", "prefill", "program", "prompt_and_cache_len", "resolve_block_size", "round_up",
    "rows_layout", "rows_pay", "run_shape", "state_specs", "stop_array", "stop_width", "taps_of", "token_prompts",
    "tree_cycle", "verify_width",
]
