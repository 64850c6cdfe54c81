"""Continuous-batching generation engine: a fixed set of slots, two compiled programs per engine.

`generate()` runs one static batch: every row waits for the longest one, and each new batch shape
(prompt bucket, cache size, max_new_tokens) compiles a new prefill and loop. The engine instead owns
`slots` rows with a cache of `cache_len` positions, fixed for its lifetime:

  prefill program  - prefills up to `refill` new prompts (padded to `prompt_len` tokens) and writes
                     them into free slots (their KV rows, first token, budget, stop ids, row id);
  decode program   - one `lax.while_loop` of draft/verify cycles (decode.programs.cycle, unchanged) that
                     runs until at least `min_free` slots are free (finished or empty).

The host loop: decode until `refill` slots are free -> collect the finished rows -> prefill the next
prompts into the free slots -> decode again; when no prompts are left, decode until every slot is
free. Compilations per engine: one prefill + one decode, whatever the prompts and their lengths.

Results equal `generate()`'s for the same (prompt, row id): sampling keys depend on (seed, row id,
position) only, each row's budget is its own `max_new_tokens`, and a slot's stale KV past its fill
index is never attended (slot s holds position s; attention is masked by position).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .drafter import Drafter
from .decode.programs import cycle, prefill, rows_layout
from .decode.state import (CACHE_ALIGN, DecodeState, model_specs, resolve_block_size, round_up,
                           state_specs)
from .cache import KVCache
from .model import Target, check_ids
from .sampling import SamplingParams


@flax.struct.dataclass
class EngineState:
    dec: DecodeState  # the decode state of every slot (out width = max_new_tokens + block)
    rows: jax.Array  # [B] row id of each slot's prompt (sampling keys)
    budget: jax.Array  # [B] max new tokens of each slot's prompt
    stop: jax.Array  # [B, K] stop ids (-1 = none)
    cycles: jax.Array  # [B] decode cycles while the slot was active (acceptance statistics)


@dataclasses.dataclass
class Request:
    prompt: list[int]
    row_id: int  # sampling-key row: the same (prompt, row_id, seed) gives the same output
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class Completion:
    index: int  # position of the request in the submitted sequence
    row_id: int
    tokens: list[int]  # generated ids (first token included; a stop token is kept)
    cycles: int  # decode cycles (tau = (len(tokens) - 1) / cycles for speculative decoding)


@dataclasses.dataclass
class EngineStats:
    prefill_calls: int = 0
    decode_calls: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    compile_time: float = 0.0
    tokens: int = 0  # generated tokens returned

    @property
    def tokens_per_second(self) -> float:
        t = self.prefill_time + self.decode_time
        return self.tokens / t if t > 0 else float("nan")


def _put_rows(big: KVCache, small: KVCache, slots) -> KVCache:
    """Write the [L, R, KV, P, D] rows of `small` into slots `slots` of `big` (positions 0..P-1);
    slot indices past the batch are dropped."""
    P = small.k.shape[3]
    k = big.k.at[:, slots, :, :P].set(small.k.astype(big.k.dtype), mode="drop")
    v = big.v.at[:, slots, :, :P].set(small.v.astype(big.v.dtype), mode="drop")
    return KVCache(k, v, big.lengths.at[slots].set(small.lengths, mode="drop"))


def _engine_prefill(target, drafter, st: EngineState, tokens, lens, rows, slots, budget, stop, key, *,
                    Bk, width, sp, tp=None):
    """Prefill `tokens` [R, P] and write them into `slots` [R] (index >= B: padding, dropped)."""
    small = prefill(target, drafter, tokens, lens, rows, key, stop, budget, S=tokens.shape[1], Bk=Bk,
                    M=width - Bk, sp=sp, tp=tp)
    d = st.dec

    def put(big, new):
        return big.at[slots].set(new.astype(big.dtype), mode="drop")

    dec = DecodeState(
        tcache=_put_rows(d.tcache, small.tcache, slots),
        dcache=_put_rows(d.dcache, small.dcache, slots) if drafter is not None else None,
        anchor=put(d.anchor, small.anchor), out=put(d.out, small.out), gen_len=put(d.gen_len, small.gen_len),
        done=put(d.done, small.done | (budget <= 1)), acc_hist=d.acc_hist, cycle=d.cycle)
    return EngineState(dec=dec, rows=put(st.rows, rows), budget=put(st.budget, budget), stop=put(st.stop, stop),
                       cycles=put(st.cycles, jnp.zeros_like(rows)))


def _engine_decode(target, drafter, st: EngineState, key, min_free, *, Bk, sp, tp=None, dp=None):
    """Draft/verify cycles until at least `min_free` slots are done (over all data shards)."""
    target, drafter = rows_layout(target, drafter, Bk)

    def cond(s):
        free = jnp.sum(s.dec.done.astype(jnp.int32))
        if dp is not None:
            free = jax.lax.psum(free, dp)
        return free < min_free

    def body(s):
        active = ~s.dec.done
        dec = cycle(target, drafter, s.dec, s.rows, key, s.stop, s.budget, Bk=Bk, sp=sp, tp=tp)
        return s.replace(dec=dec, cycles=s.cycles + active.astype(jnp.int32))

    return jax.lax.while_loop(cond, body, st)


def _zeros(shape, dtype, sharding=None):
    """A zero array without compiling anything (host zeros, per shard when sharded)."""
    if sharding is None:
        return jax.device_put(np.zeros(shape, dtype))
    return jax.make_array_from_callback(
        shape, sharding, lambda idx: np.zeros(tuple(len(range(*s.indices(n))) for s, n in zip(idx, shape)), dtype))


class Engine:
    """Continuous batching over `slots` rows (see the module docstring).

        eng = Engine(target, None, slots=64, prompt_len=256, max_new_tokens=512)
        for c in eng.run(requests): ...           # Completions as rows finish
        eng.compilations                            # {'prefill': 1, 'decode': 1}

    drafter: speculative decoding (DFlash) when given, target-only otherwise.
    refill: prompts prefilled per prefill call (per data shard with a mesh), and the number of free
    slots that ends a decode call while prompts are waiting (default slots // 4).
    mesh: a ('data', 'model') mesh: slots split over 'data', tensor-parallel over 'model'.
    """

    def __init__(self, target: Target, drafter: Drafter | None, *, slots: int, prompt_len: int, max_new_tokens: int,
                 refill: int | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, block_size: int | None = None, max_stop_ids: int = 4, cache_len: int | None = None,
                 mesh=None):
        if slots < 1 or prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(f"slots, prompt_len and max_new_tokens must be >= 1, got {slots}, {prompt_len}, "
                             f"{max_new_tokens}")
        Bk = resolve_block_size(target, drafter, block_size)
        self.dp = 1
        if mesh is not None:
            from . import sharding as shd
            from .weights import shard_drafter, shard_target
            target = shard_target(target, mesh)
            drafter = shard_drafter(drafter, mesh) if drafter is not None else None
            self.dp = shd.data_axis(mesh)
            if slots % self.dp:
                raise ValueError(f"slots {slots} is not divisible by the mesh data axis ({self.dp})")
        self.target, self.drafter, self.mesh = target, drafter, mesh
        self.B, self.P, self.max_new, self.Bk = int(slots), int(prompt_len), int(max_new_tokens), Bk
        self.width = self.max_new + Bk
        self.S = int(cache_len) if cache_len is not None else round_up(self.P + self.max_new + Bk, CACHE_ALIGN)
        if self.S < self.P + Bk + 1:
            raise ValueError(f"cache_len {self.S} is too small for prompt_len {self.P} + block {Bk} + 1")
        if self.P > target.config.max_position_embeddings:
            raise ValueError(f"prompt_len {self.P} exceeds the model's max_position_embeddings "
                             f"({target.config.max_position_embeddings})")
        local = self.B // self.dp
        self.refill = int(refill) if refill is not None else max(1, local // 4)
        if not 1 <= self.refill <= local:
            raise ValueError(f"refill must be in [1, {local}] (slots per data shard), got {refill}")
        self.K = int(max_stop_ids)
        self.sp = SamplingParams(float(temperature), int(top_k), float(top_p))
        self.seed = int(seed)
        self.compilations = {"prefill": 0, "decode": 0}
        self._exe: dict = {}
        self.stats = EngineStats()

    # ---- programs ----
    def _specs(self):
        from jax.sharding import PartitionSpec as PS

        from .sharding import DATA
        t_spec = model_specs(self.target)
        d_spec = model_specs(self.drafter) if self.drafter is not None else None
        dec = state_specs(self.drafter is not None).replace(chain_hist=None)  # the engine does not record it
        st = EngineState(dec=dec, rows=PS(DATA), budget=PS(DATA), stop=PS(DATA, None), cycles=PS(DATA))
        return t_spec, d_spec, st

    def _program(self, kind, args):
        exe = self._exe.get(kind)
        if exe is not None:
            return exe
        t0 = time.perf_counter()
        from .sharding import DATA, MODEL
        tp = MODEL if self.mesh is not None else None
        if kind == "prefill":
            f = functools.partial(_engine_prefill, Bk=self.Bk, width=self.width, sp=self.sp, tp=tp)
        else:
            f = functools.partial(_engine_decode, Bk=self.Bk, sp=self.sp, tp=tp,
                                  dp=DATA if self.mesh is not None else None)
        if self.mesh is not None:
            from jax.sharding import PartitionSpec as PS
            t_spec, d_spec, st = self._specs()
            if kind == "prefill":
                rows = (PS(DATA, None), PS(DATA), PS(DATA), PS(DATA), PS(DATA), PS(DATA, None))
                in_specs = (t_spec, d_spec, st) + rows + (PS(),)
            else:
                in_specs = (t_spec, d_spec, st, PS(), PS())
            f = jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=st, check_vma=False)
        exe = jax.jit(f, donate_argnums=(2,)).lower(*args).compile()
        self._exe[kind] = exe
        self.compilations[kind] += 1
        self.stats.compile_time += time.perf_counter() - t0
        return exe

    # ---- state ----
    def _put(self, host, spec):
        if self.mesh is None:
            return jnp.asarray(host)
        from .weights import put_global
        return put_global(host, self.mesh, spec)

    def empty_state(self) -> EngineState:
        """Every slot free (done), nothing compiled."""
        c = self.target.config
        B = self.B
        shard = None
        specs = None
        if self.mesh is not None:
            from jax.sharding import NamedSharding
            _, _, specs = self._specs()

            def shard(spec):
                return NamedSharding(self.mesh, spec)

        def z(shape, dtype, spec):
            return _zeros(shape, dtype, shard(spec) if shard else None)

        def cache(layers, kv, head_dim, dtype, spec):
            shape = (layers, B, kv, self.S, head_dim)
            return KVCache(z(shape, dtype, spec and spec.k), z(shape, dtype, spec and spec.v),
                           z((B,), np.int32, spec and spec.lengths))

        from .layers import first_layer, kv_heads
        kv_t = kv_heads(first_layer(self.target.params["layers"]), c.head_dim)
        ds = specs.dec if specs is not None else None
        tcache = cache(c.num_layers, kv_t, c.head_dim, self.target.dtype, ds and ds.tcache)
        dcache = None
        if self.drafter is not None:
            dc = self.drafter.config
            kv_d = kv_heads(first_layer(self.drafter.params["layers"]), dc.head_dim)
            dcache = cache(dc.num_layers, kv_d, dc.head_dim, self.drafter.dtype, ds and ds.dcache)
        dec = DecodeState(tcache=tcache, dcache=dcache, anchor=z((B,), np.int32, ds and ds.anchor),
                          out=z((B, self.width), np.int32, ds and ds.out), gen_len=z((B,), np.int32, ds and ds.gen_len),
                          done=self._put(np.ones((B,), bool), ds and ds.done),
                          acc_hist=z((B, 1), np.int32, ds and ds.acc_hist), cycle=z((), np.int32, ds and ds.cycle))
        return EngineState(dec=dec, rows=z((B,), np.int32, specs and specs.rows),
                           budget=z((B,), np.int32, specs and specs.budget),
                           stop=self._put(np.full((B, self.K), -1, np.int32), specs and specs.stop),
                           cycles=z((B,), np.int32, specs and specs.cycles))

    # ---- host loop ----
    def check(self, req: Request) -> None:
        if not req.prompt:
            raise ValueError(f"request {req.row_id}: empty prompt")
        if len(req.prompt) > self.P:
            raise ValueError(f"request {req.row_id}: prompt of {len(req.prompt)} tokens exceeds the engine's "
                             f"prompt_len {self.P}")
        if not 1 <= req.max_new_tokens <= self.max_new:
            raise ValueError(f"request {req.row_id}: max_new_tokens {req.max_new_tokens} outside [1, {self.max_new}]")
        if len(req.prompt) + req.max_new_tokens + self.Bk > self.S:
            raise ValueError(f"request {req.row_id}: prompt of {len(req.prompt)} tokens + max_new_tokens "
                             f"{req.max_new_tokens} + block {self.Bk} exceeds the cache ({self.S} slots)")
        if len(req.stop_token_ids) > self.K:
            raise ValueError(f"request {req.row_id}: {len(req.stop_token_ids)} stop ids, the engine holds "
                             f"{self.K} (max_stop_ids)")
        check_ids(self.target.config.vocab_size, np.asarray(req.prompt))

    def run(self, requests: Iterable[Request], on_compile: Callable[[str], None] | None = None):
        """Generate every request; yields Completions in the order rows finish."""
        pending = list(enumerate(requests))
        for _, r in pending:
            self.check(r)
        pending.reverse()  # pop() from the end = submission order
        B, R, dp, local = self.B, self.refill, self.dp, self.B // self.dp
        key = self._put(np.asarray(jax.random.PRNGKey(self.seed)), _ps())
        st = self.empty_state()
        occupant = np.full((B,), -1, np.int64)  # request index in each slot (-1 = empty)
        done = np.ones((B,), bool)
        reqs = {}
        while pending or (occupant >= 0).any():
            # prefill waiting prompts into free slots: up to R per data shard per call
            while pending and (done & (occupant < 0)).any():
                tokens = np.zeros((dp * R, self.P), np.int32)
                lens = np.ones((dp * R,), np.int32)
                rows = np.zeros((dp * R,), np.int32)
                slots = np.full((dp * R,), local, np.int32)  # local index `local` = dropped
                budget = np.ones((dp * R,), np.int32)
                stop = np.full((dp * R, self.K), -1, np.int32)
                for s in range(dp):
                    free = [i for i in range(s * local, (s + 1) * local) if done[i] and occupant[i] < 0]
                    for j, slot in enumerate(free[:R]):
                        if not pending:
                            break
                        idx, r = pending.pop()
                        reqs[idx] = r
                        k = s * R + j
                        tokens[k, :len(r.prompt)] = r.prompt
                        lens[k], rows[k], slots[k], budget[k] = len(r.prompt), r.row_id, slot - s * local, \
                            r.max_new_tokens
                        stop[k, :len(r.stop_token_ids)] = r.stop_token_ids
                        occupant[slot] = idx
                        done[slot] = False
                from jax.sharding import PartitionSpec as PS
                from .sharding import DATA
                host = [(tokens, PS(DATA, None)), (lens, PS(DATA)), (rows, PS(DATA)), (slots, PS(DATA)),
                        (budget, PS(DATA)), (stop, PS(DATA, None))]
                args = (self.target, self.drafter, st, *(self._put(h, s) for h, s in host), key)
                exe = self._program("prefill", args)
                t0 = time.perf_counter()
                st = jax.block_until_ready(exe(*args))
                self.stats.prefill_time += time.perf_counter() - t0
                self.stats.prefill_calls += 1
            # decode until R slots are free (or all of them when nothing waits)
            need = min(R, B) if pending else B
            args = (self.target, self.drafter, st, key, self._put(np.int32(need), _ps()))
            exe = self._program("decode", args)
            t0 = time.perf_counter()
            st = jax.block_until_ready(exe(*args))
            self.stats.decode_time += time.perf_counter() - t0
            self.stats.decode_calls += 1
            done_d, gen_len, out, cycles = (fetch(x) for x in (st.dec.done, st.dec.gen_len, st.dec.out, st.cycles))
            done = done_d.astype(bool)
            for slot in np.nonzero(done & (occupant >= 0))[0]:
                idx = int(occupant[slot])
                occupant[slot] = -1
                toks = out[slot, :gen_len[slot]].tolist()
                self.stats.tokens += len(toks)
                yield Completion(index=idx, row_id=reqs.pop(idx).row_id, tokens=toks, cycles=int(cycles[slot]))


def fetch(x):
    """numpy of a device array; a global (multi-process) one is gathered, a process-local one is not."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from .weights import fetch as fetch_global
    return fetch_global(x)


def _ps():
    from jax.sharding import PartitionSpec as PS
    return PS()


def generate_all(engine: Engine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
                 stop_token_ids: Sequence[int] = (), row_ids: Sequence[int] | None = None) -> list[Completion]:
    """Run `prompts` through `engine`; Completions in prompt order."""
    n = len(prompts)
    mx = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    ids = list(row_ids) if row_ids is not None else list(range(n))
    reqs = [Request(list(map(int, p)), int(i), int(m), tuple(stop_token_ids)) for p, i, m in zip(prompts, ids, mx)]
    out = sorted(engine.run(reqs), key=lambda c: c.index)
    return out
