"""DFlash block drafter: pure functions over an explicit param pytree, z-lab checkpoint compatible.

Per drafter layer (KV injection): with x_n = input_layernorm(x) for the B block rows and C the
projected target context (fc -> hidden_norm over the concatenated taps),
  Q = q_norm(q_proj(x_n)),  K = k_norm([k_proj(C) ; k_proj(x_n)]),  V = [v_proj(C) ; v_proj(x_n)],
RoPE at absolute positions, attention non-causal over [context ; block] (sliding-window layers are
causal within their window, as in the reference). Context rows of position >= the block's anchor
are never visible, so the same code serves inference (one block after the cached context) and
training (many blocks per sequence, each seeing the context strictly before its anchor).

DFlash2 drafters (config kind "dflash2") add a grouped dynamic causal conv around both sublayers of every layer,
over the block rows only (`dynamic_conv`); their candidate selector is dflash_jax.drafter2.

The drafter's context cache holds, per layer, the projected and roped K/V of context rows; slot s =
position s. Block K/V never enter it.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .attention import attention, write_rows
from .cache import KVCache
from .config import DrafterConfig
from .layers import (apply_rope, first_layer, heads_axis, is_unrolled, kv_heads, mat, psum, random_init, rms_norm,
                     rope_attention_factor, rope_cos_sin, rope_inv_freq, scan_layers, swiglu, with_layout)
from .model import (Target, embed, fused_mlp, fused_qkv, lm_head, lm_head_argmax, mlp_kernel_applies,
                    qkv_kernel_applies, tp_alone)


@flax.struct.dataclass
class Drafter:
    params: dict
    config: DrafterConfig = flax.struct.field(pytree_node=False)

    @property
    def dtype(self):
        return jnp.dtype(self.config.dtype)


def init_context_cache(drafter: Drafter, batch: int, size: int) -> KVCache:
    c = drafter.config
    kv = kv_heads(first_layer(drafter.params["layers"]), c.head_dim)  # device-local under shard_map
    return KVCache.create(c.num_layers, batch, size, kv, c.head_dim, drafter.dtype)


# ----------------------------------------------------------------------------------------------
# Params, HF names, init / load / save
# ----------------------------------------------------------------------------------------------


def param_shapes(c: DrafterConfig) -> dict:
    L, H, I, D = c.num_layers, c.hidden_size, c.intermediate_size, c.head_dim
    NH, KV = c.num_heads, c.num_kv_heads
    out = {
        "fc": (c.num_taps * H, H), "hidden_norm": (H,), "norm": (H,),
        "layers": {
            "input_norm": (L, H), "q": (L, NH * D, H), "k": (L, KV * D, H), "v": (L, KV * D, H),
            "o": (L, NH * D, H), "q_norm": (L, D), "k_norm": (L, D), "post_norm": (L, H),
            "gate": (L, H, I), "up": (L, H, I), "down": (L, I, H),
        },
    }
    if c.attention_bias:
        out["layers"].update(q_bias=(L, NH * D), k_bias=(L, KV * D), v_bias=(L, KV * D), o_bias=(L, H))
    if c.is_dflash2:
        K, G, R = c.conv_kernel_size, c.conv_groups, c.selector_rank
        for sub in CONV_SUBLAYERS:  # base kernel [side, tap, channel]; kernel projection [in, out]
            out["layers"].update({f"{sub}_conv_base": (L, 2, K, H), f"{sub}_conv_proj": (L, H, 2 * K * G)})
        out.update(sel_hidden=(H, R), sel_pred=(c.vocab_size, R), sel_succ=(c.vocab_size, R))
    return out


CONV_SUBLAYERS = ("attn", "mlp")  # DFlash2: the conv around the attention and around the MLP sublayer


def drafter_config_for(target: Target, num_layers=5, block_size=16, mask_token_id=None,
                       target_layer_ids=None, dtype=None, layer_types=(), sliding_window=None,
                       attention_bias: bool = False, **extra) -> DrafterConfig:
    """A drafter config with the target's dims; `extra`: other DrafterConfig fields (kind="dflash2" and the DFlash2
    conv / selector sizes, output_multiplier, ...)."""
    from .config import default_target_layer_ids
    t = target.config
    if mask_token_id is None:
        raise ValueError("mask_token_id is required (Qwen3: 151669; use a reserved/unused token id of the target)")
    if not 0 <= mask_token_id < t.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} outside the target vocabulary [0, {t.vocab_size})")
    ids = tuple(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(t.num_layers, num_layers)
    return DrafterConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_layers=num_layers,
        num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, vocab_size=t.vocab_size,
        num_target_layers=t.num_layers, target_layer_ids=ids, mask_token_id=int(mask_token_id),
        block_size=block_size, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
        rope_scaling=t.rope_scaling, layer_types=tuple(layer_types), sliding_window=sliding_window,
        max_position_embeddings=t.max_position_embeddings, dtype=dtype or t.dtype,
        attention_bias=bool(attention_bias), **extra)


def init_drafter(target: Target, num_layers: int = 5, block_size: int = 16, mask_token_id: int | None = None,
                 seed: int = 0, target_layer_ids=None, dtype=None, std: float = 0.02,
                 layout: str = "stacked", rng: str = "numpy", **kw) -> Drafter:
    """A freshly initialised drafter for `target` (dims copied from it), ready for training.
    `dflash_jax.weights.shard_drafter(drafter, mesh)` places it in its tensor-parallel layout."""
    cfg = drafter_config_for(target, num_layers, block_size, mask_token_id, target_layer_ids, dtype, **kw)
    check_compatible(cfg, target)
    draw = random_init(seed, std, cfg.dtype, rng)

    def make(name, shape):
        if name.endswith("_conv_base"):  # DFlash2 convs start as the identity (tap 0 = 1, the others 0) ...
            return jnp.zeros(shape, cfg.dtype).at[..., 0, :].set(1)
        return draw(name, shape, name.endswith("_bias") or name.endswith("_conv_proj"))  # ... and static

    shapes = param_shapes(cfg)
    params = {k: make(k, s) for k, s in shapes.items() if k != "layers"}
    params["layers"] = with_layout({k: make(k, s) for k, s in shapes["layers"].items()}, layout)
    return Drafter(params=params, config=cfg)


def check_compatible(c: DrafterConfig, target: Target) -> None:
    t = target.config
    problems = []
    if c.hidden_size != t.hidden_size:
        problems.append(f"hidden_size {c.hidden_size} != target's {t.hidden_size}")
    if c.vocab_size != t.vocab_size:
        problems.append(f"vocab_size {c.vocab_size} != target's {t.vocab_size}")
    if c.num_target_layers != t.num_layers:
        problems.append(f"num_target_layers {c.num_target_layers} != target's {t.num_layers} layers")
    bad = [i for i in c.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} out of range for a {t.num_layers}-layer target")
    if not 0 <= c.mask_token_id < t.vocab_size:
        problems.append(f"mask_token_id {c.mask_token_id} outside the vocabulary")
    if problems:
        raise ValueError("drafter does not match the target: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------
# Forward pieces
# ----------------------------------------------------------------------------------------------
def project_context(drafter: Drafter, feats):
    """Concatenated target taps [B, T, n*H] -> C = hidden_norm(fc(feats)) [B, T, H]."""
    c = drafter.config
    p = drafter.params
    return rms_norm(mat(feats.astype(drafter.dtype), p, "fc"), p["hidden_norm"], c.rms_norm_eps)


def _inv_freq(c: DrafterConfig):
    return rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)


def _bias(y, lp, name):
    """y + the projection's bias, where the drafter has one (attention_bias)."""
    return y + lp[name] if name in lp else y


def _ctx_kv(c: DrafterConfig, lp, C, pos):
    """Context rows of one layer: K = rope(k_norm(k_proj(C))), V = v_proj(C). C [B, T, H], pos [B, T]."""
    B, T, _ = C.shape
    k = rms_norm(_bias(mat(C, lp, "k"), lp, "k_bias").reshape(B, T, -1, c.head_dim), lp["k_norm"], c.rms_norm_eps)
    v = _bias(mat(C, lp, "v"), lp, "v_bias").reshape(B, T, -1, c.head_dim)
    cos, sin = rope_cos_sin(pos, _inv_freq(c), rope_attention_factor(c.rope_scaling))
    return apply_rope(k, cos, sin), v


def append_context(drafter: Drafter, feats, cache: KVCache, count=None, uniform: bool = False) -> KVCache:
    """Project new context rows (taps of verified positions) into the drafter's cache.

    feats [B, T, n*H] for positions cache.lengths .. +T-1; only the first `count[b]` rows are kept
    (the rest land past the fill index and are overwritten later). Returns the cache with
    lengths + count. uniform: all rows share one fill (prefill): one write for all rows."""
    c = drafter.config
    B, T, _ = feats.shape
    pos = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    C = project_context(drafter, feats)

    def body(carry, xs):
        k_all, v_all = carry
        lp, i = xs
        k, v = _ctx_kv(c, lp, C, pos)
        k_all = write_rows(k_all, i, cache.lengths, k, uniform)  # in place, one dynamic_update_slice per row
        v_all = write_rows(v_all, i, cache.lengths, v, uniform)
        return (k_all, v_all), None

    layers = drafter.params["layers"]
    if not is_unrolled(layers):  # a static loop: the cache is no loop carry whose layout the compiler may change
        layers = tuple(jax.tree.map(lambda x, i=i: x[i], layers) for i in range(c.num_layers))
    k_all, v_all = scan_layers(body, (cache.k, cache.v), layers, np.arange(c.num_layers))
    count = jnp.full((B,), T, jnp.int32) if count is None else count.astype(jnp.int32)
    return KVCache(k_all, v_all, cache.lengths + count)


def dynamic_conv(lp, sub: str, xn, y, side: int, group_size: int):
    """DFlash2's grouped dynamic causal conv over the block rows (axis -2) of y [..., Q, H]:
      out_i[c] = sum_{t < K} (base[side, t, c] + D_i[side, t, c // group_size]) * y_{i-t}[c]   (y_{j<0} = 0),
    D_i = kernel_projection(xn_i) reshaped [2, K, G] (row-major: side, tap, group), xn = the sublayer's normed input
    (input_layernorm(x) around attention, post_attention_layernorm(h) around the MLP); side 0 filters the
    sublayer's input, side 1 its output. Params `{sub}_conv_base` [2, K, H], `{sub}_conv_proj` [H, 2 K G]."""
    base = lp[f"{sub}_conv_base"][side]  # [K, H]
    K, H = base.shape
    G = lp[f"{sub}_conv_proj"].shape[-1] // (2 * K)
    dyn = mat(xn, lp, f"{sub}_conv_proj").reshape(xn.shape[:-1] + (2, K, G))[..., side, :, :]  # [..., Q, K, G]
    w = base.astype(y.dtype) + jnp.repeat(dyn, H // G, axis=-1).astype(y.dtype)  # [..., Q, K, H]
    Q = y.shape[-2]
    out = w[..., 0, :] * y
    for t in range(1, min(K, Q)):
        pad = [(0, 0)] * (y.ndim - 2) + [(t, 0), (0, 0)]
        out = out + w[..., t, :] * jnp.pad(y[..., :Q - t, :], pad)
    return out


def _block_layer(c: DrafterConfig, lp, window, x, q_pos, anchor_pos, kc, vc, ctx_valid=None, tp=None, layer=None,
                 impl=None, kernels: bool = False, stack=None):
    """One drafter layer for A blocks of Q rows each.

    x [B, A, Q, H] block hidden; q_pos [B, A, Q] positions; anchor_pos [B, A];
    kc/vc [B, KV, S, D] context K/V with slot s = position s (or [L, B, KV, S, D] with `layer`);
    ctx_valid [B, A] optional extra mask.
    window: 0 = full non-causal attention; > 0 = causal sliding window.
    tp: tensor-parallel axis under shard_map (local heads / MLP width, psum after o and down).
    kernels: on TPU, the projections and the MLP by the Pallas kernels (model.fused_qkv / fused_mlp; decoding only:
    they have no derivative, and training differentiates this layer); stack: the stacked layers' params (inside
    their scan), which the kernels read in place at `layer`.
    """
    B, A, Q, H = x.shape
    D = c.head_dim
    NH, KV = lp["q"].shape[heads_axis("q")] // D, kv_heads(lp, D)
    conv = c.is_dflash2
    cos, sin = rope_cos_sin(q_pos.reshape(B, A * Q), _inv_freq(c), rope_attention_factor(c.rope_scaling))
    N = B * A * Q
    if kernels and not conv and qkv_kernel_applies(lp, N, D):  # TPU: norms, projections, rotary in proj_kernel
        q, kb, vb = fused_qkv(x.reshape(N, H), lp, cos.reshape(N, -1), sin.reshape(N, -1), c.rms_norm_eps, D, stack,
                              layer)
        q, kb, vb = q.reshape(B, A, Q, NH, D), kb.reshape(B, A, Q, KV, D), vb.reshape(B, A, Q, KV, D)
        xn = None
    else:
        xn = rms_norm(x, lp["input_norm"], c.rms_norm_eps)
        flat = (dynamic_conv(lp, "attn", xn, xn, 0, c.conv_group_size) if conv else xn).reshape(B, A * Q, H)
        q = rms_norm(_bias(mat(flat, lp, "q"), lp, "q_bias").reshape(B, A * Q, NH, D), lp["q_norm"], c.rms_norm_eps)
        kb = rms_norm(_bias(mat(flat, lp, "k"), lp, "k_bias").reshape(B, A * Q, KV, D), lp["k_norm"], c.rms_norm_eps)
        vb = _bias(mat(flat, lp, "v"), lp, "v_bias").reshape(B, A, Q, KV, D)
        q = apply_rope(q, cos, sin).reshape(B, A, Q, NH, D)
        kb = apply_rope(kb, cos, sin).reshape(B, A, Q, KV, D)
    # context: positions strictly before the block's anchor (and inside the window);
    # block: all rows (full layers) or causal within the window (sliding layers)
    ctx_len = anchor_pos if ctx_valid is None else jnp.where(ctx_valid, anchor_pos, 0)
    dq = q_pos[..., :, None] - q_pos[..., None, :]  # [B, A, Q, Q]
    m_blk = jnp.where(window > 0, (dq >= 0) & (dq < window), jnp.ones_like(dq, bool))
    o = attention(q, kb.astype(kc.dtype), vb.astype(vc.dtype), m_blk, kc, vc, ctx_len, q_pos=q_pos, window=window,
                  layer=layer, impl=impl)
    if kernels and not conv and mlp_kernel_applies(lp, N, tail=True) and tp_alone(tp):  # TPU: o projection and MLP
        return fused_mlp(x, lp, c.rms_norm_eps, None, stack, layer, attn=o.astype(x.dtype))
    o = _bias(psum(mat(o.astype(x.dtype), lp, "o"), tp), lp, "o_bias").reshape(x.shape)
    x = x + (dynamic_conv(lp, "attn", xn, o, 1, c.conv_group_size) if conv else o)
    if kernels and not conv and mlp_kernel_applies(lp, N):  # TPU: norm, SwiGLU and residual in VMEM (mlp_kernel)
        return fused_mlp(x, lp, c.rms_norm_eps, tp, stack, layer)
    hn = rms_norm(x, lp["post_norm"], c.rms_norm_eps)
    if not conv:
        return x + psum(swiglu(hn, lp), tp)
    m = psum(swiglu(dynamic_conv(lp, "mlp", hn, hn, 0, c.conv_group_size), lp), tp)
    return x + dynamic_conv(lp, "mlp", hn, m, 1, c.conv_group_size)


def _block_embed(drafter: Drafter, target: Target, anchors, block_size: int, tp=None):
    c = drafter.config
    toks = jnp.concatenate(
        [anchors[..., None], jnp.full(anchors.shape + (block_size - 1,), c.mask_token_id, anchors.dtype)], axis=-1)
    # the target's scaled embedding (Gemma 4: sqrt(H)); a drafter's own input_embedding_scale replaces that scale
    own = c.input_embedding_scale != 1.0
    x = embed(target, toks, tp, scale=1.0 if own else None).astype(drafter.dtype)
    if own:
        x = x * jnp.asarray(c.input_embedding_scale, x.dtype)
    return x


def draft_hidden_cached(drafter: Drafter, target: Target, anchors, cache: KVCache, block_size: int, tp=None):
    """Inference drafter pass: one block per row after the cached context.

    anchors [B] (token at position cache.lengths) -> final-normed hidden [B, block_size, H]."""
    c = drafter.config
    anchor_pos = cache.lengths[:, None]  # [B, 1]
    q_pos = anchor_pos[..., None] + jnp.arange(block_size, dtype=jnp.int32)  # [B, 1, Q]
    x = _block_embed(drafter, target, anchors[:, None], block_size, tp)  # [B, 1, Q, H]

    def body(x, xs):
        lp, window, i = xs
        with jax.named_scope("drafter_layer"):
            return _block_layer(c, lp, window, x, q_pos, anchor_pos, cache.k, cache.v, tp=tp, layer=i,
                                kernels=True, stack=stack), None

    stack = None if is_unrolled(drafter.params["layers"]) else drafter.params["layers"]

    x = scan_layers(body, x, drafter.params["layers"], np.asarray(c.layer_windows, np.int32),
                    np.arange(c.num_layers))
    return rms_norm(x[:, 0], drafter.params["norm"], c.rms_norm_eps)


REMAT_POLICIES = ("none", "layer", "chunk", "layer_dots")


def _remat_policy(name: str):
    if name == "layer_dots":  # keep matmul outputs without batch dims (projections, MLP), recompute attention
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return None  # save nothing: recompute the whole body


def draft_hidden_train(drafter: Drafter, target: Target, feats, anchor_tokens, anchor_pos, block_size: int,
                       anchor_valid=None, tp=None, anchor_chunk: int | None = None, remat: str = "none",
                       attn_impl="reference"):
    """Training drafter pass: many blocks per sequence, each seeing context strictly before its anchor.

    feats [B, T, n*H] target taps at positions 0..T-1; anchor_tokens/anchor_pos [B, A]
    -> final-normed hidden [B, A, block_size, H].

    Memory (for long sequences and many anchors): `anchor_chunk` runs each layer's blocks in chunks
    of that many anchors (blocks are independent within a layer: each sees the context and itself),
    so the [chunk, heads, block, T] attention scores replace [A, heads, block, T]; the context K/V
    are computed once per layer and shared by the chunks. `remat`: 'none'; 'layer' = jax.checkpoint
    per drafter layer (only layer inputs are kept for the backward pass); 'chunk' = per layer and per
    anchor chunk (the backward pass recomputes one chunk at a time); 'layer_dots' = per layer, keeping
    projection/MLP matmul outputs."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {remat!r}")
    c = drafter.config
    B, T, _ = feats.shape
    A = anchor_pos.shape[1]
    C = project_context(drafter, feats)
    ctx_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid = anchor_valid if anchor_valid is not None else jnp.ones((B, A), bool)
    ch = A if not anchor_chunk or anchor_chunk >= A else int(anchor_chunk)
    n = -(-A // ch)
    pad = n * ch - A
    if pad:  # padding anchors: invisible context, dropped below
        anchor_tokens = jnp.pad(anchor_tokens, ((0, 0), (0, pad)))
        anchor_pos = jnp.pad(anchor_pos, ((0, 0), (0, pad)))
        valid = jnp.pad(valid, ((0, 0), (0, pad)))
    q_pos = anchor_pos[..., None] + jnp.arange(block_size, dtype=jnp.int32)
    x = _block_embed(drafter, target, anchor_tokens, block_size, tp)

    def chunks(a):  # [B, n*ch, ...] -> [n, B, ch, ...]
        return jnp.moveaxis(a.reshape((B, n, ch) + a.shape[2:]), 1, 0)

    def unchunk(a):
        return jnp.moveaxis(a, 0, 1).reshape((B, n * ch) + a.shape[3:])

    def one_chunk(lp, window, kc, vc, xc, qp, ap, av):
        return _block_layer(c, lp, window, xc, qp, ap, kc, vc, av, tp, impl=attn_impl)

    if remat == "chunk":
        one_chunk = jax.checkpoint(one_chunk)

    def layer(x, lp, window):
        kc, vc = _ctx_kv(c, lp, C, ctx_pos)  # [B, T, KV, D]: once per layer
        kc, vc = kc.swapaxes(1, 2), vc.swapaxes(1, 2)
        if n == 1:
            return one_chunk(lp, window, kc, vc, x, q_pos, anchor_pos, valid)
        out = jax.lax.map(lambda a: one_chunk(lp, window, kc, vc, *a),
                          (chunks(x), chunks(q_pos), chunks(anchor_pos), chunks(valid)))
        return unchunk(out)

    if remat != "none":
        layer = jax.checkpoint(layer, policy=_remat_policy(remat))

    def body(x, xs):
        lp, window = xs
        return layer(x, lp, window), None

    x = scan_layers(body, x, drafter.params["layers"], np.asarray(c.layer_windows, np.int32))
    if pad:
        x = x[:, :A]
    return rms_norm(x, drafter.params["norm"], c.rms_norm_eps)


def draft_argmax_from_hidden(drafter: Drafter, target: Target, h, tp=None):
    """The argmax of draft_logits_from_hidden (the greedy drafts) without materialising the logits on TPU
    (model.lm_head_argmax)."""
    c = drafter.config
    cap = c.final_logit_softcapping or target.config.logit_softcap
    return lm_head_argmax(target, h.astype(target.dtype), softcap=cap or 0.0, mult=c.output_multiplier, tp=tp)


def draft_logits_from_hidden(drafter: Drafter, target: Target, h):
    """Final-normed drafter hidden [..., H] -> float32 logits through the target's lm_head, times output_multiplier,
    soft-capped by the drafter's final_logit_softcapping or else the target's own cap (Gemma 4)."""
    c = drafter.config
    logits = lm_head(target, h.astype(target.dtype), softcap=0.0)
    if c.output_multiplier != 1.0:
        logits = logits * c.output_multiplier
    cap = c.final_logit_softcapping or target.config.logit_softcap
    if cap:
        logits = jnp.tanh(logits / cap) * cap
    return logits
