"""KV cache: preallocated [L, B, KV, S, D] buffers where slot s holds the token at absolute position s,
plus per-row fill lengths. A forward over T tokens writes slots lengths..lengths+T-1 and advances the
lengths; rolling back a rejected draft is `cache.rollback(lengths)` - entries past the fill are never
attended (masked by position) and are overwritten by the next write (dflash_jax.attention.write_rows,
in place)."""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, KV, S, D]
    v: jax.Array  # [L, B, KV, S, D]
    lengths: jax.Array  # [B] int32: filled slots (= position of the next token)

    @property
    def size(self) -> int:
        return self.k.shape[3]

    @classmethod
    def create(cls, num_layers, batch, size, kv_heads, head_dim, dtype):
        shape = (num_layers, batch, kv_heads, size, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

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
