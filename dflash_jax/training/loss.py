"""Training objectives: the DFlash drafter loss and a plain next-token LM loss.

An objective has
  loss(params, frozen, batch, rng) -> (scalar loss, aux)   # jittable; aux: dict of *sums*
  summarize(aux sums as numpy) -> {name: float}             # host side, after summing over micro-batches
so the trainer can accumulate aux over micro-batches, steps and evaluation batches by addition and
turn sums into ratios once.

Drafter loss (DFlash section 4): cross entropy of block position k (1..B-1) against the
target-generated token at anchor+k, weighted exp(-(k-1)/gamma), normalised by the weight sum over
valid positions. The target runs online in the same step (its tapped features are stop_gradient'ed),
the drafter sees context strictly before each anchor. Logits are computed in chunks of anchors under
`jax.checkpoint`, so the [anchors, B-1, vocab] float32 logits never exist at once.

DFlash2 drafters add alpha (`selector_weight`) times the selector's K-way cross entropy over the unary top K
(dflash_jax.drafter2.selector_loss_terms: predecessors teacher-forced, label = the training token, i.e. the target's
choice in its regenerated responses), averaged over the valid slots whose label is a candidate; their accuracy and
tau count the selector's choice instead of the plain argmax.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..config import DrafterConfig
from ..drafter import Drafter, draft_hidden_train, draft_logits_from_hidden
from ..drafter2 import selector_loss_terms
from ..model import Target, forward, lm_head

F32 = jnp.float32


def cast_tree(tree, dtype):
    dt = jnp.dtype(dtype)
    return jax.tree_util.tree_map(lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1 .. B-1."""
    k = np.arange(1, block_size, dtype=np.float64)
    return np.exp(-(k - 1) / gamma).astype(np.float32)


def block_labels(tokens, lengths, anchor_pos, block_size: int):
    """labels [R, A, B-1] = tokens at anchor+1 .. anchor+B-1; valid where that position < length."""
    R, T = tokens.shape
    k = jnp.arange(1, block_size, dtype=jnp.int32)
    pos = anchor_pos[..., None] + k  # [R, A, B-1]
    valid = pos < lengths[:, None, None]
    idx = jnp.clip(pos, 0, T - 1).reshape(R, -1)
    labels = jnp.take_along_axis(tokens, idx, axis=1).reshape(pos.shape)
    return labels, valid


def truncate_target(target: Target, num_layers: int) -> Target:
    """The target's first `num_layers` decoder layers (its embedding, norm and lm_head unchanged)."""
    c = target.config
    if num_layers >= c.num_layers:
        return target
    layers = target.params["layers"]
    layers = layers[:num_layers] if isinstance(layers, (list, tuple)) else {k: v[:num_layers] for k, v in layers.items()}
    cfg = dataclasses.replace(c, num_layers=num_layers,
                              **({"layer_types": c.layer_types[:num_layers]} if getattr(c, "layer_types", ()) else {}))
    return Target(params=dict(target.params, layers=layers), config=cfg)


def target_features(target: Target, tokens, taps):
    """Tapped target features [R, T, n*H] over whole (right-padded) sequences, no gradient.

    The target runs only up to its last tapped layer (later layers do not affect the features), without
    a cache (dense causal attention)."""
    target = truncate_target(target, max(taps) + 1)
    _, _, feats = forward(target, tokens, None, tuple(taps))
    return jax.lax.stop_gradient(feats)


def drafter_hidden(drafter: Drafter, target: Target, batch: dict, anchor_chunk: int | None = None,
                   remat: str = "none"):
    """Final-normed drafter hidden [R, A, B, H] for every block of the batch."""
    c = drafter.config
    tokens, anchor_pos = batch["tokens"], batch["anchor_pos"]
    feats = target_features(target, tokens, c.target_layer_ids)
    anchor_tokens = jnp.take_along_axis(tokens, anchor_pos, axis=1)
    return draft_hidden_train(drafter, target, feats, anchor_tokens, anchor_pos, c.block_size,
                              batch.get("anchor_valid"), anchor_chunk=anchor_chunk, remat=remat)


def block_logits(drafter: Drafter, target: Target, batch: dict):
    """float32 logits [R, A, B-1, V] of block positions 1..B-1 (unchunked; for tests and analysis)."""
    h = drafter_hidden(drafter, target, batch)
    return draft_logits_from_hidden(drafter, target, h[:, :, 1:])


def _chunked_ce(drafter, target, hq, labels, chunk: int, prev=None):
    """hq [R, A, K, H], labels [R, A, K] -> (ce [R, A, K] f32, correct [R, A, K] bool, selector terms), chunked
    over A. `prev` [R, A, K] (a DFlash2 drafter: the token before each slot): selector terms = (its cross entropy,
    label in its top K) [R, A, K] and `correct` is the selector's choice; else None."""
    R, A, K, H = hq.shape
    c = min(chunk, A)
    n = -(-A // c)
    pad = n * c - A
    two = prev is not None
    prev = labels if prev is None else prev
    if pad:
        hq = jnp.pad(hq, ((0, 0), (0, pad), (0, 0), (0, 0)))
        labels, prev = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (labels, prev))
    hq = jnp.moveaxis(hq.reshape(R, n, c, K, H), 1, 0)
    labels, prev = (jnp.moveaxis(a.reshape(R, n, c, K), 1, 0) for a in (labels, prev))

    @jax.checkpoint
    def one(h, lab, prv):
        logits = draft_logits_from_hidden(drafter, target, h)  # [R, c, K, V] f32
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, lab[..., None], axis=-1)[..., 0]
        if two:
            sel_ce, inside, correct = selector_loss_terms(drafter, logits, h, prv, lab)
            return lse - tgt, correct, sel_ce, inside
        return lse - tgt, jnp.argmax(logits, axis=-1) == lab

    def body(_, xs):
        return None, one(*xs)

    _, outs = jax.lax.scan(body, None, (hq, labels, prev))
    outs = [jnp.moveaxis(a, 0, 1).reshape(R, n * c, K)[:, :A] for a in outs]
    return outs[0], outs[1], (tuple(outs[2:]) if two else None)


def block_metrics_sums(ce, correct, valid, anchor_valid, weights):
    """Sums for the weighted loss, per-position accuracy and acceptance length (see summarize)."""
    v = valid & anchor_valid[..., None]
    vf = v.astype(F32)
    w = weights[None, None, :] * vf
    ok = (correct & v).astype(jnp.int32)
    lead = jnp.sum(jnp.cumprod(ok, axis=-1), axis=-1)  # leading correct positions per block
    return {
        "wce_sum": jnp.sum(w * ce),
        "w_sum": jnp.sum(w),
        "ce_sum": jnp.sum(vf * ce),
        "correct_k": jnp.sum(ok, axis=(0, 1)).astype(F32),  # [K]
        "valid_k": jnp.sum(vf, axis=(0, 1)),  # [K]
        "lead_sum": jnp.sum(jnp.where(anchor_valid, lead, 0)).astype(F32),
        "blocks": jnp.sum(anchor_valid.astype(F32)),
    }


def summarize_block_sums(s: dict) -> dict:
    """Sums (numpy) -> loss, ce (unweighted), acc (all positions), acc_k per position, tau."""
    out = {}
    w = float(s["w_sum"])
    out["loss"] = float(s["wce_sum"]) / w if w > 0 else float("nan")
    vk = np.asarray(s["valid_k"], np.float64)
    ck = np.asarray(s["correct_k"], np.float64)
    nv = vk.sum()
    out["ce"] = float(s["ce_sum"]) / nv if nv > 0 else float("nan")
    out["acc"] = float(ck.sum() / nv) if nv > 0 else float("nan")
    for k in range(len(vk)):
        out[f"acc_{k + 1}"] = float(ck[k] / vk[k]) if vk[k] > 0 else float("nan")
    b = float(s["blocks"])
    out["tau"] = 1.0 + float(s["lead_sum"]) / b if b > 0 else float("nan")
    out["blocks"] = b
    return out


@dataclasses.dataclass(frozen=True)
class DrafterObjective:
    """DFlash drafter training: params = drafter params (master dtype), frozen = the Target."""
    config: DrafterConfig  # dtype = compute dtype
    gamma: float
    loss_chunk: int = 64
    anchor_chunk: int | None = None  # anchors per attention chunk inside each drafter layer (None = all)
    remat: str = "none"  # drafter.REMAT_POLICIES
    selector_weight: float = 1.0  # DFlash2: alpha, the weight of the selector's cross entropy

    def loss(self, params, target: Target, batch: dict, rng=None):
        c = self.config
        drafter = Drafter(params=cast_tree(params, c.dtype), config=c)
        h = drafter_hidden(drafter, target, batch, self.anchor_chunk, self.remat)
        labels, valid = block_labels(batch["tokens"], batch["lengths"], batch["anchor_pos"], c.block_size)
        prev = None
        if c.is_dflash2:  # the token before each slot: the anchor, then the labels
            anchors = jnp.take_along_axis(batch["tokens"], batch["anchor_pos"], axis=1)
            prev = jnp.concatenate([anchors[..., None], labels[..., :-1]], axis=-1)
        ce, correct, sel = _chunked_ce(drafter, target, h[:, :, 1:], labels, self.loss_chunk, prev)
        sums = block_metrics_sums(ce, correct, valid, batch["anchor_valid"],
                                  jnp.asarray(position_weights(c.block_size, self.gamma)))
        loss = sums["wce_sum"] / jnp.maximum(sums["w_sum"], 1e-9)
        if sel is not None:
            sel_ce, inside = sel
            m = (valid & batch["anchor_valid"][..., None] & inside).astype(F32)
            sums.update(sel_ce_sum=jnp.sum(m * sel_ce), sel_n=jnp.sum(m))
            loss = loss + self.selector_weight * sums["sel_ce_sum"] / jnp.maximum(sums["sel_n"], 1.0)
        return loss, sums

    @staticmethod
    def summarize(s: dict) -> dict:
        out = summarize_block_sums(s)
        if "sel_n" in s:  # DFlash2: the selector's cross entropy and how often the label is a candidate
            n = float(s["sel_n"])
            out["sel_ce"] = float(s["sel_ce_sum"]) / n if n else float("nan")
            out["sel_in_top_k"] = n / max(float(np.sum(s["valid_k"])), 1.0)
        return out


@dataclasses.dataclass(frozen=True)
class LMObjective:
    """Next-token prediction for a Target trained from scratch (or fine-tuned).

    params = the target's params (master dtype); frozen unused. batch: tokens [R, T] int32 and
    loss_mask [R, T] (1 where token t+1 is a training label for position t; the last column is ignored)."""
    config: object  # TargetConfig with dtype = compute dtype

    def loss(self, params, frozen, batch, rng=None):
        target = Target(params=cast_tree(params, self.config.dtype), config=self.config)
        tokens = batch["tokens"]
        h, _, _ = forward(target, tokens, None)  # no cache: dense causal, differentiable
        logits = lm_head(target, h[:, :-1])
        labels = tokens[:, 1:]
        mask = batch["loss_mask"][:, :-1].astype(F32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        ce = lse - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        correct = (jnp.argmax(logits, axis=-1) == labels).astype(F32)
        sums = {"ce_sum": jnp.sum(ce * mask), "tokens": jnp.sum(mask), "correct": jnp.sum(correct * mask)}
        return sums["ce_sum"] / jnp.maximum(sums["tokens"], 1.0), sums

    @staticmethod
    def summarize(s: dict) -> dict:
        n = float(s["tokens"])
        loss = float(s["ce_sum"]) / n if n else float("nan")
        return {"loss": loss, "ppl": float(np.exp(min(loss, 50.0))), "acc": float(s["correct"]) / n if n else
                float("nan"), "tokens": n}
