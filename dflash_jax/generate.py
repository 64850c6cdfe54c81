"""On-device generation: target-only decoding and DFlash speculative decoding.

Both modes share one cycle: feed a block of `Bk` tokens `[anchor, d_1 .. d_{Bk-1}]` to the target
(Bk = 1 and no drafts for target-only decoding), choose `posterior[j]` from the target's distribution
after block token j, accept the longest prefix of drafts with `d_j == posterior[j-1]`, commit
`posterior[0 .. acc]`, and roll the caches back to the committed length by moving their fill index.
The whole decode runs in one jitted `lax.while_loop` with donated state; prefill is a separate jitted
call so prefill and decode are timed apart. Compiled executables are cached per static shape
(batch, prompt bucket, cache size, block size, sampling settings).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import time
import warnings
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .drafter import (Drafter, append_context, check_compatible, draft_hidden_cached, draft_logits_from_hidden,
                      init_context_cache)
from .cache import KVCache
from .model import Target, _check_ids, forward, init_cache, lm_head
from .sampling import SamplingParams, argmax, position_keys, sample

MIN_PROMPT_BUCKET = 16
PREFILL_CHUNK = 2048  # prompts longer than this prefill chunk by chunk (memory bounded by the chunk)
CACHE_ALIGN = 128


@flax.struct.dataclass
class DecodeState:
    tcache: KVCache  # target KV cache; lengths = position of `anchor`
    dcache: KVCache | None  # drafter context cache (lengths == tcache.lengths)
    anchor: jax.Array  # [B] last committed token, not yet fed to the target
    out: jax.Array  # [B, M + Bk] generated tokens (M: the most new tokens any row may have, static)
    gen_len: jax.Array  # [B] generated so far
    done: jax.Array  # [B] bool
    acc_hist: jax.Array  # [B, M] tokens committed per cycle (0 = row idle)
    cycle: jax.Array  # [] int32
    # [B, M] per cycle, what the chain of the drafter's full block would have committed in it
    # (1 + its accepted drafts, before stop / length cuts; negative: at least that many, the cycle could
    # not tell more; 0 = row idle) - the acceptance evidence of dflash_jax.autoshape. None: not recorded
    chain_hist: jax.Array | None = None


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # per row: generated ids (first token included; a stop token is kept)
    acceptance_lengths: list[list[int]]  # per row: tokens committed in each decode cycle
    prefill_time: float  # seconds, compile excluded
    decode_time: float  # seconds, compile excluded
    compile_time: float  # seconds spent compiling in this call (0 when cached)
    cycles: int  # decode cycles run (loop iterations)
    block_size: int  # 1 = target-only
    tree_budget: int | None = None  # draft-tree nodes per cycle (None: chain)
    auto_reason: str | None = None  # with block_size / tree_budget "auto": the choice and why
    auto_look: bool = False  # ... and whether the call began with a look (run for evidence: a first run, a probe,
    # a tree being tried), not with the best estimate
    # per row and decode cycle (speculative runs): what the chain of the drafter's full block would have
    # committed (1 + accepted drafts, before stop cuts; negative -n: at least n, censored)
    chain_lengths: list[list[int]] = dataclasses.field(default_factory=list)
    # chain calls with shadow_trees: {N: per row and decode cycle, what a tree of N nodes would have committed
    # there (1 + the depth the committed text reaches in it; 0: unknown, the text so far ends inside it)}
    shadow_lengths: dict = dataclasses.field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by the decode loop (the first token of each row comes from prefill)."""
        return sum(sum(a) for a in self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length over all cycles of all rows (1.0 for target-only decoding)."""
        lens = [x for row in self.acceptance_lengths for x in row]
        return float(np.mean(lens)) if lens else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else float("nan")

    @property
    def time_per_output_token(self) -> float:
        return self.decode_time / max(self.decode_tokens, 1)

    def histogram(self, max_len: int | None = None) -> list[int]:
        m = max_len or self.block_size
        h = [0] * (m + 1)
        for row in self.acceptance_lengths:
            for x in row:
                h[min(x, m)] += 1
        return h


def _bucket(n: int) -> int:
    b = MIN_PROMPT_BUCKET
    while b < n:
        b *= 2
    return b


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def capped_new_tokens(max_positions: int, prompt_len: int, max_new_tokens: int) -> int:
    """max_new_tokens limited so that prompt + generated tokens fit in the model's context
    (`max_position_embeddings`); a prompt that leaves no room is a ValueError."""
    if prompt_len > max_positions:
        raise ValueError(f"prompt of {prompt_len} tokens exceeds the model's max_position_embeddings ({max_positions})")
    room = max_positions - prompt_len
    if room < 1:
        raise ValueError(f"prompt of {prompt_len} tokens fills the model's context (max_position_embeddings "
                         f"{max_positions}): no room for new tokens")
    return min(int(max_new_tokens), room)


def prompt_and_cache_len(longest: int, max_new_tokens: int, Bk: int, max_cache_len: int | None = None):
    """(prompt bucket P, cache slots S) for a batch whose longest prompt has `longest` tokens."""
    need = longest + max_new_tokens + Bk
    if max_cache_len is None:
        P = _bucket(longest)
        return P, _round_up(max(P, need), CACHE_ALIGN)
    if need > max_cache_len:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} + block {Bk} = {need} "
                         f"exceeds the cache ({max_cache_len} slots)")
    return min(_bucket(longest), int(max_cache_len)), int(max_cache_len)


def verify_width(block: int, tree: int | None) -> int:
    """Cache slots one verification writes (and the most rows any of the cycle's dots sees per batch
    row): the chain block, or the tree's root + nodes (at least the drafter block)."""
    return block if tree is None else max(block, int(tree) + 1)


def resolve_block_size(target, drafter, block_size) -> int:
    """The verified block: 1 without a drafter, else `block_size` (default the drafter's), checked
    against the drafter (which must match the target)."""
    if drafter is None:
        return 1
    check_compatible(drafter.config, target)
    Bk = drafter.config.block_size if block_size is None else int(block_size)
    if not 2 <= Bk <= drafter.config.block_size:
        raise ValueError(f"block_size must be in [2, {drafter.config.block_size}] for this drafter, got {Bk}")
    return Bk


def taps_of(drafter: Drafter | None) -> tuple[int, ...]:
    return tuple(drafter.config.target_layer_ids) if drafter is not None else ()


# ----------------------------------------------------------------------------------------------
# Device functions
# ----------------------------------------------------------------------------------------------
def _prefill(target, drafter, tokens, lens, rows, key, stop_ids, budget, *, S, Bk, sp, chunk=None, tp=None, M=None):
    """tokens [B, P] right-padded, lens [B] -> DecodeState with the first token chosen. budget [B] (a
    runtime value: one program serves every max_new_tokens): the most new tokens of each row; `M` (static,
    default S): the most any row may have, the width of the state's token and history buffers.

    A prompt longer than `chunk` is prefilled chunk by chunk into the caches (each chunk attends to
    the cache filled so far plus itself), so memory is bounded by the chunk, not by P x P scores;
    the chunk starts are min(c * chunk, P - chunk), so a last partial chunk recomputes a few
    positions instead of writing past P. `tp`: the tensor-parallel mesh axis under shard_map."""
    B, P = tokens.shape
    C = P if chunk is None or chunk >= P else int(chunk)
    n_chunks = -(-P // C)
    taps = taps_of(drafter)
    tcache = init_cache(target, B, S)
    dcache = init_context_cache(drafter, B, S) if drafter is not None else None
    H = target.config.hidden_size

    def one_chunk(c, carry):
        tcache, dcache, h_last = carry
        start = jnp.minimum(c * C, P - C).astype(jnp.int32)
        toks = jax.lax.dynamic_slice_in_dim(tokens, start, C, axis=1)
        at = jnp.full((B,), start, jnp.int32)
        h, tcache, feats = forward(target, toks, tcache.rollback(at), taps, tp, uniform=True)
        idx = lens - 1 - start  # the row's last prompt token, if inside this chunk
        inside = (idx >= 0) & (idx < C)
        h_last = jnp.where(inside[:, None], h[jnp.arange(B), jnp.clip(idx, 0, C - 1)], h_last)
        if drafter is not None:
            dcache = append_context(drafter, feats, dcache.rollback(at), uniform=True)
        return tcache, dcache, h_last

    carry = (tcache, dcache, jnp.zeros((B, H), target.dtype))
    if n_chunks == 1:
        carry = one_chunk(0, carry)
    else:
        carry = jax.lax.fori_loop(0, n_chunks, one_chunk, carry)
    tcache, dcache, h_last = carry
    tcache = tcache.rollback(lens)
    logits = lm_head(target, h_last)[:, None]  # [B, 1, V]
    first = sample(logits, sp, position_keys(key, rows, lens[:, None]), tp)[:, 0]
    if drafter is not None:
        dcache = dcache.rollback(lens)
    M = S if M is None else int(M)
    out = jnp.zeros((B, M + Bk), jnp.int32).at[:, 0].set(first)
    done = jnp.any(first[:, None] == stop_ids, axis=-1) | (budget <= 1)
    return DecodeState(tcache=tcache, dcache=dcache, anchor=first, out=out, gen_len=jnp.ones((B,), jnp.int32),
                       done=done, acc_hist=jnp.zeros((B, M), jnp.int32), cycle=jnp.zeros((), jnp.int32),
                       chain_hist=jnp.zeros((B, M), jnp.int32) if drafter is not None else None)


def _cycle(target, drafter, st: DecodeState, rows, key, stop_ids, budget, *, Bk, sp, tp=None, tree=None,
           shadow=None):
    """One draft + verify cycle for every row (rows that are done stay put; budget [B]: each row's most
    new tokens). `tree`: a node budget for tree verification (None = the chain of Bk - 1 drafts).
    `shadow` (chains): also build the `shadow`-node draft tree of this cycle's distributions, unverified, and
    return (state, (its node tokens [B, shadow], parents [B, shadow]: flattened, root 0, -1 = no node))."""
    if tree is not None:
        return _tree_cycle(target, drafter, st, rows, key, stop_ids, budget, Bk=Bk, sp=sp, tp=tp, N=tree)
    B = st.anchor.shape[0]
    start = st.tcache.lengths  # [B] position of the anchor
    if drafter is not None:
        with jax.named_scope("draft"):
            h = draft_hidden_cached(drafter, target, st.anchor, st.dcache, Bk, tp)  # [B, Bk, H]
            dl = draft_logits_from_hidden(drafter, target, h[:, 1:])
            drafts = argmax(dl, tp)  # [B, Bk-1]
            if shadow:
                from .tree import NEG, build_tree
                t = build_tree(dl, st.anchor, shadow, tp)
                shadow = (t.tokens[:, 1:], jnp.where(t.logq[:, 1:] > NEG / 2, t.parent[:, 1:], -1))
        block = jnp.concatenate([st.anchor[:, None], drafts], axis=1)  # [B, Bk]
    else:
        block = st.anchor[:, None]
    with jax.named_scope("verify"):
        hT, tcache, feats = forward(target, block, st.tcache, taps_of(drafter), tp)
        logits = lm_head(target, hT)  # [B, Bk, V]
        j = jnp.arange(Bk, dtype=jnp.int32)
        post = sample(logits, sp, position_keys(key, rows, start[:, None] + 1 + j), tp)  # [B, Bk]
    with jax.named_scope("accept"):
        if Bk > 1:
            acc = jnp.sum(jnp.cumprod((block[:, 1:] == post[:, :-1]).astype(jnp.int32), axis=1), axis=1)
            full = drafter.config.block_size
            chain = jnp.where((acc == Bk - 1) & (Bk < full), -(acc + 1), acc + 1)  # a shorter block cuts it
        else:
            acc = jnp.zeros((B,), jnp.int32)
            chain = None
        new = _commit(drafter, st, tcache, feats, post, acc, stop_ids, budget, chain)
        return (new, shadow) if shadow else new


def _commit(drafter, st: DecodeState, tcache, feats, post, acc, stop_ids, budget, chain=None):
    """Commit post[:, :acc + 1] (the accepted drafts and the target's token after them), cut at a
    stop token and at the row's budget; feats [B, >= acc + 1, n*H] = the target taps of the committed inputs;
    chain [B]: the full-block chain's commit this cycle (DecodeState.chain_hist), recorded if kept."""
    B, W = post.shape
    start = st.tcache.lengths
    j = jnp.arange(W, dtype=jnp.int32)
    n = acc + 1
    is_stop = jnp.any(post[:, :, None] == stop_ids[:, None, :], axis=-1) & (j[None] < n[:, None])
    has_stop = jnp.any(is_stop, axis=-1)
    n = jnp.where(has_stop, jnp.argmax(is_stop, axis=-1) + 1, n)
    n = jnp.minimum(n, budget - st.gen_len)
    active = ~st.done
    n = jnp.where(active, n, 0).astype(jnp.int32)
    done = st.done | has_stop | (st.gen_len + n >= budget)
    out = jax.vmap(lambda o, p, s: jax.lax.dynamic_update_slice(o, p, (s,)))(st.out, post, st.gen_len)
    anchor = jnp.where(active, post[jnp.arange(B), jnp.maximum(n - 1, 0)], st.anchor)
    new_len = start + n
    dcache = st.dcache
    if drafter is not None:
        dcache = append_context(drafter, feats, dcache, count=n)
    chain_hist = st.chain_hist
    if chain_hist is not None and chain is not None:
        chain_hist = chain_hist.at[:, st.cycle].set(jnp.where(active, chain, 0))
    return DecodeState(
        tcache=tcache.rollback(new_len), dcache=dcache, anchor=anchor, out=out, gen_len=st.gen_len + n, done=done,
        acc_hist=st.acc_hist.at[:, st.cycle].set(n), cycle=st.cycle + 1, chain_hist=chain_hist)


def _compact_rows(buf, starts, idx):
    """buf [L, B, KV, S, D]: for each row b, slots starts[b] + j <- slots starts[b] + idx[b, j]
    (j < W = idx.shape[1]), all layers, in place: one window read and one write per row."""
    L, B, KV, S, D = buf.shape
    W = idx.shape[1]
    zero = jnp.zeros((), jnp.int32)
    for b in range(B):
        at = (zero, jnp.int32(b), zero, starts[b], zero)
        win = jax.lax.dynamic_slice(buf, at, (L, 1, KV, W, D))
        buf = jax.lax.dynamic_update_slice(buf, jnp.take(win, idx[b], axis=3), at)
    return buf


def _tree_cycle(target, drafter, st: DecodeState, rows, key, stop_ids, budget, *, Bk, sp, tp, N):
    """Draft one block, build an N-node tree from its per-depth distributions (dflash_jax.tree),
    verify [root, nodes] in one target pass under the ancestor mask, walk the target's choices
    down the tree, then move the accepted path's K/V to contiguous slots and commit it."""
    from .tree import accept_path, build_tree, chain_equivalent
    D = Bk - 1  # draft depths
    start = st.tcache.lengths
    with jax.named_scope("draft"):
        h = draft_hidden_cached(drafter, target, st.anchor, st.dcache, Bk, tp)  # [B, Bk, H]
        tree = build_tree(draft_logits_from_hidden(drafter, target, h[:, 1:]), st.anchor, N, tp)
    with jax.named_scope("verify"):
        pos = start[:, None] + tree.depth  # [B, N+1]
        hT, tcache, feats = forward(target, tree.tokens, st.tcache, taps_of(drafter), tp,
                                    positions=pos, new_mask=tree.ancestors)
        logits = lm_head(target, hT)  # [B, N+1, V]
        choice = sample(logits, sp, position_keys(key, rows, pos + 1), tp)  # target's token after each node
    with jax.named_scope("accept"):
        acc, path = accept_path(tree, choice, D)  # path [B, D+1]: flattened node per depth
        chain = chain_equivalent(tree, choice)
        post = jnp.take_along_axis(choice, path, axis=1)  # [B, D+1] committed tokens
        feats_p = jnp.take_along_axis(feats, path[:, :, None], axis=1) if feats is not None else None
        return _commit(drafter, st, _compact_path(tcache, start, path, N), feats_p, post, acc, stop_ids, budget, chain)


def _compact_path(tcache, start, path, N: int):
    """tcache with each row's accepted tree path (path [B, D + 1]: flattened node per depth) moved to the
    contiguous slots start + d, the depth-d node's K/V from its tree slot (the window is the N + 1 tree slots)."""
    W = min(N + 1, path.shape[1])
    idx = jnp.broadcast_to(jnp.arange(N + 1, dtype=jnp.int32), (path.shape[0], N + 1)).at[:, :W].set(path[:, :W])
    return tcache.replace(k=_compact_rows(tcache.k, start, idx), v=_compact_rows(tcache.v, start, idx))


def rows_pay(target, drafter, width: int) -> bool:
    """Whether a speculative decode loop whose dots see `width` rows per batch row runs faster on
    layers.by_rows params: on XLA:CPU from layers.ROWS_MIN_WIDTH rows where layers.rows_faster measures
    it (the target's [hidden, intermediate] dots; which layout wins changed between jax releases);
    not on TPU, for a TPU topology traced from a CPU host, or target-only, and not with several processes
    (their programs must agree; each would time the probe on its own)."""
    from .attention import tracing_for_tpu
    from .layers import ROWS_MIN_WIDTH, rows_faster
    if (drafter is None or jax.default_backend() != "cpu" or tracing_for_tpu() or width < ROWS_MIN_WIDTH
            or jax.process_count() > 1):
        return False
    c = target.config
    return rows_faster(c.hidden_size, c.intermediate_size, width)


def rows_layout(target, drafter, width: int):
    """(target, drafter) with their [in, out] matrices transposed (layers.by_rows) where `rows_pay`; a
    model already in that layout is returned as it is (by_rows finds nothing left to transpose)."""
    from .layers import by_rows
    if not rows_pay(target, drafter, width):
        return target, drafter
    return target.replace(params=by_rows(target.params)), drafter.replace(params=by_rows(drafter.params))


_ROWS_CACHE: list = []  # [(target params, drafter params, row-layout target, row-layout drafter)]: the latest pair


def _rows_pair(target, drafter, width: int, mesh):
    """generate()'s models: where `rows_pay` (and without a mesh), the by_rows copies made once per pair
    of weights and kept for the latest pair, so the decode loop finds them transposed already instead of
    transposing every call (~45 ms a call for the embedded pair, 5-10% of a short answer's decode)."""
    if mesh is not None or not rows_pay(target, drafter, width):
        return target, drafter
    for tp_, dp_, rt, rd in _ROWS_CACHE:
        if tp_ is target.params and dp_ is drafter.params:
            return rt, rd
    rt, rd = rows_layout(target, drafter, width)
    _ROWS_CACHE[:] = [(target.params, drafter.params, rt, rd)]
    return rt, rd


def _loop(target, drafter, st, rows, key, stop_ids, budget, *, Bk, sp, tp=None, dp=None, tree=None, shadow=None):
    """The decode loop; with `shadow` (a chain): returns (state, (tokens, parents) [B, M, shadow]) - each cycle's
    unverified `shadow`-node draft tree (`_cycle`), for GenerationResult.shadow_lengths."""
    target, drafter = rows_layout(target, drafter, verify_width(Bk, tree))

    def cond(s):
        s = s[0] if shadow else s
        busy = jnp.any(~s.done)
        if dp is not None:  # rows are split over the data axis: stop when every shard is done
            busy = jax.lax.pmax(busy.astype(jnp.int32), dp) > 0
        return (s.cycle < s.acc_hist.shape[1]) & busy

    def body(s):
        if not shadow:
            return _cycle(target, drafter, s, rows, key, stop_ids, budget, Bk=Bk, sp=sp, tp=tp, tree=tree)
        s, (toks, pars) = s
        new, (t, p) = _cycle(target, drafter, s, rows, key, stop_ids, budget, Bk=Bk, sp=sp, tp=tp, shadow=shadow)
        return new, (toks.at[:, s.cycle].set(t), pars.at[:, s.cycle].set(p))

    if not shadow:
        return jax.lax.while_loop(cond, body, st)
    B, M = st.acc_hist.shape
    return jax.lax.while_loop(cond, body, (st, (jnp.zeros((B, M, shadow), jnp.int32),
                                                jnp.full((B, M, shadow), -1, jnp.int32))))


# ----------------------------------------------------------------------------------------------
# Compilation cache (explicit, so tests can count compilations)
# ----------------------------------------------------------------------------------------------
_COMPILED: dict = {}
COMPILE_COUNTS = {"prefill": 0, "loop": 0}


def _compiled(kind, fn, statics: dict, args, donate=(), mesh=None, specs=None):
    """Compile `fn` (with `statics` bound) for these argument shapes once; cache the executable.

    With a mesh, `fn` runs under shard_map with `specs` = (in_specs, out_specs)."""
    from .attention import program_key
    key = (kind, tuple(sorted(statics.items())), mesh, program_key(),
           jax.tree_util.tree_structure(args),
           tuple((a.shape, str(a.dtype), getattr(a, "sharding", None)) for a in jax.tree_util.tree_leaves(args)))
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit, 0.0
    t0 = time.perf_counter()
    exe = _program(fn, statics, donate, mesh, specs).lower(*args).compile()
    COMPILE_COUNTS[kind] += 1
    _COMPILED[key] = exe
    return exe, time.perf_counter() - t0


def clear_compile_cache():
    _COMPILED.clear()
    _ROWS_CACHE.clear()


def _program(fn, statics: dict, donate=(), mesh=None, specs=None):
    """The jitted device program: `fn` with `statics` bound, under shard_map with `specs` on a mesh.
    generate() compiles it on real arrays, dflash_jax.planner on abstract ones (a TPU topology)."""
    f = functools.partial(fn, **statics)
    if mesh is not None:
        f = jax.shard_map(f, mesh=mesh, in_specs=specs[0], out_specs=specs[1], check_vma=False)
    return jax.jit(f, donate_argnums=donate)


def decode_programs(target, drafter, mesh, *, S: int, Bk: int, sp: SamplingParams,
                    chunk: int = PREFILL_CHUNK, tree: int | None = None, shadow: int | None = None) -> dict:
    """What generate() runs, as {kind: (fn, statics, donate, specs)} for kind in prefill / loop /
    cycle (the loop's body alone), plus "row_specs" (tokens, lens, rows, stop, budget) under a mesh.

    Argument order: prefill (target, drafter, tokens, lens, rows, key, stop, budget); loop and cycle
    (target, drafter, state, rows, key, stop, budget), the state donated. budget [B]: each row's most new
    tokens, a runtime value (the programs depend on the cache size S, not on max_new_tokens). `tree`: node
    budget of tree verification (None: chain). `shadow`: the loop of a chain also returns each cycle's unverified
    draft tree of that many nodes (`_loop`)."""
    # the prefill's Bk only sizes the token buffer: the drafter's full block, so every drafted shape of a pair
    # shares one state layout (a call can change shape in place, generate._decode)
    statics = dict(S=S, Bk=drafter.config.block_size if drafter is not None else 1, sp=sp, chunk=int(chunk))
    loop_statics = dict(Bk=Bk, sp=sp)
    if tree is not None:
        loop_statics["tree"] = int(tree)
    row_specs = pre_specs = loop_specs = cycle_specs = None
    if mesh is not None:
        from jax.sharding import PartitionSpec as PS
        from .sharding import DATA, MODEL
        statics["tp"] = loop_statics["tp"] = MODEL
        t_spec, d_spec = _model_specs(target), (_model_specs(drafter) if drafter is not None else None)
        st_spec = _state_specs(drafter is not None)
        row_specs = (PS(DATA, None), PS(DATA), PS(DATA), PS(DATA, None), PS(DATA))
        pre_specs = ((t_spec, d_spec) + row_specs[:3] + (PS(), row_specs[3], row_specs[4]), st_spec)
        loop_specs = cycle_specs = ((t_spec, d_spec, st_spec, PS(DATA), PS(), PS(DATA, None), PS(DATA)), st_spec)
        if shadow:
            loop_specs = (loop_specs[0], (st_spec, (PS(DATA, None, None),) * 2))
    cycle_statics = dict(loop_statics)  # _cycle has no data axis: only the loop's stop test reduces over it
    if mesh is not None:
        loop_statics["dp"] = DATA
    if shadow and tree is None and drafter is not None:
        loop_statics["shadow"] = int(shadow)
    return {"prefill": (_prefill, statics, (), pre_specs), "loop": (_loop, loop_statics, (2,), loop_specs),
            "cycle": (_cycle, cycle_statics, (2,), cycle_specs), "row_specs": row_specs}


# ----------------------------------------------------------------------------------------------
# Host API
# ----------------------------------------------------------------------------------------------
STOP_ALIGN = 4  # stop-id columns are padded (with -1) to a multiple of this: the programs' shapes then do not
# change with the number of stop ids (the cost curve runs with none, a chat target's calls with 1-3)


def stop_width(n: int) -> int:
    """Columns of the [B, K] stop-id array of `n` stop ids (the programs compile for K)."""
    return _round_up(max(1, int(n)), STOP_ALIGN)


def _stop_array(stop_token_ids, B, default):
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


def generate(target: Target, drafter: Drafter | None, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_token_ids=None, seed: int = 0, block_size: int | str | None = "auto",
             max_cache_len: int | None = None, row_ids: Sequence[int] | None = None, mesh=None,
             prefill_chunk: int = PREFILL_CHUNK, tree_budget: int | str | None = None,
             shadow_trees: int | Sequence[int] | None = None) -> GenerationResult:
    """Generate for a ragged batch of token-id prompts; speculative when `drafter` is given.

    stop_token_ids: None (the target's eos ids), a list shared by all rows, or a list per row.
    max_cache_len: KV cache slots per row (default: sized from the prompt bucket); a prompt that
    does not fit with max_new_tokens + block_size is a ValueError.
    mesh: a ('data', 'model') mesh (default: the mesh the target's params live on, if any): the
    decode runs under shard_map, tensor-parallel over 'model', rows split over 'data'.
    prefill_chunk: prompts longer than this many tokens are prefilled chunk by chunk.
    Shape of the speculative cycle (block_size, tree_budget):
    - block_size "auto" (the default), tree_budget None: automatic - target-only, a chain block or a
      tree, whichever gives the most expected committed tokens per second (dflash_jax.autoshape: cycle
      costs measured once per pair / batch / device / cache size and cached on disk, acceptance
      estimated from earlier calls); the same with tree_budget "auto" (block_size then "auto" or None).
    - block_size None: the chain of the drafter's full block; an int: a chain of that block
      (2 .. the drafter's block size).
    - tree_budget an int N: verify a draft tree of N nodes per cycle (DDTree-style, built on device
      from the drafter's per-depth distributions, depth <= block - 1), block "auto" or None being the
      drafter's own block, an int that block.
    Without a drafter: target-only decoding ("auto" measures nothing); an int tree_budget is a ValueError.
    shadow_trees (a chain: block_size given or None): tree budgets N (an int or several) whose commits the result
    reports per cycle (GenerationResult.shadow_lengths): each cycle also builds the draft tree of max(N) nodes
    from its distributions, unverified, and after the call the committed text is walked down it - what a tree
    of N nodes would have committed at that cycle's anchor (exactly, for the drafter's full block: a tree run is
    built from the same distributions; a shorter block's trees come from its own block pass, N <= its drafts; at
    T > 0 as well, samples being keyed by position). Costs one tree build per cycle (embedded pair, CPU: ~0.3 ms at
    15 nodes, ~0.9 ms at 63).
    """
    sp = SamplingParams(float(temperature), int(top_k), float(top_p))
    if not prompts:
        raise ValueError("prompts is empty")
    prompts = [list(map(int, p)) for p in prompts]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        _check_ids(target.config.vocab_size, np.asarray(p))
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if int(prefill_chunk) < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    longest = max(len(p) for p in prompts)
    capped = capped_new_tokens(target.config.max_position_embeddings, longest, max_new_tokens)
    if capped < max_new_tokens:
        warnings.warn(f"max_new_tokens {max_new_tokens} capped to {capped}: a prompt of {longest} tokens plus the new "
                      f"tokens must fit max_position_embeddings ({target.config.max_position_embeddings})", stacklevel=2)
        max_new_tokens = capped
    if shadow_trees is not None:
        ns = [shadow_trees] if isinstance(shadow_trees, int) else list(shadow_trees)
        if drafter is None or tree_budget is not None or block_size == "auto" or not ns or any(
                isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in ns):
            raise ValueError(f"shadow_trees must be tree budgets >= 1 of a chain (a drafter, block_size given or None, "
                             f"no tree_budget), got shadow_trees={shadow_trees!r} with block_size={block_size!r}, "
                             f"tree_budget={tree_budget!r}")
    if tree_budget == "auto" or (block_size == "auto" and tree_budget is None and drafter is not None):
        if drafter is not None:
            check_compatible(drafter.config, target)
        _stop_array(stop_token_ids, len(prompts), target.config.eos_token_ids)  # per-row stop ids: one per prompt
        return _generate_auto(target, drafter, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, stop_token_ids=stop_token_ids, seed=seed,
                              block_size=block_size, tree_budget=tree_budget, max_cache_len=max_cache_len,
                              row_ids=row_ids, mesh=mesh, prefill_chunk=prefill_chunk)
    if block_size == "auto":  # a given tree's depth, or no drafter
        block_size = None
    Bk = resolve_block_size(target, drafter, block_size)
    if tree_budget is not None:
        if drafter is None:
            raise ValueError("tree_budget needs a drafter")
        if isinstance(tree_budget, bool) or int(tree_budget) != tree_budget or tree_budget < 1:
            raise ValueError(f"tree_budget must be an integer >= 1 (or None for the chain), got {tree_budget!r}")
        tree_budget = int(tree_budget)
    return _decode(target, drafter, prompts, sp=sp, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                   seed=seed, max_cache_len=max_cache_len, row_ids=row_ids, mesh=mesh, prefill_chunk=prefill_chunk,
                   Bk=Bk, tree=tree_budget, shadow=shadow_trees)[0]


def _decode(target, drafter, prompts, *, sp, max_new_tokens, stop_token_ids, seed, max_cache_len, row_ids, mesh,
            prefill_chunk, Bk, tree, look=None, then=None, shadow=None):
    """generate()'s body for one shape (Bk, tree) - checked by the caller. With `look` and `then`: the shape
    runs for `look` new tokens per row, `then(partial GenerationResult)` names the shape (Bk, tree) for the
    rest (Bk 1: target-only), and the decode goes on in the same state - the caches, the drafter context and
    the tokens so far - up to max_new_tokens: no second prefill (auto's looks, dflash_jax.autoshape); `then` may
    name a third value, the rest's shadow trees.
    `shadow` (a chain): tree budgets whose commits each cycle reports (GenerationResult.shadow_lengths).
    Every drafted shape of a drafter shares one state layout (token buffer [B, S + the drafter's block]),
    so the prefill and each shape's loop are the programs a fixed-shape call of that shape runs.
    Returns (the whole call's GenerationResult, the later part's alone or None)."""
    width = verify_width(Bk, tree)
    mesh = mesh if mesh is not None else _mesh_of(target)
    B = len(prompts)
    longest = max(len(p) for p in prompts)
    if mesh is not None:
        from . import sharding as shd
        from .weights import shard_drafter, shard_target
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
    stop = _stop_array(stop_token_ids, B, target.config.eos_token_ids)
    stop = np.concatenate([stop, np.repeat(stop[-1:], Bp - B, axis=0)])  # padding rows copy the last row
    rows = np.asarray(row_ids if row_ids is not None else np.arange(Bp), np.int32)
    key = jax.random.PRNGKey(seed)
    first_new = min(int(look), int(max_new_tokens)) if look is not None else int(max_new_tokens)
    budget = np.full((Bp,), first_new, np.int32)

    def put(h, spec):
        if mesh is None:
            return jnp.asarray(h)
        from .weights import put_global
        return put_global(h, mesh, spec)

    base = (target, drafter)
    target, drafter = _rows_pair(target, drafter, width, mesh)
    shadow = _shadow_budgets(shadow, drafter, tree)
    progs = decode_programs(target, drafter, mesh, S=S, Bk=Bk, sp=sp, chunk=int(prefill_chunk), tree=tree,
                            shadow=max(shadow) if shadow else None)
    from jax.sharding import PartitionSpec as PS
    specs = progs["row_specs"] or (None,) * 5
    tokens_d, lens_d, rows_d, stop_d, budget_d = (put(h, s) for h, s in zip((tokens, lens, rows, stop, budget), specs))
    key = put(np.asarray(key), PS())
    pre_args = (target, drafter, tokens_d, lens_d, rows_d, key, stop_d, budget_d)
    fn, statics, donate, pspecs = progs["prefill"]
    pre, c1 = _compiled("prefill", fn, statics, pre_args, donate, mesh, pspecs)
    t0 = time.perf_counter()
    state = jax.block_until_ready(pre(*pre_args))
    t_prefill = time.perf_counter() - t0

    def run_loop(state, target, drafter, progs, budget_d):
        loop_args = (target, drafter, state, rows_d, key, stop_d, budget_d)
        fn, statics, donate, lspecs = progs["loop"]
        loop, c = _compiled("loop", fn, statics, loop_args, donate, mesh, lspecs)
        t0 = time.perf_counter()
        out = jax.block_until_ready(loop(*loop_args))
        t = time.perf_counter() - t0
        return (out if "shadow" in statics else (out, None)) + (c, t)

    state, trees, c2, t_decode = run_loop(state, target, drafter, progs, budget_d)
    res, host = _result(state, B, 0, Bk, tree, trees, shadow)
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
    shadow2 = _shadow_budgets(more_shadow[0] if more_shadow and Bk2 > 1 else None, drafter, tree2)
    target, drafter = base
    if Bk2 == 1:  # target-only from here: the drafter's part of the state is dropped (its own program's layout)
        drafter = None
        state = state.replace(dcache=None, chain_hist=None, out=state.out[:, :state.acc_hist.shape[1] + 1])
    state = state.replace(done=put(done, specs[2]))
    budget_d = put(np.full((Bp,), int(max_new_tokens), np.int32), specs[4])
    target, drafter = _rows_pair(target, drafter, verify_width(Bk2, tree2), mesh)
    progs = decode_programs(target, drafter, mesh, S=S, Bk=Bk2, sp=sp, chunk=int(prefill_chunk), tree=tree2,
                            shadow=max(shadow2) if shadow2 else None)
    t_host = time.perf_counter() - t0
    state, trees, c3, t_more = run_loop(state, target, drafter, progs, budget_d)
    more, _ = _result(state, B, res.cycles, Bk2, tree2, trees, shadow2)
    for n in set(res.shadow_lengths) | set(more.shadow_lengths):  # a part without them: unknown (0) there
        a = res.shadow_lengths.get(n) or [[0] * len(r) for r in res.acceptance_lengths]
        b = more.shadow_lengths.get(n) or [[0] * len(r) for r in more.acceptance_lengths]
        res.shadow_lengths[n] = [x + y for x, y in zip(a, b)]
    for i in range(B):
        res.tokens[i] = res.tokens[i] + more.tokens[i]
        res.acceptance_lengths[i] = res.acceptance_lengths[i] + more.acceptance_lengths[i]
        if more.chain_lengths:
            res.chain_lengths[i] = (res.chain_lengths[i] if res.chain_lengths else []) + more.chain_lengths[i]
    more.decode_time, more.compile_time = t_more, c3
    res.decode_time += t_host + t_more  # auto's choice between the parts is the caller's time too
    res.compile_time += c3
    res.cycles += more.cycles
    res.block_size, res.tree_budget = Bk2, tree2
    return res, more


def _result(state, B: int, skip: int, Bk, tree, trees=None, shadow=()):
    """GenerationResult of the rows 0..B-1 for the cycles after the first `skip` (tokens: those generated in
    them), and the host copies (out, gen_len) of every row. `trees`: the loop's shadow trees (`_loop`), whose
    commits for the budgets `shadow` the result reports."""
    from .weights import fetch
    out, gen_len, hist = (fetch(x) for x in (state.out, state.gen_len, state.acc_hist))
    cycles = int(fetch(state.cycle))
    accs = [[int(x) for x in hist[i, skip:cycles] if x > 0] for i in range(B)]
    before = [int(gen_len[i]) - sum(a) if skip else 0 for i, a in enumerate(accs)]
    toks = [out[i, before[i]:gen_len[i]].tolist() for i in range(B)]
    chains = []
    if state.chain_hist is not None:
        ch = fetch(state.chain_hist)
        chains = [[int(x) for x in ch[i, skip:cycles] if x != 0] for i in range(B)]
    res = GenerationResult(tokens=toks, acceptance_lengths=accs, prefill_time=0.0, decode_time=0.0, compile_time=0.0,
                           cycles=cycles - skip, block_size=Bk, tree_budget=tree, chain_lengths=chains)
    if trees is not None and shadow:
        tk, pa = (fetch(x) for x in trees)
        res.shadow_lengths = {n: [] for n in shadow}
        for i in range(B):
            cyc = [c for c in range(skip, cycles) if hist[i, c] > 0]
            paths = shadow_paths(tk[i, cyc], pa[i, cyc], out[i, :gen_len[i]], max(before[i], 1), accs[i], Bk - 1)
            for n in shadow:
                res.shadow_lengths[n].append([0 if p is None else 1 + sum(f <= n for f in p) for p in paths])
    return res, (out, gen_len)


def shadow_paths(tokens, parents, text, first: int, commits, depth: int) -> list:
    """Per cycle of one row, the flattened indices of the shadow tree's nodes the committed text walks through
    (a tree of n <= the recorded nodes holds indices 1..n: node order is score order, parents first), or None
    where the text so far ends before the walk does. tokens / parents [cycles, nodes] (parent 0: the root, -1:
    no node); text: the row's generated tokens; first: the index in it of the first cycle's first commit;
    commits: tokens each cycle committed; depth: the drafts' depth (the tree's deepest level)."""
    out, g = [], int(first)
    for tk, pa, n in zip(tokens, parents, commits):
        child = {(int(p), int(t)): f + 1 for f, (p, t) in enumerate(zip(pa, tk)) if p >= 0}
        path, cur = [], 0
        for d in range(depth):
            if g + d >= len(text):
                path = None  # the text ends inside the walk: unknown
                break
            cur = child.get((cur, int(text[g + d])))
            if cur is None:
                break
            path.append(cur)
        out.append(path)
        g += int(n)
    return out


def _shadow_budgets(shadow, drafter, tree) -> tuple:
    """The sorted tree budgets of `shadow` (an int or a sequence) for a chain with a drafter, else ()."""
    if not shadow or drafter is None or tree is not None:
        return ()
    return tuple(sorted({int(n) for n in ([shadow] if isinstance(shadow, int) else shadow)}))


def _generate_auto(target, drafter, prompts, *, block_size, tree_budget, max_cache_len, **kw):
    """block_size / tree_budget "auto": the shape of highest expected committed tokens per second
    (dflash_jax.autoshape), printed in one line when it changes; the run's acceptance and cycle times
    are recorded. A look (a probe from target-only, the first run, a tree being tried) runs its shape for
    autoshape.LOOK_TOKENS new tokens only; the rows still going then continue in the same decode state (no
    second prefill; output is what one run gives) with the best shape by the updated evidence. The host's
    choice between the two parts counts as decode time."""
    from . import autoshape as au
    for name, v in (("block_size", block_size), ("tree_budget", tree_budget)):
        if v not in (None, "auto"):
            raise ValueError(f"{name}={v!r} with auto: leave it None (auto chooses both block and tree)")
    if drafter is None:
        return generate(target, None, prompts, max_cache_len=max_cache_len, **kw)
    Bd = drafter.config.block_size
    shapes = au.candidate_shapes(Bd)
    width = max(s.width for s in shapes)
    longest = max(len(p) for p in prompts)
    new = kw["max_new_tokens"]  # checked and capped by generate()
    _, S = prompt_and_cache_len(longest, new, width, max_cache_len)
    costs = au.cost_curve(target, drafter, len(prompts), S, shapes, log=print, prompt_len=longest)
    ev = au.evidence_for(target, drafter)
    ctx = f"b{len(prompts)}|S{S}"  # observed cycle times count for this batch and cache size only

    def say(c):
        if _LAST_AUTO.get(id(ev)) != c.shape:
            print(c.reason, flush=True)
            _LAST_AUTO[id(ev)] = c.shape

    plens = [len(p) for p in prompts]

    def record(sh, r, offset=0, reference=False):
        # a program's first run (it just compiled) carries one-time costs (~0.3 s on CPU): not a cycle time
        ev.add(sh, r.acceptance_lengths, r.chain_lengths if sh.block > 1 else None,
               seconds=r.decode_time if r.compile_time == 0 else None, cycles=r.cycles, context=ctx, offset=offset,
               reference=reference, shadows=r.shadow_lengths, fill=au.mean_fill(plens, r.acceptance_lengths, offset))

    def run(sh, ps, reference=False, **over):
        r = generate(target, drafter if sh.block > 1 else None, ps, max_cache_len=S,
                     block_size=sh.block if sh.block > 1 else None, tree_budget=sh.tree,
                     shadow_trees=au.shadow_trees(ev, sh, shapes, costs) or None, **{**kw, **over})
        record(sh, r, reference=reference)
        return r

    choice = au.agree(au.choose(shapes, costs, ev, context=ctx), shapes)
    say(choice)
    if not choice.look or choice.reference or new <= 2 * au.LOOK_TOKENS:  # a whole call of one shape
        res = run(choice.shape, prompts, reference=choice.reference, max_new_tokens=new)
        res.auto_reason, res.auto_look = choice.reason, choice.look
        ev.add_lengths([len(t) for t in res.tokens])
        au.save_evidence(target, drafter)
        return res
    before = copy.deepcopy(ev)
    sh = choice.shape

    def then(part):  # the look's evidence in, the shape for the rest out
        record(sh, part)
        rest = before.for_the_rest(sh, part.acceptance_lengths, part.chain_lengths,
                                   part.shadow_lengths).with_times(ev)
        nxt = au.agree(au.choose(shapes, costs, rest, context=ctx, look=False, part=au.REST), shapes)
        say(nxt)
        part.auto_reason = f"{choice.reason}; then {nxt.reason}"  # part is the call's result, carried on
        return nxt.shape.block, nxt.shape.tree, au.shadow_trees(ev, nxt.shape, shapes, costs)

    sp = SamplingParams(float(kw["temperature"]), int(kw["top_k"]), float(kw["top_p"]))
    res, more = _decode(target, drafter, prompts, sp=sp, max_cache_len=S, Bk=sh.block, tree=sh.tree,
                        look=au.LOOK_TOKENS, then=then, shadow=au.shadow_trees(ev, sh, shapes, costs),
                        **{k: kw[k] for k in ("max_new_tokens", "stop_token_ids", "seed", "row_ids", "mesh",
                                              "prefill_chunk")})
    res.auto_look = True
    if more is None:  # every row ended within the look
        res.auto_reason = choice.reason
        record(sh, res)
    else:
        record(au.Shape(more.block_size, more.tree_budget), more, offset=au.LOOK_TOKENS)
    ev.add_lengths([len(t) for t in res.tokens])
    au.save_evidence(target, drafter)
    return res


_LAST_AUTO: dict = {}


def _mesh_of(target):
    from jax.sharding import NamedSharding
    from .layers import first_layer
    sh = getattr(first_layer(target.params["layers"])["q"], "sharding", None)
    return sh.mesh if isinstance(sh, NamedSharding) and sh.mesh.axis_names == ("data", "model") else None


def _model_specs(model):
    from .sharding import param_specs
    return type(model)(params=param_specs(model.params), config=model.config)


def _state_specs(with_drafter: bool):
    from jax.sharding import PartitionSpec as PS
    from .sharding import DATA, cache_spec
    return DecodeState(tcache=cache_spec(), dcache=cache_spec() if with_drafter else None, anchor=PS(DATA),
                       out=PS(DATA, None), gen_len=PS(DATA), done=PS(DATA), acc_hist=PS(DATA, None), cycle=PS(),
                       chain_hist=PS(DATA, None) if with_drafter else None)


@functools.partial(jax.jit, static_argnames=("Bk",))
def _draft_logits_dev(target, drafter, ctx, anchor, Bk):
    T = ctx.shape[1]
    _, _, feats = forward(target, ctx, None, taps_of(drafter))
    dc = append_context(drafter, feats, init_context_cache(drafter, 1, T))
    h = draft_hidden_cached(drafter, target, anchor, dc, Bk)
    return draft_logits_from_hidden(drafter, target, h[:, 1:])[0]


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
    _check_ids(target.config.vocab_size, ids)
    check_compatible(drafter.config, target)
    Bk = block_size or drafter.config.block_size
    return _draft_logits_dev(target, drafter, jnp.asarray(ids[None, :-1]), jnp.asarray(ids[-1:]), Bk)
