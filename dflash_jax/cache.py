"""KV cache: preallocated [L, B, KV, S, D] buffers where slot s holds the token at absolute position s,
plus per-row fill lengths. A forward over T tokens writes slots lengths..lengths+T-1 and advances the
lengths; rolling back a rejected draft is `cache.rollback(lengths)` - entries past the fill are never
attended (masked by position) and are overwritten by the next write (dflash_jax.attention.write_rows,
in place).

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
