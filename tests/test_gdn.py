"""Gated DeltaNet (dflash_jax.gdn): the block form against the token-by-token recurrence, chains and trees, and the
commit of a verified block against running the kept rows alone."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import gdn

jax.config.update("jax_enable_x64", False)


def inputs(seed, B=2, T=11, H=3, Dk=8, Dv=6):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s).astype(np.float32))
    q = f(B, T, H, Dk)
    k = f(B, T, H, Dk)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = f(B, T, H, Dv)
    g = -jnp.abs(f(B, T, H)) * 0.7
    beta = jax.nn.sigmoid(f(B, T, H))
    S0 = f(B, H, Dk, Dv) * 0.3
    return S0, q, k, v, g, beta


def test_block_equals_recurrence_on_a_chain():
    S0, q, k, v, g, beta = inputs(0)
    o_ref, S_ref = gdn.recurrent_reference(S0, q, k, v, g, beta)
    T = q.shape[1]
    o, u, lg = gdn.delta_block(S0, q, k, v, g, beta, jnp.tril(jnp.ones((T, T), bool))[None])
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    S = gdn.state_after(S0, k, u, lg, jnp.ones(q.shape[:2]), lg[:, -1])
    np.testing.assert_allclose(S, S_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,sub", [(150, 64), (64, 64), (7, 4)])
def test_sub_blocks_equal_recurrence(T, sub):
    S0, q, k, v, g, beta = inputs(1, T=T)
    o_ref, S_ref = gdn.recurrent_reference(S0, q, k, v, g, beta)
    o, S = gdn.delta_sequence(S0, q, k, v, g, beta, sub=sub)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(S, S_ref, rtol=1e-4, atol=1e-4)


def random_tree(r, W):
    parent = np.full(W, -1)
    for t in range(1, W):
        parent[t] = r.integers(0, t)
    depth = np.zeros(W, int)
    anc = np.eye(W, dtype=bool)
    for t in range(1, W):
        depth[t] = depth[parent[t]] + 1
        anc[t] = anc[parent[t]]
        anc[t, t] = True
    return parent, depth, anc


def path_of(anc, t):
    return [j for j in range(anc.shape[0]) if anc[t, j]]  # ancestors precede: ascending order is root -> t


def test_tree_rows_see_their_own_path():
    W, B = 9, 2
    S0, q, k, v, g, beta = inputs(2, B=B, T=W)
    r = np.random.default_rng(3)
    trees = [random_tree(r, W) for _ in range(B)]
    anc = jnp.asarray(np.stack([t[2] for t in trees]))
    o, u, lg = gdn.delta_block(S0, q, k, v, g, beta, anc)
    for b, (_, _, a) in enumerate(trees):
        for t in range(W):
            p = path_of(a, t)
            sl = lambda x: x[b:b + 1, p]
            o_ref, S_ref = gdn.recurrent_reference(S0[b:b + 1], sl(q), sl(k), sl(v), sl(g), sl(beta))
            np.testing.assert_allclose(o[b, t], o_ref[0, -1], rtol=1e-4, atol=1e-5)
            on = jnp.zeros((1, W)).at[0, jnp.asarray(p)].set(1.0)
            S = gdn.state_after(S0[b:b + 1], k[b:b + 1], u[b:b + 1], lg[b:b + 1], on, lg[b:b + 1, t])
            np.testing.assert_allclose(S, S_ref, rtol=1e-4, atol=1e-5)


def test_padding_rows_leave_the_state():
    S0, q, k, v, g, beta = inputs(4, T=10)
    valid = jnp.asarray(np.arange(10)[None] < np.array([[6], [10]]))
    o, S = gdn.delta_sequence(S0, q, k, v, jnp.where(valid[..., None], g, 0), jnp.where(valid[..., None], beta, 0))
    _, S_ref0 = gdn.recurrent_reference(S0[:1], q[:1, :6], k[:1, :6], v[:1, :6], g[:1, :6], beta[:1, :6])
    np.testing.assert_allclose(S[0], S_ref0[0], rtol=1e-4, atol=1e-5)


def conv_ref(state, xs, w):
    """The conv of rows xs (one path, oldest first) after state: [len(xs), C]."""
    ext = np.concatenate([state, xs], axis=0)
    K = w.shape[1]
    y = np.stack([sum(ext[t + m] * w[:, m] for m in range(K)) for t in range(len(xs))])
    return y / (1 + np.exp(-y))


def test_conv_on_chain_and_tree_and_commit():
    r = np.random.default_rng(5)
    B, W, C, K = 2, 8, 5, 4
    state = r.normal(size=(B, K - 1, C)).astype(np.float32)
    x = r.normal(size=(B, W, C)).astype(np.float32)
    w = r.normal(size=(C, K)).astype(np.float32)
    y = gdn.causal_conv(jnp.asarray(state), jnp.asarray(x), jnp.asarray(w))
    for b in range(B):
        np.testing.assert_allclose(y[b], conv_ref(state[b], x[b], w), rtol=1e-5, atol=1e-5)
    trees = [random_tree(r, W) for _ in range(B)]
    parent = jnp.asarray(np.stack([t[0] for t in trees]))
    depth = jnp.asarray(np.stack([t[1] for t in trees]))
    yt = gdn.causal_conv(jnp.asarray(state), jnp.asarray(x), jnp.asarray(w), parent, depth)
    for b, (_, _, a) in enumerate(trees):
        for t in range(W):
            p = path_of(a, t)
            np.testing.assert_allclose(yt[b, t], conv_ref(state[b], x[b, p], w)[-1], rtol=1e-5, atol=1e-5)
    # commit: the window after n kept rows of a chain, and after a tree path
    n = jnp.asarray([3, 0])
    after = gdn.conv_after(jnp.asarray(state), jnp.asarray(x), n)
    np.testing.assert_allclose(after[0], np.concatenate([state[0], x[0, :3]])[-(K - 1):])
    np.testing.assert_allclose(after[1], state[1])
    _, _, a = trees[0]
    p = path_of(a, W - 1)
    path = jnp.asarray([p + [p[-1]] * (W - len(p)), [0] * W])
    after = gdn.conv_after(jnp.asarray(state), jnp.asarray(x), jnp.asarray([len(p), 1]), path)
    np.testing.assert_allclose(after[0], np.concatenate([state[0], x[0, p]])[-(K - 1):])
    np.testing.assert_allclose(after[1], np.concatenate([state[1], x[1, :1]])[-(K - 1):])


def test_commit_state_equals_running_the_kept_rows():
    cfg = gdn.GDNConfig(num_k_heads=1, num_v_heads=2, k_dim=8, v_dim=4, conv_kernel=3)
    Hd = 12
    r = np.random.default_rng(6)
    lp = {k: jnp.asarray(r.normal(0, 0.3, size=s).astype(np.float32)) for k, s in gdn.param_shapes(cfg, Hd).items()}
    B, W = 2, 6
    st = gdn.init_state(cfg, 1, B, jnp.float32)
    st = gdn.GDNState(conv=jnp.asarray(r.normal(size=st.conv.shape).astype(np.float32)),
                      rec=jnp.asarray(r.normal(size=st.rec.shape).astype(np.float32)))
    h = jnp.asarray(r.normal(size=(B, W, Hd)).astype(np.float32))
    out, pend = gdn.mixer(cfg, lp, h, st.conv[0], st.rec[0], eps=1e-6, pending=True)
    pend = jax.tree.map(lambda a: a[None], pend)
    n = jnp.asarray([4, 0])
    new = gdn.commit_state(st, pend, n)
    out_ref, (conv_ref_, rec_ref) = gdn.mixer(cfg, lp, h[:, :4], st.conv[0], st.rec[0], eps=1e-6)
    np.testing.assert_allclose(out[:, :4], out_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new.rec[0, 0], rec_ref[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new.conv[0, 0], conv_ref_[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.rec[0, 1], st.rec[0, 1])
    np.testing.assert_allclose(new.conv[0, 1], st.conv[0, 1])


def test_prefill_benchmark_forms_agree():
    """python -m infer.bench_gdn's three forms (block prefill, the decode step per token, the recurrence) compute the
    same layer stack; its figures are reported for each."""
    from dflash_jax.bench.gdn import prefill_stack
    out = prefill_stack(tokens=70, layers=2, hidden=48, k_heads=2, v_heads=4, head_dim=16, runs=1, log=lambda *_: None)
    for form in ("token", "recurrence"):
        assert out[form]["max_rel_diff_to_block"] <= 1e-4, out[form]
        assert out[form]["block_speedup"] > 0 and len(out[form]["runs"]) == 1
    assert out["config"]["tokens"] == 70
