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


@pytest.mark.parametrize("mix", ["capped", "wide"])
def test_row_sampling_equals_each_rows_own_setting(mix):
    """RowSampling (a setting per row, runtime arrays) draws what `sample` draws for each row's SamplingParams;
    "wide" holds a top-p row without top-k (the sorted-vocabulary branch), "capped" only top-k <= ROW_TOP_K_CAP."""
    from dflash_jax.sampling import RowSampling
    sets = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.8, 5, 1.0), SamplingParams(1.3, 40, 0.9)]
    sets.append(SamplingParams(1.0, 0, 0.3) if mix == "wide" else SamplingParams(0.7, 64, 0.5))
    B, T, V = len(sets), 4, 300
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, V)).astype(np.float32) * 3)
    pos = jnp.arange(T, dtype=jnp.int32)[None] + jnp.arange(B, dtype=jnp.int32)[:, None] * 100
    rows = jnp.arange(B)
    f = jax.jit(lambda lg, key, rs: sample(lg, rs, position_keys(key, rows, pos)))
    for seed in range(4):
        key = jax.random.PRNGKey(seed)
        got = np.asarray(f(logits, key, RowSampling.host(sets)))
        for i, sp in enumerate(sets):
            want = sample(logits[i:i + 1], sp, position_keys(key, rows[i:i + 1], pos[i:i + 1]))
            np.testing.assert_array_equal(got[i], np.asarray(want)[0], err_msg=f"{sp} seed {seed}")
    greedy = RowSampling.host([SamplingParams()] * B)  # no sampled row: the argmax, no noise drawn
    np.testing.assert_array_equal(np.asarray(f(logits, jax.random.PRNGKey(0), greedy)), np.argmax(logits, -1))
