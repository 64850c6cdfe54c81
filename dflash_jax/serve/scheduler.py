"""The engine as a request stream: one background thread owns the engine and runs it in bounded decode chunks.

Between two chunks the thread drops what clients cancelled (their slots are marked done in the next chunk),
prefills waiting requests into free slots (their first token is streamed at once), picks the chunk's shape
(fixed, or serve.policy's load-aware choice at the chunk's batch bucket), and decodes at most `chunk_cycles`
cycles - fewer when a request waits for a slot and one frees up. After each chunk every request gets its new
text; a finished one its end. Requests share the compiled programs whatever their sampling settings (per-row
runtime arrays) and seeds (the seed is the row's sampling-key id).

Failures stay with their request: an exception while handling one request ends that request with a 500; one
inside a device call ends the requests on the engine with a 500 and the engine starts over empty.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

from ..engine import Engine, Request
from ..sampling import SamplingParams
from .metrics import Metrics
from .policy import TARGET_ONLY, Acceptance, choose
from .textstream import Tokens, TextStream

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Delta:
    text: str
    tokens: int


@dataclasses.dataclass
class Done:
    finish_reason: str  # "stop" (a stop token or string) or "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int


@dataclasses.dataclass
class Failed:
    status: int
    message: str


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class Draining(Exception):
    pass


@dataclasses.dataclass(eq=False)
class Job:
    """One request on its way through the engine. `emit` receives Delta, then Done or Failed (from the scheduler
    thread: it must be thread-safe); `cancel()` may be called from any thread."""
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    row_id: int  # sampling-key row (the request's seed)
    stop_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    emit: Callable[[object], None]
    label: str = ""  # what a log line calls it
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    slot: int | None = None
    used: int = 0  # generated tokens consumed from the slot
    last: float = 0.0  # when it last got tokens
    stream: TextStream | None = None
    ended: bool = False
    fail: bool = False  # handling it raises (how tests fail one request)

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    """Owns `engine` on a thread of its own (`start`); `submit` jobs from any thread.

    shapes: the engine's shapes the chunks may run; with `curve` and `prior` (serve.warmup.measure) each chunk
    runs the one serve.policy expects to commit the most tokens per second, else always the first.
    chunk_cycles: the most cycles of one decode chunk. max_queue: jobs waiting for a slot beyond which `submit`
    raises QueueFull. idle: called from the scheduler thread every `idle_every` seconds while nothing is in flight
    (multi-host serving: serve.lockstep.Leader.idle keeps the other processes' wait short)."""

    def __init__(self, engine: Engine, tokens: Tokens, metrics: Metrics, *, shapes=None, curve: dict | None = None,
                 prior: dict | None = None, chunk_cycles: int = 8, max_queue: int = 64,
                 idle: Callable[[], None] | None = None, idle_every: float = 5.0):
        self.engine, self.tokens, self.metrics = engine, tokens, metrics
        self.shapes = list(shapes or engine.shapes)
        self.names = [str(s) for s in self.shapes]
        self.curve = curve
        self.acceptance = Acceptance(prior or {}) if curve else None
        self.chunk_cycles, self.max_queue = int(chunk_cycles), int(max_queue)
        self.queue: collections.deque[Job] = collections.deque()
        self.jobs: dict[int, Job] = {}  # slot -> job
        self.cancel_next: set[int] = set()  # slots to mark done in the next chunk
        self.admitting: list[Job] = []  # taken from the queue, not on the engine yet
        self.cond = threading.Condition()
        self.draining = self.stopping = False
        self.last_shape = None
        self.since_drafted = 0  # chunks since the last drafted one (the policy explores after a while)
        self._cycles: dict = {}  # slot -> its decode cycles after the last chunk
        self._mean_seconds = 1.0  # decayed mean of finished requests' times
        self.idle, self.idle_every = idle, float(idle_every)
        self._active_at = time.monotonic()  # the end of the last pass with work (or the last idle call)
        self.thread = threading.Thread(target=self._loop, name="dflash-scheduler", daemon=True)
        metrics.slots.set(engine.B)
        metrics.shapes(self.names)
        self._count_compilations()

    # ---- any thread ----
    def start(self) -> None:
        self.engine.reset()
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.draining:
                raise Draining("the server is shutting down")
            if len(self.queue) >= self.max_queue:
                raise QueueFull(max(1, round(self._retry_after())))
            self.queue.append(job)
            self.metrics.queue.set(len(self.queue))
            self.cond.notify()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify()

    def in_flight(self) -> int:
        """Jobs queued, being admitted or on the engine."""
        with self.cond:
            return len(self.queue) + len(self.admitting) + len(self.jobs)

    def drain(self, timeout: float) -> bool:
        """Stop taking jobs, let the queued and running ones finish for up to `timeout` seconds, then end the rest
        (503) and stop the thread. Whether everything finished in time."""
        with self.cond:
            self.draining = True
            self.cond.notify()
        end = time.monotonic() + timeout
        while self.in_flight() and time.monotonic() < end:
            time.sleep(0.02)
        clean = not self.in_flight()
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=max(5.0, timeout))
        for job in list(self.queue) + self.admitting + list(self.jobs.values()):
            self._end(job, Failed(503, "the server shut down before the request finished"))
        return clean

    def _retry_after(self) -> float:
        """Seconds until the queue has room, about: the mean request time of late times the queued requests per
        slot, at least one second."""
        return max(1.0, self._mean_seconds * (len(self.queue) + 1) / self.engine.B)

    # ---- the scheduler thread ----
    def _loop(self) -> None:
        while True:
            with self.cond:
                ping = False
                while not (self.queue or self.jobs or self.stopping):
                    self.cond.wait(0.5)
                    if self.idle is not None and time.monotonic() - self._active_at > self.idle_every:
                        ping = True
                        break
                if self.stopping:
                    return
                admit = [] if ping else self._take_admissions()
            if ping:
                self.idle()
                self._active_at = time.monotonic()
                continue
            try:
                if admit:
                    self._admit(admit)
                with self.cond:
                    self.admitting = []
                if self.jobs:
                    self._chunk()
            except Exception as e:  # noqa: BLE001 - a device failure ends the jobs on the engine, not the server
                log.exception("engine failure; the requests on it fail and the engine starts over")
                for job in list(self.jobs.values()) + [j for j in admit if not j.ended]:
                    self._end(job, Failed(500, f"internal error in the engine: {type(e).__name__}: {e}"))
                with self.cond:
                    self.jobs.clear()
                    self.admitting = []
                self.cancel_next.clear()
                self.engine.reset()
            self.metrics.active.set(len(self.jobs))
            self._count_compilations()
            self._active_at = time.monotonic()

    def _take_admissions(self) -> list[Job]:
        """Queued jobs for the free slots (cancelled ones dropped); called under the lock."""
        for job in [j for j in self.queue if j.cancelled]:
            self.queue.remove(job)
            self._end(job, None)
        free = len(self.engine.free_slots())
        self.admitting = [self.queue.popleft() for _ in range(min(free, len(self.queue)))]
        self.metrics.queue.set(len(self.queue))
        return self.admitting

    def _admit(self, jobs: list[Job]) -> None:
        ok = []
        for job in jobs:
            req = Request(job.prompt, job.row_id, job.max_tokens, job.stop_ids, job.sampling)
            try:
                self.engine.check(req)
            except ValueError as e:
                self._end(job, Failed(400, str(e)))
                continue
            ok.append((job, req))
        if not ok:
            return
        slots = self.engine.admit([r for _, r in ok])
        snap = self.engine.peek()
        now = time.perf_counter()
        for (job, _), slot in zip(ok, slots):
            job.slot = slot
            self._cycles[slot] = 0
            job.stream = TextStream(self.tokens, job.stop_ids, job.stop_strings)
            self.jobs[slot] = job
            self.metrics.prompt_tokens.inc(len(job.prompt))
            self.metrics.ttft.observe(now - job.arrived)
            job.last = now
            self._progress(job, snap, now, first=True)

    def _chunk(self) -> None:
        eng = self.engine
        for slot, job in list(self.jobs.items()):
            if job.cancelled and slot not in self.cancel_next:
                self.cancel_next.add(slot)
                self._end(job, None)
        live = [s for s in self.jobs if s not in self.cancel_next]
        batch = eng.batch_for(self.jobs)
        shape = self._choose(len(live), batch)
        with self.cond:
            waiting = bool(self.queue)
        rows, local = batch * eng.dp, eng.B // eng.dp  # the bucket's rows over every data shard
        done_now = rows - sum(1 for s in live if s % local < batch)
        before = {s: (self.jobs[s].used, self._cycles.get(s, 0)) for s in live}
        snap = eng.decode(shape, cycles=self.chunk_cycles, stop_free=done_now + 1 if waiting else rows,
                          cancel=sorted(self.cancel_next), batch=batch)
        for slot in self.cancel_next:
            self.jobs.pop(slot, None)
        eng.release(self.cancel_next)
        self.cancel_next = set()
        now = time.perf_counter()
        tokens = row_cycles = 0
        for slot in live:
            job = self.jobs[slot]
            got = int(snap.gen_len[slot]) - before[slot][0]
            tokens += got
            row_cycles += int(snap.cycles[slot]) - before[slot][1]
            if got:
                self.metrics.itl.observe((now - job.last) / got)
                job.last = now
            self._progress(job, snap, now)
        self._cycles = {s: int(snap.cycles[s]) for s in self.jobs}
        name = str(shape)
        self.metrics.chunk(name, batch, tokens, row_cycles, drafted=shape.block > 1)
        if self.acceptance is not None:
            self.acceptance.observe(name, tokens, row_cycles)

    def _choose(self, active: int, batch: int):
        if self.acceptance is None or len(self.shapes) == 1:
            return self.shapes[0]
        best, rates, explore = choose(active, batch, self.curve, self.acceptance.taus(self.names),
                                      since_drafted=self.since_drafted)
        self.since_drafted = 0 if best != TARGET_ONLY else self.since_drafted + 1
        for s, r in rates.items():
            self.metrics.expected.labels(s).set(r)
        if best != self.last_shape and not explore:
            log.info(f"shape {best} at {active} active rows (batch {batch}): expected tokens/s "
                     + ", ".join(f"{s} {r:.0f}" for s, r in rates.items()))
            self.last_shape = best
        return self.shapes[self.names.index(best)]

    def _progress(self, job: Job, snap, now: float, first: bool = False) -> None:
        """Hand `job` its new tokens from `snap`; end it when its row is done or its text stopped."""
        slot = job.slot
        try:
            if job.fail:
                raise RuntimeError("failure injected for this request (DFLASH_SERVE_FAULT_MARKER)")
            n = int(snap.gen_len[slot])
            new = snap.out[slot, job.used:n].tolist()
            job.used = n
            self.metrics.generated_tokens.inc(len(new))
            text = job.stream.push(new)
            finished = job.stream.stopped or bool(snap.done[slot])
            if finished:
                text += job.stream.flush()  # the held-back tail is final now
            if text:
                job.emit(Delta(text, len(new)))
            if finished:
                reason = "stop" if job.stream.stopped else "length"
                self._end(job, Done(reason, len(job.prompt), job.used))
                if snap.done[slot]:
                    self.jobs.pop(slot, None)
                    self.engine.release([slot])
                else:  # a stop string: the row goes on on device until the next chunk marks it done
                    self.cancel_next.add(slot)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            log.exception(f"request {job.label} failed")
            self._end(job, Failed(500, f"internal error: {type(e).__name__}: {e}"))
            if slot in self.jobs and not snap.done[slot]:
                self.cancel_next.add(slot)
            elif slot in self.jobs:
                self.jobs.pop(slot, None)
                self.engine.release([slot])

    def _end(self, job: Job, event) -> None:
        """Send `job` its last event (None: it was cancelled) once."""
        if job.ended:
            return
        job.ended = True
        if event is None:
            self.metrics.cancelled.inc()
            return
        if isinstance(event, Failed):
            self.metrics.failed.inc()
        else:
            took = time.perf_counter() - job.arrived
            self.metrics.e2e.observe(took)
            self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * took
        try:
            job.emit(event)
        except Exception:  # noqa: BLE001 - a closed client
            log.debug("could not deliver the end of a request", exc_info=True)

    def _count_compilations(self) -> None:
        for k, v in self.engine.compilations.items():
            self.metrics.compilations.labels(k).set(v)
