"""Speculative sampling's ratio test, for drafts sampled from a known proposal (a DFlash2 drafter's selector at
T > 0; a v1 drafter's argmax drafts are a one-hot proposal and use exact-match acceptance instead).

For the draft x_j at block row j + 1 with proposal q_j (K candidates with their probabilities) and the target's
distribution p_j after block row j (temperature, top-k and top-p applied): accept x_j if U_j q_j(x_j) < p_j(x_j);
at the first rejection the token is drawn from normalize(max(p_j - q_j, 0)) (it never equals x_j); after a fully
accepted block the bonus token is the target's own sample. Every draw is keyed by (seed, row, position): U by
fold_in(key, 2), the residual draw by fold_in(key, 3) (the selector's proposal uses fold_in(key, 1),
dflash_jax.drafter2), the target's own sample by the key itself.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..sampling import RowSampling, SamplingParams, processed_logits, row_probs, sample


def ratio_post(logits, block, post, cand, q, keys, sp: SamplingParams | RowSampling, tp=None):
    """The committed choice after each block row under the ratio test.

    logits [B, Bk, V] (with `tp`: this device's vocab shard) the target's logits after each block row; block [B, Bk]
    = [anchor, drafts]; post [B, Bk] the target's own samples (keys `keys`); cand / q [B, Bk - 1, K] each draft's
    proposal; keys [B, Bk] the position keys of the tokens after each block row. Returns post' [B, Bk]: post'[j] =
    block[j + 1] where that draft is accepted, else the residual draw; post'[Bk - 1] = post[Bk - 1]. The accepted
    prefix is then the leading run of block[j + 1] == post'[j] (decode.programs.accept_stage). `sp` a RowSampling: each
    row its own setting; a greedy row's p is one-hot at the argmax, which makes the test exact match."""
    B, Bk = block.shape
    S = Bk - 1
    if tp is not None:
        logits = jax.lax.all_gather(logits, tp, axis=logits.ndim - 1, tiled=True)
    if isinstance(sp, RowSampling):
        p = row_probs(logits[:, :S], sp)
    else:
        p = jax.nn.softmax(processed_logits(logits[:, :S], sp), axis=-1)  # [B, S, V]
    bi = jnp.arange(B)[:, None, None]
    si = jnp.arange(S)[None, :, None]
    qv = jnp.zeros_like(p).at[bi, si, cand].add(q.astype(p.dtype))  # the proposal over the vocabulary
    d = block[:, 1:]
    p_x = jnp.take_along_axis(p, d[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(qv, d[..., None], axis=-1)[..., 0]
    k = keys[:, :S]
    u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 2), (), jnp.float32)))(k)
    ok = u * q_x < p_x
    resid = jnp.log(jnp.maximum(p - qv, 0.0))
    fold3 = jax.vmap(jax.vmap(lambda key: jax.random.fold_in(key, 3)))(k)
    r = sample(resid, SamplingParams(temperature=1.0), fold3)  # [B, S]
    return post.at[:, :S].set(jnp.where(ok, d, r))
