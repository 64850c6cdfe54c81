"""Decoding: target-only and DFlash speculative (chain or draft tree), on device, with a host API.

Modules, in import order (each imports only those above it, and dflash_jax's model-level modules):

    shape     the typed shape of a cycle - TargetOnly(), Chain(b), Tree(n), Auto() - and its one parser
              `parse_shape(block_size=, tree_budget=, shape=)` / `Shape.parse("auto" | "chain:8" | "tree:16" | "off")`
    state     DecodeState (what the device programs carry) and the sizes they are built for: prompt bucket,
              cache slots, verify width, stop-id columns, the context cap; shard_map specs of state and models
    ratio     the ratio test of speculative sampling, for drafts sampled from a known proposal (DFlash2 at T > 0)
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

Per-layer decode state. The target's part of DecodeState (`tcache`) is what its layer kinds keep:

    cache.KVCache           attention layers: [L, B, KV, S, D] K/V slots and a fill index
    hybrid.HybridCache      a hybrid target (Qwen3.5 / Qwen3-Next): the attention layers' KVCache, the Gated DeltaNet
                            layers' gdn.GDNState (conv window + delta-rule state per row), and between a verification
                            and its commit a gdn.Pending
    gemma4.Gemma4Cache      Gemma 4: one KVCache per attention kind (sliding / full layers differ in head size and KV
                            heads), moved together

and every kind answers the same three calls of the programs here:

    model.init_cache(target, batch, slots)               the empty state
    model.forward(..., valid=, verify=, parent=)          a prefill chunk applies its rows (`valid`: a prompt's padding
                                                          changes nothing); a verification (`verify`) writes K/V rows
                                                          (overwritten later) and leaves the recurrent state as it is,
                                                          returning what commit needs; a tree also gives `parent`
    tcache.commit(lengths, n, path)                       keep n rows of a chain or the accepted tree path: the fill
                                                          index moves to `lengths`, a recurrent state is recomputed at
                                                          the path's last kept row from the verification's block terms

A new layer kind is its module (the state, its block math, its commit) and its entry in the family's layer list
(hybrid.kinds); prefill / cycle / tree_cycle / commit do not change.
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
