"""The device programs of a decode: prefill, one cycle (chain or tree), commit, the decode loop.

Both decode modes share one cycle: feed a block of `Bk` tokens `[anchor, d_1 .. d_{Bk-1}]` to the target
(Bk = 1 and no drafts for target-only decoding), choose `posterior[j]` from the target's distribution
after block token j, accept the longest prefix of drafts with `d_j == posterior[j-1]`, commit
`posterior[0 .. acc]`, and roll the caches back to the committed length by moving their fill index.
A tree cycle verifies a draft tree of N nodes under its ancestor mask instead and commits the accepted path.
A DFlash2 drafter's chain is its selector's walk (selector_draft_stage); sampled at T > 0, it is verified by the
ratio test (decode.ratio) instead of exact match; its tree holds the N most likely selector paths.
A cycle is its stages called in sequence - draft_stage, verify_stage, accept_stage (a tree: draft_logits_stage
+ tree.build_tree, tree_verify_stage, tree_accept_stage) - which dflash_jax.bench.cycle_parts jits apart to time.
The whole decode runs in one jitted `lax.while_loop` with donated state (`loop`); prefill is a separate
program so prefill and decode are timed apart. `decode_programs` names what a decode runs, as
(function, statics, donated args, shard_map specs) per program; `program` jits one of them (dflash_jax.decode.cache
compiles and caches it on real arrays, dflash_jax.planner on abstract ones).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..cache import ring_put, ring_read
from ..drafter import (append_context, draft_argmax_from_hidden, draft_hidden_cached, draft_logits_from_hidden,
                       init_context_cache)
from ..drafter2 import candidates, is_dflash2, selector_drafts, selector_tree
from ..model import forward, init_cache, lm_head, lm_head_argmax
from ..sampling import RowSampling, SamplingParams, argmax, position_keys, sample
from .ratio import ratio_post
from .state import PREFILL_CHUNK, DecodeState, model_specs, state_specs, taps_of, verify_width


def prefill(target, drafter, tokens, lens, rows, key, stop_ids, budget, *, S, Bk, sp, chunk=None, tp=None, M=None):
    """tokens [B, P] right-padded, lens [B] -> DecodeState with the first token chosen. budget [B] (a
    runtime value: one program serves every max_new_tokens): the most new tokens of each row; `M` (static,
    default S): the most any row may have, the width of the state's token and history buffers.

    A prompt longer than `chunk` is prefilled chunk by chunk into the caches (each chunk attends to
    the cache filled so far plus itself), so memory is bounded by the chunk, not by P x P scores;
    the chunk starts are min(c * chunk, P - chunk), so a last partial chunk recomputes a few
    positions instead of writing past P. `tp`: the tensor-parallel mesh axis under shard_map."""
    B, P = tokens.shape
    if target.config.gemma4 is not None:  # sliding ring caches take at most ring_write rows per call
        from ..gemma4 import prefill_chunk
        chunk = prefill_chunk(target.config, P if chunk is None else chunk)
    C = P if chunk is None or chunk >= P else int(chunk)
    n_chunks = -(-P // C)
    recurrent = target.config.is_hybrid  # a recurrent state must see every prompt token once, in order
    if recurrent and P % C:
        raise ValueError(f"a prompt bucket of {P} tokens is not a multiple of the prefill chunk ({C}): a target with "
                         f"recurrent layers cannot recompute an overlapping last chunk")
    taps = taps_of(drafter)
    tcache = init_cache(target, B, S)
    dcache = init_context_cache(drafter, B, S) if drafter is not None else None
    H = target.config.hidden_size

    def one_chunk(c, carry):
        tcache, dcache, h_last = carry
        start = jnp.minimum(c * C, P - C).astype(jnp.int32)
        toks = jax.lax.dynamic_slice_in_dim(tokens, start, C, axis=1)
        at = jnp.full((B,), start, jnp.int32)
        valid = (start + jnp.arange(C, dtype=jnp.int32))[None] < lens[:, None] if recurrent else None
        h, tcache, feats = forward(target, toks, tcache.rollback(at), taps, tp, uniform=True, valid=valid)
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


def greedy(sp) -> bool:
    """Whether every row of `sp` takes the argmax (a RowSampling's temperatures are runtime values: not greedy)."""
    return isinstance(sp, SamplingParams) and sp.greedy


def draft_logits_stage(target, drafter, anchor, dcache, *, Bk, tp=None):
    """The drafter's block pass after each row's anchor: its logits [B, Bk - 1, V] for the Bk - 1 draft positions
    (the first stage of a chain or tree cycle)."""
    h = draft_hidden_cached(drafter, target, anchor, dcache, Bk, tp)  # [B, Bk, H]
    return draft_logits_from_hidden(drafter, target, h[:, 1:])


def draft_stage(target, drafter, anchor, dcache, *, Bk, tp=None, shadow=None):
    """A chain cycle's draft: (block [B, Bk] = [anchor, Bk - 1 greedy drafts], shadow). Without a drafter the block
    is the anchor alone. `shadow`: also the `shadow`-node draft tree of these distributions, as (its node tokens
    [B, shadow], parents [B, shadow]: flattened, root 0, -1 = no node); else None."""
    if drafter is None:
        return anchor[:, None], None
    with jax.named_scope("draft"):
        if not shadow:  # the greedy drafts alone: on TPU the logits stay in VMEM (model.lm_head_argmax)
            h = draft_hidden_cached(drafter, target, anchor, dcache, Bk, tp)
            drafts = draft_argmax_from_hidden(drafter, target, h[:, 1:], tp)  # [B, Bk-1]
            return jnp.concatenate([anchor[:, None], drafts], axis=1), shadow
        from ..tree import NEG, build_tree
        dl = draft_logits_stage(target, drafter, anchor, dcache, Bk=Bk, tp=tp)
        drafts = argmax(dl, tp)  # [B, Bk-1]
        t = build_tree(dl, anchor, shadow, tp)
        shadow = (t.tokens[:, 1:], jnp.where(t.logq[:, 1:] > NEG / 2, t.parent[:, 1:], -1))
    return jnp.concatenate([anchor[:, None], drafts], axis=1), shadow  # [B, Bk]


def selector_draft_stage(target, drafter, anchor, dcache, rows, key, *, Bk, sp, tp=None):
    """A DFlash2 chain cycle's draft: (block [B, Bk] = [anchor, the selector's Bk - 1 drafts], proposal). At T > 0
    (a SamplingParams without greedy_drafts) the selector's walk is sampled, keyed by the drafted positions, and
    proposal = (candidate ids, q) [B, Bk - 1, K] for the ratio test; else the argmax walk and proposal None. A
    RowSampling (the engine): each row walks at its own temperature (argmax at 0) and the ratio test verifies all."""
    rows_sp = isinstance(sp, RowSampling)
    sampled = rows_sp or (isinstance(sp, SamplingParams) and not sp.greedy and not sp.greedy_drafts)
    j = jnp.arange(1, Bk, dtype=jnp.int32)
    with jax.named_scope("draft"):
        h = draft_hidden_cached(drafter, target, anchor, dcache, Bk, tp)
        keys = position_keys(key, rows, dcache.lengths[:, None] + j) if sampled else None
        drafts, cand, q = selector_drafts(drafter, target, h[:, 1:], anchor, tp, sp.temperature if sampled else 0.0,
                                          keys)
    return jnp.concatenate([anchor[:, None], drafts], axis=1), ((cand, q) if sampled else None)


def verify_stage(target, drafter, tcache, block, rows, key, *, sp, tp=None, proposal=None):
    """A chain cycle's verification: the target's pass over block [B, Bk] at each row's cache length and its
    choice after every block token. Returns (post [B, Bk], tcache with the block written, the drafter's taps of
    the block). `proposal` (sampled drafts: candidate ids, q [B, Bk - 1, K]): the choices follow the ratio test
    (decode.ratio) instead of being the target's own samples."""
    Bk = block.shape[1]
    start = tcache.lengths  # [B] position of the anchor
    with jax.named_scope("verify"):
        hT, tcache, feats = forward(target, block, tcache, taps_of(drafter), tp, verify=True)
        if greedy(sp) and proposal is None:  # on TPU the logits stay in VMEM (model.lm_head_argmax)
            return lm_head_argmax(target, hT, tp=tp), tcache, feats
        logits = lm_head(target, hT)  # [B, Bk, V]
        j = jnp.arange(Bk, dtype=jnp.int32)
        keys = position_keys(key, rows, start[:, None] + 1 + j)
        post = sample(logits, sp, keys, tp)  # [B, Bk]
        if proposal is not None:
            post = ratio_post(logits, block, post, *proposal, keys, sp, tp)
    return post, tcache, feats


def accept_stage(drafter, st: DecodeState, block, post, tcache, feats, stop_ids, budget):
    """A chain cycle's acceptance: the longest prefix of drafts the target agrees with, committed (`commit`) with
    the target's token after it; tcache: verify_stage's."""
    B, Bk = block.shape
    with jax.named_scope("accept"):
        if Bk > 1:
            acc = jnp.sum(jnp.cumprod((block[:, 1:] == post[:, :-1]).astype(jnp.int32), axis=1), axis=1)
            full = drafter.config.block_size
            chain = jnp.where((acc == Bk - 1) & (Bk < full), -(acc + 1), acc + 1)  # a shorter block cuts it
        else:
            acc = jnp.zeros((B,), jnp.int32)
            chain = None
        return commit(drafter, st, tcache, feats, post, acc, stop_ids, budget, chain)


def cycle(target, drafter, st: DecodeState, rows, key, stop_ids, budget, *, Bk, sp, tp=None, tree=None,
          shadow=None):
    """One draft + verify cycle for every row (rows that are done stay put; budget [B]: each row's most
    new tokens): draft_stage, verify_stage, accept_stage. `tree`: a node budget for tree verification (None =
    the chain of Bk - 1 drafts). `shadow` (chains): also build the `shadow`-node draft tree of this cycle's
    distributions, unverified, and return (state, (its node tokens [B, shadow], parents [B, shadow]: flattened,
    root 0, -1 = no node))."""
    if tree is not None:
        return tree_cycle(target, drafter, st, rows, key, stop_ids, budget, Bk=Bk, sp=sp, tp=tp, N=tree)
    if is_dflash2(drafter) and Bk > 1:
        block, proposal = selector_draft_stage(target, drafter, st.anchor, st.dcache, rows, key, Bk=Bk, sp=sp, tp=tp)
        post, tcache, feats = verify_stage(target, drafter, st.tcache, block, rows, key, sp=sp, tp=tp,
                                           proposal=proposal)
        return accept_stage(drafter, st, block, post, tcache, feats, stop_ids, budget)
    block, shadow = draft_stage(target, drafter, st.anchor, st.dcache, Bk=Bk, tp=tp, shadow=shadow)
    post, tcache, feats = verify_stage(target, drafter, st.tcache, block, rows, key, sp=sp, tp=tp)
    new = accept_stage(drafter, st, block, post, tcache, feats, stop_ids, budget)
    return (new, shadow) if shadow else new


def commit(drafter, st: DecodeState, tcache, feats, post, acc, stop_ids, budget, chain=None, path=None):
    """Commit post[:, :acc + 1] (the accepted drafts and the target's token after them), cut at a
    stop token and at the row's budget; feats [B, >= acc + 1, n*H] = the target taps of the committed inputs;
    chain [B]: the full-block chain's commit this cycle (DecodeState.chain_hist), recorded if kept; path [B, D + 1]
    (a tree): the flattened node per depth of the accepted path (a recurrent layer keeps the state after it)."""
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
        tcache=tcache.commit(new_len, n, path), dcache=dcache, anchor=anchor, out=out, gen_len=st.gen_len + n, done=done,
        acc_hist=st.acc_hist.at[:, st.cycle].set(n), cycle=st.cycle + 1, chain_hist=chain_hist)


def compact_rows(buf, starts, idx, ring: bool = False):
    """buf [L, B, KV, S, D] (or a quantized cache's scales [L, B, KV, S]): for each row b, slots starts[b] + j <-
    slots starts[b] + idx[b, j] (j < W = idx.shape[1]), all layers, in place: one window read and one write per row
    (a ring cache: slots mod S, cache.ring_read / ring_put)."""
    L, B, KV, S = buf.shape[:4]
    rest = buf.shape[4:]
    W = idx.shape[1]
    zero = jnp.zeros((), jnp.int32)
    if ring:
        for b in range(B):
            base, shape = (0, b, 0, 0) + (0,) * len(rest), (L, 1, KV, W) + rest
            win = ring_read(buf, base, 3, shape, starts[b])
            buf = ring_put(buf, base, 3, jnp.take(win, idx[b], axis=3), starts[b])
        return buf
    for b in range(B):
        at = (zero, jnp.int32(b), zero, starts[b]) + (zero,) * len(rest)
        win = jax.lax.dynamic_slice(buf, at, (L, 1, KV, W) + rest)
        buf = jax.lax.dynamic_update_slice(buf, jnp.take(win, idx[b], axis=3), at)
    return buf


def tree_cycle(target, drafter, st: DecodeState, rows, key, stop_ids, budget, *, Bk, sp, tp, N):
    """Draft one block, build an N-node tree from its per-depth distributions (dflash_jax.tree),
    verify [root, nodes] in one target pass under the ancestor mask, walk the target's choices
    down the tree, then move the accepted path's K/V to contiguous slots and commit it: draft_logits_stage,
    tree.build_tree, tree_verify_stage, tree_accept_stage."""
    from ..tree import build_tree
    with jax.named_scope("draft"):
        if is_dflash2(drafter):  # the N most likely selector paths
            h = draft_hidden_cached(drafter, target, st.anchor, st.dcache, Bk, tp)[:, 1:]
            tree = selector_tree(drafter, *candidates(drafter, target, h, tp), st.anchor, N)
        else:
            dl = draft_logits_stage(target, drafter, st.anchor, st.dcache, Bk=Bk, tp=tp)
            tree = build_tree(dl, st.anchor, N, tp)
    choice, tcache, feats = tree_verify_stage(target, drafter, st.tcache, tree, rows, key, sp=sp, tp=tp)
    return tree_accept_stage(drafter, st, tree, choice, tcache, feats, stop_ids, budget, Bk=Bk, N=N)


def tree_verify_stage(target, drafter, tcache, tree, rows, key, *, sp, tp=None):
    """A tree cycle's verification: the target's pass over [root, nodes] (tree.tokens [B, N + 1]) under the
    ancestor mask, at positions cache length + depth. Returns (choice [B, N + 1]: the target's token after each
    node, tcache with the tree rows written, the drafter's taps of the tree rows)."""
    start = tcache.lengths
    with jax.named_scope("verify"):
        pos = start[:, None] + tree.depth  # [B, N+1]
        hT, tcache, feats = forward(target, tree.tokens, tcache, taps_of(drafter), tp,
                                    positions=pos, new_mask=tree.ancestors, verify=True, parent=tree.parent)
        if greedy(sp):
            return lm_head_argmax(target, hT, tp=tp), tcache, feats
        logits = lm_head(target, hT)  # [B, N+1, V]
        choice = sample(logits, sp, position_keys(key, rows, pos + 1), tp)  # target's token after each node
    return choice, tcache, feats


def tree_accept_stage(drafter, st: DecodeState, tree, choice, tcache, feats, stop_ids, budget, *, Bk, N):
    """A tree cycle's acceptance: walk the target's choices down the tree, move the accepted path's K/V to
    contiguous slots (compact_path) and commit it; tcache: tree_verify_stage's."""
    from ..tree import accept_path, chain_equivalent
    D = Bk - 1  # draft depths
    start = st.tcache.lengths
    with jax.named_scope("accept"):
        acc, path = accept_path(tree, choice, D)  # path [B, D+1]: flattened node per depth
        chain = chain_equivalent(tree, choice)
        post = jnp.take_along_axis(choice, path, axis=1)  # [B, D+1] committed tokens
        feats_p = jnp.take_along_axis(feats, path[:, :, None], axis=1) if feats is not None else None
        return commit(drafter, st, compact_path(tcache, start, path, N), feats_p, post, acc, stop_ids, budget, chain,
                      path)


def compact_path(tcache, start, path, N: int):
    """tcache with each row's accepted tree path (path [B, D + 1]: flattened node per depth) moved to the
    contiguous slots start + d, the depth-d node's K/V from its tree slot (the window is the N + 1 tree slots)."""
    W = min(N + 1, path.shape[1])
    idx = jnp.broadcast_to(jnp.arange(N + 1, dtype=jnp.int32), (path.shape[0], N + 1)).at[:, :W].set(path[:, :W])
    # every KVCache of the target's state (one, the hybrid's attention layers', one per Gemma 4 attention kind)
    return tcache.map_kv(lambda kv: kv.map_arrays(lambda a: compact_rows(a, start, idx, kv.ring)))


def rows_pay(target, drafter, width: int) -> bool:
    """Whether a speculative decode loop whose dots see `width` rows per batch row runs faster on
    layers.by_rows params: on XLA:CPU from layers.ROWS_MIN_WIDTH rows where layers.rows_faster measures
    it (the target's [hidden, intermediate] dots; which layout wins changed between jax releases);
    not on TPU, for a TPU topology traced from a CPU host, or target-only, and not with several processes
    (their programs must agree; each would time the probe on its own)."""
    from ..attention import tracing_for_tpu
    from ..layers import ROWS_MIN_WIDTH, rows_faster
    if (drafter is None or jax.default_backend() != "cpu" or tracing_for_tpu() or width < ROWS_MIN_WIDTH
            or jax.process_count() > 1):
        return False
    c = target.config
    return rows_faster(c.hidden_size, c.intermediate_size or c.moe_intermediate_size, width)  # MoE-only: experts


def rows_layout(target, drafter, width: int):
    """(target, drafter) with their [in, out] matrices transposed (layers.by_rows) where `rows_pay`; a
    model already in that layout is returned as it is (by_rows finds nothing left to transpose)."""
    from ..layers import by_rows
    if not rows_pay(target, drafter, width):
        return target, drafter
    return target.replace(params=by_rows(target.params)), drafter.replace(params=by_rows(drafter.params))


def loop(target, drafter, st, rows, key, stop_ids, budget, *, Bk, sp, tp=None, dp=None, tree=None, shadow=None):
    """The decode loop; with `shadow` (a chain): returns (state, (tokens, parents) [B, M, shadow]) - each cycle's
    unverified `shadow`-node draft tree (`cycle`), for GenerationResult.shadow_lengths."""
    target, drafter = rows_layout(target, drafter, verify_width(Bk, tree))

    def cond(s):
        s = s[0] if shadow else s
        busy = jnp.any(~s.done)
        if dp is not None:  # rows are split over the data axis: stop when every shard is done
            busy = jax.lax.pmax(busy.astype(jnp.int32), dp) > 0
        return (s.cycle < s.acc_hist.shape[1]) & busy

    def body(s):
        if not shadow:
            return cycle(target, drafter, s, rows, key, stop_ids, budget, Bk=Bk, sp=sp, tp=tp, tree=tree)
        s, (toks, pars) = s
        new, (t, p) = cycle(target, drafter, s, rows, key, stop_ids, budget, Bk=Bk, sp=sp, tp=tp, shadow=shadow)
        return new, (toks.at[:, s.cycle].set(t), pars.at[:, s.cycle].set(p))

    if not shadow:
        return jax.lax.while_loop(cond, body, st)
    B, M = st.acc_hist.shape
    return jax.lax.while_loop(cond, body, (st, (jnp.zeros((B, M, shadow), jnp.int32),
                                                jnp.full((B, M, shadow), -1, jnp.int32))))


def program(fn, statics: dict, donate=(), mesh=None, specs=None):
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
    draft tree of that many nodes (`loop`)."""
    if is_dflash2(drafter) and shadow:
        raise ValueError("shadow trees are not supported with a DFlash2 drafter (its chain is the selector's walk)")
    # the prefill's Bk only sizes the token buffer: the drafter's full block, so every drafted shape of a pair
    # shares one state layout (a call can change shape in place, decode.runner.run_shape)
    statics = dict(S=S, Bk=drafter.config.block_size if drafter is not None else 1, sp=sp, chunk=int(chunk))
    loop_statics = dict(Bk=Bk, sp=sp)
    if tree is not None:
        loop_statics["tree"] = int(tree)
    row_specs = pre_specs = loop_specs = cycle_specs = None
    if mesh is not None:
        from jax.sharding import PartitionSpec as PS
        from ..sharding import DATA, MODEL
        statics["tp"] = loop_statics["tp"] = MODEL
        t_spec, d_spec = model_specs(target), (model_specs(drafter) if drafter is not None else None)
        st_spec = state_specs(drafter is not None, target)
        row_specs = (PS(DATA, None), PS(DATA), PS(DATA), PS(DATA, None), PS(DATA))
        pre_specs = ((t_spec, d_spec) + row_specs[:3] + (PS(), row_specs[3], row_specs[4]), st_spec)
        loop_specs = cycle_specs = ((t_spec, d_spec, st_spec, PS(DATA), PS(), PS(DATA, None), PS(DATA)), st_spec)
        if shadow:
            loop_specs = (loop_specs[0], (st_spec, (PS(DATA, None, None),) * 2))
    cycle_statics = dict(loop_statics)  # cycle has no data axis: only the loop's stop test reduces over it
    if mesh is not None:
        loop_statics["dp"] = DATA
    if shadow and tree is None and drafter is not None:
        loop_statics["shadow"] = int(shadow)
    return {"prefill": (prefill, statics, (), pre_specs), "loop": (loop, loop_statics, (2,), loop_specs),
            "cycle": (cycle, cycle_statics, (2,), cycle_specs), "row_specs": row_specs}


@functools.partial(jax.jit, static_argnames=("Bk",))
def draft_logits_program(target, drafter, ctx, anchor, Bk):
    """The drafter's logits [Bk - 1, V] after the context ctx [1, T] (prefilled into the target) and anchor [1]."""
    T = ctx.shape[1]
    _, _, feats = forward(target, ctx, None, taps_of(drafter))
    dc = append_context(drafter, feats, init_context_cache(drafter, 1, T))
    h = draft_hidden_cached(drafter, target, anchor, dc, Bk)
    return draft_logits_from_hidden(drafter, target, h[:, 1:])[0]

