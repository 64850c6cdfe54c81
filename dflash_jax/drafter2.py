"""DFlash2 drafters: the candidate selector over a block's draft slots, and the DFlash2 tensor names.

The layer stack (the v1 stack with a dynamic causal conv around each sublayer) is dflash_jax.drafter; a DFlash2
drafter is a `Drafter` whose config has kind "dflash2". Its selector, for draft slot i (block row i = 1 .. Q-1,
final-normed hidden h_i):
  u_i = the draft logits (target lm_head, times output_multiplier, soft-capped: drafter.draft_logits_from_hidden),
  candidates = top-K(u_i) (K = selector_top_k; descending, ties -> lower id),
  s_i(p -> c) = u_i(c) + sum_r A[p, r] (W_h h_i)[r] B[c, r]   for each candidate c,
A = predecessor codebook [V, R], B = successor codebook [V, R], W_h = hidden projection [H -> R]; p = the anchor
for slot 1, then the token chosen at the slot before. T = 0: the argmax walk (ties -> the better-ranked
candidate); T > 0: candidate k ~ q_i = softmax(s_i / T) over the K candidates (Gumbel-max with given noise); a draft
tree holds the N most likely paths (`selector_tree`). Training: `selector_loss_terms`.
Params: `sel_hidden` [H, R], `sel_pred` [V, R], `sel_succ` [V, R]; per layer `{attn,mlp}_conv_base` [2, K, H],
`{attn,mlp}_conv_proj` [H, 2 K G].
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .drafter import Drafter, draft_logits_from_hidden, param_shapes
from .layers import is_unrolled, mat, random_init, stack_layers, unstack_layers
from .model import Target
from .tree import NEG, DraftTree, assemble_tree

# our param -> (checkpoint tensor name, stored transposed [out, in]); "{i}": the layer
HF_LAYER_NAMES = {
    "attn_conv_base": ("layers.{i}.attention_conv.base_kernel", False),
    "attn_conv_proj": ("layers.{i}.attention_conv.kernel_projection.weight", True),
    "mlp_conv_base": ("layers.{i}.mlp_conv.base_kernel", False),
    "mlp_conv_proj": ("layers.{i}.mlp_conv.kernel_projection.weight", True),
}
HF_TOP_NAMES = {
    "sel_hidden": ("candidate_selector.hidden_projection.weight", True),
    "sel_pred": ("candidate_selector.predecessor_codebook", False),
    "sel_succ": ("candidate_selector.successor_codebook", False),
}


def is_dflash2(drafter) -> bool:
    return drafter is not None and drafter.config.is_dflash2


def dflash2_from(drafter: Drafter, seed: int = 0, std: float = 0.02, **sizes) -> Drafter:
    """A DFlash2 drafter whose stack computes what `drafter` (a DFlash drafter) computes: its params, identity convs
    (tap 0 = 1, zero kernel projections) and a selector drawn normal(0, std). `sizes`: conv_kernel_size,
    conv_group_size, selector_rank, selector_top_k (defaults: DrafterConfig's)."""
    if drafter.config.is_dflash2:
        raise ValueError("dflash2_from takes a DFlash (v1) drafter; this one is already DFlash2")
    cfg = dataclasses.replace(drafter.config, kind="dflash2", **sizes)
    shapes = param_shapes(cfg)
    draw = random_init(seed, std, cfg.dtype)
    params = {k: v for k, v in drafter.params.items() if k != "layers"}
    params.update({k: draw(k, shapes[k], False) for k in HF_TOP_NAMES})
    new = {k: (jnp.zeros(s, cfg.dtype).at[..., 0, :].set(1) if k.endswith("_base") else jnp.zeros(s, cfg.dtype))
           for k, s in shapes["layers"].items() if k in HF_LAYER_NAMES}
    layers = drafter.params["layers"]
    unrolled = is_unrolled(layers)
    stacked = dict(stack_layers(layers) if unrolled else layers, **new)
    params["layers"] = unstack_layers(stacked) if unrolled else stacked
    return Drafter(params=params, config=cfg)


def candidates(drafter: Drafter, target: Target, h, tp=None):
    """Draft slots' hidden h [..., S, H] -> (unary scores of the candidates u [..., S, K] float32 descending,
    candidate ids [..., S, K] int32, W_h h [..., S, R] float32). With `tp` the lm_head is vocab-sharded: each shard's
    top K, then the top K of those."""
    return top_candidates(drafter, draft_logits_from_hidden(drafter, target, h), h, tp)


def top_candidates(drafter: Drafter, u, h, tp=None):
    """`candidates` from the draft logits u [..., S, V(local)] already computed for h [..., S, H]."""
    K = drafter.config.selector_top_k
    vals, ids = jax.lax.top_k(u, min(K, u.shape[-1]))
    if tp is not None:
        ids = ids + jax.lax.axis_index(tp) * u.shape[-1]
        vals = jax.lax.all_gather(vals, tp, axis=u.ndim - 1, tiled=True)
        ids = jax.lax.all_gather(ids, tp, axis=u.ndim - 1, tiled=True)
        vals, pick = jax.lax.top_k(vals, K)
        ids = jnp.take_along_axis(ids, pick, axis=-1)
    wh = mat(h.astype(jnp.float32), {"w": drafter.params["sel_hidden"].astype(jnp.float32)}, "w")
    return vals.astype(jnp.float32), ids.astype(jnp.int32), wh


def pair_scores(drafter: Drafter, u, cand, wh, prev):
    """s(prev -> c) [..., S, K] for each slot's candidates: u + sum_r A[prev, r] wh[r] B[c, r]; prev [..., S] the
    token before each slot (teacher-forced in training)."""
    A = drafter.params["sel_pred"].astype(jnp.float32)[prev]  # [..., S, R]
    Bc = drafter.params["sel_succ"].astype(jnp.float32)[cand]  # [..., S, K, R]
    return u + jnp.einsum("...r,...kr->...k", A * wh, Bc)


def walk(drafter: Drafter, u, cand, wh, anchor, temperature=0.0, noise=None):
    """The selector's walk over the S slots: (drafts [B, S], q [B, S, K] float32 = each slot's proposal
    distribution over its candidates given the token chosen before (one-hot at T = 0)).
    u / cand / wh from `candidates`; anchor [B]; noise [B, S, K] Gumbel(0, 1) (T > 0); temperature a number or
    one per row [B] (rows at 0 walk the argmax)."""
    per_row = not isinstance(temperature, (int, float))
    if per_row:
        hot = jnp.asarray(temperature, jnp.float32) > 0
        t = jnp.where(hot, temperature, 1.0)[:, None]
    B, S, K = cand.shape
    A = drafter.params["sel_pred"].astype(jnp.float32)
    Bc = drafter.params["sel_succ"].astype(jnp.float32)[cand] * wh[:, :, None, :]  # [B, S, K, R]
    xs = (jnp.moveaxis(u, 1, 0), jnp.moveaxis(cand, 1, 0), jnp.moveaxis(Bc, 1, 0),
          jnp.moveaxis(noise, 1, 0) if noise is not None else jnp.zeros((S, B, K), jnp.float32))

    def step(prev, x):
        u_i, c_i, b_i, g_i = x
        s = u_i + jnp.einsum("br,bkr->bk", A[prev], b_i)  # [B, K]
        if per_row:
            k = jnp.where(hot, jnp.argmax(s / t + g_i, axis=-1), jnp.argmax(s, axis=-1))
            q = jnp.where(hot[:, None], jax.nn.softmax(s / t, axis=-1), jax.nn.one_hot(k, K, dtype=jnp.float32))
        elif temperature > 0:
            k = jnp.argmax(s / temperature + g_i, axis=-1)
            q = jax.nn.softmax(s / temperature, axis=-1)
        else:
            k = jnp.argmax(s, axis=-1)
            q = jax.nn.one_hot(k, K, dtype=jnp.float32)
        tok = jnp.take_along_axis(c_i, k[:, None], axis=1)[:, 0]
        return tok, (tok, q)

    _, (drafts, q) = jax.lax.scan(step, anchor.astype(jnp.int32), xs)
    return jnp.moveaxis(drafts, 0, 1), jnp.moveaxis(q, 0, 1)


def selector_tree(drafter: Drafter, u, cand, wh, root, n: int) -> DraftTree:
    """The draft tree of the n most likely selector paths: a path's score is the sum of log q_i(c_i | c_{i-1}),
    q_i = softmax(s_i) over slot i's candidates. A child never scores above its parent, so the n best paths are
    prefix-closed and each depth's members are among the n best extensions of the previous depth's n best: a beam of
    n per depth, then the n best of the D x n (tree.assemble_tree). u / cand / wh [B, D, ...] from `candidates`;
    root [B]; top1 = the argmax walk (the chain's drafts)."""
    if n < 1:
        raise ValueError(f"tree budget must be >= 1, got {n}")
    B, D, K = cand.shape
    A = drafter.params["sel_pred"].astype(jnp.float32)
    Bs = drafter.params["sel_succ"].astype(jnp.float32)
    walk_drafts, _ = walk(drafter, u, cand, wh, root)
    S = jnp.zeros((B, 1), jnp.float32)  # the root: one prefix
    last = root[:, None].astype(jnp.int32)
    scores, toks, pranks = [], [], []
    for d in range(D):
        s = u[:, d, None, :] + jnp.einsum("bir,bkr->bik", A[last] * wh[:, d, None, :], Bs[cand[:, d]])  # [B, i, K]
        ext = (S[..., None] + jax.nn.log_softmax(s, axis=-1)).reshape(B, -1)  # prefix i, candidate k
        w = min(n, ext.shape[1])
        S, sel = jax.lax.top_k(ext, w)
        i, k = sel // K, sel % K
        last = jnp.take_along_axis(cand[:, d], k, axis=1)
        pad = ((0, 0), (0, n - w))
        S = jnp.maximum(S, NEG)
        scores.append(jnp.pad(S, pad, constant_values=NEG))
        toks.append(jnp.pad(last, pad))
        pranks.append(jnp.pad(i.astype(jnp.int32), pad))
    return assemble_tree(scores, toks, pranks, root, walk_drafts)


def draft_keys_noise(keys, K: int):
    """Gumbel(0, 1) noise [B, S, K] for the selector's sampled walk from position keys [B, S] (of the drafted
    positions): fold_in(key, 1), so the target's own draws at those positions stay independent of it."""
    return jax.vmap(jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, 1), (K,), jnp.float32)))(keys)


def selector_drafts(drafter: Drafter, target: Target, h, anchor, tp=None, temperature=0.0, keys=None):
    """Block hidden of the draft slots h [B, S, H] -> (drafts [B, S], candidate ids [B, S, K], q [B, S, K]);
    temperature a number or one per row [B] (`walk`)."""
    u, cand, wh = candidates(drafter, target, h, tp)
    sampled = not isinstance(temperature, (int, float)) or temperature > 0
    noise = draft_keys_noise(keys, cand.shape[-1]) if sampled else None
    drafts, q = walk(drafter, u, cand, wh, anchor, temperature, noise)
    return drafts, cand, q


def selector_loss_terms(drafter: Drafter, u, h, prev, labels):
    """Training: the K-way cross entropy of the selector's scores over the unary top K, predecessors teacher-forced.
    u [..., S, V] draft logits of the slots' hidden h [..., S, H]; prev [..., S] the token before each slot; labels
    [..., S] the token to draft. Returns (cross entropy [..., S] float32, 0 where the label is not a candidate;
    in_top_k [..., S] bool; correct [..., S] bool: the selector's best candidate after prev is the label - with
    teacher-forced predecessors, the leading run of correct slots is the argmax walk's accepted run)."""
    u, cand, wh = top_candidates(drafter, u, h)
    s = pair_scores(drafter, u, cand, wh, prev)
    hit = cand == labels[..., None]
    inside = jnp.any(hit, axis=-1)
    ce = jax.nn.logsumexp(s, axis=-1) - jnp.sum(jnp.where(hit, s, 0.0), axis=-1)
    correct = jnp.take_along_axis(cand, jnp.argmax(s, axis=-1)[..., None], axis=-1)[..., 0] == labels
    return jnp.where(inside, ce, 0.0), inside, correct
