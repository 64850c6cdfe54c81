"""The q / k projection kernel (dflash_jax.proj_kernel, Pallas interpret mode on CPU) against the XLA composition it
replaces on TPU: projection, per-head RMS norm, rotate-half rotary embedding."""
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import proj_kernel
from dflash_jax.layers import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq


@pytest.mark.parametrize("N,heads,dtype", [(24, 4, jnp.float32), (40, 6, jnp.float32), (16, 2, jnp.bfloat16)])
def test_proj_norm_rope_equals_the_composition(N, heads, dtype):
    """Heads of 128 in column tiles of 4 heads (6 heads: tiles of 3), positions far apart, float32 and bfloat16; the
    input RMS norm inside, with and without the per-head norm and rotary (v)."""
    rng = np.random.default_rng(N)
    H, D = 256, 128
    x = jnp.asarray(rng.normal(size=(N, H)), dtype)
    w = jnp.asarray(rng.normal(size=(heads * D, H)) / 16, dtype)
    nw = jnp.asarray(rng.uniform(0.5, 1.5, size=D), dtype)
    pos = jnp.asarray(rng.integers(0, 30000, size=(N,)), jnp.int32)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(D, 1e6, None))
    y = jnp.einsum("ni,oi->no", x.astype(jnp.float32), w.astype(jnp.float32)).reshape(N, heads, D)
    want = apply_rope(rms_norm(y, nw, 1e-6)[None], cos[None], sin[None])[0].reshape(N, heads * D)
    got = proj_kernel.proj_norm_rope(x, w, nw, cos, sin, eps=1e-6, interpret=True)
    assert got.dtype == dtype and got.shape == (N, heads * D)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    # the layer's input norm inside (the decoder layer's use), with and without the per-head norm and rotary
    inw = jnp.asarray(rng.uniform(0.5, 1.5, size=H), dtype)
    h = rms_norm(x, inw, 1e-6).astype(jnp.float32)
    y = jnp.einsum("ni,oi->no", h, w.astype(jnp.float32))
    want = apply_rope(rms_norm(y.reshape(N, heads, D), nw, 1e-6)[None], cos[None], sin[None])[0].reshape(N, -1)
    got = proj_kernel.proj_norm_rope(x, w, nw, cos, sin, eps=1e-6, in_norm=inw, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    got = proj_kernel.proj_norm_rope(x, w, eps=1e-6, in_norm=inw, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(y, np.float32), rtol=tol, atol=tol * 4)


def test_applies_only_where_it_tiles():
    assert proj_kernel.applies(256, 4096, 4096, 128) and proj_kernel.applies(16, 4096, 1024, 128)
    assert not proj_kernel.applies(256, 64, 256, 64)  # heads narrower than the 128 lanes
    assert not proj_kernel.applies(1815, 4096, 4096, 128)  # over 1,024 rows and no tile of 8k rows divides them
    with pytest.raises(ValueError, match="no tiling"):
        proj_kernel.proj_norm_rope(jnp.zeros((8, 64)), jnp.zeros((128, 64)), jnp.ones((64,)), jnp.zeros((8, 32)),
                                   jnp.zeros((8, 32)), eps=1e-6, interpret=True)


def test_decoder_and_drafter_layers_with_the_kernels_equal_xla(monkeypatch):
    """A Qwen3-shaped target (heads of 128) and its drafter with the TPU kernels forced on (interpreted here): the
    cached forward's logits and the drafter's block hidden states equal the XLA layers' (q / k / v with the input
    norm, the o projection with the residual add and the SwiGLU MLP with its norm in one kernel, attention in the
    projections' layout)."""
    import jax

    import dflash_jax
    from dflash_jax import model
    from dflash_jax.config import TargetConfig
    from dflash_jax.drafter import append_context, draft_hidden_cached, init_context_cache, init_drafter
    cfg = TargetConfig(family="qwen3", vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=128, qk_norm=True, max_position_embeddings=512)
    target = dflash_jax.init_target(cfg, seed=0, std=0.05)
    drafter = init_drafter(target, num_layers=1, block_size=16, mask_token_id=255, seed=1, std=0.05)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 16)), jnp.int32)

    def run():
        cache = model.init_cache(target, 2, 128)
        h, cache, feats = model.forward(target, tokens, cache, drafter.config.target_layer_ids)
        dc = append_context(drafter, feats, init_context_cache(drafter, 2, 128))
        return model.lm_head(target, h), draft_hidden_cached(drafter, target, tokens[:, -1], dc, 16)

    calls = []
    want_logits, want_h = run()
    monkeypatch.setattr(model, "on_tpu", lambda: True)
    real = model.fused_qkv
    monkeypatch.setattr(model, "fused_qkv", lambda *a, **k: calls.append(1) or real(*a, **k))
    from dflash_jax import mlp_kernel
    tails, real_mlp = [], mlp_kernel.swiglu_mlp
    monkeypatch.setattr(mlp_kernel, "swiglu_mlp", lambda *a, **k: tails.append(k.get("attn") is not None)
                        or real_mlp(*a, **k))
    got_logits, got_h = jax.jit(run)()
    assert calls, "the kernels were not used"
    assert tails and all(tails), "the o projection did not run inside the MLP kernel"
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(got_h), np.asarray(want_h), rtol=2e-4, atol=2e-4)


def test_q_k_v_in_one_kernel_over_row_tiles(monkeypatch):
    """proj_heads with three projections of different widths (q / k with their per-head norm and rotary, v plain),
    stacked weights read at a traced layer, three row tiles (each projection's column tiles written in its own
    steps): each output equals proj_norm_rope of that projection alone."""
    import jax
    rng = np.random.default_rng(3)
    N, H, D, L = 48, 256, 128, 2
    monkeypatch.setattr(proj_kernel, "ROW_BYTES", 16 * H * 4)  # row tiles of 16 tokens
    x = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=(L, n * D, H)) / 16, jnp.float32) for n in (4, 2, 2)]
    norms = [jnp.asarray(rng.uniform(0.5, 1.5, size=D), jnp.float32) for _ in range(2)] + [None]
    inw = jnp.asarray(rng.uniform(0.5, 1.5, size=H), jnp.float32)
    cos, sin = rope_cos_sin(jnp.arange(N, dtype=jnp.int32) * 7, rope_inv_freq(D, 1e6, None))
    got = jax.jit(lambda i: proj_kernel.proj_heads(x, ws, norms, cos, sin, eps=1e-6, in_norm=inw, layer=i,
                                                   interpret=True))(jnp.int32(1))
    for g, w, nw in zip(got, ws, norms):
        want = proj_kernel.proj_norm_rope(x, w[1], nw, cos, sin, eps=1e-6, in_norm=inw, interpret=True)
        assert g.shape == want.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, atol=1e-6)
