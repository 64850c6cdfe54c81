"""Sampling without sorting the vocabulary equals Gumbel-max over the full processed distribution."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.sampling import SamplingParams, _gumbel, argmax, position_keys, processed_logits, sample


def _full_vocab_sample(logits, sp, keys):
    """The pre-top-k sampler: processed logits (sort-based top-p) + noise for every vocabulary id."""
    x = processed_logits(logits, sp)
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    noise = jax.vmap(lambda k: _gumbel(k, ids))(keys.reshape(-1, keys.shape[-1])).reshape(x.shape)
    return argmax(x + noise)


@pytest.mark.parametrize("sp", [SamplingParams(0.8, 5, 1.0), SamplingParams(1.3, 40, 0.9), SamplingParams(1.0, 7, 0.3)])
def test_top_k_path_equals_full_vocabulary_sampler(sp):
    B, T, V = 4, 8, 300
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, V)).astype(np.float32) * 3)
    pos = jnp.arange(T, dtype=jnp.int32)[None] + jnp.arange(B, dtype=jnp.int32)[:, None] * 100
    f = jax.jit(lambda lg, key: (sample(lg, sp, position_keys(key, jnp.arange(B), pos)),
                                 _full_vocab_sample(lg, sp, position_keys(key, jnp.arange(B), pos))))
    for seed in range(6):
        got, want = f(logits, jax.random.PRNGKey(seed))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
