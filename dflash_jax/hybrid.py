"""Hybrid targets: Qwen3.5 / Qwen3.6 and Qwen3-Next - Gated DeltaNet layers (dflash_jax/gdn.py) between gated full
attention layers (every `full_attention_interval`-th), each followed by the dense SwiGLU MLP.

Full attention here: q_proj yields per head [query | gate] (the output is multiplied by sigmoid(gate)), q / k
RMS-normed per head, rotary on the first `rotary_dim` dims (partial_rotary_factor; Qwen3.5's interleaved mrope is
plain rope for text, where the three position streams agree), the usual KV cache. RMSNorm weights are stored zero
centred (applied as 1 + w, in float32).

Params: `layers` is a tuple of per-layer dicts (the kinds differ), matrices as in dflash_jax.model (q / k / v
[out, in], the others [in, out]). The decode state of a hybrid target is a `HybridCache`: the KV cache of the
attention layers, the GDN state of the linear layers, and - between a verification and its commit - what the GDN
layers need to commit any prefix (a chain) or any path (a tree) of the verified rows.

Tensor names: `hf_names` (Qwen3.5 text weights under `model.language_model.` in the multimodal checkpoints, under
`model.` otherwise; Qwen3-Next's fused in_proj_qkvz / in_proj_ba are split at load, `hf_sources`).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from . import gdn, moe
from .attention import attention, write_rows
from .cache import KVCache
from .st_io import read_params, text_prefix
from .layers import (F32, apply_rope, mat, proj, psum, rms_norm, rope_attention_factor, rope_cos_sin, rope_inv_freq,
                     swiglu)


@flax.struct.dataclass
class HybridCache:
    kv: KVCache  # [La, B, KV, S, D] the attention layers' cache (lengths: the committed fill of every layer)
    lin: gdn.GDNState  # the linear layers' state after the committed tokens
    pending: gdn.Pending | None = None  # set by a verification (forward(verify=True)), cleared by commit

    @property
    def lengths(self):
        return self.kv.lengths

    @property
    def size(self) -> int:
        return self.kv.size

    def map_kv(self, fn):
        """fn applied to the attention layers' KVCache."""
        return self.replace(kv=fn(self.kv))

    def rollback(self, lengths):
        """Move the attention layers' fill index (the recurrent state is moved by `commit` only)."""
        return self.map_kv(lambda kv: kv.rollback(lengths))

    def commit(self, lengths, n, path=None):
        """After a verification: keep n [B] of the verified rows (a chain) or path[:, :n] (a tree): the recurrent
        state after them and the fill index at `lengths` (the start + n; the K/V of a tree path must already sit in
        contiguous slots, decode.programs.compact_path)."""
        lin = self.lin if self.pending is None else gdn.commit_state(self.lin, self.pending, n, path)
        return HybridCache(kv=self.kv.rollback(lengths), lin=lin, pending=None)


def cache_spec():
    """The PartitionSpecs of a HybridCache: the attention layers' KV cache as sharding.cache_spec, the conv window
    [Lg, B, K - 1, C] and the state [Lg, B, Hv, Dk, Dv] with rows on 'data' and channels / value heads on 'model'."""
    from jax.sharding import PartitionSpec as P
    from .sharding import DATA, MODEL, cache_spec as kv_spec
    return HybridCache(kv=kv_spec(), lin=gdn.GDNState(conv=P(None, DATA, None, MODEL), rec=P(None, DATA, MODEL, None, None)))


def kinds(c):
    """(attention layer ordinal or -1, linear layer ordinal or -1) per layer."""
    a = l = 0
    out = []
    for t in c.layer_types:
        out.append((a, -1) if t == "full" else (-1, l))
        a, l = a + (t == "full"), l + (t == "linear")
    return out


def counts(c) -> tuple[int, int]:
    return sum(t == "full" for t in c.layer_types), sum(t == "linear" for t in c.layer_types)


def param_shapes(c) -> dict:
    """Our params' shapes: {"embed", "norm", "lm_head"?, "layers": tuple of per-layer shape dicts}."""
    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    NH, KV = c.num_heads, c.num_kv_heads
    layers = []
    E, Ie, Is = c.num_experts, c.moe_intermediate_size, c.shared_expert_size
    for i, t in enumerate(c.layer_types):
        lp = {"input_norm": (H,), "post_norm": (H,)}
        if c.is_sparse(i):  # dflash_jax.moe's expert params + the shared expert
            lp.update(router=(H, E), e_gate=(E, H, Ie), e_up=(E, H, Ie), e_down=(E, Ie, H))
            if Is:
                lp.update(sh_gate=(H, Is), sh_up=(H, Is), sh_down=(Is, H), sh_router=(H, 1))
        else:
            lp.update(gate=(H, I), up=(H, I), down=(I, H))
        if t == "full":
            lp.update(q=(NH * D * (2 if c.attn_output_gate else 1), H), k=(KV * D, H), v=(KV * D, H), o=(NH * D, H),
                      q_norm=(D,), k_norm=(D,))
        else:
            lp.update(gdn.param_shapes(c.gdn, H))
        layers.append(lp)
    out = {"embed": (c.vocab_size, H), "norm": (H,), "layers": tuple(layers)}
    if not c.tie_word_embeddings:
        out["lm_head"] = (H, c.vocab_size)
    return out


def init_params(c, make) -> dict:
    """Random params through make(name, shape, zero) (layers.random_init): norms as zero-centred weights (0), A_log
    and dt_bias in the range transformers initialises them to."""
    shapes = param_shapes(c)
    rng = np.random.default_rng(0)

    def one(name, shape):
        if "norm" in name and name != "lin_norm":
            return jnp.zeros(shape, jnp.dtype(c.dtype)) if c.zero_centered_norms else make(name, shape, False)
        if name == "A_log":
            return jnp.asarray(np.log(rng.uniform(1.0, 16.0, size=shape)), jnp.dtype(c.dtype))
        if name == "dt_bias":
            return jnp.ones(shape, jnp.dtype(c.dtype))
        return make(name, shape, False)

    params = {k: one(k, s) for k, s in shapes.items() if k != "layers"}
    params["layers"] = tuple({k: one(k, s) for k, s in lp.items()} for lp in shapes["layers"])
    return params


def norm(c, x, w):
    """RMSNorm with the family's weight convention (zero centred: 1 + w in float32)."""
    return rms_norm(x, w.astype(F32) + 1.0 if c.zero_centered_norms else w, c.rms_norm_eps)


def init_cache(c, params, batch: int, size: int) -> HybridCache:
    """Empty state; head counts read off the (possibly model-sharded) params, so inside shard_map this is the
    device-local state."""
    La, Lg = counts(c)
    ks = kinds(c)
    first_a = next(i for i, (a, _) in enumerate(ks) if a >= 0) if La else None
    first_l = next(i for i, (_, l) in enumerate(ks) if l >= 0) if Lg else None
    kvh = params["layers"][first_a]["k"].shape[0] // c.head_dim if La else 1
    kv = KVCache.create(max(La, 1), batch, size if La else 1, kvh, c.head_dim, jnp.dtype(c.dtype))
    if La == 0:
        kv = kv.replace(lengths=jnp.zeros((batch,), jnp.int32))
    hv = params["layers"][first_l]["lin_v"].shape[1] // c.gdn.v_dim if Lg else c.gdn.num_v_heads
    return HybridCache(kv=kv, lin=gdn.init_state(c.gdn, max(Lg, 1), batch, jnp.dtype(c.dtype), hv))


def _attention_layer(c, lp, h, k_all, v_all, ai, pos, cos, sin, impl, new_mask, uniform):
    B, T, _ = h.shape
    D = c.head_dim
    qg = proj(h, lp["q"])
    if c.attn_output_gate:
        qg = qg.reshape(B, T, -1, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(B, T, -1)
    else:
        q, gate = qg.reshape(B, T, -1, D), None
    k = proj(h, lp["k"]).reshape(B, T, -1, D)
    v = proj(h, lp["v"]).reshape(B, T, -1, D)
    q, k = norm(c, q, lp["q_norm"]), norm(c, k, lp["k_norm"])
    rd = c.rotary_dim
    q = jnp.concatenate([apply_rope(q[..., :rd], cos, sin), q[..., rd:]], axis=-1)
    k = jnp.concatenate([apply_rope(k[..., :rd], cos, sin), k[..., rd:]], axis=-1)
    new_vis = jnp.tril(jnp.ones((T, T), bool))[None, None] if new_mask is None else new_mask[:, None]
    if k_all is None:
        attn = attention(q[:, None], k[:, None], v[:, None], new_vis, q_pos=pos[:, None], impl=impl)
    else:
        lengths = pos[:, 0]
        k_all = write_rows(k_all, ai, lengths, k, uniform)
        v_all = write_rows(v_all, ai, lengths, v, uniform)
        attn = attention(q[:, None], k[:, None].astype(k_all.dtype), v[:, None].astype(v_all.dtype), new_vis,
                         k_all, v_all, lengths[:, None], q_pos=pos[:, None], layer=ai, impl=impl)
    attn = attn[:, 0]
    if gate is not None:
        attn = (attn.astype(F32) * jax.nn.sigmoid(gate.astype(F32))).astype(attn.dtype)
    return mat(attn, lp, "o"), k_all, v_all


def ffn(c, lp, h, i, tp=None):
    """The feed-forward block of layer i: dense SwiGLU, or routed experts plus the shared expert scaled by
    sigmoid(h . sh_router); reduced over the tensor-parallel axis `tp`."""
    if not c.is_sparse(i):
        return psum(swiglu(h, lp), tp)
    out = moe.moe_block(c, lp, h, tp)
    if "sh_gate" in lp:
        sh = psum(swiglu(h, {"gate": lp["sh_gate"], "up": lp["sh_up"], "down": lp["sh_down"]}), tp)
        gate = jax.nn.sigmoid(jnp.einsum("bth,ho->bto", h, lp["sh_router"], preferred_element_type=F32))
        out = out + (gate * sh.astype(F32)).astype(out.dtype)
    return out


def run_layers(c, layers, x, cache: HybridCache | None, pos, *, tp=None, impl=None, new_mask=None, uniform=False,
               valid=None, verify=False, parent=None, depth=None, on_layer=None):
    """The decoder layers of a hybrid target over T new rows x [B, T, H] at positions pos [B, T].

    cache None: a fresh causal sequence (training, full forward). Otherwise the attention layers write their K/V at
    pos[:, 0] and read the committed cache; the linear layers start from the committed state and - `verify` - leave
    a Pending for commit (a tree: new_mask [B, T, T] ancestors and self, parent / depth [B, T]) or - else - apply
    the rows (`valid` [B, T]: rows past a prompt's end change nothing). on_layer(i, x): called with every layer's
    output (the drafter's taps). Returns (x, new cache)."""
    B, T, _ = x.shape
    inv = rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling)
    cos, sin = rope_cos_sin(pos, inv, rope_attention_factor(c.rope_scaling))
    k_all = v_all = None
    conv = rec = None
    if cache is not None:
        k_all, v_all = cache.kv.k, cache.kv.v
        conv, rec = cache.lin.conv, cache.lin.rec
    pend = []
    zero_conv = zero_rec = None
    for i, (lp, (ai, li)) in enumerate(zip(layers, kinds(c))):
        h = norm(c, x, lp["input_norm"])
        if ai >= 0:
            o, k_all, v_all = _attention_layer(c, lp, h, k_all, v_all, ai, pos, cos, sin, impl, new_mask, uniform)
        else:
            if cache is None:
                if zero_conv is None:
                    st = gdn.init_state(c.gdn, 1, B, x.dtype, lp["lin_v"].shape[1] // c.gdn.v_dim)
                    zero_conv, zero_rec = st.conv[0], st.rec[0]
                cs, rs = zero_conv, zero_rec
            else:
                cs, rs = conv[li], rec[li]
            tree = new_mask is not None
            o, new = gdn.mixer(c.gdn, lp, h, cs, rs, eps=c.rms_norm_eps, valid=valid, pending=verify,
                               parent=parent if tree else None, depth=depth if tree else None,
                               anc=new_mask if tree else None)
            if cache is not None:
                if verify:
                    pend.append(new)
                else:
                    conv = conv.at[li].set(new[0].astype(conv.dtype))
                    rec = rec.at[li].set(new[1])
        x = x + psum(o, tp)
        x = x + ffn(c, lp, norm(c, x, lp["post_norm"]), i, tp)
        if on_layer is not None:
            on_layer(i, x)
    if cache is None:
        return x, None
    kv = KVCache(k_all, v_all, cache.kv.lengths + T)
    pending = jax.tree.map(lambda *a: jnp.stack(a), *pend) if pend else None
    return x, HybridCache(kv=kv, lin=gdn.GDNState(conv=conv, rec=rec), pending=pending)


# ----------------------------------------------------------------------------------------------
# Checkpoint names
# ----------------------------------------------------------------------------------------------
_ATTN = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
         "o": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
_LIN = {"lin_z": "linear_attn.in_proj_z.weight", "lin_b": "linear_attn.in_proj_b.weight",
        "lin_a": "linear_attn.in_proj_a.weight", "dt_bias": "linear_attn.dt_bias", "A_log": "linear_attn.A_log",
        "lin_norm": "linear_attn.norm.weight", "lin_out": "linear_attn.out_proj.weight"}
_COMMON = {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
           "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}
_SHARED = {"sh_gate": "mlp.shared_expert.gate_proj.weight", "sh_up": "mlp.shared_expert.up_proj.weight",
           "sh_down": "mlp.shared_expert.down_proj.weight", "sh_router": "mlp.shared_expert_gate.weight",
           "router": "mlp.gate.weight"}
TRANSPOSED = frozenset({"o", "gate", "up", "down", "lin_q", "lin_k", "lin_v", "lin_z", "lin_b", "lin_a", "lin_out",
                        "lm_head", "sh_gate", "sh_up", "sh_down", "sh_router", "router"})


def expert_sources(c, names, base: str) -> dict:
    """Our expert params of one layer from either layout: one tensor per expert (`experts.{e}.gate_proj.weight`
    ...) or fused 3D tensors (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I])."""
    E, I = c.num_experts, c.moe_intermediate_size
    fused = base + "mlp.experts.gate_up_proj"
    if fused in names:
        down = base + "mlp.experts.down_proj"
        return {"e_gate": (fused, lambda w: np.swapaxes(w[:, :I], 1, 2)),
                "e_up": (fused, lambda w: np.swapaxes(w[:, I:], 1, 2)),
                "e_down": (down, lambda w: np.swapaxes(w, 1, 2))}
    per = lambda k: tuple(f"{base}mlp.experts.{e}.{k}_proj.weight" for e in range(E))
    stack = lambda ws: np.stack([np.asarray(w).T for w in ws])
    return {"e_gate": (per("gate"), stack), "e_up": (per("up"), stack), "e_down": (per("down"), stack)}


def hf_sources(c, pre: str = "model.", names=()) -> dict:
    """{our key path: (tensor name, how to build ours from it)}: how = "T" (transpose), None (as is), or a
    (name, function) for tensors split out of a fused one (Qwen3-Next in_proj_qkvz / in_proj_ba, the q / k / v
    parts of conv1d)."""
    g = c.gdn
    out = {("embed",): (pre + "embed_tokens.weight", None), ("norm",): (pre + "norm.weight", None)}
    if not c.tie_word_embeddings:
        out[("lm_head",)] = ("lm_head.weight", "T")
    ks, vs = g.key_size, g.value_size
    r = g.num_v_heads // g.num_k_heads
    for i, t in enumerate(c.layer_types):
        base = f"{pre}layers.{i}."
        for k, n in _COMMON.items():
            if k in ("gate", "up", "down") and c.is_sparse(i):
                continue
            out[("layers", i, k)] = (base + n, "T" if k in TRANSPOSED else None)
        if c.is_sparse(i):
            for k, n in _SHARED.items():
                if k == "router" or c.shared_expert_size:
                    out[("layers", i, k)] = (base + n, "T")
            for k, v in expert_sources(c, names, base).items():
                out[("layers", i, k)] = v
        if t == "full":
            for k, n in _ATTN.items():
                out[("layers", i, k)] = (base + n, "T" if k in TRANSPOSED else None)
            continue
        for k, n in _LIN.items():
            out[("layers", i, k)] = (base + n, "T" if k in TRANSPOSED else None)
        conv = base + "linear_attn.conv1d.weight"  # [C, 1, K]
        for k, (a, b) in {"conv_q": (0, ks), "conv_k": (ks, 2 * ks), "conv_v": (2 * ks, 2 * ks + vs)}.items():
            out[("layers", i, k)] = (conv, lambda w, a=a, b=b: w[a:b, 0, :])
        if c.family == "qwen3_next":  # fused, grouped per key head: [Hk, (Dk, Dk, r Dv, r Dv)] and [Hk, (r, r)]
            qkvz, ba = base + "linear_attn.in_proj_qkvz.weight", base + "linear_attn.in_proj_ba.weight"
            cuts = np.cumsum([g.k_dim, g.k_dim, r * g.v_dim, r * g.v_dim])

            def part(w, j, cuts=cuts):
                w = w.reshape(g.num_k_heads, -1, w.shape[-1])
                lo = 0 if j == 0 else cuts[j - 1]
                return w[:, lo:cuts[j]].reshape(-1, w.shape[-1]).T

            for j, k in enumerate(("lin_q", "lin_k", "lin_v", "lin_z")):
                out[("layers", i, k)] = (qkvz, lambda w, j=j: part(w, j))
            for j, k in enumerate(("lin_b", "lin_a")):
                out[("layers", i, k)] = (ba, lambda w, j=j: w.reshape(g.num_k_heads, 2, r, -1)[:, j].reshape(-1, w.shape[-1]).T)
        else:
            qkv = base + "linear_attn.in_proj_qkv.weight"
            for k, (a, b) in {"lin_q": (0, ks), "lin_k": (ks, 2 * ks), "lin_v": (2 * ks, 2 * ks + vs)}.items():
                out[("layers", i, k)] = (qkv, lambda w, a=a, b=b: w[a:b].T)
    return out


def load_params(c, st, dtype, place=None) -> dict:
    """Params from a checkpoint (dflash_jax.st_io.SafetensorsDir), every tensor checked against config.json; the vision
    tower, `mtp.*` and rotary buffers are skipped; `place`: st_io.read_params's."""
    names = set(st.keys())
    skip = ("model.visual.", "visual.", "mtp.", "model.mtp.")
    return read_params(st, hf_sources(c, text_prefix(names), names), param_shapes(c), dtype,
                       lambda n: n.startswith(skip) or n.endswith("rotary_emb.inv_freq")
                       or (c.tie_word_embeddings and n == "lm_head.weight"), place)


def hf_tensors(c, params) -> dict:
    """Our params -> {HF tensor name: array} in the Qwen3.5 text layout (`model.` prefix; Qwen3-Next checkpoints
    are written unfused in that layout too only when family is qwen3_5)."""
    if c.family != "qwen3_5":
        raise ValueError("saving is supported for dense qwen3_5 hybrids")
    get = lambda a: np.asarray(jax.device_get(a))
    out = {"model.embed_tokens.weight": get(params["embed"]), "model.norm.weight": get(params["norm"])}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = get(params["lm_head"]).T
    for i, (t, lp) in enumerate(zip(c.layer_types, params["layers"])):
        base = f"model.layers.{i}."
        names = dict(_COMMON, **(_ATTN if t == "full" else _LIN))
        for k, n in names.items():
            out[base + n] = get(lp[k]).T if k in TRANSPOSED else get(lp[k])
        if t == "linear":
            out[base + "linear_attn.in_proj_qkv.weight"] = np.concatenate(
                [get(lp["lin_q"]), get(lp["lin_k"]), get(lp["lin_v"])], axis=1).T
            out[base + "linear_attn.conv1d.weight"] = np.concatenate(
                [get(lp["conv_q"]), get(lp["conv_k"]), get(lp["conv_v"])], axis=0)[:, None, :]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
