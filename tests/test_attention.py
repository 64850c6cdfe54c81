"""dflash_jax.attention: every implementation equals the reference; in-place row writes; chunked prefill."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import attention as att
from dflash_jax.config import TargetConfig
from dflash_jax.model import forward, init_cache, init_target, lm_head


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


_att = jax.jit(att.attention, static_argnames=("impl", "block", "ring"))  # one compilation per call, not per op


def _both(*args, block, **kw):
    ref = _att(*args, impl="reference", **kw)
    blk = _att(*args, impl="blockwise", block=block, **kw)
    return np.asarray(ref), np.asarray(blk)


@pytest.mark.parametrize("block", [16, 20, 64])  # several blocks; a partial last block; one block = S
def test_target_shape_gqa_ragged(block):
    """Target decode / verify: T new causal tokens after ragged fills (0 = empty cache), GQA 6:2."""
    B, T, NH, KV, D, S = 3, 5, 6, 2, 8, 48
    q = _rand((B, 1, T, NH, D), 0)
    kn, vn = _rand((B, 1, T, KV, D), 1), _rand((B, 1, T, KV, D), 2)
    kc, vc = _rand((B, KV, S, D), 3), _rand((B, KV, S, D), 4)
    lens = jnp.asarray([[0], [7], [43]], jnp.int32)
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    ref, blk = _both(q, kn, vn, causal, kc, vc, lens, block=block)
    np.testing.assert_allclose(blk, ref, rtol=2e-5, atol=2e-6)
    # row 0 (empty cache) is plain causal attention over the new tokens
    solo = np.asarray(_att(q[:1], kn[:1], vn[:1], causal))
    np.testing.assert_allclose(ref[:1], solo, rtol=2e-5, atol=2e-6)


def test_layer_indexed_cache_reads_only_that_layer():
    B, T, NH, KV, D, S, L = 2, 3, 4, 4, 8, 32, 3
    q = _rand((B, 1, T, NH, D), 5)
    kn, vn = _rand((B, 1, T, KV, D), 6), _rand((B, 1, T, KV, D), 7)
    k_all, v_all = _rand((L, B, KV, S, D), 8), _rand((L, B, KV, S, D), 9)
    lens = jnp.asarray([[9], [30]], jnp.int32)
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    for layer in (0, 2, jnp.int32(1)):
        want = np.asarray(_att(q, kn, vn, causal, k_all[layer], v_all[layer], lens, impl="reference"))
        for impl in att.IMPLS:
            got = np.asarray(_att(q, kn, vn, causal, k_all, v_all, lens, layer=layer, impl=impl, block=8))
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("Q", [1, 5, 16])
def test_pallas_kernel_equals_reference(Q):
    """The Pallas cache kernel (interpret mode on CPU) through attention(impl="pallas"): ragged fills
    (empty, inside the first block, a partial last block, full), GQA 6:2, a static and a traced layer
    index; the kernel is really used (a 256-slot cache with 128-slot blocks)."""
    from dflash_jax import kernels
    B, NH, KV, D, S, L = 4, 6, 2, 8, 256, 2
    q = _rand((B, 1, Q, NH, D), 20)
    kn, vn = _rand((B, 1, Q, KV, D), 21), _rand((B, 1, Q, KV, D), 22)
    k_all, v_all = _rand((L, B, KV, S, D), 23), _rand((L, B, KV, S, D), 24)
    lens = jnp.asarray([[0], [7], [200], [256]], jnp.int32)
    causal = jnp.tril(jnp.ones((Q, Q), bool))[None, None]
    assert att._kernel_applies(q.reshape(B, 1, Q, KV, NH // KV, D), k_all, None, 0, None, 128)
    for layer in (1, jnp.int32(0)):
        want = np.asarray(_att(q, kn, vn, causal, k_all[layer], v_all[layer], lens, impl="reference"))
        got = np.asarray(_att(q, kn, vn, causal, k_all, v_all, lens, layer=layer, impl="pallas", block=128))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    # 24 query rows in 3 kernel steps of 8 give the same partials as one step
    qr = _rand((B, KV, 24, D), 25)
    one = kernels.cache_attention(qr, k_all, v_all, lens[:, 0], 1, scale=0.3, block=128, interpret=True)
    tiled = kernels.cache_attention(qr, k_all, v_all, lens[:, 0], 1, scale=0.3, block=128, rows=8, interpret=True)
    for a, b in zip(one, tiled):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
    # bf16 cache and queries (the TPU dtype): within bf16 rounding of the fp32 reference
    got16 = np.asarray(_att(q.astype(jnp.bfloat16), kn.astype(jnp.bfloat16), vn.astype(jnp.bfloat16), causal,
                            k_all.astype(jnp.bfloat16), v_all.astype(jnp.bfloat16), lens, layer=1, impl="pallas",
                            block=128).astype(jnp.float32))
    want = np.asarray(_att(q, kn, vn, causal, k_all[1], v_all[1], lens, impl="reference"))
    np.testing.assert_allclose(got16, want, rtol=0, atol=5e-2)


def test_pallas_kernel_with_a_tree_mask_and_row_tiles():
    """The new tokens join the kernel's softmax under any mask (a draft tree's ancestors, per batch row), and the
    fused kernel tiled into query-row steps of 8 gives the output of one step."""
    from dflash_jax import kernels
    B, NH, KV, D, S, Q = 3, 4, 2, 8, 256, 6
    q = _rand((B, 1, Q, NH, D), 30)
    kn, vn = _rand((B, 1, Q, KV, D), 31), _rand((B, 1, Q, KV, D), 32)
    kc, vc = _rand((B, KV, S, D), 33), _rand((B, KV, S, D), 34)
    lens = jnp.asarray([[0], [100], [256]], jnp.int32)
    rng = np.random.default_rng(35)
    tree = jnp.asarray((rng.uniform(size=(B, 1, Q, Q)) < 0.5) | np.eye(Q, dtype=bool))
    want = np.asarray(_att(q, kn, vn, tree, kc, vc, lens, impl="reference"))
    got = np.asarray(_att(q, kn, vn, tree, kc, vc, lens, impl="pallas", block=128))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    qr = _rand((B, KV, 24, D), 36)
    new = (_rand((B, KV, Q, D), 37), _rand((B, KV, Q, D), 38), jnp.asarray(rng.uniform(size=(B, 24, Q)) < 0.7))
    one = kernels.cache_attention(qr, kc, vc, lens[:, 0], scale=0.3, block=128, interpret=True, new=new)
    tiled = kernels.cache_attention(qr, kc, vc, lens[:, 0], scale=0.3, block=128, rows=8, interpret=True, new=new)
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(one), rtol=1e-6, atol=1e-6)


def test_pallas_kernel_shares_a_tokens_mask_row_over_its_heads():
    """A mask of one row per new token ([B, Q, N], as attention passes a prefill chunk's) gives the output of the
    mask repeated per query row ([B, G * Q, N]), with row tiles inside one head's rows (tr | Q) and across heads."""
    from dflash_jax import kernels
    B, KV, D, S, Q, G = 2, 2, 8, 256, 16, 2
    kc, vc = _rand((B, KV, S, D), 60), _rand((B, KV, S, D), 61)
    lens = jnp.asarray([7, 256], jnp.int32)
    qr = _rand((B, KV, G * Q, D), 62)
    kn, vn = _rand((B, KV, Q, D), 63), _rand((B, KV, Q, D), 64)
    tok = jnp.asarray(np.random.default_rng(65).uniform(size=(B, Q, Q)) < 0.6)
    want = kernels.cache_attention(qr, kc, vc, lens, scale=0.3, block=128, interpret=True,
                                   new=(kn, vn, jnp.tile(tok, (1, G, 1))))
    for rows in (8, 32):  # tr = 8 divides Q: row tile r reads token rows (r % 2) * 8..; tr = 32 spans both heads
        got = kernels.cache_attention(qr, kc, vc, lens, scale=0.3, block=128, rows=rows, interpret=True,
                                      new=(kn, vn, tok))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_cache_kernel_rows_per_step_fit_the_generations_vmem():
    """A prefill chunk's thousands of new tokens take fewer query rows per step than a verify's, within the TPU
    generation's VMEM budget (a v6e core has twice a v5p core's); past any tiling, attention takes the XLA path."""
    from dflash_jax import kernels, vmem
    R, S, D = 4 * 8192, 8192, 128  # 4 heads per KV head x 8,192 new tokens

    def rows(n_new):
        return kernels.tiling(R, S, D, n_new=n_new)[1]
    assert rows(16) == 512 and rows(2048) == 512
    v5p = rows(8192)
    with vmem.building_for("v6e"):
        v6e = rows(8192)
    assert v5p is not None and v5p < v6e <= 512
    est = kernels.vmem_bytes(v5p, 512, D, N=8192, R=R)
    assert est <= vmem.budget("v5p") < kernels.vmem_bytes(2 * v5p, 512, D, N=8192, R=R)  # the next divisor of R
    assert rows(1 << 17) is None
    qg = jnp.zeros((1, 1, 2, 2, 2, 128))
    assert att._kernel_applies(qg, jnp.zeros((1, 2, 8192, 128)), None, 0, None, 512, new=2)
    assert not att._kernel_applies(qg, jnp.zeros((1, 2, 8192, 128)), None, 0, None, 512, new=1 << 17)


def test_pallas_kernel_in_the_projections_layout(monkeypatch):
    """A 16-token verify with heads of 128 takes the kernel in the projections' layout (q, the new K / V and the
    output [B, Q, heads * D], rows gathered in VMEM; groups=G): the reference's output."""
    from dflash_jax import kernels
    seen = []
    real = kernels.cache_attention
    monkeypatch.setattr(kernels, "cache_attention", lambda *a, **k: seen.append(k.get("groups", 0)) or real(*a, **k))
    B, NH, KV, D, S, Q = 2, 4, 2, 128, 256, 16
    q = _rand((B, 1, Q, NH, D), 40)
    kn, vn = _rand((B, 1, Q, KV, D), 41), _rand((B, 1, Q, KV, D), 42)
    kc, vc = _rand((B, KV, S, D), 43), _rand((B, KV, S, D), 44)
    lens = jnp.asarray([[5], [256]], jnp.int32)
    causal = jnp.tril(jnp.ones((Q, Q), bool))[None, None]
    want = np.asarray(_att(q, kn, vn, causal, kc, vc, lens, impl="reference"))
    got = np.asarray(_att(q, kn, vn, causal, kc, vc, lens, impl="pallas", block=128))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert seen == [NH // KV]


def test_pallas_falls_back_where_the_kernel_does_not_apply():
    """A window without the queries' positions, sinks, several query groups or a cache length that is not a
    multiple of 128 take the blockwise path under impl="pallas" (same result)."""
    qg, pos = jnp.zeros((1, 1, 2, 2, 2, 8)), jnp.zeros((1, 1, 2), jnp.int32)
    assert att._kernel_applies(qg, jnp.zeros((1, 2, 128, 8)), None, 0, None, 512)
    assert att._kernel_applies(qg, jnp.zeros((1, 2, 128, 8)), pos, 6, None, 512)  # a window with positions
    assert not att._kernel_applies(qg, jnp.zeros((1, 2, 128, 8)), None, 6, None, 512)  # a window without
    assert not att._kernel_applies(qg, jnp.zeros((1, 2, 128, 8)), None, 0, jnp.zeros(1), 512)  # sinks
    assert not att._kernel_applies(jnp.zeros((1, 3, 2, 2, 2, 8)), jnp.zeros((1, 2, 128, 8)), None, 0, None,
                                   512)  # A = 3
    assert not att._kernel_applies(qg, jnp.zeros((1, 2, 48, 8)), None, 0, None, 512)  # S = 48


@pytest.mark.parametrize("window", [6, 130, "traced", "traced 0"])
def test_pallas_kernel_with_a_sliding_window_equals_reference(window):
    """The kernel over a sliding window (interpret mode): rows start at the first block their earliest query's
    window reaches and mask the slots out of each query's window; equal to the reference for ragged fills, 3 new
    tokens, windows inside one block and across blocks, a traced window and a traced 0 (no window)."""
    B, NH, KV, D, S, Q = 4, 4, 2, 8, 512, 3
    q = _rand((B, 1, Q, NH, D), 40)
    kn, vn = _rand((B, 1, Q, KV, D), 41), _rand((B, 1, Q, KV, D), 42)
    k, v = _rand((B, KV, S, D), 43), _rand((B, KV, S, D), 44)
    lens = jnp.asarray([[0], [5], [300], [509]], jnp.int32)
    q_pos = lens[:, :, None] + jnp.arange(Q, dtype=jnp.int32)[None, None]  # [B, 1, Q]
    causal = jnp.tril(jnp.ones((Q, Q), bool))[None, None]
    w = {"traced": jnp.int32(9), "traced 0": jnp.int32(0)}.get(window, window)  # a traced 0: no window (a full
    want = np.asarray(_att(q, kn, vn, causal, k, v, lens, impl="reference", q_pos=q_pos, window=w))  # layer in a scan)
    got = np.asarray(_att(q, kn, vn, causal, k, v, lens, impl="pallas", block=128, q_pos=q_pos, window=w))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    if window == 6:  # the window matters here: without it the result differs
        full = np.asarray(_att(q, kn, vn, causal, k, v, lens, impl="reference"))
        assert np.abs(full - want).max() > 1e-3


@pytest.mark.parametrize("window", [0, 6, "traced"])
def test_drafter_shape_blocks_context_and_windows(window):
    """Drafter: A blocks per row, non-causal (or windowed causal) within a block, each block sees
    context before its own anchor; an invalid block sees no context."""
    B, A, Q, NH, KV, D, S = 2, 3, 4, 4, 2, 8, 40
    q = _rand((B, A, Q, NH, D), 10)
    kn, vn = _rand((B, A, Q, KV, D), 11), _rand((B, A, Q, KV, D), 12)
    kc, vc = _rand((B, KV, S, D), 13), _rand((B, KV, S, D), 14)
    anchor = jnp.asarray([[3, 17, 36], [0, 25, 9]], jnp.int32)
    valid = jnp.asarray([[True, True, True], [True, False, True]])
    ctx_len = jnp.where(valid, anchor, 0)
    q_pos = anchor[..., None] + jnp.arange(Q, dtype=jnp.int32)
    w = 6 if window == "traced" else window
    dq = q_pos[..., :, None] - q_pos[..., None, :]
    m_blk = jnp.ones_like(dq, bool) if w == 0 else (dq >= 0) & (dq < w)

    def run(impl, window_arg):
        f = lambda win: att.attention(q, kn, vn, m_blk, kc, vc, ctx_len, q_pos=q_pos, window=win, impl=impl, block=8)
        return np.asarray(jax.jit(f)(jnp.int32(window_arg)) if window == "traced" else jax.jit(lambda: f(window_arg))())

    ref = run("reference", w)
    np.testing.assert_allclose(run("blockwise", w), ref, rtol=2e-5, atol=2e-6)
    # the window really restricts the context: compare with an explicit dense softmax
    qg = np.asarray(q).reshape(B, A, Q, KV, NH // KV, D)
    s_ctx = np.einsum("baqkgd,bksd->bakgqs", qg, np.asarray(kc)) / np.sqrt(D)
    s_new = np.einsum("baqkgd,barkd->bakgqr", qg, np.asarray(kn)) / np.sqrt(D)
    sp = np.arange(S)
    m_ctx = sp[None, None, None] < np.asarray(ctx_len)[..., None, None]
    if w:
        m_ctx = m_ctx & (np.asarray(q_pos)[..., None] - sp < w)
    s = np.concatenate([np.where(m_ctx[:, :, None, None], s_ctx, -np.inf),
                        np.where(np.asarray(m_blk)[:, :, None, None], s_new, -np.inf)], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bakgqs,bksd->baqkgd", p[..., :S], np.asarray(vc)) + \
        np.einsum("bakgqr,barkd->baqkgd", p[..., S:], np.asarray(vn))
    np.testing.assert_allclose(ref, o.reshape(B, A, Q, NH * D), rtol=1e-4, atol=1e-5)


def test_blockwise_never_reads_past_the_longest_fill():
    """Slots past the last block holding any row's fill are NaN: the reference (all S slots) is
    poisoned, the blockwise path is not, so its work stops at the fill."""
    B, T, NH, KV, D, S, blk = 2, 2, 2, 1, 8, 64, 8
    q = _rand((B, 1, T, NH, D), 20)
    kn, vn = _rand((B, 1, T, KV, D), 21), _rand((B, 1, T, KV, D), 22)
    kc, vc = _rand((B, KV, S, D), 23), _rand((B, KV, S, D), 24)
    lens = jnp.asarray([[5], [13]], jnp.int32)  # longest fill 13 -> blocks 0 and 1 (slots < 16)
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    clean = np.asarray(_att(q, kn, vn, causal, kc, vc, lens, impl="reference"))
    kp, vp = kc.at[:, :, 16:].set(jnp.nan), vc.at[:, :, 16:].set(jnp.nan)
    assert np.isnan(np.asarray(_att(q, kn, vn, causal, kp, vp, lens, impl="reference"))).all()
    got = np.asarray(_att(q, kn, vn, causal, kp, vp, lens, impl="blockwise", block=blk))
    np.testing.assert_allclose(got, clean, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("unroll", [32, 1])  # straight-line row updates / a loop over rows
def test_write_rows_equals_scatter(unroll, monkeypatch):
    monkeypatch.setattr(att, "UNROLL_ROWS", unroll)
    L, B, KV, S, D, T = 2, 3, 2, 16, 4, 3
    buf = _rand((L, B, KV, S, D), 30)
    new = _rand((B, T, KV, D), 31)
    starts = jnp.asarray([0, 5, 13], jnp.int32)
    pos = starts[:, None] + jnp.arange(T)
    want = buf.at[1, jnp.arange(B)[:, None], :, pos].set(new)
    np.testing.assert_array_equal(np.asarray(att.write_rows(buf, 1, starts, new)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(att.write_rows(buf[1], None, starts, new)), np.asarray(want[1]))
    same = jnp.full((B,), 6, jnp.int32)  # one shared fill: a single write for all rows
    want = buf.at[0, jnp.arange(B)[:, None], :, 6 + jnp.arange(T)].set(new)
    np.testing.assert_array_equal(np.asarray(att.write_rows(buf, 0, same, new, uniform=True)), np.asarray(want))


def test_bad_impl_is_a_value_error():
    with pytest.raises(ValueError, match="attention implementation"):
        att.set_default_impl("nope")


def test_gpu_default_is_dense_for_decode_sized_calls_and_blockwise_for_long_prefill(monkeypatch):
    """On a GPU (backend patched here) a call whose float32 scores fit DENSE_GPU_BYTES takes "reference",
    a larger one "blockwise"; an explicit set_default_impl wins; on CPU dense for a decode-size call over a short
    cache, else "blockwise" in CPU_BLOCK-slot blocks; on TPU "pallas". The
    layer layout for "auto" is stacked on TPU only."""
    from dflash_jax.layers import default_layout
    seen = []
    real_ref, real_blk = att._reference, att._blockwise
    monkeypatch.setattr(att, "_reference", lambda *a, **k: seen.append("reference") or real_ref(*a, **k))
    monkeypatch.setattr(att, "_blockwise", lambda *a, **k: seen.append("blockwise") or real_blk(*a, **k))
    B, NH, KV, D, S = 1, 4, 2, 8, 64

    def args(T):
        q, kn, vn = _rand((B, 1, T, NH, D), 0), _rand((B, 1, T, KV, D), 1), _rand((B, 1, T, KV, D), 2)
        return (q, kn, vn, jnp.tril(jnp.ones((T, T), bool))[None, None], _rand((B, KV, S, D), 3),
                _rand((B, KV, S, D), 4), jnp.asarray([[40]], jnp.int32))

    monkeypatch.setattr(att.jax, "default_backend", lambda: "gpu")
    assert default_layout() == "unrolled"
    small = 4 * B * NH * 3 * (S + 3)  # the score bytes of a 3-row call
    monkeypatch.setattr(att, "DENSE_GPU_BYTES", small)
    att.attention(*args(3))
    out_big = att.attention(*args(4))
    assert seen == ["reference", "blockwise"]
    assert att.default_impl(small) == "reference" and att.default_impl(small + 1) == "blockwise"
    with att.use_impl("blockwise"):
        assert att.default_impl(1) == "blockwise"
    np.testing.assert_allclose(np.asarray(out_big), np.asarray(_att(*args(4), impl="reference")), rtol=2e-5, atol=2e-6)
    monkeypatch.setattr(att.jax, "default_backend", lambda: "tpu")
    assert att.default_impl(1) == "pallas" and default_layout() == "stacked"
    monkeypatch.setattr(att.jax, "default_backend", lambda: "cpu")
    assert att.default_impl(1) == "blockwise" and default_layout() == "unrolled"
    # CPU: dense for a decode-size call over a short cache; blockwise (CPU_BLOCK-slot blocks) past either bound
    row = att.DENSE_CPU_ROW_BYTES
    assert att.default_impl(row, slots=att.DENSE_CPU_SLOTS) == "reference"
    assert att.default_impl(2 * row, slots=att.DENSE_CPU_SLOTS, rows=2) == "reference"
    assert att.default_impl(row + 1, slots=att.DENSE_CPU_SLOTS) == "blockwise"
    assert att.default_impl(1, slots=att.DENSE_CPU_SLOTS + 1) == "blockwise"
    assert att.default_block() == att.CPU_BLOCK
    with att.for_tpu():
        assert att.default_block() == att.DEFAULT_BLOCK
    # generate's compile cache tells a forced implementation from the per-call default (which on CPU may be dense)
    with att.use_impl("blockwise"):
        forced = att.program_key()
    assert forced != att.program_key()


# ----------------------------------------------------------------------------------------------
# model level: both implementations agree; chunked prefill == one-shot prefill
# ----------------------------------------------------------------------------------------------
CFG = TargetConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, max_position_embeddings=512, qk_norm=True, dtype="float32")


@pytest.fixture(scope="module")
def tiny():
    return init_target(CFG, seed=3, std=0.2)


def test_model_cached_forward_same_on_both_impls(tiny):
    ids = np.random.default_rng(0).integers(0, 64, size=(2, 9)).astype(np.int32)
    outs = []
    for impl in att.IMPLS:
        f = jax.jit(lambda t, x, c: lm_head(t, forward(t, x, c, attn_impl=impl)[0]))
        outs.append(np.asarray(f(tiny, jnp.asarray(ids), init_cache(tiny, 2, 128).rollback(jnp.asarray([4, 11])))))
    for o in outs[1:]:  # a 128-slot cache: the Pallas kernel applies (interpreted on CPU)
        np.testing.assert_allclose(o, outs[0], rtol=1e-5, atol=1e-5)


def test_chunked_prefill_equals_one_shot(tiny):
    """A 3-chunk prefill (last chunk partial, so it overlaps) produces the same tokens as one pass,
    for a ragged batch whose rows end in different chunks."""
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 64, size=n)) for n in (45, 7, 30)]
    kw = dict(max_new_tokens=6, max_cache_len=96)
    one = dflash_jax.generate(tiny, None, prompts, prefill_chunk=4096, **kw)
    many = dflash_jax.generate(tiny, None, prompts, prefill_chunk=20, **kw)  # P = 64 -> starts 0, 20, 40, 44
    assert many.tokens == one.tokens


@pytest.mark.parametrize("window", [0, 5])
def test_sinks_join_the_normaliser_on_every_path(window):
    """gpt-oss attention sinks: one extra logit per head in the softmax denominator, attending to
    nothing. Blockwise == reference == an explicit softmax over [visible keys ; sink]."""
    B, T, NH, KV, D, S = 2, 3, 4, 2, 8, 24
    q = _rand((B, 1, T, NH, D), 30)
    kn, vn = _rand((B, 1, T, KV, D), 31), _rand((B, 1, T, KV, D), 32)
    kc, vc = _rand((B, KV, S, D), 33), _rand((B, KV, S, D), 34)
    lens = jnp.asarray([[4], [17]], jnp.int32)
    q_pos = lens[:, :, None] + jnp.arange(T)[None, None, :]
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    sinks = _rand((NH,), 35) * 3.0
    ref, blk = _both(q, kn, vn, causal, kc, vc, lens, block=8, q_pos=q_pos, window=window, sinks=sinks)
    np.testing.assert_allclose(blk, ref, rtol=2e-5, atol=2e-6)
    # explicit: keys = committed slots < len (within the window) + new tokens <= self
    qn, knn, vnn, kcn, vcn, sk = (np.asarray(a, np.float64) for a in (q, kn, vn, kc, vc, sinks))
    want = np.zeros((B, T, NH, D))
    for b in range(B):
        L = int(lens[b, 0])
        for t in range(T):
            pos = L + t
            for h in range(NH):
                g = h // (NH // KV)
                keys = [kcn[b, g, s] for s in range(L) if not window or pos - s < window] + \
                       [knn[b, 0, r, g] for r in range(t + 1) if not window or t - r < window]
                vals = [vcn[b, g, s] for s in range(L) if not window or pos - s < window] + \
                       [vnn[b, 0, r, g] for r in range(t + 1) if not window or t - r < window]
                logits = np.array([qn[b, 0, t, h] @ k for k in keys]) * D ** -0.5
                m = max(logits.max(), sk[h])
                e = np.exp(logits - m)
                want[b, t, h] = (e[:, None] * np.array(vals)).sum(0) / (e.sum() + np.exp(sk[h] - m))
    np.testing.assert_allclose(ref.reshape(B, T, NH, D), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fill, window", [(None, 0), (44, 0), (44, 6)])
def test_costing_loop_over_every_block_equals_the_dynamic_loop(fill, window):
    """count_every_block (the planner's costing trace: a static unrolled loop over the blocks up to the
    planned fill, or a window's span) computes the same attention as the dynamic loop."""
    B, T, NH, KV, D, S = 3, 5, 6, 2, 8, 48
    q = _rand((B, 1, T, NH, D), 20)
    kn, vn = _rand((B, 1, T, KV, D), 21), _rand((B, 1, T, KV, D), 22)
    kc, vc = _rand((B, KV, S, D), 23), _rand((B, KV, S, D), 24)
    lens = jnp.asarray([[0], [17], [43]], jnp.int32)
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    q_pos = lens[:, :, None] + jnp.arange(T)[None, None]
    kw = dict(q_pos=q_pos, window=window, impl="blockwise", block=8)
    want = np.asarray(att.attention(q, kn, vn, causal, kc, vc, lens, **kw))
    with att.count_every_block(fill):
        text = jax.jit(lambda *a: att.attention(*a, **kw)).lower(q, kn, vn, causal, kc, vc, lens).as_text()
        got = np.asarray(jax.jit(lambda *a: att.attention(*a, **kw))(q, kn, vn, causal, kc, vc, lens))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert "while" not in text  # the block loop is unrolled, so a cost analysis counts every block


def test_costing_loop_bounded_by_one_rows_window():
    """One row, one query group: the costing loop spans only the blocks its window can reach."""
    T, NH, KV, D, S = 3, 4, 2, 8, 64
    q = _rand((1, 1, T, NH, D), 30)
    kn, vn = _rand((1, 1, T, KV, D), 31), _rand((1, 1, T, KV, D), 32)
    kc, vc = _rand((1, KV, S, D), 33), _rand((1, KV, S, D), 34)
    lens = jnp.asarray([[50]], jnp.int32)
    q_pos = lens[:, :, None] + jnp.arange(T)[None, None]
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    kw = dict(q_pos=q_pos, window=6, impl="blockwise", block=8)
    want = np.asarray(att.attention(q, kn, vn, causal, kc, vc, lens, **kw))
    with att.count_every_block(S):
        f = jax.jit(lambda *a: att.attention(*a, **kw))
        got = np.asarray(f(q, kn, vn, causal, kc, vc, lens))
        text = f.lower(q, kn, vn, causal, kc, vc, lens).as_text()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert text.count("dynamic_slice") < 8  # (6 + 3) / 8 + 1 = 3 blocks of K and V, not 8 of each


@pytest.mark.parametrize("unroll", [32, 1])
def test_ring_writes_and_reads_wrap_around(unroll, monkeypatch):
    """write_rows(ring=True) stores row b's T entries at slots (starts[b] + t) mod S, wrapping past the end (per row,
    in a loop over rows, and one write for all rows); cache.ring_read reads such a span back; T = S wraps fully."""
    from dflash_jax.cache import ring_read
    monkeypatch.setattr(att, "UNROLL_ROWS", unroll)
    L, B, KV, S, D = 2, 4, 2, 16, 3
    buf = _rand((L, B, KV, S, D), 50)
    for T, starts in ((5, [0, 13, 16 + 14, 7]), (16, [3, 0, 31, 40])):
        new = _rand((B, T, KV, D), 51 + T)
        starts = jnp.asarray(starts, jnp.int32)
        slots = (starts[:, None] + jnp.arange(T)) % S
        want = buf.at[1, jnp.arange(B)[:, None], :, slots].set(new)
        got = att.write_rows(buf, 1, starts, new, ring=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        for b in range(B):
            back = ring_read(got, (1, b, 0, 0, 0), 3, (1, 1, KV, T, D), starts[b])
            np.testing.assert_array_equal(np.asarray(back[0, 0]), np.asarray(jnp.swapaxes(new[b], 0, 1)))
        same = jnp.full((B,), 27, jnp.int32)
        want = buf.at[0, jnp.arange(B)[:, None], :, (27 + jnp.arange(T)) % S].set(new)
        np.testing.assert_array_equal(np.asarray(att.write_rows(buf, 0, same, new, uniform=True, ring=True)),
                                      np.asarray(want))


@pytest.mark.parametrize("Q, window", [(1, 100), (4, 100), (3, 200), (2, "traced")])
def test_ring_cache_attention_equals_the_full_cache(Q, window):
    """A ring cache of 256 slots (slot = position mod 256) holding the last positions of a 1024-slot cache: every path
    (reference, blockwise, the Pallas kernel in interpret mode) over the ring equals the reference over the full cache
    with the window; fills before the ring wrapped, at a lap's end and past several laps; windows inside one block
    and across the wrap."""
    B, NH, KV, D, S, R = 5, 4, 2, 8, 1024, 256
    q = _rand((B, 1, Q, NH, D), 60)
    kn, vn = _rand((B, 1, Q, KV, D), 61), _rand((B, 1, Q, KV, D), 62)
    k, v = _rand((B, KV, S, D), 63), _rand((B, KV, S, D), 64)
    lens = jnp.asarray([[0], [70], [256], [300], [900]], jnp.int32)
    q_pos = lens[:, :, None] + jnp.arange(Q, dtype=jnp.int32)[None, None]
    causal = jnp.tril(jnp.ones((Q, Q), bool))[None, None]
    w = jnp.int32(37) if window == "traced" else window
    # the ring: slot s <- the latest position p = s (mod R) below each row's fill
    from dflash_jax.cache import slot_positions
    held = slot_positions(lens[:, 0], R)  # [B, R]
    take = lambda a: jnp.take_along_axis(a, jnp.maximum(held, 0)[:, None, :, None], axis=2)  # noqa: E731
    rk, rv = take(k), take(v)
    want = np.asarray(_att(q, kn, vn, causal, k, v, lens, impl="reference", q_pos=q_pos, window=w))
    for impl, block in (("reference", None), ("blockwise", 64), ("blockwise", 96), ("pallas", 128)):
        got = np.asarray(_att(q, kn, vn, causal, rk, rv, lens, impl=impl, block=block, q_pos=q_pos, window=w,
                              ring=True))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=impl)
