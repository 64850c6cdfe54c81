"""The engine on the host: `Engine` (slots, programs, the step API and `run`), its requests and results."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..cache import KVCache
from ..decode.cache import ProgramCache
from ..decode.shape import Auto, Shape, TargetOnly
from ..decode.state import CACHE_ALIGN, DecodeState, model_specs, resolve_block_size, round_up, state_specs, \
    verify_width
from ..drafter import Drafter
from ..model import Target, check_ids
from ..sampling import RowSampling, SamplingParams
from .programs import PENDING, EngineState, engine_decode, engine_prefill

FOREVER = 1 << 30  # cycles of a decode call without a chunk limit


@dataclasses.dataclass
class Request:
    prompt: list[int]
    row_id: int  # sampling-key row: the same (prompt, row_id, seed, setting) gives the same output
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams | None = None  # None: the engine's setting


@dataclasses.dataclass
class Completion:
    index: int  # position of the request in the submitted sequence
    row_id: int
    tokens: list[int]  # generated ids (first token included; a stop token is kept)
    cycles: int  # decode cycles (tau = (len(tokens) - 1) / cycles for speculative decoding)


@dataclasses.dataclass
class Snapshot:
    """The slots after a call, on the host."""
    done: np.ndarray  # [B] bool: finished or empty
    gen_len: np.ndarray  # [B] tokens generated
    out: np.ndarray  # [B, W] generated tokens (the first gen_len of each row)
    cycles: np.ndarray  # [B] decode cycles while active
    seconds: float = 0.0  # the call's time on device
    batch: int = 0  # the slots the call's cycles ran on (its batch bucket)


@dataclasses.dataclass
class EngineStats:
    prefill_calls: int = 0
    decode_calls: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    compile_time: float = 0.0
    tokens: int = 0  # generated tokens returned by run()

    @property
    def tokens_per_second(self) -> float:
        t = self.prefill_time + self.decode_time
        return self.tokens / t if t > 0 else float("nan")


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
    slots that ends a decode call of `run` while prompts are waiting (default slots // 4).
    temperature / top_k / top_p: the setting of requests that bring none (Request.sampling).
    shapes: what `decode` may run (decode.shape values or strings: "off", "chain:8", "tree:15"); the first is the
    default. Default: the chain of `block_size` (target-only without a drafter).
    prompt_buckets: prompt lengths the prefill is compiled for (a prompt is padded to the smallest that holds
    it); `prompt_len` is always one. batch_buckets: slot counts the decode is compiled for (its cycles run on
    the first b slots); `slots` is always one (the only one with a mesh).
    mesh: a ('data', 'model') mesh: slots split over 'data', tensor-parallel over 'model'.
    """

    def __init__(self, target: Target, drafter: Drafter | None, *, slots: int, prompt_len: int, max_new_tokens: int,
                 refill: int | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, block_size: int | None = None, max_stop_ids: int = 4, cache_len: int | None = None,
                 mesh=None, shapes: Sequence | None = None, prompt_buckets: Sequence[int] | None = None,
                 batch_buckets: Sequence[int] | None = None):
        if slots < 1 or prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(f"slots, prompt_len and max_new_tokens must be >= 1, got {slots}, {prompt_len}, "
                             f"{max_new_tokens}")
        Bk = resolve_block_size(target, drafter, block_size)
        full = drafter.config.block_size if drafter is not None else None
        shapes = [Shape.parse(s) for s in shapes] if shapes else [TargetOnly() if Bk == 1 else Shape.parse(Bk)]
        if any(isinstance(s, Auto) for s in shapes):
            raise ValueError("the engine runs fixed shapes: list them in shapes= (auto chooses among them)")
        self.shapes = list(dict.fromkeys(s.resolve(full, target.config.vocab_size) for s in shapes))
        self.dp = 1
        if mesh is not None:
            from .. import sharding as shd
            from ..weights import shard_drafter, shard_target
            target = shard_target(target, mesh)
            drafter = shard_drafter(drafter, mesh) if drafter is not None else None
            self.dp = shd.data_axis(mesh)
            if slots % self.dp:
                raise ValueError(f"slots {slots} is not divisible by the mesh data axis ({self.dp})")
        self.target, self.drafter, self.mesh = target, drafter, mesh
        self.B, self.P, self.max_new = int(slots), int(prompt_len), int(max_new_tokens)
        self.Bk = max(s.block for s in self.shapes)  # the token buffer holds the largest block
        self.verify_max = max(verify_width(s.block, s.tree) for s in self.shapes)
        self.width = self.max_new + self.Bk
        self.S = int(cache_len) if cache_len is not None else round_up(self.P + self.max_new + self.verify_max,
                                                                       CACHE_ALIGN)
        if self.S < self.P + self.verify_max + 1:
            raise ValueError(f"cache_len {self.S} is too small for prompt_len {self.P} + block {self.verify_max} + 1")
        if self.P > target.config.max_position_embeddings:
            raise ValueError(f"prompt_len {self.P} exceeds the model's max_position_embeddings "
                             f"({target.config.max_position_embeddings})")
        local = self.B // self.dp
        self.refill = int(refill) if refill is not None else max(1, local // 4)
        if not 1 <= self.refill <= local:
            raise ValueError(f"refill must be in [1, {local}] (slots per data shard), got {refill}")
        self.prompt_buckets = sorted({int(p) for p in (prompt_buckets or ()) if 0 < int(p) < self.P} | {self.P})
        self.batch_buckets = sorted({int(b) for b in (batch_buckets or ()) if 0 < int(b) < local} | {local})
        if mesh is not None and len(self.batch_buckets) > 1:
            raise ValueError("batch_buckets need a single device (no mesh)")
        self.K = int(max_stop_ids)
        self.sp = SamplingParams(float(temperature), int(top_k), float(top_p))
        self.seed = int(seed)
        self.programs = ProgramCache()
        self.stats = EngineStats()
        self.state: EngineState | None = None
        self.busy = np.zeros((self.B,), bool)  # slots holding a request the caller has not released
        self._key = None

    @property
    def compilations(self) -> dict:
        """Programs compiled so far: {'prefill': n, 'decode': n}."""
        return {k: self.programs.counts.get(k, 0) for k in ("prefill", "decode")}

    # ---- programs ----
    def _specs(self):
        from jax.sharding import PartitionSpec as PS

        from ..sharding import DATA
        t_spec = model_specs(self.target)
        d_spec = model_specs(self.drafter) if self.drafter is not None else None
        dec = state_specs(self.drafter is not None, self.target).replace(chain_hist=None)  # the engine does not record it
        st = EngineState(dec=dec, rows=PS(DATA), budget=PS(DATA), stop=PS(DATA, None), cycles=PS(DATA),
                         sp=RowSampling(PS(DATA), PS(DATA), PS(DATA)))
        return t_spec, d_spec, st

    def _compiled(self, kind, statics, args):
        from jax.sharding import PartitionSpec as PS

        from ..sharding import DATA, MODEL
        specs = None
        if self.mesh is not None:
            statics = dict(statics, tp=MODEL, **({"dp": DATA} if kind == "decode" else {}))
            t_spec, d_spec, st = self._specs()
            if kind == "prefill":
                row = PS(DATA)
                ins = (t_spec, d_spec if args[1] is not None else None, st, PS(DATA, None), row, row, row, row,
                       PS(DATA, None), RowSampling(row, row, row), PS())
            else:
                ins = (t_spec, d_spec if args[1] is not None else None, st, PS(), PS(), PS(), PS(DATA))
            specs = (ins, st)
        fn = engine_prefill if kind == "prefill" else engine_decode
        exe, secs = self.programs.compiled(kind, fn, statics, args, (2,), self.mesh, specs)
        self.stats.compile_time += secs
        return exe

    def _put(self, host, spec=None):
        if self.mesh is None:
            return jnp.asarray(host)
        from jax.sharding import PartitionSpec as PS

        from ..weights import put_global
        return put_global(host, self.mesh, spec if spec is not None else PS())

    def _models(self, shape: Shape):
        """The pair a decode of `shape` runs (with a drafter, target-only keeps its context), in the row layout
        where that pays (made once, kept)."""
        if self.drafter is None or self.mesh is not None:
            return self.target, self.drafter
        return self.programs.rows_pair(self.target, self.drafter, verify_width(shape.block, shape.tree))

    def warm(self) -> None:
        """Compile every program (each prompt bucket's prefill, each shape's decode per batch bucket) now."""
        self.reset()
        for P in self.prompt_buckets:
            self._prefill_call([], P, run=False)
        for shape in self.shapes:
            for b in self.batch_buckets:
                self._decode_exe(shape, b)

    # ---- state ----
    def empty_state(self) -> EngineState:
        """Every slot free (done), nothing compiled."""
        c = self.target.config
        B = self.B
        specs = self._specs()[2] if self.mesh is not None else None

        def z(shape, dtype, spec):
            from jax.sharding import NamedSharding
            return _zeros(shape, dtype, NamedSharding(self.mesh, spec) if specs is not None else None)

        def cache(layers, kv, head_dim, dtype, spec):
            shape = (layers, B, kv, self.S, head_dim)
            return KVCache(z(shape, dtype, spec and spec.k), z(shape, dtype, spec and spec.v),
                           z((B,), np.int32, spec and spec.lengths))

        ds = specs.dec if specs is not None else None
        if c.is_hybrid or c.gemma4 is not None or c.kv_quant:  # per-layer kinds, KV scales: init_cache shapes
            # zeros placed by their specs
            from jax.sharding import PartitionSpec
            from ..model import init_cache
            shapes = jax.eval_shape(lambda: init_cache(self.target, B, self.S))
            if ds is None:
                tcache = jax.tree.map(lambda a: z(a.shape, a.dtype, None), shapes)
            else:
                tcache = jax.tree.map(lambda sp, a: z(a.shape, a.dtype, sp), ds.tcache, shapes,
                                      is_leaf=lambda x: isinstance(x, PartitionSpec))
        else:
            from ..layers import first_layer, kv_heads
            kv_t = kv_heads(first_layer(self.target.params["layers"]), c.head_dim)
            tcache = cache(c.num_layers, kv_t, c.head_dim, self.target.dtype, ds and ds.tcache)
        dcache = None
        if self.drafter is not None:
            from ..layers import first_layer, kv_heads
            dc = self.drafter.config
            kv_d = kv_heads(first_layer(self.drafter.params["layers"]), dc.head_dim)
            dcache = cache(dc.num_layers, kv_d, dc.head_dim, self.drafter.dtype, ds and ds.dcache)
        dec = DecodeState(tcache=tcache, dcache=dcache, anchor=z((B,), np.int32, ds and ds.anchor),
                          out=z((B, self.width), np.int32, ds and ds.out), gen_len=z((B,), np.int32, ds and ds.gen_len),
                          done=self._put(np.ones((B,), bool), ds and ds.done),
                          acc_hist=z((B, 1), np.int32, ds and ds.acc_hist), cycle=z((), np.int32, ds and ds.cycle))
        rs, row = RowSampling.host([self.sp] * B), specs and specs.rows
        return EngineState(dec=dec, rows=z((B,), np.int32, row), budget=z((B,), np.int32, row),
                           stop=self._put(np.full((B, self.K), -1, np.int32), specs and specs.stop),
                           cycles=z((B,), np.int32, row),
                           sp=RowSampling(*(self._put(h, row) for h in (rs.temperature, rs.top_k, rs.top_p))))

    def reset(self) -> None:
        """Every slot free: a fresh state (the programs are kept)."""
        self.state = self.empty_state()
        self.busy[:] = False
        self._key = self._put(np.asarray(jax.random.PRNGKey(self.seed)))

    # ---- the step API ----
    def check(self, req: Request) -> None:
        if not req.prompt:
            raise ValueError(f"request {req.row_id}: empty prompt")
        if len(req.prompt) > self.P:
            raise ValueError(f"request {req.row_id}: prompt of {len(req.prompt)} tokens exceeds the engine's "
                             f"prompt_len {self.P}")
        if not 1 <= req.max_new_tokens <= self.max_new:
            raise ValueError(f"request {req.row_id}: max_new_tokens {req.max_new_tokens} outside [1, {self.max_new}]")
        if len(req.prompt) + req.max_new_tokens + self.verify_max > self.S:
            raise ValueError(f"request {req.row_id}: prompt of {len(req.prompt)} tokens + max_new_tokens "
                             f"{req.max_new_tokens} + block {self.verify_max} exceeds the cache ({self.S} slots)")
        if len(req.stop_token_ids) > self.K:
            raise ValueError(f"request {req.row_id}: {len(req.stop_token_ids)} stop ids, the engine holds "
                             f"{self.K} (max_stop_ids)")
        check_ids(self.target.config.vocab_size, np.asarray(req.prompt))

    def free_slots(self) -> list[int]:
        """Slots a request may take, lowest first (spread over the data shards with a mesh)."""
        local = self.B // self.dp
        per = [[s for s in range(k * local, (k + 1) * local) if not self.busy[s]] for k in range(self.dp)]
        return [s for group in zip(*[p + [None] * (local - len(p)) for p in per]) for s in group if s is not None]

    def admit(self, reqs: Sequence[Request]) -> list[int]:
        """Prefill `reqs` into free slots (at most `refill` per data shard per prefill call); their slots."""
        for r in reqs:
            self.check(r)
        if self.state is None:
            self.reset()
        free = self.free_slots()
        if len(reqs) > len(free):
            raise ValueError(f"{len(reqs)} requests for {len(free)} free slots")
        todo, local = list(zip(reqs, free)), self.B // self.dp
        while todo:
            count, call, rest = [0] * self.dp, [], []
            for r, s in todo:
                k = s // local
                if count[k] < self.refill:
                    call.append((r, s))
                    count[k] += 1
                else:
                    rest.append((r, s))
            longest = max(len(r.prompt) for r, _ in call)
            self._prefill_call(call, next(p for p in self.prompt_buckets if p >= longest))
            todo = rest
        slots = free[:len(reqs)]
        self.busy[slots] = True
        return slots

    def _prefill_call(self, call, P: int, run: bool = True):
        from jax.sharding import PartitionSpec as PS

        from ..sharding import DATA
        n, R, local = self.dp * self.refill, self.refill, self.B // self.dp
        tokens, lens = np.zeros((n, P), np.int32), np.ones((n,), np.int32)
        rows, slots, budget = np.zeros((n,), np.int32), np.full((n,), local, np.int32), np.ones((n,), np.int32)
        stop = np.full((n, self.K), -1, np.int32)
        settings = [self.sp] * n
        used = [0] * self.dp
        for r, s in call:
            k = s // local
            i = k * R + used[k]
            used[k] += 1
            tokens[i, :len(r.prompt)] = r.prompt
            lens[i], rows[i], slots[i], budget[i] = len(r.prompt), r.row_id, s - k * local, r.max_new_tokens
            stop[i, :len(r.stop_token_ids)] = r.stop_token_ids
            settings[i] = r.sampling or self.sp
        row = PS(DATA)
        sp = jax.tree.map(lambda h: self._put(h, row), RowSampling.host(settings))
        host = [(tokens, PS(DATA, None)), (lens, row), (rows, row), (slots, row), (budget, row), (stop, PS(DATA, None))]
        args = (self.target, self.drafter, self.state, *(self._put(h, s) for h, s in host), sp, self._key)
        exe = self._compiled("prefill", dict(Bk=self.Bk, width=self.width), args)
        if run:
            t0 = time.perf_counter()
            self.state = jax.block_until_ready(exe(*args))
            self.stats.prefill_time += time.perf_counter() - t0
            self.stats.prefill_calls += 1

    def _decode_args(self, shape: Shape, b: int, stop_free: int, limit: int, cancel):
        target, drafter = self._models(shape)
        return (target, drafter, self.state, self._key, self._put(np.int32(stop_free)), self._put(np.int32(limit)),
                self._put(cancel, self._specs()[2].rows if self.mesh is not None else None))

    def _decode_exe(self, shape: Shape, b: int, args=None):
        args = args or self._decode_args(shape, b, 0, 0, np.zeros((self.B,), bool))
        statics = dict(b=b, Bk=shape.block, tree=shape.tree)
        if shape.block == 1 and self.drafter is not None:  # batch the drafter's upkeep (the cache has room)
            statics["pending"] = min(PENDING, self.verify_max)
        return self._compiled("decode", statics, args)

    def batch_for(self, slots: Iterable[int]) -> int:
        """The smallest batch bucket holding every slot in `slots` (the highest busy one decides)."""
        top = max((int(s) % (self.B // self.dp) + 1 for s in slots), default=1)
        return next(b for b in self.batch_buckets if b >= top)

    def decode(self, shape: Shape | str | None = None, *, cycles: int | None = None, stop_free: int | None = None,
               cancel: Iterable[int] = (), batch: int | None = None) -> Snapshot:
        """Decode cycles of `shape` (one of self.shapes; default the first) on the smallest batch bucket holding the
        busy slots (or `batch`) until `stop_free` of those slots are done (default: all of them; over all data
        shards) or after `cycles` cycles. `cancel`: slots marked done first (their requests were dropped)."""
        shape = self.shapes[0] if shape is None else Shape.parse(shape).resolve(
            self.drafter.config.block_size if self.drafter is not None else None)
        if shape not in self.shapes:
            raise ValueError(f"shape {shape} is not one of the engine's ({', '.join(map(str, self.shapes))})")
        b = batch or self.batch_for(np.nonzero(self.busy)[0])
        mask = np.zeros((self.B,), bool)
        mask[list(cancel)] = True
        stop_free = b * self.dp if stop_free is None else int(stop_free)
        args = self._decode_args(shape, b, stop_free, FOREVER if cycles is None else int(cycles), mask)
        exe = self._decode_exe(shape, b, args)
        t0 = time.perf_counter()
        self.state = jax.block_until_ready(exe(*args))
        secs = time.perf_counter() - t0
        self.stats.decode_time += secs
        self.stats.decode_calls += 1
        snap = self.peek()
        snap.seconds, snap.batch = secs, b
        return snap

    def peek(self) -> Snapshot:
        """The slots now (after a prefill: each new row's first token)."""
        st = self.state
        return Snapshot(*(fetch(x) for x in (st.dec.done, st.dec.gen_len, st.dec.out, st.cycles)))

    def release(self, slots: Iterable[int]) -> None:
        """The caller is done with these slots (their rows finished or were cancelled): they take new requests."""
        self.busy[list(slots)] = False

    # ---- a finished list of requests ----
    def run(self, requests: Iterable[Request], on_compile: Callable[[str], None] | None = None):
        """Generate every request; yields Completions in the order rows finish."""
        pending = list(enumerate(requests))
        for _, r in pending:
            self.check(r)
        pending.reverse()  # pop() from the end = submission order
        self.reset()
        owner: dict = {}  # slot -> (index, request)
        while pending or owner:
            free = self.free_slots()
            if pending and free:
                batch = [pending.pop() for _ in range(min(len(free), len(pending)))]
                owner.update(zip(self.admit([r for _, r in batch]), batch))
            # decode until `refill` slots are free (or all of them when nothing waits)
            snap = self.decode(stop_free=min(self.refill, self.B) if pending else self.B, batch=self.B // self.dp)
            for slot in sorted(s for s in owner if snap.done[s]):
                idx, r = owner.pop(slot)
                self.release([slot])
                toks = snap.out[slot, :snap.gen_len[slot]].tolist()
                self.stats.tokens += len(toks)
                yield Completion(index=idx, row_id=r.row_id, tokens=toks, cycles=int(snap.cycles[slot]))


def fetch(x):
    """numpy of a device array; a global (multi-process) one is gathered, a process-local one is not."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from ..weights import fetch as fetch_global
    return fetch_global(x)


def generate_all(engine: Engine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
                 stop_token_ids: Sequence[int] = (), row_ids: Sequence[int] | None = None) -> list[Completion]:
    """Run `prompts` through `engine`; Completions in prompt order."""
    n = len(prompts)
    mx = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    ids = list(row_ids) if row_ids is not None else list(range(n))
    reqs = [Request(list(map(int, p)), int(i), int(m), tuple(stop_token_ids)) for p, i, m in zip(prompts, ids, mx)]
    out = sorted(engine.run(reqs), key=lambda c: c.index)
    return out
