"""The server put together: the models, the engine sized from the options, the start-up measurement, the scheduler
and the HTTP app, run by uvicorn. SIGTERM (or Ctrl-C): new requests get 503, the requests in flight finish (at most
`drain_timeout` seconds), then the process exits with status 0; a second signal exits at once."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import uvicorn

from ..decode.shape import Auto, Shape, TargetOnly, Tree
from ..decode.state import stop_width
from .app import Service, build_app
from .metrics import Metrics
from .scheduler import Scheduler
from .textstream import Tokens
from .warmup import WARM_PROMPTS, measure

log = logging.getLogger("dflash_jax.serve")

AUTO_CHAINS = (4, 8, 16)  # the chains --shape auto chooses among by default (those within the drafter's block)
FAULT_ENV = "DFLASH_SERVE_FAULT_MARKER"  # tests: a prompt holding this text fails inside the scheduler


@dataclasses.dataclass
class Options:
    target: str | None = None  # HF directory; None: the embedded reference pair
    drafter: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    slots: int = 8
    max_queue: int = 64
    shape: str = "auto"  # auto | chain:B | tree:N | off
    auto_shapes: tuple[str, ...] | None = None  # what auto chooses among (default: off + AUTO_CHAINS)
    api_key: str | None = None
    max_tokens_default: int = 256
    cache_len: int = 1024
    chunk_cycles: int = 8
    prompt_buckets: tuple[int, ...] | None = None  # default: 64, 256, 1024, ... below the longest prompt
    batch_buckets: tuple[int, ...] | None = None  # default: a quarter of the slots and all of them
    refill: int | None = None
    drain_timeout: float = 30.0
    dtype: str = "float32"
    quant: str | None = None  # the target's weights / KV cache in "int8" or "fp8" (dflash_jax.quant)
    kv_quant: str | None = None
    model_name: str | None = None
    seed: int = 0
    mesh: object | None = None  # a ('data', 'model') jax Mesh: slots over 'data', tensor-parallel over 'model'


def engine_shapes(opts: Options, full_block: int | None) -> list[Shape]:
    """The shapes the engine compiles: auto's candidates, or the one fixed shape."""
    sh = Shape.parse(opts.shape)
    if full_block is None:
        if isinstance(sh, Tree):
            raise ValueError("--shape tree:N needs a drafter")
        return [TargetOnly()]
    if not isinstance(sh, Auto):
        return [sh.resolve(full_block)]
    names = opts.auto_shapes or ("off",) + tuple(f"chain:{b}" for b in AUTO_CHAINS if b <= full_block)
    return list(dict.fromkeys(Shape.parse(s).resolve(full_block) for s in names))


def build_engine(opts: Options):
    """(engine, tokenizer, model name, shapes, stop ids): the models loaded (sharded over `opts.mesh`) and the engine
    sized from the options; nothing compiled yet. Every process of a multi-host server builds the same."""
    from ..engine import Engine
    from ..quant import quantize_target
    t0 = time.perf_counter()
    if opts.target is None:
        from ..embedded import load_reference, reference_paths
        target, drafter, tok = load_reference(opts.dtype, mesh=opts.mesh)
        name = opts.model_name or "dflash-reference"
        tdir = reference_paths()[0]
        target = quantize_target(target, opts.quant, opts.kv_quant)
    else:
        from ..text import load_tokenizer
        from ..weights import load_drafter, load_target
        target = load_target(opts.target, dtype=opts.dtype, mesh=opts.mesh, quant=opts.quant, kv_quant=opts.kv_quant)
        drafter = load_drafter(opts.drafter, target, dtype=opts.dtype, mesh=opts.mesh) if opts.drafter else None
        tok, tdir = load_tokenizer(opts.target), opts.target
        name = opts.model_name or os.path.basename(os.path.normpath(opts.target))
    if Shape.parse(opts.shape) == TargetOnly():
        drafter = None
    from ..text import stop_token_ids
    stops = tuple(stop_token_ids(tok, target.config, tdir))
    shapes = engine_shapes(opts, drafter.config.block_size if drafter is not None else None)
    S = min(int(opts.cache_len), target.config.max_position_embeddings)
    verify = max(s.tree + 1 if s.tree else s.block for s in shapes)
    P = S - verify - 1  # the longest prompt: one new token still fits
    if P < 16:
        raise ValueError(f"--cache-len {opts.cache_len} leaves no room for prompts (at least {verify + 17})")
    buckets = opts.prompt_buckets or tuple(p for p in (64, 256, 1024, 4096, 16384) if p < P)
    if opts.mesh is not None:  # one batch bucket: all the slots (the engine's rule on a mesh)
        if opts.batch_buckets and tuple(opts.batch_buckets) != (opts.slots,):
            raise ValueError(f"--batch-buckets {opts.batch_buckets} with a mesh: a mesh decodes every slot at once")
        batches = (opts.slots,)
    else:
        batches = opts.batch_buckets or (max(1, opts.slots // 4), opts.slots)
    dp = 1 if opts.mesh is None else int(opts.mesh.shape["data"])
    refill = opts.refill or max(1, min(4, opts.slots // (2 * dp)))
    engine = Engine(target, drafter, slots=opts.slots, prompt_len=P, max_new_tokens=P, cache_len=S, refill=refill,
                    seed=opts.seed, shapes=shapes, max_stop_ids=stop_width(len(stops)), prompt_buckets=buckets,
                    batch_buckets=batches, mesh=opts.mesh)
    log.info(f"{name}: {opts.slots} slots, cache {S}, shapes {', '.join(map(str, shapes))}, prompt buckets "
             f"{engine.prompt_buckets}, batch buckets {engine.batch_buckets}"
             + (f", mesh {dict(opts.mesh.shape)} over {jax_process_count()} process(es)" if opts.mesh is not None else "")
             + f" (loaded in {time.perf_counter() - t0:.1f} s)")
    return engine, tok, name, shapes, stops


def jax_process_count() -> int:
    import jax
    return jax.process_count()


def build(opts: Options):
    """(app, service) ready to serve: models loaded, programs compiled, costs measured, the scheduler running. With
    several jax processes this is process 0's part: its engine calls reach the others (serve.lockstep)."""
    t0 = time.perf_counter()
    engine, tok, name, shapes, stops = build_engine(opts)
    leader = None
    if jax_process_count() > 1:
        from .lockstep import Leader
        engine = leader = Leader(engine)
    P = engine.P
    tokens = Tokens(tok)
    metrics = Metrics()
    curve = prior = None
    if len(shapes) > 1:
        warm = [tokens.chat(q) for q in WARM_PROMPTS]
        curve, prior = measure(engine, [w[:P // 2] for w in warm], shapes, cycles=opts.chunk_cycles)
    else:
        engine.warm()
    sched = Scheduler(engine, tokens, metrics, shapes=shapes, curve=curve, prior=prior,
                      chunk_cycles=opts.chunk_cycles, max_queue=opts.max_queue,
                      idle=leader.idle if leader is not None else None)
    svc = Service(scheduler=sched, tokens=tokens, metrics=metrics, model=name, stop_ids=stops,
                  max_tokens_default=opts.max_tokens_default, api_key=opts.api_key,
                  fault_marker=os.environ.get(FAULT_ENV) or None)
    sched.start()
    log.info(f"ready in {time.perf_counter() - t0:.1f} s ({sum(engine.compilations.values())} programs compiled)")
    return build_app(svc), svc


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT drains (new requests 503, the ones in flight finish within
    the timeout) and then exits cleanly; a second one exits at once."""

    def __init__(self, config, svc: Service, drain_timeout: float):
        super().__init__(config)
        self.svc, self.drain_timeout, self._draining = svc, drain_timeout, False

    def handle_exit(self, sig, frame):
        if self._draining:
            return super().handle_exit(sig, frame)
        self._draining = True
        self.svc.draining = True
        threading.Thread(target=self._drain, name="dflash-drain", daemon=True).start()

    def _drain(self):
        n = self.svc.scheduler.in_flight()
        log.info(f"shutting down: {n} request(s) in flight, waiting up to {self.drain_timeout:.0f} s")
        clean = self.svc.scheduler.drain(self.drain_timeout)
        log.info("every request finished" if clean else "drain timeout: the rest were ended with 503")
        time.sleep(0.2)  # let the last responses go out
        self.should_exit = True


def serve(opts: Options) -> int:
    """Build and run the server until it is told to stop; the exit status (0 after a drain). With several jax
    processes, process 0 serves HTTP and the others run its engine calls (serve.lockstep.follow) until it stops."""
    import jax
    if jax.process_count() > 1 and jax.process_index() != 0:
        from .lockstep import follow
        engine = build_engine(opts)[0]
        n = follow(engine)
        log.info(f"process {jax.process_index()}: process 0 stopped after {n} engine calls")
        return 0
    app, svc = build(opts)
    config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=int(opts.drain_timeout) + 5)
    server = DrainingServer(config, svc, opts.drain_timeout)
    print(f"serving {svc.model} on http://{opts.host}:{opts.port}/v1", flush=True)
    server.run()
    if not svc.draining:  # stopped another way: end the scheduler
        svc.scheduler.drain(0)
    close = getattr(svc.scheduler.engine, "close", None)
    if close is not None:  # multi-host: the other processes stop following
        if svc.scheduler.thread.is_alive():
            log.warning("the scheduler is still in an engine call; the other processes are not told to stop")
        else:
            close()
    return 0
