"""Target language models (Qwen3, LLaMA-3.x, Qwen2) as pure functions over explicit param pytrees.

A model is a `Target` (a flax.struct dataclass): `params` is a plain nested dict of arrays with the
decoder layers stacked on a leading [L] axis (scanned with `lax.scan`), `config` is a static,
hashable `TargetConfig`. `forward` is pure: it takes a `KVCache` and returns a new one.

KV cache: dflash_jax.cache. Checkpoint names, load / save: dflash_jax.weights (which imports this
module, not the other way round). Families with per-layer kinds keep their layers, decode state and tensor names in
their own modules (dflash_jax.hybrid, dflash_jax.gemma4); `forward`, `init_cache`, `param_shapes` and `init_target`
dispatch to them.
"""
from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from . import gemma4, hybrid, moe
from .attention import attention, compiles_for_tpu, write_kv
from .cache import KVCache
from .config import TargetConfig
from .layers import (F32, ROWS, SCALE, apply_rope, first_layer, is_unrolled, kv_heads, mat, psum, random_init, rms_norm,
                     rope_attention_factor, rope_cos_sin, rope_inv_freq, scan_layers, with_layout)


@flax.struct.dataclass
class Target:
    params: dict
    config: TargetConfig = flax.struct.field(pytree_node=False)

    @property
    def dtype(self):
        return jnp.dtype(self.config.dtype)


def init_cache(target: Target, batch: int, size: int):
    """Empty cache: a KVCache, or for a hybrid target a hybrid.HybridCache, for Gemma 4 a gemma4.Gemma4Cache. KV heads
    are read off the (possibly model-sharded) k projection, so inside shard_map this builds the device-local cache."""
    c = target.config
    if c.is_hybrid:
        return hybrid.init_cache(c, target.params, batch, size)
    if c.gemma4 is not None:
        return gemma4.init_cache(c, target.params, batch, size)
    kv = kv_heads(first_layer(target.params["layers"]), c.head_dim)
    return KVCache.create(c.num_layers, batch, size, kv, c.head_dim, target.dtype, quant=c.kv_quant)


# ----------------------------------------------------------------------------------------------
# Parameter layout and HF names
# ----------------------------------------------------------------------------------------------
# ours -> (HF name template, transpose [out,in] -> [in,out])


def param_shapes(c: TargetConfig) -> dict:
    """Shapes of our params (layers stacked on axis 0): q / k / v [out, in], other matrices [in, out]
    (layers.OUT_IN)."""
    if c.is_hybrid:
        return hybrid.param_shapes(c)
    if c.gemma4 is not None:
        return gemma4.param_shapes(c)
    L, H, I, V, D = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    NH, KV = c.num_heads, c.num_kv_heads
    layers = {
        "input_norm": (L, H), "q": (L, NH * D, H), "k": (L, KV * D, H), "v": (L, KV * D, H),
        "o": (L, NH * D, H), "post_norm": (L, H), "gate": (L, H, I), "up": (L, H, I), "down": (L, I, H),
    }
    if c.qkv_bias:
        layers.update(q_bias=(L, NH * D), k_bias=(L, KV * D), v_bias=(L, KV * D))
    if c.o_bias:
        layers["o_bias"] = (L, H)
    if c.qk_norm:
        layers.update(q_norm=(L, D), k_norm=(L, D))
    if c.attention_sinks:
        layers["sinks"] = (L, NH)
    layers = moe.update_param_shapes(c, layers)  # experts (MoE families); see dflash_jax/moe.py
    out = {"embed": (V, H), "layers": layers, "norm": (H,)}
    if not c.tie_word_embeddings:
        out["lm_head"] = (H, V)
    return out


def init_target(config: TargetConfig, seed: int = 0, std: float = 0.02, layout: str = "stacked",
                rng: str = "numpy") -> Target:
    """Random weights (normal(0, std) matrices, unit norms, zero biases), for tests and pretraining;
    rng="device" draws them on the accelerator (benchmarks at real sizes, layers.random_init)."""
    shapes = param_shapes(config)
    draw = random_init(seed, std, config.dtype, rng)
    if config.is_hybrid:
        return Target(params=hybrid.init_params(config, draw), config=config)
    if config.gemma4 is not None:
        return Target(params=gemma4.init_params(config, draw), config=config)

    def make(name, shape):
        return draw(name, shape, "bias" in name and name != "router_bias")

    params = {k: make(k, v) for k, v in shapes.items() if k != "layers"}
    params["layers"] = with_layout({k: make(k, v) for k, v in shapes["layers"].items()}, layout)
    return Target(params=params, config=config)


def relayout(model, layout: str):
    """The same Target/Drafter with its layers 'stacked' (lax.scan) or 'unrolled' (Python loop;
    fastest on CPU) - 'auto' picks by backend. A hybrid or Gemma 4 target's layers are always per layer."""
    if getattr(model.config, "is_hybrid", False) or getattr(model.config, "gemma4", None) is not None:
        return model
    return model.replace(params=dict(model.params, layers=with_layout(model.params["layers"], layout)))


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
def tp_alone(tp) -> bool:
    """Whether a layer's weights are whole on this device: no tensor-parallel axis, or one of size 1."""
    return tp is None or jax.lax.axis_size(tp) == 1


def _layer_window(c: TargetConfig, i):
    """Sliding window of layer i (0 = full attention): a static int for unrolled layers, else traced."""
    if not (c.layer_windows and any(c.layer_windows)):
        return 0
    if isinstance(i, (int, np.integer)):
        return int(c.layer_windows[int(i)])
    return jnp.asarray(c.layer_windows, jnp.int32)[i]


def on_tpu() -> bool:
    """Where the Pallas kernels replace XLA's fusions: on TPU, or tracing a TPU program here (the planner). Whether a
    kernel compiles or is interpreted is attention.compiles_for_tpu (tests force this on CPU: interpreted)."""
    return compiles_for_tpu()


def qkv_kernel_applies(lp, N: int, head_dim: int) -> bool:
    """Whether a layer's q / k / v projections (with the input norm; q / k with their per-head norms and rotary) take
    proj_kernel on N tokens: on TPU, unquantized [out, in] weights, heads of a multiple of 128 lanes."""
    from .proj_kernel import applies
    names = ("q", "k", "v")
    if not on_tpu() or any(n + SCALE in lp or n + ROWS in lp or n + "_bias" in lp for n in names):
        return False
    return applies(N, lp["q"].shape[-1], [lp[n].shape[-2] for n in names], head_dim)


def mlp_kernel_applies(lp, N: int, tail: bool = False) -> bool:
    """Whether a layer's dense SwiGLU MLP (with its input norm) takes mlp_kernel on N tokens: on TPU, unquantized
    [in, out] weights, all N tokens in one row tile. tail: with the attention's o projection and residual add too
    (an unquantized, unbiased [in, out] o)."""
    from .mlp_kernel import applies
    names = ("gate", "up", "down") + (("o",) if tail else ())
    if not on_tpu() or any(n not in lp or n + SCALE in lp or n + ROWS in lp for n in names) or "gate_bias" in lp:
        return False
    if tail and "o_bias" in lp:
        return False
    return applies(N, lp["gate"].shape[-2], lp["gate"].shape[-1], A=lp["o"].shape[-2] if tail else 0)


def fused_qkv(x, lp, cos, sin, eps: float, head_dim: int, stack=None, layer=None):
    """q [N, NH, D], k, v [N, KV, D] of x [N, H] by one proj_kernel call: rms_norm(x, input_norm) projected, q / k
    normed per head and rotated (cos / sin [N, D / 2]). stack (the stacked layers' params, inside their scan) with
    `layer`: the kernel reads the projections in place (a slice of the stack passed to a kernel is copied first)."""
    from .proj_kernel import proj_heads
    w = lp if stack is None else stack
    q, k, v = proj_heads(x, [w["q"], w["k"], w["v"]], [lp["q_norm"], lp["k_norm"], None], cos, sin, eps=eps,
                         in_norm=lp["input_norm"], layer=layer, head_dim=head_dim, interpret=not compiles_for_tpu())
    return tuple(a.reshape(x.shape[0], -1, head_dim) for a in (q, k, v))


def fused_mlp(x, lp, eps: float, tp=None, stack=None, layer=None, attn=None):
    """x + the dense SwiGLU MLP of rms_norm(x, post_norm), x [..., H], by mlp_kernel (with `tp`: its local part,
    reduced over tp, then added); stack / layer: as fused_qkv. attn [..., A] (no `tp`; mlp_kernel_applies(tail=True)):
    x is first x + mat(attn, lp, "o"), in the same kernel."""
    from .mlp_kernel import swiglu_mlp
    w = lp if stack is None else stack
    tail = {} if attn is None else {"attn": attn.reshape(-1, attn.shape[-1]), "wo": w["o"]}
    y = swiglu_mlp(x.reshape(-1, x.shape[-1]), w["gate"], w["up"], w["down"], lp["post_norm"], eps=eps,
                   residual=tp is None, layer=layer, interpret=not compiles_for_tpu(), **tail).reshape(x.shape)
    return y if tp is None else x + psum(y, tp)


def _layer(c: TargetConfig, lp, x, kv, i, pos, cos, sin, tp=None, impl=None, new_mask=None, uniform=False,
           stack=None):
    """One decoder layer over T new tokens. x [B, T, H]; kv: the KVCache of all layers (its lengths unused; None:
    no cache, a fresh causal sequence). pos [B, T] = lengths + 0..T-1 (a tree: lengths + depth, with
    pos[:, 0] = lengths). new_mask [B, T, T] (None: causal) = which new tokens each new token sees.

    Under shard_map with tensor-parallel axis `tp`, heads and MLP width are local (column-parallel
    q/k/v/gate/up, row-parallel o/down followed by one psum each). stack: the stacked layers' params (inside their
    scan; lp is layer i's slice), for the kernels to read in place."""
    B, T, _ = x.shape
    D = c.head_dim
    kernels = kv is not None  # with a cache (decoding): no derivative is taken, the Pallas kernels may run
    if kernels and c.qk_norm and qkv_kernel_applies(lp, B * T, D):  # TPU: norms, projection, rotary in proj_kernel
        q, k, v = (a.reshape(B, T, -1, D) for a in fused_qkv(x.reshape(B * T, -1), lp, cos.reshape(B * T, -1),
                                                             sin.reshape(B * T, -1), c.rms_norm_eps, D, stack, i))
    else:
        h = rms_norm(x, lp["input_norm"], c.rms_norm_eps)
        q, k, v = mat(h, lp, "q"), mat(h, lp, "k"), mat(h, lp, "v")  # [B, T, NH*D], [B, T, KV*D] x2
        if c.qkv_bias:
            q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
        q = q.reshape(B, T, -1, D)
        k = k.reshape(B, T, -1, D)
        v = v.reshape(B, T, -1, D)
        if c.qk_norm:
            q = rms_norm(q, lp["q_norm"], c.rms_norm_eps)
            k = rms_norm(k, lp["k_norm"], c.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    new_vis = jnp.tril(jnp.ones((T, T), bool))[None, None]  # new tokens among themselves
    if new_mask is not None:  # tree verification: ancestors and self
        new_vis = new_mask[:, None]
    window = _layer_window(c, i)  # gpt-oss sliding layers: context and new tokens within the window
    if not (isinstance(window, int) and window == 0):
        dist = pos[:, None, :, None] - pos[:, None, None, :]
        new_vis = new_vis & ((window <= 0) | (dist < window))
    sinks = lp.get("sinks")  # gpt-oss: one extra softmax logit per head
    if kv is None:
        attn = attention(q[:, None], k[:, None], v[:, None], new_vis, q_pos=pos[:, None], window=window, sinks=sinks,
                         impl=impl)
    else:
        lengths = pos[:, 0]
        # store first (in place; quantized for a quantized cache), then read the committed slots < lengths
        kv, k, v = write_kv(kv, i, lengths, k, v, uniform)
        attn = attention(q[:, None], k[:, None], v[:, None], new_vis, kv.k, kv.v, lengths[:, None], q_pos=pos[:, None],
                         window=window, sinks=sinks, layer=i, impl=impl, k_scale=kv.k_scale, v_scale=kv.v_scale)
    if kernels and not c.num_experts and mlp_kernel_applies(lp, B * T, tail=True) and tp_alone(tp):
        return fused_mlp(x, lp, c.rms_norm_eps, None, stack, i, attn=attn[:, 0]), kv  # TPU: o projection and MLP
    o = psum(mat(attn[:, 0], lp, "o"), tp)
    if c.o_bias:
        o = o + lp["o_bias"]
    x = x + o
    if kernels and not c.num_experts and mlp_kernel_applies(lp, B * T):  # TPU: norm, SwiGLU, residual in mlp_kernel
        x = fused_mlp(x, lp, c.rms_norm_eps, tp, stack, i)
    else:
        x = x + moe.ffn(c, lp, rms_norm(x, lp["post_norm"], c.rms_norm_eps), i, tp)  # dense or MoE, reduced over tp
    return x, kv


def forward(target: Target, tokens, cache, taps: Sequence[int] = (), tp=None, attn_impl=None,
            positions=None, new_mask=None, uniform: bool = False, valid=None, verify: bool = False, parent=None):
    """Causal forward of T new tokens per row, appended at `cache.lengths`.

    tokens [B, T] int32 -> (hidden [B, T, H] after the final norm, new cache with lengths + T,
    tap features [B, T, len(taps) * H] (outputs of decoder layers `taps`, before the final norm;
    None when `taps` is empty)). `tp`: tensor-parallel mesh axis name when run under shard_map.
    cache=None: a fresh sequence at positions 0..T-1 without a cache (returned cache is None); the
    attention is then dense causal and differentiable (training). `attn_impl`: see dflash_jax.attention.
    Tree verification: `positions` [B, T] (lengths + node depth; positions[:, 0] = lengths) and
    `new_mask` [B, T, T] (node i sees node j: j is i or an ancestor); the K/V still land in slots
    lengths .. lengths + T - 1 in the given (flattened) order.
    uniform: every row's cache.lengths is the same (a chunked prefill): one cache write for all rows.
    Hybrid targets (dflash_jax.hybrid): `valid` [B, T] marks the rows a prefill chunk applies to the recurrent
    state (a prompt's padding changes nothing); `verify` leaves the recurrent state as it is and the returned
    cache carries what `HybridCache.commit` needs; a tree also passes `parent` [B, T] (flattened, -1 at the root).
    """
    c = target.config
    p = target.params
    B, T = tokens.shape
    lengths = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
    pos = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    if positions is not None:
        pos = positions.astype(jnp.int32)
    x = embed(target, tokens, tp)  # [B, T, H]
    n_taps = len(taps)
    uniq = sorted(set(int(l) for l in taps))  # a layer listed twice (small N defaults) is stored once
    slot_of = np.full((c.num_layers,), -1, np.int32)
    for l in taps:
        if not 0 <= l < c.num_layers:
            raise ValueError(f"tap layer {l} out of range for a {c.num_layers}-layer target")
        slot_of[l] = uniq.index(int(l))
    tap_buf = jnp.zeros((max(n_taps, 1), B, T, c.hidden_size), x.dtype)
    if c.is_hybrid or c.gemma4 is not None:  # per-layer kinds in their family's module
        outs = {}
        tap = lambda i, h: outs.__setitem__(i, h) if slot_of[i] >= 0 else None
        if c.is_hybrid:
            x, new_cache = hybrid.run_layers(c, p["layers"], x, cache, pos, tp=tp, impl=attn_impl, new_mask=new_mask,
                                             uniform=uniform, valid=valid, verify=verify, parent=parent,
                                             depth=None if positions is None else pos - lengths[:, None], on_layer=tap)
            h = hybrid.norm(c, x, p["norm"])
        else:
            x, new_cache = gemma4.run_layers(c, p, tokens, x, cache, pos, tp=tp, impl=attn_impl, new_mask=new_mask,
                                             uniform=uniform, on_layer=tap)
            h = rms_norm(x, p["norm"], c.rms_norm_eps)
        for l in outs:
            tap_buf = tap_buf.at[slot_of[l]].set(outs[l])
        return h, new_cache, _tap_features(tap_buf, taps, uniq)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling),
                            rope_attention_factor(c.rope_scaling))  # the families above build their own

    stack = None if is_unrolled(p["layers"]) else p["layers"]  # the kernels read a stacked layer in place

    def body(carry, xs):
        x, kv, tap_buf = carry
        lp, i, slot = xs
        with jax.named_scope("decoder_layer"):
            x, kv = _layer(c, lp, x, kv, i, pos, cos, sin, tp, attn_impl, new_mask, uniform, stack)
        if n_taps:
            if isinstance(slot, np.integer):  # unrolled: the tap slot is static
                tap_buf = tap_buf.at[slot].set(x) if slot >= 0 else tap_buf
            else:
                s = jnp.maximum(slot, 0)
                tap_buf = jax.lax.dynamic_update_index_in_dim(tap_buf, jnp.where(slot >= 0, x, tap_buf[s]), s, 0)
        return (x, kv, tap_buf), None

    x, kv, tap_buf = scan_layers(body, (x, cache, tap_buf), p["layers"], np.arange(c.num_layers), slot_of)
    h = rms_norm(x, p["norm"], c.rms_norm_eps)
    new_cache = None if cache is None else kv.replace(lengths=cache.lengths + T)
    return h, new_cache, _tap_features(tap_buf, taps, uniq)


def _tap_features(tap_buf, taps, uniq):
    """[n_unique, B, T, H] tap outputs -> [B, T, len(taps) * H] in the order of `taps` (None without taps)."""
    if not len(taps):
        return None
    if uniq != [int(l) for l in taps]:  # duplicates or an unsorted list: back to the order of `taps`
        tap_buf = tap_buf[np.asarray([uniq.index(int(l)) for l in taps])]
    _, B, T, H = tap_buf.shape
    return jnp.moveaxis(tap_buf, 0, 2).reshape(B, T, len(taps) * H)  # [B, T, n*H]


def lm_head(target: Target, h, softcap: float | None = None):
    """h [..., H] -> float32 logits [..., V] (under shard_map: this device's vocab shard), soft-capped to
    cap * tanh(logits / cap) with cap = `softcap` (None: the family's own, TargetConfig.logit_softcap; 0: none)."""
    p = target.params
    if target.config.tie_word_embeddings:
        logits = jnp.einsum("...h,vh->...v", h, p["embed"], preferred_element_type=F32)
    else:  # held [V, H] by the CPU decode loop (layers.by_rows), else [H, V]
        w, eq = (p["lm_head" + ROWS], "...h,vh->...v") if "lm_head" + ROWS in p else (p["lm_head"], "...h,hv->...v")
        scale = p.get("lm_head" + SCALE)  # int8 / fp8 values with a scale per vocab entry (dflash_jax.quant)
        logits = jnp.einsum(eq, h, w if scale is None else w.astype(h.dtype), preferred_element_type=F32)
        logits = logits if scale is None else logits * scale
    cap = target.config.logit_softcap if softcap is None else softcap
    return jnp.tanh(logits / cap) * cap if cap else logits


def lm_head_argmax(target: Target, h, softcap: float | None = None, mult: float = 1.0, tp=None, kernel=None):
    """The greedy token of each hidden state h [..., H]: argmax of mult * lm_head(target, h, 0), soft-capped by
    `softcap` (None: the family's own; 0: none), as sampling.argmax picks it (with `tp`: over vocabulary shards).
    kernel (None: on TPU): the Pallas kernel (dflash_jax.head_kernel), which keeps the logits in VMEM; else the
    float32 logits are materialised and reduced."""
    from .sampling import argmax, shard_argmax
    cap = target.config.logit_softcap if softcap is None else softcap
    p = target.params
    if kernel is None:
        kernel = on_tpu() and "lm_head" + ROWS not in p
    if not kernel:
        x = lm_head(target, h, softcap=0.0)
        x = x * mult if mult != 1.0 else x
        return argmax(jnp.tanh(x / cap) * cap if cap else x, tp)
    from .head_kernel import head_argmax
    lead = h.shape[:-1]
    if target.config.tie_word_embeddings:
        w, axis = p["embed"], 0
    else:
        w, axis = (p["lm_head" + ROWS], 0) if "lm_head" + ROWS in p else (p["lm_head"], 1)
    scale = None if target.config.tie_word_embeddings else p.get("lm_head" + SCALE)
    ids, val = head_argmax(h.reshape(-1, h.shape[-1]), w, vocab_axis=axis, scale=scale,
                           mult=mult, cap=cap or 0.0, interpret=not compiles_for_tpu())
    ids, val = ids.reshape(lead), val.reshape(lead)
    return ids if tp is None else shard_argmax(val, ids, w.shape[axis], tp)


def embed(target: Target, tokens, tp=None, scale: float | None = None):
    """Token embeddings [..., H] times `scale` (None: the family's own, TargetConfig.embed_scale); with `tp` the
    table is vocab-sharded: look up locally, psum."""
    table = target.params["embed"]
    scale = target.config.embed_scale if scale is None else scale
    if tp is None:
        x = jnp.take(table, tokens, axis=0)
    else:
        v_local = table.shape[0]
        local = tokens - jax.lax.axis_index(tp) * v_local
        inside = (local >= 0) & (local < v_local)
        x = jnp.take(table, jnp.clip(local, 0, v_local - 1), axis=0)
        x = jax.lax.psum(jnp.where(inside[..., None], x, jnp.zeros_like(x)), tp)
    return x * jnp.asarray(scale, x.dtype) if scale != 1.0 else x


@jax.jit
def _full_logits(target, tokens):
    h, _, _ = forward(target, tokens, None)
    return lm_head(target, h)


def target_logits(target: Target, input_ids) -> jax.Array:
    """Plain causal forward (no cache carried over): input_ids [B, T] -> float32 logits [B, T, V]."""
    ids = jnp.asarray(np.asarray(input_ids, dtype=np.int32))
    if ids.ndim == 1:
        ids = ids[None]
    check_ids(target.config.vocab_size, ids)
    return _full_logits(target, ids)


def check_ids(vocab, ids):
    a = np.asarray(ids)
    if a.size and (a.min() < 0 or a.max() >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab}); got range [{a.min()}, {a.max()}]")
