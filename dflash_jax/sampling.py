"""Token selection on the *target* distribution: greedy, temperature, top-k, top-p.

Random streams are keyed by (seed, row, absolute position of the token being chosen), so a token's
randomness does not depend on how many tokens a cycle produced: speculative decoding with exact-match
acceptance then commits exactly the tokens target-only sampling would, for the same seed.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_logits(logits, sp: SamplingParams):
    """Temperature, top-k and top-p applied to float32 logits [..., V] (masked entries = -inf)."""
    x = logits.astype(jnp.float32) / sp.temperature
    V = x.shape[-1]
    if 0 < sp.top_k < V:
        kth = jax.lax.top_k(x, sp.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if sp.top_p < 1.0:
        srt = jnp.sort(x, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        keep = (cum - probs) < sp.top_p  # smallest prefix whose mass reaches top_p
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return x


def target_probs(logits, sp: SamplingParams):
    """The exact distribution sampling draws from (for tests and analysis)."""
    if sp.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1])
    return jax.nn.softmax(processed_logits(logits, sp), axis=-1)


def position_keys(base_key, rows, positions):
    """Keys [B, T] for rows [B] (global row ids) and absolute positions [B, T]."""
    def one(r, p):
        return jax.random.fold_in(jax.random.fold_in(base_key, r), p)
    return jax.vmap(lambda r, ps: jax.vmap(lambda p: one(r, p))(ps))(rows, positions)


def sample(logits, sp: SamplingParams, keys=None):
    """logits [B, T, V] float32, keys [B, T] -> tokens [B, T] int32."""
    if sp.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = processed_logits(logits, sp)
    flat_k = keys.reshape((-1,) + keys.shape[2:])
    toks = jax.vmap(lambda k, l: jax.random.categorical(k, l))(flat_k, x.reshape(-1, x.shape[-1]))
    return toks.reshape(logits.shape[:-1]).astype(jnp.int32)
