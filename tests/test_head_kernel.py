"""The greedy LM-head kernel (dflash_jax.head_kernel, Pallas interpret mode on CPU) against the float32 logits +
sampling.argmax it replaces on TPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax
from dflash_jax import head_kernel
from dflash_jax.config import TargetConfig
from dflash_jax.model import lm_head, lm_head_argmax
from dflash_jax.sampling import argmax


def _rand(shape, seed, lo=None):
    r = np.random.default_rng(seed)
    return jnp.asarray((r.uniform(lo, 2.0, size=shape) if lo is not None else r.normal(size=shape)).astype(np.float32))


@pytest.mark.parametrize("vocab_axis,scaled,mult,cap", [(1, False, 1.0, 0.0), (0, True, 1.0, 30.0),
                                                        (1, True, 0.7, 0.0)])
def test_head_argmax_equals_logits_argmax(vocab_axis, scaled, mult, cap):
    """[H, V] and [V, H] weights, a vocabulary of 1,300 (a partial last 512-entry tile), a per-entry scale, a
    multiplier and a soft cap: the same ids as the float32 logits' argmax, and their maxima."""
    N, H, V = 40, 128, 1300
    h = _rand((N, H), 1)
    w = _rand((H, V) if vocab_axis else (V, H), 2)
    scale = _rand((V,), 3, lo=0.5) if scaled else None
    x = jnp.einsum("nh,hv->nv" if vocab_axis else "nh,vh->nv", h, w, precision="highest")
    x = x * scale if scaled else x
    x = x * mult
    x = jnp.tanh(x / cap) * cap if cap else x
    ids, val = head_kernel.head_argmax(h, w, vocab_axis=vocab_axis, scale=scale, mult=mult, cap=cap, interpret=True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(argmax(x)))
    np.testing.assert_allclose(np.asarray(val), np.asarray(x.max(-1)), rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_lowest_id_across_tiles_and_row_tiles(monkeypatch):
    """Equal maxima in two vocabulary tiles: the lower id, as jnp.argmax; 48 tokens in row tiles of 16 (a small
    VMEM budget) give the same ids as one tile, and 50 tokens (no tile of 8k rows divides them) are padded."""
    h = jnp.ones((48, 128), jnp.float32)
    w = jnp.zeros((128, 1200), jnp.float32).at[:, 700].set(1.0).at[:, 1100].set(1.0).at[:, 300].set(0.5)
    ids, _ = head_kernel.head_argmax(h, w, interpret=True)
    assert np.asarray(ids).tolist() == [700] * 48
    w2 = _rand((128, 1200), 4)
    h2 = _rand((48, 128), 5)
    whole, _ = head_kernel.head_argmax(h2, w2, interpret=True)
    monkeypatch.setattr(head_kernel, "ROW_BYTES", 16 * 128 * 4)
    tiled, _ = head_kernel.head_argmax(h2, w2, interpret=True)
    np.testing.assert_array_equal(np.asarray(tiled), np.asarray(whole))
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(argmax(h2 @ w2)))
    h3 = _rand((50, 128), 7)  # 50 tokens: no multiple of 8 divides them; 4 tiles of 16 rows, the last padded
    padded, _ = head_kernel.head_argmax(h3, w2, interpret=True)
    np.testing.assert_array_equal(np.asarray(padded), np.asarray(argmax(h3 @ w2)))


@pytest.mark.parametrize("tie", [False, True])
def test_lm_head_argmax_kernel_equals_the_logits_path(tie):
    """model.lm_head_argmax through the kernel equals the logits path (lm_head + argmax) on a tiny target, tied and
    untied embeddings, with a soft cap."""
    cfg = TargetConfig(family="qwen3", vocab_size=640, hidden_size=128, intermediate_size=256, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=64, tie_word_embeddings=tie)
    target = dflash_jax.init_target(cfg, seed=0, std=0.5)
    h = _rand((3, 7, 128), 6)
    x = lm_head(target, h)
    for softcap in (None, 20.0):
        want = argmax(x if softcap is None else jnp.tanh(x / softcap) * softcap)
        got = jax.jit(lambda h: lm_head_argmax(target, h, softcap=softcap, kernel=True))(h)
        ref = jax.jit(lambda h: lm_head_argmax(target, h, softcap=softcap, kernel=False))(h)
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
