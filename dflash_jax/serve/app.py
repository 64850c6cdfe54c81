"""The HTTP routes (FastAPI): /v1/models, /v1/chat/completions, /v1/completions (streamed as server-sent events or
whole), /health and /metrics, over a running serve.scheduler.Scheduler."""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import random
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..sampling import SamplingParams
from .metrics import Metrics
from .protocol import ApiError, Params, Reply, parse, sse
from .scheduler import Delta, Done, Draining, Failed, Job, QueueFull, Scheduler
from .textstream import Tokens

POLL_SECONDS = 0.25  # how often a whole (not streamed) request checks whether its client left


@dataclasses.dataclass
class Service:
    """What the routes serve: the scheduler, the tokenizer, the limits of requests."""
    scheduler: Scheduler
    tokens: Tokens
    metrics: Metrics
    model: str  # the served model's name (/v1/models)
    stop_ids: tuple[int, ...]  # end-of-sequence ids (a request's stop tokens unless ignore_eos)
    max_tokens_default: int = 256  # a request without max_tokens gets at most this many
    api_key: str | None = None
    draining: bool = False
    fault_marker: str | None = None  # a prompt holding this text fails inside the scheduler (tests)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def engine(self):
        return self.scheduler.engine


def build_app(svc: Service) -> FastAPI:
    app = FastAPI(title="dflash-jax", docs_url=None, redoc_url=None)
    app.state.service = svc

    def count(request: Request, status: int) -> None:
        svc.metrics.requests.labels(request.url.path, str(status)).inc()

    def error(request: Request, e: ApiError) -> JSONResponse:
        count(request, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def auth(request: Request) -> None:
        if svc.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip(), svc.api_key)):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", "invalid_api_key")

    @app.get("/health")
    async def health(request: Request):
        eng = svc.engine
        body = {"status": "draining" if svc.draining else "ok", "model": svc.model, "slots": eng.B,
                "active": len(svc.scheduler.jobs), "queued": len(svc.scheduler.queue),
                "compilations": eng.compilations, "shapes": svc.scheduler.names,
                "cache_len": eng.S, "max_prompt_tokens": eng.P}
        status = 503 if svc.draining else 200
        count(request, status)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics(request: Request):
        count(request, 200)
        return Response(svc.metrics.render(), media_type=svc.metrics.content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            auth(request)
        except ApiError as e:
            return error(request, e)
        count(request, 200)
        return {"object": "list", "data": [{"id": svc.model, "object": "model", "created": svc.created,
                                            "owned_by": "dflash-jax"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "completion")

    async def complete(request: Request, kind: str):
        try:
            auth(request)
            if svc.draining:
                raise ApiError(503, "the server is shutting down", "shutting_down")
            p = parse(await request.body(), kind)
            if p.model not in (None, svc.model):
                raise ApiError(404, f"model '{p.model}' is not served here (this server: '{svc.model}')",
                               "model_not_found")
            ids = await asyncio.to_thread(tokenize, p)
            job, events = make_job(p, ids)
            try:
                svc.scheduler.submit(job)
            except QueueFull as e:
                raise ApiError(429, str(e), "queue_full", {"Retry-After": str(e.retry_after)}) from None
            except Draining as e:
                raise ApiError(503, str(e), "shutting_down") from None
        except ApiError as e:
            return error(request, e)
        reply = Reply(kind, svc.model)
        if p.stream:
            count(request, 200)
            return StreamingResponse(stream(job, events, reply, p), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole(request, job, events, reply)

    def tokenize(p: Params) -> list[int]:
        try:
            if p.kind == "chat":
                return svc.tokens.chat(p.messages)
            if isinstance(p.prompt, str):
                return svc.tokens.text(p.prompt)
        except ValueError as e:
            raise ApiError(400, f"could not build the prompt: {e}", "invalid_prompt") from None
        vocab = svc.engine.target.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in p.prompt):
            raise ApiError(400, f"'prompt' token ids must lie in [0, {vocab})", "invalid_prompt")
        return list(p.prompt)

    def make_job(p: Params, ids: list[int]):
        eng = svc.engine
        room = eng.S - eng.verify_max - len(ids)
        if len(ids) > eng.P or room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; at most {eng.P} fit the cache ({eng.S} positions, "
                                f"--cache-len)", "prompt_too_long")
        if p.max_tokens is not None and p.max_tokens > room:
            raise ApiError(400, f"max_tokens {p.max_tokens} and the prompt's {len(ids)} tokens exceed the cache "
                                f"({eng.S} positions): at most {room} new tokens for this prompt", "max_tokens_too_large")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        text = " ".join(m["content"] for m in p.messages) if p.kind == "chat" else str(p.prompt)
        job = Job(prompt=ids, max_tokens=p.max_tokens or min(svc.max_tokens_default, room),
                  sampling=SamplingParams(p.temperature, p.top_k, p.top_p),
                  row_id=(p.seed if p.seed is not None else random.getrandbits(62)) % (1 << 31),
                  stop_ids=() if p.ignore_eos else svc.stop_ids, stop_strings=p.stop,
                  emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                  label=f"{p.kind} of {len(ids)} prompt tokens",
                  fail=bool(svc.fault_marker and svc.fault_marker in text))
        return job, events

    async def whole(request: Request, job: Job, events: asyncio.Queue, reply: Reply):
        parts = []
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), POLL_SECONDS)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    svc.scheduler.wake()
                    count(request, 499)
                    return Response(status_code=499)
                continue
            if isinstance(ev, Delta):
                parts.append(ev.text)
            elif isinstance(ev, Done):
                count(request, 200)
                return JSONResponse(reply.whole("".join(parts), ev.finish_reason,
                                                reply.usage(ev.prompt_tokens, ev.completion_tokens)))
            elif isinstance(ev, Failed):
                return error(request, ApiError(ev.status, ev.message, "request_failed"))

    async def stream(job: Job, events: asyncio.Queue, reply: Reply, p: Params):
        over = False
        try:
            if reply.kind == "chat":
                yield sse(reply.chunk(first=True))
            while True:
                ev = await events.get()
                if isinstance(ev, Delta):
                    yield sse(reply.chunk(ev.text))
                elif isinstance(ev, Done):
                    over = True
                    yield sse(reply.chunk(finish=ev.finish_reason))
                    if p.include_usage:
                        yield sse(reply.usage_chunk(reply.usage(ev.prompt_tokens, ev.completion_tokens)))
                    break
                elif isinstance(ev, Failed):
                    over = True
                    yield sse(ApiError(ev.status, ev.message, "request_failed").body())
                    break
            yield sse("[DONE]")
        finally:
            if not over:  # the client left: the slot is freed at the next chunk
                job.cancel()
                svc.scheduler.wake()

    return app
