"""The user API: `generate()` (argument checks, prompts in any accepted form, the shape; auto runs in
decode.auto_glue) and `draft_logits()`. Logs through `logging` (logger "dflash_jax.decode.api"); never prints."""
from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from ..drafter import Drafter, check_compatible
from ..model import Target, check_ids
from ..sampling import SamplingParams
from .auto_glue import generate_auto
from .programs import draft_logits_program
from .result import GenerationResult
from .runner import run_shape, stop_array
from .shape import Auto, Chain, Shape, parse_shape
from .state import PREFILL_CHUNK, capped_new_tokens

log = logging.getLogger(__name__)


def generate(target: Target, drafter: Drafter | None, prompts, *,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_token_ids=None, seed: int = 0, block_size: int | str | None = "auto",
             max_cache_len: int | None = None, row_ids: Sequence[int] | None = None, mesh=None,
             prefill_chunk: int = PREFILL_CHUNK, tree_budget: int | str | None = None,
             shadow_trees: int | Sequence[int] | None = None, shape: Shape | str | int | None = None,
             tokenizer=None, greedy_drafts: bool = False) -> GenerationResult:
    """Generate for a ragged batch of prompts; speculative when `drafter` is given.

    prompts: token-id sequences (lists, numpy / jax arrays: a 2-D array is one prompt per row, a 1-D one or a flat
    list of ids one prompt), a tokenizer's output (a transformers BatchEncoding or a dict with "input_ids", padding
    dropped by its "attention_mask"), or strings (with `tokenizer`: each one user turn, in the tokenizer's chat
    template when it has one).
    tokenizer: a transformers tokenizer; the result then carries the decoded `texts` (cut before a stop token),
    and stop_token_ids defaults to the tokenizer's and the target's eos ids.
    stop_token_ids: None (the target's eos ids), a list shared by all rows, or a list per row.
    max_cache_len: KV cache slots per row (default: sized from the prompt bucket); a prompt that
    does not fit with max_new_tokens + block_size is a ValueError.
    mesh: a ('data', 'model') mesh (default: the mesh the target's params live on, if any): the
    decode runs under shard_map, tensor-parallel over 'model', rows split over 'data'.
    prefill_chunk: prompts longer than this many tokens are prefilled chunk by chunk.
    Shape of the speculative cycle: `shape` (decode.shape: Auto(), Chain(b), Tree(n), TargetOnly(), or a string
    "auto", "chain:8", "tree:16", "off"), or the older pair (block_size, tree_budget), not both:
    - block_size "auto" (the default), tree_budget None: automatic - target-only, a chain block or a
      tree, whichever gives the most expected committed tokens per second (dflash_jax.auto, run by
      decode.auto_glue: cycle costs measured once per pair / batch / device / cache size and cached on disk,
      acceptance estimated from earlier calls); the same with tree_budget "auto" (block_size then "auto" or None).
    - block_size None: the chain of the drafter's full block; an int: a chain of that block
      (2 .. the drafter's block size).
    - tree_budget an int N (at most decode.shape.MAX_TREE_NODES): verify a draft tree of N nodes per cycle
      (DDTree-style, built on device from the drafter's per-depth distributions, depth <= block - 1), block "auto"
      or None being the drafter's own block, an int that block.
    Without a drafter: target-only decoding ("auto" measures nothing); a tree is a ValueError.
    shadow_trees (a chain: block_size given or None): tree budgets N (an int or several) whose commits the result
    reports per cycle (GenerationResult.shadow_lengths): each cycle also builds the draft tree of max(N) nodes
    from its distributions, unverified, and after the call the committed text is walked down it - what a tree
    of N nodes would have committed at that cycle's anchor (exactly, for the drafter's full block: a tree run is
    built from the same distributions; a shorter block's trees come from its own block pass, N <= its drafts; at
    T > 0 as well, samples being keyed by position). Costs one tree build per cycle (embedded pair, CPU: ~0.3 ms at
    15 nodes, ~0.9 ms at 63).
    A DFlash2 drafter (config kind "dflash2") drafts by its selector's walk: the argmax walk at T = 0; at T > 0 a
    walk sampled from its proposal, verified by the ratio test (decode.ratio), or with `greedy_drafts` the argmax
    walk accepted on exact match. A tree holds its N most likely selector paths; "auto" is its full block's chain.
    Every bad argument is a ValueError naming it.
    """
    sp = SamplingParams(float(temperature), int(top_k), float(top_p), bool(greedy_drafts))
    prompts = token_prompts(prompts, tokenizer)
    if not prompts:
        raise ValueError("prompts is empty")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        check_ids(target.config.vocab_size, np.asarray(p))
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if int(prefill_chunk) < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    longest = max(len(p) for p in prompts)
    capped = capped_new_tokens(target.config.max_position_embeddings, longest, max_new_tokens)
    if capped < max_new_tokens:
        warnings.warn(f"max_new_tokens {max_new_tokens} capped to {capped}: a prompt of {longest} tokens plus the new "
                      f"tokens must fit max_position_embeddings ({target.config.max_position_embeddings})",
                      stacklevel=2)
        max_new_tokens = capped
    sh = parse_shape(block_size, tree_budget, shape)
    if shadow_trees is not None:
        ns = [shadow_trees] if isinstance(shadow_trees, int) else list(shadow_trees)
        if drafter is None or not isinstance(sh, Chain) or not ns or any(
                isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in ns):
            raise ValueError(f"shadow_trees must be tree budgets >= 1 of a chain (a drafter, block_size given or None, "
                             f"no tree_budget), got shadow_trees={shadow_trees!r} with shape {sh}")
    if drafter is not None:
        check_compatible(drafter.config, target)
        if drafter.config.is_dflash2:
            if shadow_trees is not None:
                raise ValueError("shadow_trees are not supported with a DFlash2 drafter (its chain is the selector's "
                                 "walk)")
            sh = Chain() if isinstance(sh, Auto) else sh
    sh = sh.resolve(drafter.config.block_size if drafter is not None else None, target.config.vocab_size)
    if stop_token_ids is None and tokenizer is not None:
        from ..text import stop_token_ids as default_stops
        stop_token_ids = default_stops(tokenizer, target.config)
    kw = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed, row_ids=row_ids, mesh=mesh,
              prefill_chunk=prefill_chunk)
    if isinstance(sh, Auto):
        stop_array(stop_token_ids, len(prompts), target.config.eos_token_ids)  # per-row stop ids: one per prompt
        res = generate_auto(target, drafter, prompts, sp=sp, max_cache_len=max_cache_len, **kw)
    else:
        res = run_shape(target, drafter if sh.block > 1 else None, prompts, sp=sp, max_cache_len=max_cache_len,
                        Bk=sh.block, tree=sh.tree, shadow=shadow_trees, **kw)[0]
    if tokenizer is not None:
        res.texts = texts_of(tokenizer, res.tokens, stop_array(stop_token_ids, len(prompts),
                                                                target.config.eos_token_ids))
    return res


def token_prompts(prompts, tokenizer=None) -> list[list[int]]:
    """The prompts of generate() as lists of token ids (see generate); anything else is a one-line ValueError."""
    if isinstance(prompts, Mapping) or (hasattr(prompts, "keys") and hasattr(prompts, "__getitem__")):
        if "input_ids" not in prompts:
            raise ValueError(f"prompts as a mapping need 'input_ids' (a tokenizer's output), got keys "
                             f"{sorted(map(str, prompts.keys()))}")
        rows = _id_rows(prompts["input_ids"], "input_ids")
        mask = prompts.get("attention_mask") if hasattr(prompts, "get") else None
        if mask is not None:
            masks = _id_rows(mask, "attention_mask")
            if [len(m) for m in masks] != [len(r) for r in rows]:
                raise ValueError("prompts' attention_mask does not match the shape of its input_ids")
            rows = [[t for t, m in zip(r, mr) if m] for r, mr in zip(rows, masks)]
        return rows
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and any(isinstance(p, str) for p in prompts)):
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("prompts mix strings and token ids: pass one kind")
        if tokenizer is None:
            raise ValueError("string prompts need tokenizer= (or pass token ids)")
        from ..text import encode_chat
        return [encode_chat(tokenizer, t) for t in texts]
    return _id_rows(prompts, "prompts")


def _id_rows(x, name: str) -> list[list[int]]:
    """Rows of integer ids from a 1-D / 2-D array (one row / one per row), a flat list of ids (one row) or a list
    of rows."""
    if hasattr(x, "__array__") and not isinstance(x, (list, tuple)):
        a = np.asarray(x)
        if a.ndim not in (1, 2):
            raise ValueError(f"{name} must be 1-D (one prompt) or 2-D (one per row), got shape {a.shape}")
        return [_ids(r, f"{name} row {i}") for i, r in enumerate(a if a.ndim == 2 else a[None])]
    if not isinstance(x, (list, tuple, range)):
        raise ValueError(f"{name} must be token-id sequences, arrays, a tokenizer's output or strings, "
                         f"got {type(x).__name__}")
    if len(x) and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in x):
        return [[int(v) for v in x]]  # a flat list of ids: one prompt
    return [_ids(r, f"prompt {i}") for i, r in enumerate(x)]


def _ids(row, what: str) -> list[int]:
    try:
        a = np.asarray(row)
    except (TypeError, ValueError):
        raise ValueError(f"{what} is not a sequence of token ids") from None
    if a.size == 0:
        return []
    if a.ndim != 1:
        raise ValueError(f"{what} must be one sequence of token ids, got shape {a.shape}")
    if a.dtype == bool or not (np.issubdtype(a.dtype, np.integer) or (np.issubdtype(a.dtype, np.floating)
                                                                       and np.all(a == np.round(a)))):
        raise ValueError(f"{what} must hold integer token ids, got {a.dtype} values such as {a.ravel()[0]!r}")
    return [int(v) for v in a]


def texts_of(tokenizer, tokens, stops) -> list[str]:
    """Each row's generated tokens decoded, cut before its first stop token (stops: [B, K], -1 = none)."""
    from ..text import decode
    return [decode(tokenizer, t, [int(s) for s in stops[i] if s >= 0]) for i, t in enumerate(tokens)]


# ----------------------------------------------------------------------------------------------
# The drafter alone
# ----------------------------------------------------------------------------------------------
def draft_logits(target: Target, drafter: Drafter, prefix_ids: Sequence[int], block_size: int | None = None):
    """The drafter's float32 logits [B-1, V] for the B-1 tokens after `prefix_ids`.

    The last token of `prefix_ids` is the anchor; the others are the committed context (the target
    is prefilled over them and its taps feed the drafter)."""
    ids = np.asarray(prefix_ids)
    if ids.ndim != 1:
        raise ValueError(f"prefix_ids must be one sequence of token ids (1-D), got shape {ids.shape}; "
                         f"call draft_logits once per row for a batch")
    ids = ids.astype(np.int32)
    if ids.size < 2:
        raise ValueError("prefix_ids needs at least one context token and the anchor")
    check_ids(target.config.vocab_size, ids)
    check_compatible(drafter.config, target)
    Bk = block_size or drafter.config.block_size
    return draft_logits_program(target, drafter, jnp.asarray(ids[None, :-1]), jnp.asarray(ids[-1:]), Bk)
