"""Gemma 4 text targets: Gemma4ForCausalLM and the text model of Gemma4ForConditionalGeneration.

Layers (transformers 5.x models/gemma4): sliding-window attention layers (window from the config; head_dim and
num_key_value_heads) and full attention layers (`global_head_dim`, `num_global_key_value_heads` with
`attention_k_eq_v`), each kind with its own RoPE (sliding: default; full: "proportional", frequencies past
partial_rotary_factor * D / 2 are zero). q and k are RMS-normed per head before RoPE, v by a weightless RMSNorm; with
k_eq_v a full layer has no v_proj and V is its k_proj output. Attention scale 1. A layer is

    x = x + attn_post_norm(attn(input_norm(x)))
    m = GELU-tanh MLP(ffn_pre_norm(x)); with the MoE block: ffn_post_norm_1(m) + ffn_post_norm_2(experts(
        ffn_pre_norm_2(x))) routed from x (softmax router on a weightless-normed, scaled x; top-k, renormalised,
        times a per-expert scale)
    x = x + ffn_post_norm(m)
    x = x + ple_post_norm(ple_out(GELU(ple_gate(x)) * per-layer input))      (per-layer input embeddings, PLE)
    x = x * layer_scalar

RMSNorm is x_hat * w. Embeddings are scaled by sqrt(H) and the tied lm_head's logits soft-capped
(dflash_jax.model.embed / lm_head, which the drafter uses too). The last `num_kv_shared_layers` layers compute no K/V:
they attend over the K/V (cache and new rows) of the last earlier layer of their kind.

Params: `layers` is a tuple of per-layer dicts (the kinds differ in shape), matrices as in dflash_jax.model (q / k / v
[out, in], the others [in, out]). The decode state is a `Gemma4Cache`: one KVCache per attention kind. The full layers'
slot s holds position s; the sliding layers' cache is a ring (dflash_jax.cache) of `ring_size` slots, the window plus
the most rows one call writes (Gemma4Config.ring_write, which also bounds the prefill chunk and the verify width), so
its memory follows the window, not the context.

Tensor names: `hf_sources` (under `model.language_model.` in the multimodal checkpoints, `model.` otherwise).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .attention import attention, write_rows
from .cache import KVCache
from .layers import F32, apply_rope, mat, proj, psum, rms_norm, rope_cos_sin
from .moe import experts_gathered, experts_grouped
from .st_io import read_params, text_prefix

KINDS = ("sliding", "full")


@flax.struct.dataclass
class Gemma4Cache:
    sliding: KVCache  # [Ls, B, KVs, S, Ds] the sliding layers' K/V (Ls = 0 when there are none)
    full: KVCache  # [Lf, B, KVf, S, Df] the full layers' K/V; both fill indexes move together

    @property
    def lengths(self):
        return self.full.lengths

    @property
    def size(self) -> int:
        return self.full.size

    def rollback(self, lengths):
        return self.map_kv(lambda kv: kv.rollback(lengths))

    def commit(self, lengths, n=None, path=None):
        """Keep the verified rows up to `lengths` (attention only: the fill index moves; a tree path's K/V must
        already sit in contiguous slots, decode.programs.compact_path)."""
        return self.rollback(lengths)

    def map_kv(self, fn):
        """The cache with fn applied to each kind's KVCache."""
        return self.replace(sliding=fn(self.sliding), full=fn(self.full))


# ----------------------------------------------------------------------------------------------
# Layer plan and param shapes
# ----------------------------------------------------------------------------------------------
def plan(c) -> list[tuple[str, int, bool]]:
    """Per layer: (kind, the cache layer of that kind it reads, whether it computes K/V). A KV-shared layer reads
    the cache layer of the last earlier layer of its kind that computes K/V."""
    first_shared = c.num_layers - c.gemma4.kv_shared_layers
    n = {k: 0 for k in KINDS}
    out = []
    for i, w in enumerate(c.layer_windows):
        kind = "sliding" if w else "full"
        if i < first_shared:
            out.append((kind, n[kind], True))
            n[kind] += 1
        elif n[kind]:
            out.append((kind, n[kind] - 1, False))
        else:
            raise ValueError(f"gemma4: KV-shared layer {i} has no earlier {kind} layer to share K/V with")
    return out


def counts(c) -> dict:
    """Cache layers per kind."""
    return {k: sum(1 for kind, _, own in plan(c) if own and kind == k) for k in KINDS}


def dims(c, kind: str) -> tuple[int, int]:
    """(head_dim, KV heads) of a kind."""
    g = c.gemma4
    return (c.head_dim, c.num_kv_heads) if kind == "sliding" else (g.global_head_dim, g.global_kv_heads)


def param_shapes(c) -> dict:
    """Our params' shapes: {"embed", "norm", "lm_head"?, "ple_*"?, "layers": tuple of per-layer shape dicts}."""
    g = c.gemma4
    H, NH, P, E, Ie = c.hidden_size, c.num_heads, g.ple_dim, c.num_experts, c.moe_intermediate_size
    layers = []
    for kind, _, own in plan(c):
        D, KV = dims(c, kind)
        I = c.intermediate_size * (2 if g.double_wide_mlp and not own else 1)
        lp = {"input_norm": (H,), "attn_post_norm": (H,), "ffn_pre_norm": (H,), "ffn_post_norm": (H,),
              "layer_scalar": (1,), "q": (NH * D, H), "q_norm": (D,), "o": (NH * D, H),
              "gate": (H, I), "up": (H, I), "down": (I, H)}
        if own:
            lp.update(k=(KV * D, H), k_norm=(D,))
            if not (g.k_eq_v and kind == "full"):
                lp["v"] = (KV * D, H)
        if E:
            lp.update(router=(H, E), router_scale=(H,), expert_scale=(E,), e_gate=(E, H, Ie), e_up=(E, H, Ie),
                      e_down=(E, Ie, H), ffn_post_norm_1=(H,), ffn_pre_norm_2=(H,), ffn_post_norm_2=(H,))
        if P:
            lp.update(ple_gate=(H, P), ple_out=(P, H), ple_post_norm=(H,))
        layers.append(lp)
    out = {"embed": (c.vocab_size, H), "norm": (H,), "layers": tuple(layers)}
    if P:
        out.update(ple_embed=(g.ple_vocab, c.num_layers * P), ple_proj=(H, c.num_layers * P), ple_norm=(P,))
    if not c.tie_word_embeddings:
        out["lm_head"] = (H, c.vocab_size)
    return out


ONES = ("layer_scalar", "router_scale", "expert_scale")  # initialised to one, as transformers does


def init_params(c, make) -> dict:
    """Random params through make(name, shape, zero) (layers.random_init: norms one, matrices normal)."""
    shapes = param_shapes(c)

    def one(name, shape):
        return jnp.ones(shape, jnp.dtype(c.dtype)) if name in ONES else make(name, shape, False)

    params = {k: one(k, s) for k, s in shapes.items() if k != "layers"}
    params["layers"] = tuple({k: one(k, s) for k, s in lp.items()} for lp in shapes["layers"])
    return params


def cache_kv_heads(c, params) -> dict:
    """KV heads per kind as the params hold them (replicated over a model axis larger than the checkpoint's)."""
    out = {k: dims(c, k)[1] for k in KINDS}
    for lp, (kind, _, own) in zip(params["layers"], plan(c)):
        if own:
            out[kind] = lp["k"].shape[0] // dims(c, kind)[0]
    return out


def ring_size(c, size: int) -> int:
    """Slots of the sliding layers' ring cache beside a full cache of `size` slots: the largest window plus
    ring_write, rounded up to 128, at most `size`."""
    w = max((int(x) for x in c.layer_windows), default=0)
    return min(int(size), -(-(w + c.gemma4.ring_write) // 128) * 128)


def check_write(c, cache: Gemma4Cache, T: int) -> None:
    """A call writing T rows must fit the ring's slack (else it would overwrite positions still in the window)."""
    if cache.sliding.size < cache.full.size and T > c.gemma4.ring_write:
        raise ValueError(f"gemma4: a call writes {T} rows, more than the sliding ring caches allow (ring_write "
                         f"{c.gemma4.ring_write}): use a smaller block, tree or prefill chunk")


def prefill_chunk(c, chunk: int) -> int:
    """The prefill chunk for this target: at most ring_write rows per call."""
    return min(int(chunk), c.gemma4.ring_write)


def init_cache(c, params, batch: int, size: int) -> Gemma4Cache:
    n, kv = counts(c), cache_kv_heads(c, params)
    dt = jnp.dtype(c.dtype)
    sizes = {"sliding": ring_size(c, size), "full": size}
    caches = {k: KVCache.create(n[k], batch, sizes[k], kv[k], dims(c, k)[0], dt) for k in KINDS}
    return Gemma4Cache(sliding=caches["sliding"].replace(ring=True), full=caches["full"])


def cache_spec() -> Gemma4Cache:
    """The PartitionSpecs of a Gemma4Cache: each kind's KVCache as sharding.cache_spec (rows on 'data', KV heads on
    'model'; the sliding one a ring)."""
    from .sharding import cache_spec as kv_spec
    return Gemma4Cache(sliding=kv_spec().replace(ring=True), full=kv_spec())


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
def inv_freq(head_dim: int, rope: tuple) -> np.ndarray:
    """RoPE inverse frequencies [head_dim // 2] of (theta, rope_type, partial_rotary_factor, factor): "default"
    over the whole head; "proportional" keeps the first int(factor * D // 2) of theta^(-2i / D), zero past them."""
    theta, kind, part, factor = rope
    if kind == "default":
        return (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(np.float32)
    n = int(part * head_dim // 2)
    inv = np.zeros(head_dim // 2, np.float64)
    inv[:n] = 1.0 / theta ** (np.arange(0, 2 * n, 2, dtype=np.float64) / head_dim)
    return (inv / factor).astype(np.float32)


def _vnorm(x, eps):
    return rms_norm(x, jnp.ones((), F32), eps)


def gelu(x):
    return jax.nn.gelu(x.astype(F32), approximate=True).astype(x.dtype)


def geglu(x, lp):
    """The dense MLP: down(GELU-tanh(gate(x)) * up(x))."""
    return mat(gelu(mat(x, lp, "gate")) * mat(x, lp, "up"), lp, "down")


def route(c, lp, x):
    """x [N, H] (the layer's residual stream) -> (combine weights [N, k] float32, expert ids [N, k])."""
    H = x.shape[-1]
    xn = _vnorm(x, c.rms_norm_eps) * lp["router_scale"] * jnp.asarray(H ** -0.5, x.dtype)
    probs = jax.nn.softmax(jnp.einsum("nh,he->ne", xn, lp["router"], preferred_element_type=F32), axis=-1)
    w, idx = jax.lax.top_k(probs, c.num_experts_per_tok)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w * lp["expert_scale"].astype(F32)[idx], idx


def ffn(c, lp, x, tp=None):
    """The feed-forward part of a layer on its residual stream x [B, T, H], before ffn_post_norm. Under shard_map
    with tensor-parallel axis `tp` the MLP width and the experts are local; both parts are reduced over `tp`."""
    eps = c.rms_norm_eps
    m = psum(geglu(rms_norm(x, lp["ffn_pre_norm"], eps), lp), tp)
    if not c.num_experts:
        return m
    B, T, H = x.shape
    w, idx = route(c, lp, x.reshape(B * T, H))
    E_loc = lp["e_gate"].shape[0]
    if tp is not None:  # expert parallel: this device holds experts [offset, offset + E_loc)
        idx = idx - jax.lax.axis_index(tp) * E_loc
        w = jnp.where((idx >= 0) & (idx < E_loc), w, 0.0)
    xe = rms_norm(x, lp["ffn_pre_norm_2"], eps).reshape(B * T, H)
    run = experts_gathered if B * T * idx.shape[1] < E_loc else experts_grouped
    y = psum(run(c, lp, xe, w, idx), tp).reshape(B, T, H)
    return rms_norm(m, lp["ffn_post_norm_1"], eps) + rms_norm(y, lp["ffn_post_norm_2"], eps)


def per_layer_inputs(c, params, tokens, x):
    """PLE: the per-layer inputs [B, T, L, P] of tokens [B, T] with scaled embeddings x [B, T, H]:
    (norm(x @ ple_proj / sqrt(H)) + ple_embed[tokens] * sqrt(P)) / sqrt(2)."""
    g = c.gemma4
    B, T, H = x.shape
    L, P, dt = c.num_layers, g.ple_dim, x.dtype
    tok = jnp.take(params["ple_embed"], jnp.clip(tokens, 0, g.ple_vocab - 1), axis=0) * jnp.asarray(P ** 0.5, dt)
    ctx = (x @ params["ple_proj"]) * jnp.asarray(H ** -0.5, dt)
    ctx = rms_norm(ctx.reshape(B, T, L, P), params["ple_norm"], c.rms_norm_eps)
    return (ctx + tok.reshape(B, T, L, P)) * jnp.asarray(2 ** -0.5, dt)


def _attention(c, lp, h, kind, a, own, shared, kv, pos, rope, vis, window, impl, uniform, tp):
    """One layer's attention over h [B, T, H]; `shared` holds each kind's latest new K/V (KV-shared layers read
    them), `kv` each kind's (k, v) cache buffers (None: no cache), updated in place of the dict."""
    B, T, _ = h.shape
    D = dims(c, kind)[0]
    eps = c.rms_norm_eps
    cos, sin = rope[kind]
    q = apply_rope(rms_norm(proj(h, lp["q"]).reshape(B, T, -1, D), lp["q_norm"], eps), cos, sin)
    if own:
        raw = proj(h, lp["k"]).reshape(B, T, -1, D)
        v = proj(h, lp["v"]).reshape(B, T, -1, D) if "v" in lp else raw  # k_eq_v: V is the k projection
        shared[kind] = apply_rope(rms_norm(raw, lp["k_norm"], eps), cos, sin), _vnorm(v, eps)
    k, v = shared[kind]
    if kv is None:
        out = attention(q[:, None], k[:, None], v[:, None], vis, q_pos=pos[:, None], window=window, scale=1.0,
                        impl=impl)
    else:
        k_all, v_all = kv[kind]
        lengths = pos[:, 0]
        ring = kind == "sliding" and k_all.shape[3] < kv["full"][0].shape[3]  # a ring that can wrap
        if own:
            k_all = write_rows(k_all, a, lengths, k, uniform, ring=ring)
            v_all = write_rows(v_all, a, lengths, v, uniform, ring=ring)
            kv[kind] = k_all, v_all
        out = attention(q[:, None], k[:, None].astype(k_all.dtype), v[:, None].astype(v_all.dtype), vis, k_all, v_all,
                        lengths[:, None], q_pos=pos[:, None], window=window, layer=a, scale=1.0, impl=impl, ring=ring)
    return psum(mat(out[:, 0], lp, "o"), tp)


def run_layers(c, params, tokens, x, cache: Gemma4Cache | None, pos, *, tp=None, impl=None, new_mask=None,
               uniform=False, on_layer=None):
    """The decoder layers over T new rows: tokens [B, T], their scaled embeddings x [B, T, H], positions pos [B, T].

    cache None: a fresh causal sequence. Otherwise every layer that computes K/V writes them at pos[:, 0] and attends
    to the committed cache of its kind; new_mask [B, T, T] (a tree: ancestors and self; None: causal) says which new
    rows each new row sees, and a sliding layer also bounds both parts by its window. on_layer(i, x): called with
    every layer's output (after layer_scalar: the drafter's taps). Under shard_map with tensor-parallel axis `tp`
    the attention heads, MLP width and experts are local (the per-layer inputs replicated). Returns (x, new cache)."""
    B, T, _ = x.shape
    eps = c.rms_norm_eps
    ple = per_layer_inputs(c, params, tokens, x) if c.gemma4.ple_dim else None
    rope = {k: rope_cos_sin(pos, inv_freq(dims(c, k)[0], getattr(c.gemma4, k + "_rope"))) for k in KINDS}
    vis = jnp.tril(jnp.ones((T, T), bool))[None, None] if new_mask is None else new_mask[:, None]
    near = pos[:, None, :, None] - pos[:, None, None, :]  # [B, 1, T, T] distance between new rows
    kv = None if cache is None else {k: (getattr(cache, k).k, getattr(cache, k).v) for k in KINDS}
    if cache is not None:
        check_write(c, cache, T)
    shared: dict = {}
    for i, (lp, (kind, a, own)) in enumerate(zip(params["layers"], plan(c))):
        w = int(c.layer_windows[i])
        vis_i = vis & (near < w) if w else vis
        h = rms_norm(x, lp["input_norm"], eps)
        o = _attention(c, lp, h, kind, a, own, shared, kv, pos, rope, vis_i, w, impl, uniform, tp)
        x = x + rms_norm(o, lp["attn_post_norm"], eps)
        x = x + rms_norm(ffn(c, lp, x, tp), lp["ffn_post_norm"], eps)
        if ple is not None:
            y = mat(gelu(mat(x, lp, "ple_gate")) * ple[:, :, i], lp, "ple_out")
            x = x + rms_norm(y, lp["ple_post_norm"], eps)
        x = x * lp["layer_scalar"].astype(x.dtype)
        if on_layer is not None:
            on_layer(i, x)
    if cache is None:
        return x, None
    new = {k: getattr(cache, k).replace(k=kv[k][0], v=kv[k][1], lengths=cache.lengths + T) for k in KINDS}
    return x, Gemma4Cache(**new)


# ----------------------------------------------------------------------------------------------
# Checkpoint names
# ----------------------------------------------------------------------------------------------
_LAYER = {"input_norm": "input_layernorm.weight", "attn_post_norm": "post_attention_layernorm.weight",
          "ffn_pre_norm": "pre_feedforward_layernorm.weight", "ffn_post_norm": "post_feedforward_layernorm.weight",
          "layer_scalar": "layer_scalar", "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
          "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight",
          "k_norm": "self_attn.k_norm.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
          "down": "mlp.down_proj.weight", "router": "router.proj.weight", "router_scale": "router.scale",
          "expert_scale": "router.per_expert_scale", "ffn_post_norm_1": "post_feedforward_layernorm_1.weight",
          "ffn_pre_norm_2": "pre_feedforward_layernorm_2.weight", "ffn_post_norm_2": "post_feedforward_layernorm_2.weight",
          "ple_gate": "per_layer_input_gate.weight", "ple_out": "per_layer_projection.weight",
          "ple_post_norm": "post_per_layer_input_norm.weight"}
_TOP = {"embed": "embed_tokens.weight", "norm": "norm.weight", "ple_embed": "embed_tokens_per_layer.weight",
        "ple_proj": "per_layer_model_projection.weight", "ple_norm": "per_layer_projection_norm.weight"}
TRANSPOSED = frozenset({"o", "gate", "up", "down", "router", "ple_gate", "ple_out", "ple_proj", "lm_head"})
# the experts' fused tensors: gate_up_proj [E, 2I, H] -> e_gate / e_up [E, H, I], down_proj [E, H, I] -> [E, I, H]
_EXPERTS = {"e_gate": ("experts.gate_up_proj", 0), "e_up": ("experts.gate_up_proj", 1),
            "e_down": ("experts.down_proj", None)}


def hf_sources(c, pre: str = "model.") -> dict:
    """{our key path: (tensor name, how)}: how = "T" (transpose), None (as is) or a function of the tensor."""
    shapes = param_shapes(c)
    out = {(k,): (pre + n, "T" if k in TRANSPOSED else None) for k, n in _TOP.items() if k in shapes}
    if "lm_head" in shapes:
        out[("lm_head",)] = ("lm_head.weight", "T")
    I = c.moe_intermediate_size
    for i, lp in enumerate(shapes["layers"]):
        base = f"{pre}layers.{i}."
        for k in lp:
            if k in _EXPERTS:
                name, half = _EXPERTS[k]
                how = (lambda w: np.swapaxes(w, 1, 2)) if half is None else \
                    (lambda w, h=half: np.swapaxes(w[:, h * I:(h + 1) * I], 1, 2))
                out[("layers", i, k)] = (base + name, how)
            else:
                out[("layers", i, k)] = (base + _LAYER[k], "T" if k in TRANSPOSED else None)
    return out


def _ignorable(c, pre: str, n: str) -> bool:
    """Checkpoint tensors that are not part of the text target: other towers, rotary buffers, a tied lm_head, and
    the K/V tensors some checkpoints keep for KV-shared layers."""
    if not n.startswith(pre) and n != "lm_head.weight":
        return pre != "model."  # a multimodal checkpoint's vision / audio parts
    if n.endswith("rotary_emb.inv_freq") or (c.tie_word_embeddings and n == "lm_head.weight"):
        return True
    parts = n[len(pre):].split(".")
    shared = [i for i, (_, _, own) in enumerate(plan(c)) if not own]
    return (len(parts) > 3 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) in shared
            and parts[2] == "self_attn" and parts[3] in ("k_proj", "v_proj", "k_norm", "v_norm"))


def load_params(c, st, dtype, place=None) -> dict:
    """Params from a checkpoint (dflash_jax.st_io.SafetensorsDir), every tensor checked against config.json; `place`:
    st_io.read_params's."""
    pre = text_prefix(set(st.keys()))
    return read_params(st, hf_sources(c, pre), param_shapes(c), dtype, lambda n: _ignorable(c, pre, n), place)


def hf_tensors(c, params) -> dict:
    """Our params -> {HF tensor name: array} in the Gemma4ForCausalLM layout (`model.` prefix)."""
    get = lambda a: np.asarray(jax.device_get(a))
    out = {}
    for path, (name, how) in hf_sources(c).items():
        a = get(params[path[0]] if len(path) == 1 else params["layers"][path[1]][path[2]])
        if path[-1] in _EXPERTS:
            if path[-1] == "e_up":
                continue
            if path[-1] == "e_gate":
                up = get(params["layers"][path[1]]["e_up"])
                a = np.concatenate([a, up], axis=2)
            a = np.swapaxes(a, 1, 2)
        elif how == "T":
            a = a.T
        out[name] = np.ascontiguousarray(a)
    return out
