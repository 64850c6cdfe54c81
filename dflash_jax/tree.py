"""Draft trees (DDTree-style) built on device, for tree verification in the fused decode loop.

The drafter gives one distribution per draft depth d = 1 .. D (a block pass). A draft tree of N
nodes is a prefix-closed set of token sequences; node scores are the sum of log q_d(token) along the
path. The tree maximising sum over nodes of prod q along the path (the draft-side expected
acceptance length) takes, best first, the N highest-scoring prefixes: scores only fall from a node
to its children and to its next-ranked sibling, so a frontier search that pops the best candidate
and pushes (next sibling at the same depth, first child one depth down) enumerates prefixes in
score order. The builder takes that same set without the sequential search (see build_tree): static
shapes, a few small top-k's, jit-able, batched over rows.

Flattened layout used by verification: index 0 = root (the last committed token), node i at index
i + 1. `parent` indexes that layout (root = 0), `depth` is 0 for the root.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

NEG = -1e30


@flax.struct.dataclass
class DraftTree:
    tokens: jax.Array  # [B, N + 1] int32 (index 0: the root's token)
    parent: jax.Array  # [B, N + 1] int32 (root: -1)
    depth: jax.Array  # [B, N + 1] int32 (root: 0)
    logq: jax.Array  # [B, N + 1] float32: sum of draft log-probs along the path (root: 0)
    ancestors: jax.Array  # [B, N + 1, N + 1] bool: [i, j] = j is i or an ancestor of i
    top1: jax.Array  # [B, D] int32: the drafter's most likely token per depth (the chain's drafts)


def chunked_top_k(x, k: int, chunk: int):
    """lax.top_k(x, k) over the last axis in two exact stages: the top min(k, chunk) of each `chunk`-wide
    slice of x (padded with -inf), then the top k of those candidates (every member of the top k is among
    its slice's). The same values and ids as lax.top_k (ties: lower id first); for backends where a large
    k over a large vocabulary becomes a full sort (XLA:GPU sorts for k > 16)."""
    V = x.shape[-1]
    C = -(-V // chunk)
    if C <= 1:
        return jax.lax.top_k(x, k)
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, C * chunk - V)], constant_values=-jnp.inf)
    v1, i1 = jax.lax.top_k(xp.reshape(x.shape[:-1] + (C, chunk)), min(k, chunk))  # [..., C, k1]
    gid = i1 + (jnp.arange(C, dtype=i1.dtype) * chunk)[:, None]
    v2, pick = jax.lax.top_k(v1.reshape(x.shape[:-1] + (-1,)), k)
    return v2, jnp.take_along_axis(gid.reshape(x.shape[:-1] + (-1,)), pick, axis=-1)


def topk_logprobs(logits, k: int, tp=None, chunk: int | None = None):
    """Draft log-probs of the k most likely tokens per position: logits [..., V] (with `tp`: this
    device's vocab shard) -> (values [..., k] descending, global token ids [..., k]). `chunk`: take the
    top k in two stages (`chunked_top_k`), same result."""
    x = logits.astype(jnp.float32)
    v_local = x.shape[-1]
    m = jnp.max(x, axis=-1, keepdims=True)
    if tp is not None:
        m = jax.lax.pmax(m, tp)
    se = jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)
    if tp is not None:
        se = jax.lax.psum(se, tp)
    # top-k of the raw logits (same order as the log-probs), normalised afterwards: the [..., V]
    # log-softmax is never materialised, so no consumer of the k values can pull it into its fusion
    vals, ids = chunked_top_k(x, min(k, v_local), chunk) if chunk else jax.lax.top_k(x, min(k, v_local))
    ids = ids.astype(jnp.int32)
    if tp is not None:
        ids = ids + jax.lax.axis_index(tp) * v_local
        vals = jax.lax.all_gather(vals, tp, axis=vals.ndim - 1, tiled=True)
        ids = jax.lax.all_gather(ids, tp, axis=ids.ndim - 1, tiled=True)
        vals, pick = jax.lax.top_k(vals, k)
        ids = jnp.take_along_axis(ids, pick, axis=-1)
    # the barrier keeps XLA from re-deriving the k values from the [..., V] logits in every consumer
    # (on CPU that fusion made a 15 x 2048 tree build cost ~9 ms instead of ~0.4)
    return jax.lax.optimization_barrier((vals - m - jnp.log(se), ids))


def _pairs(n: int, k: int):
    """Static (i, j) pairs with (i + 1) * (j + 1) <= n, i < n, j < k, i-major: the only (prefix rank i,
    token rank j) extensions that can be among the n best of the next depth (every (i', j') with
    i' <= i and j' <= j scores at least as high, so a pair outside this set has >= n at least as good)."""
    i, j = np.meshgrid(np.arange(n), np.arange(k), indexing="ij")
    keep = (i + 1) * (j + 1) <= n
    return i[keep].astype(np.int32), j[keep].astype(np.int32)


def build_tree(draft_logits, root, n: int, tp=None, chunk: int | None = None) -> DraftTree:
    """Best-first draft tree of `n` nodes per row.

    draft_logits [B, D, V] float32: the drafter's logits for depths 1..D (with `tp`: vocab shard);
    root [B]: the last committed token. The tree is the n highest-scoring prefixes (score = sum of
    log q along the path; a child never scores above its parent, so that set is prefix-closed and is
    what the best-first search pops). Built without a sequential loop: a prefix's depth-d
    distribution does not depend on the prefix, so the n best depth-d prefixes are the n best
    (best depth-(d-1) prefix i, depth-d token j) sums, of which only pairs with (i+1)(j+1) <= n can
    qualify (D - 1 small top-k's); one top-k over the D x n candidates then picks the tree. Ties go to
    the shallower, then the earlier candidate, so a parent always precedes its children (node index
    order = score order). Nodes deeper than D are never made; with n > the number of distinct prefixes
    (V + V^2 + ... + V^D) the surplus nodes have score -1e30 and can never match. n >= 1. `chunk`: the
    vocabulary top-k in two stages (`chunked_top_k`; the same tree)."""
    if n < 1:
        raise ValueError(f"tree budget must be >= 1, got {n}")
    B, D, _ = draft_logits.shape
    V = draft_logits.shape[-1] * (1 if tp is None else jax.lax.axis_size(tp))
    K = min(n, int(V))
    vals, ids = topk_logprobs(draft_logits, K, tp, chunk)  # [B, D, K] descending
    pi, pj = _pairs(n, K)

    def to_n(x, fill):  # [B, K] -> [B, n]
        return jnp.pad(x, ((0, 0), (0, n - K)), constant_values=fill) if K < n else x

    S = to_n(vals[:, 0], NEG)  # scores of the n best depth-1 prefixes, descending
    scores, toks, pranks = [S], [to_n(ids[:, 0], 0)], [jnp.zeros((B, n), jnp.int32)]
    for d in range(1, D):
        cand = S[:, pi] + vals[:, d, pj]  # [B, P]
        S, sel = jax.lax.top_k(cand, n)
        scores.append(S)
        toks.append(jnp.take_along_axis(ids[:, d][:, pj], sel, axis=1))
        pranks.append(jnp.asarray(pi)[sel])
    return assemble_tree(scores, toks, pranks, root, ids[:, :, 0])


def assemble_tree(scores, toks, pranks, root, top1) -> DraftTree:
    """The n-node tree from the n best prefixes of each depth d = 1 .. D: scores / toks / pranks, lists of D
    [B, n] arrays (descending scores, -1e30 = none; the prefix's last token; its parent's rank among the depth
    d - 1 prefixes). The tree is the n best of the D x n prefixes (depth-major, so ties go shallower and a parent
    precedes its children); top1 [B, D]: the chain's drafts (DraftTree.top1)."""
    B, n = scores[0].shape
    D = len(scores)
    logq, g = jax.lax.top_k(jnp.concatenate(scores, axis=1), n)  # [B, n]: depth-major, so ties go shallower
    g = g.astype(jnp.int32)
    dep = g // n  # 0-based draft depth
    tok = jnp.take_along_axis(jnp.concatenate(toks, axis=1), g, axis=1)
    prank = jnp.take_along_axis(jnp.concatenate(pranks, axis=1), g, axis=1)
    rows = jnp.arange(B)[:, None]
    flat = jnp.zeros((B, D * n), jnp.int32).at[rows, g].set(jnp.arange(1, n + 1, dtype=jnp.int32))
    par = jnp.take_along_axis(flat, jnp.maximum(dep - 1, 0) * n + prank, axis=1)
    alive = logq > NEG / 2
    par = jnp.where((dep == 0) | ~alive, 0, par)
    depth = jnp.where(alive, dep + 1, 1)
    tokens = jnp.concatenate([root[:, None].astype(jnp.int32), tok], axis=1)
    parent = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), par], axis=1)
    depth = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), depth], axis=1)
    logq = jnp.concatenate([jnp.zeros((B, 1), jnp.float32), jnp.where(alive, logq, NEG)], axis=1)
    # ancestors: a node sees itself and, after D rounds of "my parent's set", every ancestor
    eye = jnp.eye(n + 1, dtype=bool)
    p0 = jnp.maximum(parent, 0)
    anc = jnp.broadcast_to(eye, (B, n + 1, n + 1))
    for _ in range(min(D, n)):
        anc = eye | jnp.take_along_axis(anc, p0[:, :, None], axis=1)
    return DraftTree(tokens=tokens, parent=parent, depth=depth, logq=logq, ancestors=anc, top1=top1)


def _on_path(tree: DraftTree, choice):
    """[B, N + 1] bool: the node and all its ancestors match the target's choices (root: True)."""
    N1 = tree.tokens.shape[1]
    par = jnp.maximum(tree.parent, 0)
    ok = jnp.take_along_axis(choice, par, axis=1) == tree.tokens  # node's token = target's pick after its parent
    ok = ok & (tree.parent >= 0) & (tree.depth > 0)
    ok = ok.at[:, 0].set(True)  # the root is committed already
    on_path = ~jnp.any(tree.ancestors & ~ok[:, None, :], axis=-1)  # [B, N+1]: every ancestor matched
    return on_path & ((tree.logq > NEG / 2) | (jnp.arange(N1) == 0))


def accept_path(tree: DraftTree, choice, max_depth: int):
    """Walk from the root following the target's choice. choice [B, N + 1]: the target's token after
    each flattened node. Returns (acc [B] accepted draft nodes, path [B, max_depth + 1] flattened
    indices of root, depth-1 node, ... (entries past acc repeat the last accepted node))."""
    on_path = _on_path(tree, choice)
    acc = jnp.sum(on_path, axis=1).astype(jnp.int32) - 1
    d = jnp.arange(max_depth + 1, dtype=jnp.int32)
    hit = on_path[:, None, :] & (tree.depth[:, None, :] == d[None, :, None])  # [B, max_depth+1, N+1]
    idx = jnp.argmax(hit, axis=-1).astype(jnp.int32)
    last = jnp.take_along_axis(idx, jnp.minimum(acc, max_depth)[:, None], axis=1)
    path = jnp.where(d[None] <= acc[:, None], idx, last)
    return acc, path


def chain_equivalent(tree: DraftTree, choice):
    """[B] int32: what the chain of D drafts (the drafter's top-1 token per depth, verified with the
    same target choices) commits in this cycle, 1 + its accepted drafts: the tree's greedy nodes
    (every token on the path the top-1 of its depth) that the walk accepted. Negative -n when the
    tree ends its greedy chain at depth n - 1 < D with all of it accepted: the chain commits >= n."""
    D = tree.top1.shape[1]
    N1 = tree.tokens.shape[1]
    top = jnp.take_along_axis(tree.top1, jnp.clip(tree.depth - 1, 0, D - 1), axis=1)
    g_ok = ((tree.tokens == top) & (tree.logq > NEG / 2)) | (jnp.arange(N1) == 0)
    greedy = ~jnp.any(tree.ancestors & ~g_ok[:, None, :], axis=-1)  # the greedy chain's nodes (root included)
    g = jnp.sum(greedy, axis=1).astype(jnp.int32) - 1  # its depth in this tree
    k = jnp.sum(greedy & _on_path(tree, choice), axis=1).astype(jnp.int32) - 1
    return jnp.where((k == g) & (g < D), -(k + 1), k + 1)
