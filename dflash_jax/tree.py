"""Draft trees (DDTree-style) built on device, for tree verification in the fused decode loop.

The drafter gives one distribution per draft depth d = 1 .. D (a block pass). A draft tree of N
nodes is a prefix-closed set of token sequences; node scores are the sum of log q_d(token) along the
path. The tree maximising sum over nodes of prod q along the path (the draft-side expected
acceptance length) takes, best first, the N highest-scoring prefixes: scores only fall from a node
to its children and to its next-ranked sibling, so a frontier search that pops the best candidate
and pushes (next sibling at the same depth, first child one depth down) enumerates prefixes in
score order. Everything has static shapes (N pops over a candidate pool of 2N + 1 slots), so the
builder is jit-able and runs per row under vmap.

Flattened layout used by verification: index 0 = root (the last committed token), node i at index
i + 1. `parent` indexes that layout (root = 0), `depth` is 0 for the root.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

NEG = -1e30


@flax.struct.dataclass
class DraftTree:
    tokens: jax.Array  # [B, N + 1] int32 (index 0: the root's token)
    parent: jax.Array  # [B, N + 1] int32 (root: -1)
    depth: jax.Array  # [B, N + 1] int32 (root: 0)
    logq: jax.Array  # [B, N + 1] float32: sum of draft log-probs along the path (root: 0)
    ancestors: jax.Array  # [B, N + 1, N + 1] bool: [i, j] = j is i or an ancestor of i


def topk_logprobs(logits, k: int, tp=None):
    """Draft log-probs of the k most likely tokens per position: logits [..., V] (with `tp`: this
    device's vocab shard) -> (values [..., k] descending, global token ids [..., k])."""
    x = logits.astype(jnp.float32)
    v_local = x.shape[-1]
    m = jnp.max(x, axis=-1, keepdims=True)
    if tp is not None:
        m = jax.lax.pmax(m, tp)
    se = jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)
    if tp is not None:
        se = jax.lax.psum(se, tp)
    lp = x - m - jnp.log(se)
    kl = min(k, v_local)
    vals, ids = jax.lax.top_k(lp, kl)
    if tp is None:
        return vals, ids.astype(jnp.int32)
    ids = ids.astype(jnp.int32) + jax.lax.axis_index(tp) * v_local
    vals = jax.lax.all_gather(vals, tp, axis=vals.ndim - 1, tiled=True)
    ids = jax.lax.all_gather(ids, tp, axis=ids.ndim - 1, tiled=True)
    vals, pick = jax.lax.top_k(vals, k)
    return vals, jnp.take_along_axis(ids, pick, axis=-1)


def _build_one(vals, ids, root, n: int):
    """One row: vals/ids [D, K] (per-depth top-K, descending) -> DraftTree fields without batch."""
    D, K = vals.shape
    P = 2 * n + 1  # candidate pool: 1 initial + at most 2 pushes per pop
    c_score = jnp.full((P,), NEG, jnp.float32).at[0].set(vals[0, 0])
    c_depth = jnp.zeros((P,), jnp.int32)  # 0-based draft depth (tree depth - 1)
    c_rank = jnp.zeros((P,), jnp.int32)
    c_parent = jnp.zeros((P,), jnp.int32)  # flattened index of the parent (root = 0)
    c_valid = jnp.zeros((P,), bool).at[0].set(True)
    tokens = jnp.zeros((n + 1,), jnp.int32).at[0].set(root)
    parent = jnp.full((n + 1,), -1, jnp.int32)
    depth = jnp.zeros((n + 1,), jnp.int32)
    logq = jnp.zeros((n + 1,), jnp.float32)
    anc = jnp.eye(n + 1, dtype=bool)

    def step(t, carry):
        c_score, c_depth, c_rank, c_parent, c_valid, tokens, parent, depth, logq, anc, used = carry
        best = jnp.argmax(jnp.where(c_valid, c_score, -jnp.inf))
        live = jnp.any(c_valid)  # False only when the budget exceeds every distinct prefix
        s, d, r, p = jnp.where(live, c_score[best], NEG), c_depth[best], c_rank[best], c_parent[best]
        node = t + 1
        tokens = tokens.at[node].set(ids[d, r])
        parent = parent.at[node].set(p)
        depth = depth.at[node].set(d + 1)
        logq = logq.at[node].set(s)
        anc = anc.at[node].set(anc[p] | (jnp.arange(n + 1) == node))
        c_valid = c_valid.at[best].set(False)
        # next sibling (same parent, next rank) into the popped slot; first child into a fresh one
        sib_ok = r + 1 < K
        r1 = jnp.minimum(r + 1, K - 1)
        c_score = c_score.at[best].set(s - vals[d, r] + vals[d, r1])
        c_rank = c_rank.at[best].set(r1)
        c_valid = c_valid.at[best].set(sib_ok & live)
        kid_ok = d + 1 < D
        d1 = jnp.minimum(d + 1, D - 1)
        c_score = c_score.at[used].set(s + vals[d1, 0])
        c_depth = c_depth.at[used].set(d1)
        c_rank = c_rank.at[used].set(0)
        c_parent = c_parent.at[used].set(node)
        c_valid = c_valid.at[used].set(kid_ok & live)
        return c_score, c_depth, c_rank, c_parent, c_valid, tokens, parent, depth, logq, anc, used + 1

    carry = (c_score, c_depth, c_rank, c_parent, c_valid, tokens, parent, depth, logq, anc, jnp.int32(1))
    carry = jax.lax.fori_loop(0, n, step, carry)
    return carry[5:10]


def build_tree(draft_logits, root, n: int, tp=None) -> DraftTree:
    """Best-first draft tree of `n` nodes per row.

    draft_logits [B, D, V] float32: the drafter's logits for depths 1..D (with `tp`: vocab shard);
    root [B]: the last committed token. Nodes deeper than D are never made; with n > the number of
    distinct prefixes (V + V^2 + ... + V^D) the surplus nodes repeat candidates of score -1e30 and
    can never match (the walk checks depth order). n >= 1."""
    if n < 1:
        raise ValueError(f"tree budget must be >= 1, got {n}")
    V = draft_logits.shape[-1] * (1 if tp is None else jax.lax.axis_size(tp))
    vals, ids = topk_logprobs(draft_logits, min(n, int(V)), tp)
    tokens, parent, depth, logq, anc = jax.vmap(lambda v, i, r: _build_one(v, i, r, n))(vals, ids, root)
    return DraftTree(tokens=tokens, parent=parent, depth=depth, logq=logq, ancestors=anc)


def accept_path(tree: DraftTree, choice, max_depth: int):
    """Walk from the root following the target's choice. choice [B, N + 1]: the target's token after
    each flattened node. Returns (acc [B] accepted draft nodes, path [B, max_depth + 1] flattened
    indices of root, depth-1 node, ... (entries past acc repeat the last accepted node))."""
    B, N1 = tree.tokens.shape
    par = jnp.maximum(tree.parent, 0)
    ok = jnp.take_along_axis(choice, par, axis=1) == tree.tokens  # node's token = target's pick after its parent
    ok = ok & (tree.parent >= 0) & (tree.depth > 0)
    ok = ok.at[:, 0].set(True)  # the root is committed already
    on_path = ~jnp.any(tree.ancestors & ~ok[:, None, :], axis=-1)  # [B, N+1]: every ancestor matched
    valid_score = tree.logq > NEG / 2
    on_path = on_path & (valid_score | (jnp.arange(N1) == 0))
    acc = jnp.sum(on_path, axis=1).astype(jnp.int32) - 1
    d = jnp.arange(max_depth + 1, dtype=jnp.int32)
    hit = on_path[:, None, :] & (tree.depth[:, None, :] == d[None, :, None])  # [B, max_depth+1, N+1]
    idx = jnp.argmax(hit, axis=-1).astype(jnp.int32)
    last = jnp.take_along_axis(idx, jnp.minimum(acc, max_depth)[:, None], axis=1)
    path = jnp.where(d[None] <= acc[:, None], idx, last)
    return acc, path
