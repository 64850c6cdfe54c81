"""Token selection on the *target* distribution: greedy, temperature, top-k, top-p.

Random streams are keyed by (seed, row, absolute position of the token being chosen), so a token's
randomness does not depend on how many tokens a cycle produced: speculative decoding with exact-match
acceptance then commits exactly the tokens target-only sampling would, for the same seed.

Two ways to give the settings: `SamplingParams` (one setting for every row, static: the program is compiled for
it) or `RowSampling` (a setting per row, runtime arrays: one program serves any mix of settings; the continuous-
batching engine uses it). Both draw the same token for the same logits, key and setting.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32

ROW_TOP_K_CAP = 64  # RowSampling: a top-k up to this (and top-p within it) needs only lax.top_k of this many ids;
# a larger top-k, or top-p without top-k, sorts the vocabulary (only in calls where some row asks for it)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    greedy_drafts: bool = False  # a DFlash2 drafter at T > 0 proposes its argmax walk (exact-match acceptance)
    # instead of sampling its selector (the ratio test, dflash_jax.decode.ratio)

    def __post_init__(self):
        if not self.temperature >= 0 or self.temperature == float("inf"):  # NaN fails every comparison
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@flax.struct.dataclass
class RowSampling:
    """One sampling setting per row as runtime arrays (a pytree: programs take it as data, not as a static)."""
    temperature: jax.Array  # [B] float32, 0: greedy
    top_k: jax.Array  # [B] int32, 0: off
    top_p: jax.Array  # [B] float32, 1: off

    @staticmethod
    def host(settings: Sequence[SamplingParams]) -> RowSampling:
        """numpy arrays of per-row settings (each a checked SamplingParams)."""
        return RowSampling(np.asarray([s.temperature for s in settings], np.float32),
                           np.asarray([s.top_k for s in settings], np.int32),
                           np.asarray([s.top_p for s in settings], np.float32))


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


def _gumbel(key, vocab_ids):
    """Gumbel(0, 1) noise for the given global vocabulary ids: counter-based, so any vocab shard draws
    exactly the values the full vocabulary would (sampling is identical across mesh shapes)."""
    idx = vocab_ids.astype(jnp.uint32)
    bits = threefry_2x32(key, jnp.concatenate([idx, idx ^ jnp.uint32(0x9E3779B9)]))[: idx.shape[0]]
    u = (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24)) + (0.5 / (1 << 24))  # (0, 1)
    return -jnp.log(-jnp.log(u))


def argmax(scores, tp=None):
    """argmax over the last (vocab) axis; with `tp` the axis is sharded over that mesh axis and the
    result is the global id (ties -> lowest id, as jnp.argmax), using two scalar all-reduces.

    Written as max, then the lowest index holding it: two single-operand reductions, which XLA:CPU
    vectorises (jnp.argmax's (value, index) reduction is 2-5x slower there; same result on TPU/GPU).
    NaN counts as the maximum, as in jnp.argmax."""
    v_local = scores.shape[-1]
    val = jnp.max(scores, axis=-1)  # NaN if the row holds one
    iota = jax.lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    hit = (scores == val[..., None]) | jnp.isnan(scores)
    idx = jnp.min(jnp.where(hit, iota, v_local), axis=-1)
    return idx if tp is None else shard_argmax(val, idx, v_local, tp)


def shard_argmax(val, idx, v_local: int, tp):
    """The global argmax from each vocabulary shard's max `val` and its local id `idx` (shards of v_local ids over
    mesh axis tp): the lowest global id holding the largest max, by two scalar all-reduces."""
    gval = jax.lax.pmax(val, tp)
    gidx = idx + jax.lax.axis_index(tp) * v_local
    return jax.lax.pmin(jnp.where(val == gval, gidx, jnp.iinfo(jnp.int32).max), tp)


def sample(logits, sp: SamplingParams, keys=None, tp=None):
    """logits [B, T, V] float32 (with `tp`: this device's vocab shard), keys [B, T] -> tokens [B, T].

    Sampling is Gumbel-max over the processed logits, with noise keyed by global vocabulary id.
    Plain temperature sampling works on vocab shards directly. With top_k > 0 only the candidates
    are touched: `lax.top_k` (per vocab shard, then over the gathered shard candidates: k values per
    shard travel, not the logits), top-p within the candidates, Gumbel noise for the candidates only;
    no sort of the vocabulary. The result equals Gumbel-max over the full processed distribution
    (same noise per id), so it does not depend on the mesh. top_p < 1 without top_k still needs the
    whole distribution: that case gathers the logits and sorts them. `sp` a RowSampling: `sample_rows`."""
    if isinstance(sp, RowSampling):
        return sample_rows(logits, sp, keys, tp)
    if sp.greedy:
        return argmax(logits, tp)
    if 0 < sp.top_k < logits.shape[-1] * (1 if tp is None else jax.lax.axis_size(tp)):
        return _sample_top_k(logits, sp, keys, tp)
    if tp is not None and sp.top_p < 1.0:
        logits = jax.lax.all_gather(logits, tp, axis=logits.ndim - 1, tiled=True)
        tp = None
    x = processed_logits(logits, sp)
    v_local = x.shape[-1]
    offset = 0 if tp is None else jax.lax.axis_index(tp) * v_local
    ids = offset + jnp.arange(v_local, dtype=jnp.int32)
    flat_k = keys.reshape((-1,) + keys.shape[2:])
    noise = jax.vmap(lambda k: _gumbel(k, ids))(flat_k).reshape(x.shape)
    return argmax(x + noise, tp)


def _sample_top_k(logits, sp: SamplingParams, keys, tp=None):
    k = sp.top_k
    x = logits.astype(jnp.float32) / sp.temperature
    v_local = x.shape[-1]
    vals, idx = jax.lax.top_k(x, min(k, v_local))  # sorted descending
    if tp is not None:  # candidates of every shard (global ids), then the global top k among them
        idx = idx + jax.lax.axis_index(tp) * v_local
        vals = jax.lax.all_gather(vals, tp, axis=x.ndim - 1, tiled=True)
        idx = jax.lax.all_gather(idx, tp, axis=x.ndim - 1, tiled=True)
        vals, pick = jax.lax.top_k(vals, k)
        idx = jnp.take_along_axis(idx, pick, axis=-1)
    if sp.top_p < 1.0:  # smallest prefix of the (sorted) candidates whose mass reaches top_p
        probs = jax.nn.softmax(vals, axis=-1)
        keep = (jnp.cumsum(probs, axis=-1) - probs) < sp.top_p
        vals = jnp.where(keep, vals, -jnp.inf)
    lead = vals.shape[:-1]
    flat_k = keys.reshape((-1,) + keys.shape[2:])
    noise = jax.vmap(_gumbel)(flat_k, idx.reshape(-1, idx.shape[-1])).reshape(vals.shape)
    best = jnp.argmax(vals + noise, axis=-1)
    return jnp.take_along_axis(idx, best[..., None], axis=-1)[..., 0].reshape(lead).astype(jnp.int32)


def sample_rows(logits, rs: RowSampling, keys, tp=None):
    """`sample` with a setting per row (rs: [B] arrays; logits [B, T, V], keys [B, T]): each row draws the token
    `sample` draws for its own SamplingParams (Gumbel-max over its processed distribution, noise keyed by global
    vocabulary id; ties at the k-th logit are kept as `processed_logits` keeps them). Greedy rows take the argmax.
    Without a sampled row no noise is drawn; the vocabulary is sorted only when some row needs top-p over more
    than ROW_TOP_K_CAP ids (a runtime branch: the program is the same for every mix of settings)."""
    greedy = argmax(logits, tp)
    hot = rs.temperature > 0  # [B]
    V = logits.shape[-1] * (1 if tp is None else jax.lax.axis_size(tp))
    cap = min(ROW_TOP_K_CAP, V)
    use_k = hot & (rs.top_k > 0) & (rs.top_k < V)
    use_p = hot & (rs.top_p < 1.0)
    wide = (use_k & (rs.top_k > cap)) | (use_p & ~(use_k & (rs.top_k <= cap)))

    def drawn():
        x = logits.astype(jnp.float32) / jnp.where(hot, rs.temperature, 1.0)[:, None, None]
        cut = jax.lax.cond(jnp.any(wide), lambda: _row_cutoff(x, rs, use_k, use_p, V, tp),
                           lambda: _row_cutoff(x, rs, use_k, use_p, cap, tp))
        x = jnp.where(x < cut, -jnp.inf, x)
        v_local = x.shape[-1]
        offset = 0 if tp is None else jax.lax.axis_index(tp) * v_local
        ids = offset + jnp.arange(v_local, dtype=jnp.int32)
        flat_k = keys.reshape((-1,) + keys.shape[2:])
        noise = jax.vmap(lambda k: _gumbel(k, ids))(flat_k).reshape(x.shape)
        return jnp.where(hot[:, None], argmax(x + noise, tp), greedy)

    return jax.lax.cond(jnp.any(hot), drawn, lambda: greedy)


def row_probs(logits, rs: RowSampling):
    """[B, T, V] the distribution each row samples from under its own setting (logits [B, T, V], the whole
    vocabulary): temperature, top-k and top-p as `sample_rows` applies them; a greedy row's is one-hot at the argmax."""
    V = logits.shape[-1]
    hot = rs.temperature > 0
    use_k, use_p = hot & (rs.top_k > 0) & (rs.top_k < V), hot & (rs.top_p < 1.0)
    x = logits.astype(jnp.float32) / jnp.where(hot, rs.temperature, 1.0)[:, None, None]
    x = jnp.where(x < _row_cutoff(x, rs, use_k, use_p, V), -jnp.inf, x)
    one = jax.nn.one_hot(argmax(logits), V, dtype=jnp.float32)
    return jnp.where(hot[:, None, None], jax.nn.softmax(x, axis=-1), one)


def _row_cutoff(x, rs: RowSampling, use_k, use_p, width: int, tp=None):
    """[B, T, 1] per-row logit cutoff (-inf: none) of top-k then top-p, from the `width` largest processed
    logits of each position (the whole vocabulary when width = V)."""
    if tp is None:
        srt = jax.lax.top_k(x, width)[0]
    else:  # each shard's candidates, then the global top `width` among them
        mine = jax.lax.top_k(x, min(width, x.shape[-1]))[0]
        srt = jax.lax.top_k(jax.lax.all_gather(mine, tp, axis=x.ndim - 1, tiled=True), width)[0]
    k = jnp.where(use_k, jnp.clip(rs.top_k, 1, width), width)[:, None, None]  # [B, 1, 1]
    kth = jnp.take_along_axis(srt, jnp.broadcast_to(k - 1, srt.shape[:-1] + (1,)), axis=-1)
    j = jax.lax.broadcasted_iota(jnp.int32, srt.shape, srt.ndim - 1)
    kept = jnp.where(j < k, srt, -jnp.inf)
    probs = jax.nn.softmax(kept, axis=-1)
    keep = ((jnp.cumsum(probs, axis=-1) - probs) < rs.top_p[:, None, None]) & (j < k)
    pcut = jnp.min(jnp.where(keep, kept, jnp.inf), axis=-1, keepdims=True)
    cut = jnp.where(use_k[:, None, None], kth, -jnp.inf)
    return jnp.where(use_p[:, None, None], jnp.maximum(cut, pcut), cut)
