"""Gated DeltaNet: the linear-attention layer kind of the Qwen3.5 / Qwen3.6 / Qwen3-Next hybrids, with the state a
speculative decoder needs - a conv window and a delta-rule state per row that verification does not overwrite and
commit moves to the accepted length (a chain) or the accepted path (a tree).

The layer (transformers `Qwen3_5GatedDeltaNet`): projections q | k | v (channels of a depthwise causal conv of
`conv_kernel` taps + SiLU), z (the output gate), b (beta = sigmoid(b)) and a (log decay
g = -exp(A_log) * softplus(a + dt_bias)); q and k L2-normalised, q scaled by k_dim^-1/2, each key head serving
num_v_heads / num_k_heads consecutive value heads; per value head the state S [k_dim, v_dim] (float32) follows

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t,   a_t = exp(g_t)

and the output is out_proj(rmsnorm(o) * w * silu(z)).

Block form (`delta_block`): unrolled over a block of W new tokens from the state S0, with gamma_t the product of
a along the token's path, S_t = gamma_t S0 + sum_{j <= t} (gamma_t / gamma_j) k_j u_j^T, so the u solve the unit
lower-triangular system  u_t + beta_t sum_{j < t} (gamma_t / gamma_j)(k_j . k_t) u_j = beta_t (v_t - gamma_t S0^T k_t)
over the block (solved as (I + M)^-1 by log2 W matrix products, `unit_lower_inverse`), and o_t = gamma_t S0^T q_t + sum_{j <= t} (gamma_t / gamma_j)(k_j . q_t) u_j: matrix work, no scan
over tokens. "j < t" is "j is a strict ancestor of t": a chain's causal mask, or a draft tree's ancestor mask (a
parent precedes its children in the flattened order, so the system stays triangular), which gives every tree node
the state of its own path. A long sequence (prefill) runs sub-blocks of `SUB_BLOCK` tokens in a scan, carrying S.

Commit (`commit_state`) needs only what the block computed (`Pending`: u, k, the path-cumulative log decay and the
conv inputs): the state after a row's last accepted node e is gamma_e S0 + sum_{j on e's path} (gamma_e / gamma_j)
k_j u_j^T, and the conv window the last conv_kernel - 1 inputs along that path. `recurrent_reference` is the
token-by-token recurrence (the test oracle).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .families import GDNConfig

F32 = jnp.float32
HIGH = jax.lax.Precision.HIGHEST
SUB_BLOCK = 32  # tokens per sub-block of a long sequence (prefill chunks, training); measured on 2 CPU cores at
# 32 value heads of 128 x 128, 1024 tokens: 98 ms per layer at 32, 132 ms at 64, 371 ms token by token


def param_shapes(g: GDNConfig, hidden: int) -> dict:
    """One layer's params: matrices [in, out]; conv taps [channels, conv_kernel] split q / k / v (so heads shard
    over a mesh axis like every other projection)."""
    K = g.conv_kernel
    return {"lin_q": (hidden, g.key_size), "lin_k": (hidden, g.key_size), "lin_v": (hidden, g.value_size),
            "lin_z": (hidden, g.value_size), "lin_b": (hidden, g.num_v_heads), "lin_a": (hidden, g.num_v_heads),
            "conv_q": (g.key_size, K), "conv_k": (g.key_size, K), "conv_v": (g.value_size, K),
            "dt_bias": (g.num_v_heads,), "A_log": (g.num_v_heads,), "lin_norm": (g.v_dim,),
            "lin_out": (g.value_size, hidden)}


# ----------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------
@flax.struct.dataclass
class GDNState:
    conv: jax.Array  # [Lg, B, K - 1, C] the last conv_kernel - 1 conv inputs (q | k | v channels), oldest first
    rec: jax.Array  # [Lg, B, Hv, Dk, Dv] float32 delta-rule state


@flax.struct.dataclass
class Pending:
    """What one verification of W rows leaves for commit, per layer."""
    x: jax.Array  # [Lg, B, W, C] conv inputs of the new rows
    u: jax.Array  # [Lg, B, W, Hv, Dv] float32
    k: jax.Array  # [Lg, B, W, Hv, Dk] float32 (normalised, one per value head)
    lg: jax.Array  # [Lg, B, W, Hv] float32 log decay summed along each row's path


def init_state(g: GDNConfig, layers: int, batch: int, dtype, local_heads: int | None = None) -> GDNState:
    """Zero state of `layers` GDN layers (`local_heads`: value heads on this device under shard_map)."""
    hv = g.num_v_heads if local_heads is None else int(local_heads)
    r = g.num_v_heads // g.num_k_heads
    C = 2 * (hv // r) * g.k_dim + hv * g.v_dim
    return GDNState(conv=jnp.zeros((layers, batch, g.conv_kernel - 1, C), dtype),
                    rec=jnp.zeros((layers, batch, hv, g.k_dim, g.v_dim), F32))


def state_bytes(g: GDNConfig, layers: int, batch: int, dtype) -> int:
    """Resident bytes of the state (the planner's memory check)."""
    it = jnp.dtype(dtype).itemsize
    return layers * batch * ((g.conv_kernel - 1) * g.conv_dim * it + g.num_v_heads * g.k_dim * g.v_dim * 4)


# ----------------------------------------------------------------------------------------------
# The delta rule
# ----------------------------------------------------------------------------------------------
def block_terms(k, v, g, beta, anc):
    """The state-independent part of a block (the WY form): k, v, g, beta as in delta_block. Returns (u0, wk, lg) with
    u0 = (I + M)^-1 beta v [B, W, H, Dv], wk = (I + M)^-1 beta gamma k [B, W, H, Dk] (so that u = u0 - wk S0) and lg
    [B, W, H] the log decay summed along each row's path."""
    W = k.shape[1]
    A = jnp.broadcast_to(anc, (k.shape[0], W, W))
    lg = jnp.einsum("bij,bjh->bih", A.astype(F32), g, precision=HIGH)
    strict = A & ~jnp.eye(W, dtype=bool)[None]
    diff = lg[:, :, None, :] - lg[:, None, :, :]  # [B, i, j, H]; <= 0 where j is an ancestor of i
    dec_st = jnp.where(strict[..., None], jnp.exp(jnp.where(strict[..., None], diff, 0.0)), 0.0)
    kk = jnp.einsum("bihd,bjhd->bijh", k, k, precision=HIGH)
    inv = unit_lower_inverse(jnp.moveaxis(beta[:, :, None, :] * dec_st * kk, 3, 1))  # [B, H, W, W]
    u0 = jnp.einsum("bhij,bjhv->bihv", inv, beta[..., None] * v, precision=HIGH)
    wk = jnp.einsum("bhij,bjhk->bihk", inv, (beta * jnp.exp(lg))[..., None] * k, precision=HIGH)
    return u0, wk, lg


def block_scores(q, k, lg, anc):
    """[B, i, j, H]: (gamma_i / gamma_j)(k_j . q_i) where j is i or one of its ancestors, else 0."""
    A = jnp.broadcast_to(anc, (q.shape[0],) + anc.shape[1:])[..., None]
    diff = lg[:, :, None, :] - lg[:, None, :, :]
    dec_in = jnp.where(A, jnp.exp(jnp.where(A, diff, 0.0)), 0.0)
    return dec_in * jnp.einsum("bihd,bjhd->bijh", q, k, precision=HIGH)


def block_apply(S0, q, u0, wk, lg, scores):
    """The state-dependent part of a block: (o [B, W, H, Dv], u [B, W, H, Dv])."""
    u = u0 - jnp.einsum("bthk,bhkv->bthv", wk, S0, precision=HIGH)
    o = jnp.exp(lg)[..., None] * jnp.einsum("bhkv,bthk->bthv", S0, q, precision=HIGH) + jnp.einsum(
        "bijh,bjhv->bihv", scores, u, precision=HIGH)
    return o, u


def delta_block(S0, q, k, v, g, beta, anc):
    """One block of W tokens from the state S0 [B, H, Dk, Dv] (float32): q, k [B, W, H, Dk], v [B, W, H, Dv], g and
    beta [B, W, H] (float32), anc [B or 1, W, W] bool (t, j): j is t or an ancestor of t (a chain: lower triangle).
    Returns (o [B, W, H, Dv], u [B, W, H, Dv], lg [B, W, H]: log decay summed along each token's path)."""
    u0, wk, lg = block_terms(k, v, g, beta, anc)
    o, u = block_apply(S0, q, u0, wk, lg, block_scores(q, k, lg, anc))
    return o, u, lg


def unit_lower_inverse(N):
    """(I + N)^-1 for strictly lower triangular N [..., W, W]: N is nilpotent, so the inverse is the finite product
    (I - N)(I + N^2)(I + N^4)... over ceil(log2 W) factors - 2 log2(W) matrix products, no sequential solve (XLA's
    triangular solve runs a scalar loop on CPU: 115 ms for 8 heads of 64 x 64)."""
    W = N.shape[-1]
    eye = jnp.eye(W, dtype=N.dtype)
    P = -N
    inv = eye + P
    for _ in range(max(int(np.ceil(np.log2(W))), 1) - 1):
        P = jnp.matmul(P, P, precision=HIGH)
        inv = jnp.matmul(inv, eye + P, precision=HIGH)
    return inv


def state_after(S0, k, u, lg, on_path, end_lg):
    """The state after a path: on_path [B, W] (float: 1 where the row is on the kept path), end_lg [B, H] the
    path's summed log decay (0 for an empty path: S0 itself)."""
    w = on_path[..., None] * jnp.exp(jnp.minimum(end_lg[:, None, :] - lg, 0.0))  # [B, W, H]
    return jnp.exp(end_lg)[..., None, None] * S0 + jnp.einsum("bjh,bjhk,bjhv->bhkv", w, k, u, precision=HIGH)


def delta_sequence(S0, q, k, v, g, beta, sub: int = SUB_BLOCK):
    """A causal sequence of T tokens (every token on one chain) in sub-blocks of `sub`, carrying the state:
    (o [B, T, H, Dv], final state). Tokens with g = beta = 0 leave the state as it is (padding)."""
    B, T = q.shape[:2]
    if T <= sub:
        o, u, lg = delta_block(S0, q, k, v, g, beta, jnp.tril(jnp.ones((T, T), bool))[None])
        return o, state_after(S0, k, u, lg, jnp.ones((B, T), F32), lg[:, -1])
    n = -(-T // sub)
    pad = n * sub - T

    def blocks(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((B, n, sub) + x.shape[2:]), 1, 0)

    causal = jnp.tril(jnp.ones((sub, sub), bool))[None]

    def step(S, xs):
        qb, kb, vb, gb, bb = xs
        o, u, lg = delta_block(S, qb, kb, vb, gb, bb, causal)
        return state_after(S, kb, u, lg, jnp.ones((B, sub), F32), lg[:, -1]), o

    S, o = jax.lax.scan(step, S0, tuple(blocks(x) for x in (q, k, v, g, beta)))
    o = jnp.moveaxis(o, 0, 1).reshape((B, n * sub) + o.shape[3:])[:, :T]
    return o, S


def recurrent_reference(S0, q, k, v, g, beta):
    """The delta rule token by token (the oracle): same arguments as delta_sequence."""
    def step(S, xs):
        qt, kt, vt, gt, bt = xs  # [B, H, *]
        S = S * jnp.exp(gt)[..., None, None]
        u = bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", S, kt, precision=HIGH))
        S = S + kt[..., :, None] * u[..., None, :]
        return S, jnp.einsum("bhkv,bhk->bhv", S, qt, precision=HIGH)

    S, o = jax.lax.scan(step, S0, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)))
    return jnp.moveaxis(o, 0, 1), S


# ----------------------------------------------------------------------------------------------
# The conv window
# ----------------------------------------------------------------------------------------------
def ancestor_inputs(conv_state, x, parent, depth, K: int):
    """The conv inputs each new row sees, newest last: [B, W, K, C]. conv_state [B, K - 1, C], x [B, W, C];
    parent [B, W] (-1 for the first row; a chain: t - 1), depth [B, W] (a chain: t). The m-th ancestor of a row at
    depth d is a new row for m <= d, else conv_state[K - 1 - (m - d)]."""
    ext = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K - 1 + W, C]
    B, W = parent.shape
    node = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
    cols = []
    for m in range(K):
        idx = jnp.where(m <= depth, K - 1 + node, K - 1 - (m - depth))
        cols.append(idx)
        node = jnp.take_along_axis(parent, jnp.maximum(node, 0), axis=1)
    idx = jnp.stack(cols[::-1], axis=2)  # [B, W, K]: oldest first
    return jnp.take_along_axis(ext[:, None], idx[..., None], axis=2)  # [B, W, K, C]


def causal_conv(conv_state, x, w, parent=None, depth=None):
    """Depthwise causal conv + SiLU of the new rows x [B, W, C] after conv_state [B, K - 1, C] (w [C, K]); a chain
    when parent is None, else along each row's tree path. Computed in float32, returned in x's dtype."""
    K = w.shape[1]
    wf = w.astype(F32)
    if parent is None:
        ext = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1).astype(F32)
        W = x.shape[1]
        y = sum(ext[:, m:m + W] * wf[:, m] for m in range(K))
    else:
        win = ancestor_inputs(conv_state, x, parent, depth, K).astype(F32)
        y = jnp.einsum("bwkc,ck->bwc", win, wf)
    return jax.nn.silu(y).astype(x.dtype)


def conv_after(conv_state, x, n, path=None):
    """The conv window after keeping n [B] new rows: the last K - 1 inputs of [conv_state, x[path[:n]]]
    (a chain: path = 0 .. n - 1)."""
    if path is not None:
        x = jnp.take_along_axis(x, path[..., None], axis=1)
    Km1 = conv_state.shape[1]
    ext = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)
    return jax.vmap(lambda e, s: jax.lax.dynamic_slice_in_dim(e, s, Km1, axis=0))(ext, n.astype(jnp.int32))


# ----------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------
def _l2norm(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def mixer(g: GDNConfig, lp: dict, h, conv_state, rec_state, *, eps: float, valid=None, parent=None, depth=None,
          anc=None, pending: bool = False, sequence=None):
    """The GDN mixer over T new rows h [B, T, H] (the input-normed residual) from (conv_state, rec_state) of one
    layer. Returns (out [B, T, H] before the residual add and before any psum over a tensor-parallel axis, new
    (conv, rec) or a per-layer Pending when `pending`). `sequence`: the delta rule of a chain without `pending`
    (default delta_sequence; recurrent_reference for the oracle).

    valid [B, T] (a prefill chunk): rows past a prompt's end leave the state untouched. parent / depth / anc (a
    tree; anc [B, T, T] ancestors and self): every row from its own path's state. Without them the rows are a
    chain (a verify block, a prefill chunk or a whole sequence)."""
    B, T, _ = h.shape
    dt = h.dtype
    x = jnp.concatenate([h @ lp["lin_q"], h @ lp["lin_k"], h @ lp["lin_v"]], axis=-1)  # [B, T, C] conv inputs
    wconv = jnp.concatenate([lp["conv_q"], lp["conv_k"], lp["conv_v"]], axis=0)
    y = causal_conv(conv_state, x, wconv, parent, depth)
    kq = lp["lin_q"].shape[1]
    hk, hv = kq // g.k_dim, lp["lin_v"].shape[1] // g.v_dim
    r = hv // hk
    q = y[..., :kq].reshape(B, T, hk, g.k_dim).astype(F32)
    k = y[..., kq:2 * kq].reshape(B, T, hk, g.k_dim).astype(F32)
    v = y[..., 2 * kq:].reshape(B, T, hv, g.v_dim).astype(F32)
    q = jnp.repeat(_l2norm(q) * (g.k_dim ** -0.5), r, axis=2)
    k = jnp.repeat(_l2norm(k), r, axis=2)
    beta = jax.nn.sigmoid((h @ lp["lin_b"]).astype(F32))
    gl = -jnp.exp(lp["A_log"].astype(F32)) * jax.nn.softplus((h @ lp["lin_a"]).astype(F32) + lp["dt_bias"].astype(F32))
    if valid is not None:
        beta = jnp.where(valid[..., None], beta, 0.0)
        gl = jnp.where(valid[..., None], gl, 0.0)
    if pending or anc is not None:
        if anc is None:
            anc = jnp.tril(jnp.ones((T, T), bool))[None]
        o, u, lg = delta_block(rec_state, q, k, v, gl, beta, anc)
        new = Pending(x=x, u=u, k=k, lg=lg)
    else:
        o, S = (sequence or delta_sequence)(rec_state, q, k, v, gl, beta)
        n = jnp.full((B,), T, jnp.int32) if valid is None else jnp.sum(valid, axis=1).astype(jnp.int32)
        new = (conv_after(conv_state, x, n), S)
    z = h @ lp["lin_z"]
    of = o.reshape(B, T, hv, g.v_dim).astype(dt).astype(F32)  # the kernel's output dtype, as transformers
    of = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)
    of = (lp["lin_norm"].astype(F32) * of.astype(dt).astype(F32))
    of = of * jax.nn.silu(z.reshape(B, T, hv, g.v_dim).astype(F32))
    return of.astype(dt).reshape(B, T, hv * g.v_dim) @ lp["lin_out"], new


def commit_state(state: GDNState, pend: Pending, n, path=None) -> GDNState:
    """Keep the first n [B] verified rows (a chain) or the rows path[:, :n] (a tree; path [B, D + 1] the flattened
    node per depth): every layer's conv window and delta-rule state after the row's last kept node. n = 0 keeps the
    state as it is."""
    B, W = pend.lg.shape[1:3]
    n = n.astype(jnp.int32)
    j = jnp.arange(W, dtype=jnp.int32)
    if path is None:
        on = (j[None] < n[:, None]).astype(F32)  # [B, W]
        end = jnp.maximum(n - 1, 0)
    else:
        end = jnp.take_along_axis(path, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
        on = jnp.zeros((B, W), F32).at[jnp.arange(B)[:, None], path].max(
            (jnp.arange(path.shape[1])[None] < n[:, None]).astype(F32))
    keep = (n > 0)[:, None]

    def one(conv, rec, x, u, k, lg):
        end_lg = jnp.where(keep, jnp.take_along_axis(lg, end[:, None, None], axis=1)[:, 0], 0.0)
        return conv_after(conv, x, n, path), state_after(rec, k, u, lg, on, end_lg)

    conv, rec = jax.vmap(one)(state.conv, state.rec, pend.x, pend.u, pend.k, pend.lg)
    return GDNState(conv=conv.astype(state.conv.dtype), rec=rec)
