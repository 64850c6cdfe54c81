"""Mixture-of-experts feed-forward blocks (Qwen3-MoE, gpt-oss): router, expert compute, HF tensor
names of the experts and MXFP4 dequantisation.

Params of a MoE layer (our [in, out] layout, experts stacked on a leading [E] axis):
  router [H, E] (+ router_bias [E], gpt-oss), e_gate / e_up [E, H, I], e_down [E, I, H]
  (+ e_gate_bias / e_up_bias [E, I], e_down_bias [E, H], gpt-oss).
gpt-oss checkpoints interleave gate and up columns in one `gate_up_proj` [E, H, 2I]; they are split on
load (gate = even columns, up = odd) and interleaved again on save.

Expert compute, chosen by the static token count N (rows x tokens) against the local expert count:
  N * top_k < E_local: slice out the selected experts' weights per (token, slot) (a decode step or a
    small verify block reads only the experts it routed to: bandwidth independent of E);
  otherwise: sort the N * top_k (token, expert) assignments by expert and run `jax.lax.ragged_dot`
    (grouped matmul, no capacity limit, no dropped tokens).
Expert parallelism: under shard_map the expert axis is split over the tensor-parallel axis `tp`, and
the activations entering the block are replicated over it. Two ways back to replicated outputs
(`TargetConfig.moe_combine`):
  "psum" (default): each device computes the assignments that landed on its experts for all tokens
    and the partial outputs are summed (one all-reduce of [N, H] per layer, as the dense MLP's
    row-parallel down projection);
  "all_to_all": each device takes N/M of the tokens, sends each (token, slot) to the device holding
    its expert (all-to-all of [M, N/M * k, H]: no capacity limit, so every destination has room for
    all of a device's slots), computes the experts it received, returns the results (a second
    all-to-all), combines its tokens and all-gathers [N, H].
With replicated activations the all-to-all moves about k/2 times the psum's bytes (k = top-k); the
planner measures both on TPU (reports/tpu_plan/README.md), which is why psum is the default.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .layers import F32, SCALE, psum, swiglu

EXPERT_KEYS = ("router", "router_bias", "e_gate", "e_up", "e_down", "e_gate_bias", "e_up_bias", "e_down_bias")
DENSE_KEYS = ("gate", "up", "down")
GPT_OSS_ALPHA = 1.702


# ----------------------------------------------------------------------------------------------
# Param shapes
# ----------------------------------------------------------------------------------------------
def update_param_shapes(c, layers: dict) -> dict:
    """Add the expert params of a MoE config to `layers` (stacked shapes), drop the dense MLP when
    no layer has one. A model mixing dense and MoE layers (Qwen3-MoE `mlp_only_layers`) carries both
    sets on every layer (the unused one zero) so that layers stack for lax.scan."""
    if not c.num_experts:
        return layers
    L, H, E, I = c.num_layers, c.hidden_size, c.num_experts, c.moe_intermediate_size
    layers = dict(layers)
    if not c.has_dense_mlp:
        for k in DENSE_KEYS:
            layers.pop(k)
    layers.update(router=(L, H, E), e_gate=(L, E, H, I), e_up=(L, E, H, I), e_down=(L, E, I, H))
    if c.family == "gpt_oss":
        layers.update(router_bias=(L, E), e_gate_bias=(L, E, I), e_up_bias=(L, E, I), e_down_bias=(L, E, H))
    return layers


def hf_layer_has(c, key: str, i: int) -> bool:
    """Whether our layer param `key` of layer i comes from (and goes to) the HF checkpoint through the
    plain per-layer name map (the dense MLP of a dense layer, attention) - False for expert params and
    for the zero-filled dense MLP of a MoE layer."""
    if key in EXPERT_KEYS:
        return False
    if key in DENSE_KEYS and c.is_sparse(i):
        return False
    return True


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
def ffn(c, lp, x, i, tp=None):
    """The feed-forward block of layer i on normed x [B, T, H] -> its output, reduced over `tp`
    (tensor / expert parallel axis under shard_map). `i` is a Python/NumPy int (unrolled layers) or
    a traced index (scan)."""
    def dense():
        return psum(swiglu(x, lp), tp)

    if not c.num_experts:
        return dense()
    if not c.has_dense_mlp:
        return moe_block(c, lp, x, tp)
    if isinstance(i, (int, np.integer)):
        return moe_block(c, lp, x, tp) if c.is_sparse(int(i)) else dense()
    sparse = jnp.asarray([c.is_sparse(j) for j in range(c.num_layers)])[i]
    return jax.lax.cond(sparse, lambda: moe_block(c, lp, x, tp), dense)


def route(c, lp, x):
    """x [N, H] -> (combine weights [N, k] float32, expert ids [N, k] int32), as transformers routes:
    qwen3_moe: softmax over all experts, top-k, optionally renormalised (norm_topk_prob);
    gpt_oss: top-k of the (biased) logits, softmax over those k."""
    logits = jnp.einsum("nh,he->ne", x, lp["router"], preferred_element_type=F32)
    if "router_bias" in lp:
        logits = logits + lp["router_bias"].astype(F32)
    k = c.num_experts_per_tok
    if c.family == "gpt_oss":
        vals, idx = jax.lax.top_k(logits, k)
        return jax.nn.softmax(vals, axis=-1), idx
    w, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if c.norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w, idx


def activation(c, g, u):
    """Gated activation of one expert: SwiGLU (qwen3_moe), GELU-tanh(gate) * up (gemma4) or gpt-oss's clamped variant
    (gate clamped above at `limit`, up clamped to [-limit, limit], (up + 1) * gate * sigmoid(1.702 gate))."""
    if c.family == "gemma4":
        return jax.nn.gelu(g, approximate=True) * u
    if c.family == "gpt_oss":
        g = jnp.minimum(g, c.swiglu_limit)
        u = jnp.clip(u, -c.swiglu_limit, c.swiglu_limit)
        return (u + 1) * (g * jax.nn.sigmoid(g * GPT_OSS_ALPHA))
    return jax.nn.silu(g) * u


def moe_block(c, lp, x, tp=None):
    """MoE block on normed x [B, T, H] (replicated over `tp`) -> output [B, T, H], reduced over `tp`."""
    B, T, H = x.shape
    x2 = x.reshape(B * T, H)
    w, idx = route(c, lp, x2)
    if tp is not None and c.moe_combine == "all_to_all":
        return experts_all_to_all(c, lp, x2, w, idx, tp).reshape(B, T, H)
    E_loc = lp["e_gate"].shape[0]
    local = idx
    if tp is not None:  # expert parallel: this device holds experts [offset, offset + E_loc)
        local = idx - jax.lax.axis_index(tp) * E_loc
        w = jnp.where((local >= 0) & (local < E_loc), w, 0.0)
    out = _local_experts(c, lp, x2, w, local)
    return psum(out, tp).reshape(B, T, H)


def _local_experts(c, lp, x, w, e):
    """Weighted sum over slots of this device's experts: x [N, H], w / e [N, k] (e local ids; out of
    range = another device's expert, weight 0) -> [N, H]."""
    if x.shape[0] * e.shape[1] < lp["e_gate"].shape[0]:
        return experts_gathered(c, lp, x, w, e)
    return experts_grouped(c, lp, x, w, e)


def experts_all_to_all(c, lp, x, w, idx, tp):
    """Expert parallel by dispatch: this device's N/M tokens (padded to a multiple of M) send each
    (token, slot) to its expert's device, the received slots run through the local experts, the
    results come back and the tokens' outputs are all-gathered. x [N, H] replicated; -> [N, H]."""
    M = jax.lax.psum(1, tp)
    N, H = x.shape
    k = idx.shape[1]
    E_loc = lp["e_gate"].shape[0]
    n = -(-N // M)
    pad = n * M - N
    if pad:
        x = jnp.concatenate([x, jnp.zeros((pad, H), x.dtype)])
        w = jnp.concatenate([w, jnp.zeros((pad, k), w.dtype)])
        idx = jnp.concatenate([idx, jnp.zeros((pad, k), idx.dtype)])
    me = jax.lax.axis_index(tp)
    mx = jax.lax.dynamic_slice_in_dim(x, me * n, n)  # [n, H] my tokens
    mi = jax.lax.dynamic_slice_in_dim(idx, me * n, n).reshape(n * k)  # [n k] slot -> global expert
    mw = jax.lax.dynamic_slice_in_dim(w, me * n, n)
    dest = mi // E_loc
    to = jnp.arange(M)[:, None] == dest[None, :]  # [M, n k]: slot s goes to device dest[s]
    send_x = jnp.where(to[..., None], jnp.repeat(mx, k, axis=0)[None], jnp.zeros((), x.dtype))  # [M, n k, H]
    send_e = jnp.where(to, mi % E_loc, E_loc)  # E_loc = no slot here
    recv_x = jax.lax.all_to_all(send_x, tp, 0, 0, tiled=False)  # [M (source), n k, H]
    recv_e = jax.lax.all_to_all(send_e, tp, 0, 0, tiled=False)
    ones = jnp.where(recv_e < E_loc, 1.0, 0.0).reshape(M * n * k, 1)  # each received slot once, weight 1
    y = _local_experts(c, lp, recv_x.reshape(M * n * k, H), ones, recv_e.reshape(M * n * k, 1))
    back = jax.lax.all_to_all(y.reshape(M, n * k, H), tp, 0, 0, tiled=False)  # [M (expert device), n k, H]
    mine = jnp.take_along_axis(back, dest[None, :, None], axis=0)[0]  # [n k, H]: each slot from its device
    out = jnp.sum(mine.reshape(n, k, H).astype(F32) * mw[..., None], axis=1).astype(x.dtype)  # [n, H]
    return jax.lax.all_gather(out, tp, axis=0, tiled=True)[:N]


def _bias(lp, name, e):
    return lp[name][e].astype(F32) if name in lp else 0.0


def experts_gathered(c, lp, x, w, e):
    """Few tokens: one dynamic slice of each (token, slot)'s expert matrices and a matvec - only the
    selected experts are read. (A vectorised gather `W[e]` makes the TPU compiler read the whole
    expert stack: 301 MiB vs 24 MiB per chip for one token, top-8 of 32 local Qwen3-30B-A3B experts.)
    Slots routed to another device (weight 0) read a clipped expert and contribute zero."""
    e = jnp.clip(e, 0, lp["e_gate"].shape[0] - 1)
    dt = x.dtype
    N, k = e.shape

    def pick(name, n, j):
        return jax.lax.dynamic_index_in_dim(lp[name], e[n, j], 0, keepdims=False)

    def bias(name, n, j):
        return pick(name, n, j).astype(F32) if name in lp else 0.0

    def dot(v, name, n, j):  # a quantized expert (dflash_jax.quant): 1-byte values, the product scaled
        y = jnp.dot(v, pick(name, n, j).astype(dt), preferred_element_type=F32)
        return y * pick(name + SCALE, n, j) if name + SCALE in lp else y

    rows = []
    for n in range(N):
        acc = jnp.zeros((x.shape[-1],), F32)
        for j in range(k):
            g = dot(x[n], "e_gate", n, j) + bias("e_gate_bias", n, j)
            u = dot(x[n], "e_up", n, j) + bias("e_up_bias", n, j)
            a = activation(c, g, u).astype(dt)
            y = dot(a, "e_down", n, j) + bias("e_down_bias", n, j)
            acc = acc + w[n, j] * y
        rows.append(acc)
    return jnp.stack(rows).astype(dt)


def experts_grouped(c, lp, x, w, e):
    """Many tokens: sort the N*k assignments by expert, one grouped matmul per projection
    (`jax.lax.ragged_dot`), weighted scatter-add back to the tokens. No capacity limit; assignments to
    experts of other devices sort past the last group (ragged_dot leaves those rows zero)."""
    N, k = e.shape
    E_loc = lp["e_gate"].shape[0]
    dt = x.dtype
    flat = jnp.where((e >= 0) & (e < E_loc), e, E_loc).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    se = flat[order]  # sorted expert ids (E_loc = not here)
    tok = order // k
    sizes = jnp.zeros((E_loc,), jnp.int32).at[se].add(1, mode="drop")
    xs = x[tok]
    ec = jnp.minimum(se, E_loc - 1)

    def dot(v, name):  # a quantized expert stack: converted for the grouped matmul, each row's product scaled
        y = jax.lax.ragged_dot(v, lp[name].astype(dt), sizes, preferred_element_type=F32)
        return y * lp[name + SCALE][ec] if name + SCALE in lp else y

    g = dot(xs, "e_gate") + _bias(lp, "e_gate_bias", ec)
    u = dot(xs, "e_up") + _bias(lp, "e_up_bias", ec)
    a = activation(c, g, u).astype(dt)
    y = dot(a, "e_down") + _bias(lp, "e_down_bias", ec)
    ws = jnp.where(se < E_loc, w.reshape(-1)[order], 0.0)
    return jnp.zeros((N, x.shape[-1]), F32).at[tok].add(y * ws[:, None]).astype(dt)


# ----------------------------------------------------------------------------------------------
# HF checkpoints: expert tensor names, MXFP4
# ----------------------------------------------------------------------------------------------
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def mxfp4_dequant(blocks, scales) -> np.ndarray:
    """MXFP4 (OCP microscaling, as gpt-oss ships its experts): blocks [..., G, 16] uint8 (two e2m1
    values per byte, low nibble first), scales [..., G] uint8 (e8m0, exponent bias 127) ->
    float32 [..., G * 32]."""
    blocks = np.asarray(blocks, np.uint8)
    scales = np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match")
    out = np.empty(blocks.shape[:-1] + (blocks.shape[-1] * 2,), np.float32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    out = np.ldexp(out, (scales.astype(np.int32) - 127)[..., None])
    return out.reshape(blocks.shape[:-2] + (-1,))


def mxfp4_quantize(w) -> tuple[np.ndarray, np.ndarray]:
    """float [..., K] (K a multiple of 32) -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8):
    round-to-nearest e2m1 with a power-of-two scale per 32 values (for tests; not a tuned quantiser)."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % 32:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of 32, got {w.shape[-1]}")
    g = w.reshape(w.shape[:-1] + (-1, 32))
    amax = np.max(np.abs(g), axis=-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    exp = np.clip(exp, -127, 127)
    q = g / np.ldexp(1.0, exp)[..., None]
    codes = np.argmin(np.abs(np.abs(q)[..., None] - FP4_VALUES[:8]), axis=-1).astype(np.uint8)  # magnitude
    codes = np.where(q < 0, codes | 8, codes).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + 127).astype(np.uint8)


class Lazy:
    """A tensor built from checkpoint tensors on demand: `shape`, `a[index]` reads only what the index
    needs along axis 0 (the expert axis), `np.asarray(a)` reads all."""

    def __init__(self, shape, read_rows):
        self.shape = tuple(shape)
        self._read = read_rows  # (expert ids ndarray) -> array [len(ids), ...]

    def __array__(self, dtype=None, copy=None):
        a = self._read(np.arange(self.shape[0]))
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        if not index:
            return np.asarray(self)
        rows = np.arange(self.shape[0])[index[0]]
        a = self._read(np.atleast_1d(rows))
        a = a[(slice(None),) + tuple(index[1:])]
        return a[0] if np.ndim(rows) == 0 else a


def zeros_source(shape) -> Lazy:
    return Lazy(shape, lambda ids: np.zeros((len(ids),) + tuple(shape[1:]), np.float32))


def _prefix(i):
    return f"model.layers.{i}.mlp."


def _check(st, name, shape):
    if name not in st:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    if st.shape(name) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {st.shape(name)}, expected {tuple(shape)} from config.json")


def hf_expert_sources(c, st, i: int) -> tuple[dict, set]:
    """Layer i's expert params read from checkpoint `st` (a SafetensorsDir): ({our key: (source,
    transposed)}, HF names consumed). Shapes are checked; a missing tensor is a ValueError."""
    H, E, I, p = c.hidden_size, c.num_experts, c.moe_intermediate_size, _prefix(i)
    names = set(st.keys())
    used = set()

    def need(name, shape):
        _check(st, name, shape)
        used.add(name)
        return name

    if c.family == "qwen3_moe":
        out = {"router": (need(p + "gate.weight", (E, H)), True)}
        for key, proj, shape in (("e_gate", "gate_proj", (I, H)), ("e_up", "up_proj", (I, H)),
                                 ("e_down", "down_proj", (H, I))):
            per = [need(f"{p}experts.{e}.{proj}.weight", shape) for e in range(E)]
            out[key] = (Lazy((E,) + shape[::-1], lambda ids, per=per: np.stack(
                [np.asarray(st.get(per[j])).T for j in ids])), False)
        return out, used
    # gpt_oss
    out = {"router": (need(p + "router.weight", (E, H)), True), "router_bias": (need(p + "router.bias", (E,)), False)}
    gub = need(p + "experts.gate_up_proj_bias", (E, 2 * I))
    out["e_gate_bias"] = (Lazy((E, I), lambda ids: np.asarray(st.get(gub))[ids][:, 0::2]), False)
    out["e_up_bias"] = (Lazy((E, I), lambda ids: np.asarray(st.get(gub))[ids][:, 1::2]), False)
    out["e_down_bias"] = (need(p + "experts.down_proj_bias", (E, H)), False)
    if p + "experts.gate_up_proj_blocks" in names:  # MXFP4: [E, out, in/32, 16] + [E, out, in/32]
        if H % 32 or I % 32:
            raise ValueError(f"MXFP4 experts need hidden_size and intermediate_size divisible by 32 ({H}, {I})")
        gb, gs = need(p + "experts.gate_up_proj_blocks", (E, 2 * I, H // 32, 16)), need(
            p + "experts.gate_up_proj_scales", (E, 2 * I, H // 32))
        db, ds = need(p + "experts.down_proj_blocks", (E, H, I // 32, 16)), need(
            p + "experts.down_proj_scales", (E, H, I // 32))

        def gate_up(ids, cols):  # dequantised [n, 2I, H] -> our [n, H, I] (even rows gate, odd rows up)
            w = mxfp4_dequant(np.asarray(st.get(gb))[ids], np.asarray(st.get(gs))[ids])
            return np.swapaxes(w[:, cols], 1, 2)

        out["e_gate"] = (Lazy((E, H, I), lambda ids: gate_up(ids, slice(0, None, 2))), False)
        out["e_up"] = (Lazy((E, H, I), lambda ids: gate_up(ids, slice(1, None, 2))), False)
        out["e_down"] = (Lazy((E, I, H), lambda ids: np.swapaxes(
            mxfp4_dequant(np.asarray(st.get(db))[ids], np.asarray(st.get(ds))[ids]), 1, 2)), False)
        return out, used
    gu = need(p + "experts.gate_up_proj", (E, H, 2 * I))
    out["e_gate"] = (Lazy((E, H, I), lambda ids: np.asarray(st.get(gu))[ids][..., 0::2]), False)
    out["e_up"] = (Lazy((E, H, I), lambda ids: np.asarray(st.get(gu))[ids][..., 1::2]), False)
    out["e_down"] = (need(p + "experts.down_proj", (E, I, H)), False)
    return out, used


def hf_expert_tensors(c, lp: dict, i: int) -> dict:
    """Layer i's expert params (numpy, our layout) -> {HF name: array} in the HF layout (gpt-oss:
    plain, not MXFP4)."""
    p = _prefix(i)
    if c.family == "qwen3_moe":
        out = {p + "gate.weight": lp["router"].T}
        for key, proj in (("e_gate", "gate_proj"), ("e_up", "up_proj"), ("e_down", "down_proj")):
            for e in range(c.num_experts):
                out[f"{p}experts.{e}.{proj}.weight"] = lp[key][e].T
        return out

    def inter(a, b):  # interleave along the last axis: a -> even, b -> odd
        return np.stack([a, b], axis=-1).reshape(a.shape[:-1] + (-1,))

    return {p + "router.weight": lp["router"].T, p + "router.bias": lp["router_bias"],
            p + "experts.gate_up_proj": inter(lp["e_gate"], lp["e_up"]),
            p + "experts.gate_up_proj_bias": inter(lp["e_gate_bias"], lp["e_up_bias"]),
            p + "experts.down_proj": lp["e_down"], p + "experts.down_proj_bias": lp["e_down_bias"]}
