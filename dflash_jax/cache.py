"""KV cache: preallocated [L, B, KV, S, D] buffers where slot s holds the token at absolute position s,
plus per-row fill lengths. A forward over T tokens writes slots lengths..lengths+T-1 and advances the
lengths; rolling back a rejected draft is `cache.rollback(lengths)` - entries past the fill are never
attended (masked by position) and are overwritten by the next write (dflash_jax.attention.write_rows,
in place).

A ring cache (`ring=True`, Gemma 4's sliding-window layers) holds S slots for any number of positions: position p sits
in slot p mod S, and slot s holds the latest such position below the fill (`slot_positions`). S >= window + the most
rows one call writes keeps every position a query's window reaches: a write of T rows overwrites positions at least
S - T + 1 behind it, outside the window of every later query. `ring_put` / `ring_read` move T slots starting
anywhere (wrapping past the end) with two in-place window updates.

A quantized cache (dflash_jax.quant: int8 or float8_e4m3fn values) also holds one float32 scale per token and head,
k_scale / v_scale [L, B, KV, S]; every attention path multiplies them back in. Unquantized caches have None there."""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, KV, S, D]
    v: jax.Array  # [L, B, KV, S, D]
    lengths: jax.Array  # [B] int32: filled slots (= position of the next token)
    k_scale: jax.Array | None = None  # [L, B, KV, S] float32 for a quantized cache, else None
    v_scale: jax.Array | None = None
    ring: bool = flax.struct.field(pytree_node=False, default=False)  # slot = position mod S (see the module doc)

    @property
    def size(self) -> int:
        return self.k.shape[3]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @classmethod
    def create(cls, num_layers, batch, size, kv_heads, head_dim, dtype, quant: str | None = None):
        """Zeros; `quant` "int8" / "fp8" stores 1-byte values with per-token, per-head scales."""
        shape = (num_layers, batch, kv_heads, size, head_dim)
        lengths = jnp.zeros((batch,), jnp.int32)
        if not quant:
            return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), lengths)
        from .quant import storage_dtype
        qd = storage_dtype(quant)
        ones = jnp.ones(shape[:4], jnp.float32)
        return cls(jnp.zeros(shape, qd), jnp.zeros(shape, qd), lengths, ones, ones)

    def map_arrays(self, fn):
        """fn applied to each per-slot array (K, V and, when quantized, their scales [L, B, KV, S])."""
        if not self.quantized:
            return self.replace(k=fn(self.k), v=fn(self.v))
        return self.replace(k=fn(self.k), v=fn(self.v), k_scale=fn(self.k_scale), v_scale=fn(self.v_scale))

    def rollback(self, lengths):
        """Move the fill index; no data moves."""
        return self.replace(lengths=lengths.astype(jnp.int32))

    def map_kv(self, fn):
        """fn applied to every KVCache of the state: here, this one (a family's state with several applies it to each)."""
        return fn(self)

    def commit(self, lengths, n=None, path=None):
        """After a verification: keep the committed rows, i.e. fill up to `lengths` (n [B] kept rows and a tree's
        path only matter to layer kinds with a recurrent state, dflash_jax.hybrid.HybridCache). A tree path's K/V
        must already sit in contiguous slots (decode.programs.compact_path)."""
        return self.rollback(lengths)


def ring_lap(lengths, S: int):
    """(lap, cut) [B] of ring caches of S slots filled to `lengths`: slot s holds position lap + s - S * (s > cut)
    (cut = (n - 1) mod S, lap = n - 1 - cut; negative: the slot holds nothing yet). A cache that never wrapped
    (n <= S) gives slot s = position s."""
    n1 = lengths.astype(jnp.int32) - 1
    cut = jnp.mod(n1, S)
    return n1 - cut, cut


def slot_positions(lengths, S: int, slots=None):
    """The positions [..., N] held by `slots` [N] (default all S) of ring caches filled to `lengths` [...]."""
    s = jnp.arange(S, dtype=jnp.int32) if slots is None else slots.astype(jnp.int32)
    lap, cut = ring_lap(lengths, S)
    return lap[..., None] + s - S * (s > cut[..., None])


def _ring_window(buf, base, ax, at, shape):
    idx = tuple(jnp.asarray(at if i == ax else x, jnp.int32) for i, x in enumerate(base))
    return idx, jax.lax.dynamic_slice(buf, idx, shape)


def _along(ax: int, ndim: int, v):
    return v.reshape((1,) * ax + (-1,) + (1,) * (ndim - ax - 1))


def ring_put(buf, base, ax: int, upd, start):
    """buf with `upd` (same rank, T = upd.shape[ax] <= S = buf.shape[ax]) stored at slots (start + t) mod S of axis
    `ax`, the other axes at `base` (a start index per axis; base[ax] is ignored): two in-place window updates (the
    slots up to the end, then the part that wraps to slot 0), each reading its T-slot window first."""
    S, T = buf.shape[ax], upd.shape[ax]
    s = jnp.mod(jnp.asarray(start, jnp.int32), S)
    a = jnp.minimum(s, S - T)
    off, wrap = s - a, jnp.maximum(s + T - S, 0)
    j = _along(ax, upd.ndim, jnp.arange(T, dtype=jnp.int32))
    idx, old = _ring_window(buf, base, ax, a, upd.shape)
    new = jnp.where(j >= off, jnp.take(upd, jnp.clip(jnp.arange(T) - off, 0, T - 1), axis=ax), old)
    buf = jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), idx)
    idx, old = _ring_window(buf, base, ax, 0, upd.shape)
    new = jnp.where(j < wrap, jnp.take(upd, jnp.clip(jnp.arange(T) + T - wrap, 0, T - 1), axis=ax), old)
    return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), idx)


def ring_read(buf, base, ax: int, shape, start):
    """The slots (start + t) mod S, t < shape[ax], of axis `ax` (the other axes: `shape` from `base`)."""
    S, W = buf.shape[ax], shape[ax]
    s = jnp.mod(jnp.asarray(start, jnp.int32), S)
    a = jnp.minimum(s, S - W)
    t = jnp.arange(W, dtype=jnp.int32)
    head = jnp.take(_ring_window(buf, base, ax, a, shape)[1], jnp.clip(t + s - a, 0, W - 1), axis=ax)
    tail = jnp.take(_ring_window(buf, base, ax, 0, shape)[1], jnp.clip(t - (S - s), 0, W - 1), axis=ax)
    return jnp.where(_along(ax, len(shape), s + t < S), head, tail)
