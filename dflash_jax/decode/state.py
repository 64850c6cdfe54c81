"""The decode state and the sizes every decode program is built for.

`DecodeState` is what the device programs carry from prefill through the decode loop; the helpers here
size its buffers (prompt bucket, cache slots, verify width, stop-id columns), cap a request to the model's
context, and give the shard_map partition specs of the state and of a model's params.
"""
from __future__ import annotations

import flax.struct
import jax

from ..cache import KVCache
from ..drafter import Drafter, check_compatible
from .shape import Chain

MIN_PROMPT_BUCKET = 16
PREFILL_CHUNK = 2048  # prompts longer than this prefill chunk by chunk (memory bounded by the chunk)
CACHE_ALIGN = 128
STOP_ALIGN = 4  # stop-id columns are padded (with -1) to a multiple of this: the programs' shapes then do not
# change with the number of stop ids (the cost curve runs with none, a chat target's calls with 1-3)


@flax.struct.dataclass
class DecodeState:
    tcache: KVCache  # target KV cache; lengths = position of `anchor`
    dcache: KVCache | None  # drafter context cache (lengths == tcache.lengths)
    anchor: jax.Array  # [B] last committed token, not yet fed to the target
    out: jax.Array  # [B, M + Bk] generated tokens (M: the most new tokens any row may have, static)
    gen_len: jax.Array  # [B] generated so far
    done: jax.Array  # [B] bool
    acc_hist: jax.Array  # [B, M] tokens committed per cycle (0 = row idle)
    cycle: jax.Array  # [] int32
    # [B, M] per cycle, what the chain of the drafter's full block would have committed in it
    # (1 + its accepted drafts, before stop / length cuts; negative: at least that many, the cycle could
    # not tell more; 0 = row idle) - the acceptance evidence of dflash_jax.auto. None: not recorded
    chain_hist: jax.Array | None = None


def even_chunk(P: int, chunk: int = PREFILL_CHUNK) -> int | None:
    """The prefill chunk for prompts padded to P tokens that divides P (a recurrent target must see every token
    once: no overlapping last chunk): the largest divisor of P that is at most `chunk` (None: P in one chunk, when
    P <= chunk or its largest such divisor is under a sixteenth of the chunk)."""
    if P <= chunk:
        return None
    d = next(d for d in range(chunk, 0, -1) if P % d == 0)
    return d if d >= chunk // 16 else None


def bucket(n: int) -> int:
    """The prompt bucket of a prompt of n tokens: the power of two >= n, at least MIN_PROMPT_BUCKET."""
    b = MIN_PROMPT_BUCKET
    while b < n:
        b *= 2
    return b


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def capped_new_tokens(max_positions: int, prompt_len: int, max_new_tokens: int) -> int:
    """max_new_tokens limited so that prompt + generated tokens fit in the model's context
    (`max_position_embeddings`); a prompt that leaves no room is a ValueError."""
    if prompt_len > max_positions:
        raise ValueError(f"prompt of {prompt_len} tokens exceeds the model's max_position_embeddings ({max_positions})")
    room = max_positions - prompt_len
    if room < 1:
        raise ValueError(f"prompt of {prompt_len} tokens fills the model's context (max_position_embeddings "
                         f"{max_positions}): no room for new tokens")
    return min(int(max_new_tokens), room)


def prompt_and_cache_len(longest: int, max_new_tokens: int, Bk: int, max_cache_len: int | None = None):
    """(prompt bucket P, cache slots S) for a batch whose longest prompt has `longest` tokens."""
    need = longest + max_new_tokens + Bk
    if max_cache_len is None:
        P = bucket(longest)
        return P, round_up(max(P, need), CACHE_ALIGN)
    if need > max_cache_len:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} + block {Bk} = {need} "
                         f"exceeds the cache ({max_cache_len} slots)")
    return min(bucket(longest), int(max_cache_len)), int(max_cache_len)


def verify_width(block: int, tree: int | None) -> int:
    """Cache slots one verification writes (and the most rows any of the cycle's dots sees per batch
    row): the chain block, or the tree's root + nodes (at least the drafter block)."""
    return block if tree is None else max(block, int(tree) + 1)


def stop_width(n: int) -> int:
    """Columns of the [B, K] stop-id array of `n` stop ids (the programs compile for K)."""
    return round_up(max(1, int(n)), STOP_ALIGN)


def resolve_block_size(target, drafter, block_size) -> int:
    """The verified block: 1 without a drafter, else `block_size` (default the drafter's), checked
    against the drafter (which must match the target)."""
    if drafter is None:
        return 1
    check_compatible(drafter.config, target)
    return Chain(block_size).resolve(drafter.config.block_size).block


def taps_of(drafter: Drafter | None) -> tuple[int, ...]:
    return tuple(drafter.config.target_layer_ids) if drafter is not None else ()


# ----------------------------------------------------------------------------------------------
# Partition specs (shard_map over a ('data', 'model') mesh)
# ----------------------------------------------------------------------------------------------
def mesh_of(target):
    """The ('data', 'model') mesh the target's params live on, or None."""
    from jax.sharding import NamedSharding
    sh = getattr(target.params["embed"], "sharding", None)
    return sh.mesh if isinstance(sh, NamedSharding) and sh.mesh.axis_names == ("data", "model") else None


def model_specs(model):
    """A Target / Drafter whose params are their partition specs."""
    from ..sharding import param_specs
    return type(model)(params=param_specs(model.params), config=model.config)


def state_specs(with_drafter: bool, target=None) -> DecodeState:
    """The DecodeState of partition specs: rows over 'data', the caches as sharding.cache_spec (a hybrid `target`:
    hybrid.cache_spec; Gemma 4: gemma4.cache_spec)."""
    from jax.sharding import PartitionSpec as PS
    from ..sharding import DATA, cache_spec
    tspec = cache_spec(quantized=bool(target is not None and target.config.kv_quant))
    if target is not None and target.config.is_hybrid:
        from ..hybrid import cache_spec as hybrid_spec
        tspec = hybrid_spec()
    elif target is not None and target.config.gemma4 is not None:
        from ..gemma4 import cache_spec as gemma4_spec
        tspec = gemma4_spec()
    return DecodeState(tcache=tspec, dcache=cache_spec() if with_drafter else None, anchor=PS(DATA),
                       out=PS(DATA, None), gen_len=PS(DATA), done=PS(DATA), acc_hist=PS(DATA, None), cycle=PS(),
                       chain_hist=PS(DATA, None) if with_drafter else None)
