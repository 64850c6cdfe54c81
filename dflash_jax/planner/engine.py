"""The serving engine's programs (dflash_jax.engine) for a TPU slice: its prefill of new prompts into free slots and
its decode call, on abstract arguments placed as the engine places them (`python -m infer.plan --engine`)."""
from __future__ import annotations

from .abstract import with_specs


def engine_args(dec, kind: str, Bk: int, tree: int | None = None, refill: int | None = None):
    """(jitted program, abstract args) of the serving engine's (dflash_jax.engine) programs for the batch of slots of
    `dec` (planner.decode.DecodePrograms): kind "engine_prefill" writes `refill` prompts per data shard (default: a
    quarter of a shard's slots, the engine's) of the full prompt length into free slots; "engine_decode" runs a call
    of cycles of block Bk (1: target-only) or of a `tree`-node tree on every slot. The cache is sized as the engine
    sizes it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as PS

    from ..decode.programs import prefill, program
    from ..decode.state import CACHE_ALIGN, model_specs, round_up, state_specs, stop_width, verify_width
    from ..engine.programs import EngineState, engine_decode, engine_prefill
    from ..sampling import RowSampling
    from ..sharding import DATA, MODEL
    s = dec.s
    B, P = s.batch, s.prompt_len
    target, drafter = dec.models(Bk if Bk > 1 else s.drafter_config.block_size, "stacked")
    full = s.drafter_config.block_size
    width = s.max_new_tokens + full
    S = s.cache_len or round_up(P + s.max_new_tokens + verify_width(full, tree), CACHE_ALIGN)
    K = stop_width(len(s.target_config.eos_token_ids))
    data = s.mesh.shape[DATA]
    st_specs = EngineState(dec=state_specs(True, target).replace(chain_hist=None), rows=PS(DATA), budget=PS(DATA),
                           stop=PS(DATA, None), cycles=PS(DATA), sp=RowSampling(PS(DATA), PS(DATA), PS(DATA)))

    def empty(B):
        i32 = jax.ShapeDtypeStruct((B,), jnp.int32)
        sp = RowSampling(jax.ShapeDtypeStruct((B,), jnp.float32), i32, jax.ShapeDtypeStruct((B,), jnp.float32))
        ones, zeros = jnp.ones((B,), jnp.int32), jnp.zeros((B,), jnp.int32)
        state = jax.eval_shape(lambda t, d, sp: prefill(
            t, d, jnp.zeros((B, P), jnp.int32), ones, zeros, jax.random.PRNGKey(0), jnp.zeros((B, K), jnp.int32),
            ones, S=S, Bk=full, M=width - full, sp=sp), target, drafter, sp)
        return EngineState(dec=state.replace(chain_hist=None), rows=i32, budget=i32,
                           stop=jax.ShapeDtypeStruct((B, K), jnp.int32), cycles=i32, sp=sp)

    st = with_specs(empty(B), st_specs, s.mesh)
    t_spec, d_spec = model_specs(target), model_specs(drafter)
    row = PS(DATA)

    def sds(shape, dtype, spec):
        from jax.sharding import NamedSharding
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(s.mesh, spec))
    if kind == "engine_prefill":
        n = data * (refill or max(1, B // data // 4))
        ins = (t_spec, d_spec, st_specs, PS(DATA, None), row, row, row, row, PS(DATA, None),
               RowSampling(row, row, row), PS())
        fn = program(engine_prefill, dict(Bk=full, width=width, tp=MODEL), (2,), s.mesh, (ins, st_specs))
        i32 = sds((n,), jnp.int32, row)
        sp = RowSampling(sds((n,), jnp.float32, row), i32, sds((n,), jnp.float32, row))
        return fn, (target, drafter, st, sds((n, P), jnp.int32, PS(DATA, None)), i32, i32, i32, i32,
                    sds((n, K), jnp.int32, PS(DATA, None)), sp, sds((2,), jnp.uint32, PS()))
    if kind != "engine_decode":
        raise ValueError(f"unknown engine program {kind!r}")
    statics = dict(b=B // data, Bk=Bk, tree=tree, tp=MODEL, dp=DATA)
    if Bk == 1:
        from ..engine.programs import PENDING
        statics["pending"] = min(PENDING, verify_width(full, tree))
    ins = (t_spec, d_spec, st_specs, PS(), PS(), PS(), PS(DATA))
    fn = program(engine_decode, statics, (2,), s.mesh, (ins, st_specs))
    return fn, (target, drafter, st, sds((2,), jnp.uint32, PS()), sds((), jnp.int32, PS()),
                sds((), jnp.int32, PS()), sds((B,), jnp.bool_, PS(DATA)))

