"""The on-device draft-tree builder returns an optimal tree (checked by brute force), with a
consistent structure (parents, depths, ancestor mask), and the walk accepts exactly the path the
target's choices select."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.tree import accept_path, build_tree, chunked_top_k


def _prefixes(V, D):
    return [p for d in range(1, D + 1) for p in itertools.product(range(V), repeat=d)]


def _best_value(logp, n):
    """max over prefix-closed sets of n prefixes of sum_prefix prod_d q_d(token_d), by enumeration."""
    D, V = logp.shape
    pre = _prefixes(V, D)
    val = {p: float(np.exp(sum(logp[i, t] for i, t in enumerate(p)))) for p in pre}
    best = -1.0
    for sub in itertools.combinations(pre, n):
        s = set(sub)
        if all(len(p) == 1 or p[:-1] in s for p in sub):
            best = max(best, sum(val[p] for p in sub))
    return best, val


@pytest.mark.parametrize("V,D", [(3, 2), (2, 3)])
def test_builder_is_optimal_and_well_formed(V, D):
    rng = np.random.default_rng(V * 10 + D)
    B = 4
    logits = rng.normal(0, 1.5, size=(B, D, V)).astype(np.float32)
    logits[0] = 0.0  # a row of exact ties
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1), np.float64)
    root = jnp.asarray(rng.integers(0, V, size=B), jnp.int32)
    total = len(_prefixes(V, D))
    build = jax.jit(build_tree, static_argnums=(2,))
    for n in sorted({1, 4, total - 1}):
        tr = jax.tree.map(np.asarray, build(jnp.asarray(logits), root, n))
        for b in range(B):
            best, val = _best_value(logp[b], n)
            assert tr.tokens[b, 0] == root[b] and tr.parent[b, 0] == -1 and tr.depth[b, 0] == 0
            seqs = {0: ()}
            for i in range(1, n + 1):
                p = int(tr.parent[b, i])
                assert 0 <= p < i, (n, b, i, p)  # a node comes after its parent
                assert tr.depth[b, i] == tr.depth[b, p] + 1 <= D
                seqs[i] = seqs[p] + (int(tr.tokens[b, i]),)
                anc = {i}
                while p > 0:
                    anc.add(p)
                    p = int(tr.parent[b, p])
                anc.add(0)
                assert set(np.flatnonzero(tr.ancestors[b, i])) == anc
                np.testing.assert_allclose(tr.logq[b, i], np.log(val[seqs[i]]), rtol=1e-5, atol=1e-5)
            paths = list(seqs.values())[1:]
            assert len(set(paths)) == n  # distinct prefixes
            got = sum(val[p] for p in paths)
            assert got == pytest.approx(best, rel=1e-5), (V, D, n, b, got, best)


@pytest.mark.parametrize("k,chunk", [(64, 128), (5, 7), (200, 64), (64, 999), (3, 1000)])
def test_two_stage_top_k_equals_top_k_and_builds_the_same_tree(k, chunk):
    """chunked_top_k (per-slice top k, then the top k of those) returns lax.top_k's values and ids, ties
    included (rounded logits: many), for a vocabulary that is not a multiple of the slice; build_tree with
    `chunk` builds the same tree."""
    x = jnp.asarray(np.round(np.random.default_rng(k).normal(size=(2, 3, 1000)) * 3), jnp.float32)
    ref, got = jax.lax.top_k(x, k), chunked_top_k(x, k, chunk)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))
    root = jnp.asarray([1, 2], jnp.int32)
    a, b = build_tree(x + 0.01 * x[..., ::-1], root, k), build_tree(x + 0.01 * x[..., ::-1], root, k, chunk=chunk)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_budget_beyond_all_prefixes_adds_dead_nodes():
    V, D = 2, 2  # 6 distinct prefixes
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, D, V)), jnp.float32)
    tr = build_tree(logits, jnp.zeros((1,), jnp.int32), 9)
    assert np.all(np.asarray(tr.logq[0, 1:7]) > -1e20) and np.all(np.asarray(tr.logq[0, 7:]) < -1e20)
    # dead nodes are never accepted, whatever the target picks
    choices = np.array(list(itertools.product(range(V), repeat=10)), np.int32)  # every target pick
    trs = jax.tree.map(lambda x: jnp.repeat(x, len(choices), axis=0), tr)
    acc, path = accept_path(trs, jnp.asarray(choices), D)
    assert int(jnp.max(acc)) == D and np.all(np.asarray(path) < 7)


def test_walk_follows_the_targets_choices():
    V, D, n = 4, 3, 7
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(0, 2, size=(2, D, V)), jnp.float32)
    tr = build_tree(logits, jnp.asarray([1, 2], jnp.int32), n)
    t = jax.tree.map(np.asarray, tr)
    walk = jax.jit(accept_path, static_argnums=(2,))
    for trial in range(40):
        choice = rng.integers(0, V, size=(2, n + 1)).astype(np.int32)
        if trial % 2 == 0:  # make the target agree along some existing path
            for b in range(2):
                i = int(rng.integers(1, n + 1))
                while i > 0:
                    choice[b, t.parent[b, i]] = t.tokens[b, i]
                    i = int(t.parent[b, i])
        acc, path = (np.asarray(x) for x in walk(tr, jnp.asarray(choice), D))
        for b in range(2):
            node, want = 0, [0]
            while True:  # reference walk
                kids = [j for j in range(1, n + 1) if t.parent[b, j] == node and t.tokens[b, j] == choice[b, node]]
                if not kids:
                    break
                node = kids[0]
                want.append(node)
            assert acc[b] == len(want) - 1
            assert list(path[b, :len(want)]) == want
            assert all(path[b, len(want):] == want[-1])
