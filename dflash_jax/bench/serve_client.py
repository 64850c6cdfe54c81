"""The serving benchmark's client side (python -m infer.bench_serve): the server in a subprocess, what it reports
(/health, /metrics, its resident memory), and one HTTP request of each kind the benchmark sends (httpx, asyncio).

    ServerProcess   `python -m infer.serve ...` on a free port of 127.0.0.1: waits until /health answers, reads
                    /health, /metrics (parsed), the process's RSS and CPU seconds, stops it with SIGTERM (the
                    server drains)
    PauseClock      the seconds this process was stopped from outside during a timed stretch
    Spec, send      one request: a chat or text completion, streamed (server-sent events) or whole, optionally
                    closed after its first text (a client that leaves), or a malformed body; an Outcome
    questions       the first user turns of a prompt set in the paper's format (prompts.load_dataset_prompts,
                    local files only)

Needs httpx and prometheus_client (`pip install "dflash-jax[serve]"`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from ..prompts import load_dataset_prompts

MAX_RETRIES = 8  # a 429 (full queue) is retried after its Retry-After this many times
JSON_HEADERS = {"Content-Type": "application/json"}


def questions(dataset: str = "gsm8k", data_dir: str | None = None, limit: int | None = None) -> list[str]:
    """The first user turn of each prompt of `dataset` (local copy under `data_dir`, $DFLASH_DATA_DIR or
    ../shared/data), at most `limit`."""
    return [s.turns[0] for s in load_dataset_prompts(dataset, data_dir, max_samples=limit, allow_hub=False)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process `pid` (Linux /proc, else psutil when installed), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
        return int(psutil.Process(pid).memory_info().rss)
    except Exception:  # noqa: BLE001 - no psutil, or the process is gone
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class PauseClock:
    """Seconds this process stood still: a thread wakes every `tick` seconds and adds up how far each wake-up came
    later than `gap` seconds. A process stopped from outside (SIGSTOP, as a shared machine's profiling may do to
    every other process) shows up here, so timings can leave those seconds out."""

    def __init__(self, tick: float = 0.02, gap: float = 0.25):
        self.tick, self.gap, self.paused = tick, gap, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pause-clock", daemon=True)

    def _watch(self):
        last = time.monotonic()
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            if now - last > self.gap:
                self.paused += now - last - self.tick
            last = now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def parse_metrics(text: str) -> dict:
    """Prometheus text -> {(sample name, ((label, value), ...) sorted): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def by_label(m: dict, name: str, label: str) -> dict:
    """{label value: sample value} of the samples called `name` that carry `label`."""
    return {dict(k[1])[label]: v for k, v in m.items() if k[0] == name and label in dict(k[1])}


def value(m: dict, name: str, default: float = 0.0) -> float:
    return m.get((name, ()), default)


class ServerProcess:
    """One `python -m infer.serve` process. `cmd`: the command without --port (e.g. [python, -m, infer.serve,
    --shape, off]); `cwd`: where it runs; its output goes to a log file (`log_path`, or a temporary file)."""

    def __init__(self, cmd: list[str], *, name: str = "server", cwd: str | None = None, env: dict | None = None,
                 log_path: str | None = None):
        self.cmd, self.name, self.cwd, self.env = list(cmd), name, cwd, env
        self.log_path = log_path or os.path.join(tempfile.mkdtemp(prefix="dflash-bench-serve-"), f"{name}.log")
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.startup_s = 0.0
        self.ready_health: dict = {}

    @property
    def command(self) -> str:
        """The command line, the interpreter written as `python`."""
        head = ["python"] if self.cmd and self.cmd[0] == sys.executable else self.cmd[:1]
        return " ".join(shlex.quote(a) for a in head + self.cmd[1:])

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout: float = 1200.0) -> ServerProcess:
        """Start the process and wait until /health answers 200 (RuntimeError with the log's tail if it exits or
        takes longer than `timeout` seconds)."""
        self.port = free_port()
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd + ["--port", str(self.port)], cwd=self.cwd, env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.name} server exited with status {self.proc.returncode}:\n"
                                   f"{self.tail()}")
            try:
                r = httpx.get(self.base + "/health", timeout=5)
                if r.status_code == 200:
                    self.ready_health = r.json()
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                self.stop(5)
                raise RuntimeError(f"the {self.name} server did not answer /health within {timeout:.0f} s:\n"
                                   f"{self.tail()}")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - t0
        return self

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=30).json()

    def metrics(self) -> dict:
        return parse_metrics(httpx.get(self.base + "/metrics", timeout=30).text)

    def rss(self) -> int | None:
        return rss_bytes(self.pid) if self.proc is not None and self.proc.poll() is None else None

    def cpu_seconds(self) -> float | None:
        return cpu_seconds(self.pid) if self.proc is not None else None

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until no slot is busy and no request waits (cancelled slots are freed at the next chunk)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            h = self.health()
            if h["active"] == 0 and h["queued"] == 0:
                return True
            time.sleep(0.1)
        return False

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server finishes what is in flight and exits 0), then SIGKILL after `timeout` seconds; the
        exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


@dataclasses.dataclass
class Spec:
    """One request to send. `body`: a JSON object, or raw bytes (a malformed body)."""
    kind: str  # what the benchmark calls it: "chat", "completion", "cancel" or "malformed:<what>"
    endpoint: str  # "chat" or "completion"
    body: dict | bytes
    stream: bool = False
    leave_after_first: bool = False  # close the stream after the first text
    index: int = 0  # which prompt (answers of the same index are compared)

    @property
    def malformed(self) -> bool:
        return self.kind.startswith("malformed")


@dataclasses.dataclass
class Outcome:
    spec: Spec
    status: int | None = None  # HTTP status (None: no answer)
    finish: str | None = None  # finish_reason of a finished answer
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None  # seconds from sending to the first text (streamed)
    seconds: float = 0.0  # sending to the end of the answer (or to leaving)
    done: bool = False  # a stream ended with [DONE]
    left: bool = False  # the client closed the stream after its first text
    error: str | None = None  # the error message of a non-200 answer, or what went wrong on the wire
    error_type: str | None = None
    retries: int = 0  # 429 answers retried

    @property
    def completed(self) -> bool:
        """A well-formed answer that ran to its end (finish_reason given, usage counted)."""
        ok = self.status == 200 and self.finish is not None and self.error is None
        return ok and (self.done or not self.spec.stream)


def _error_of(status: int, raw: bytes) -> tuple[str, str | None]:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("message") or ""), err.get("type")
    except (ValueError, KeyError, TypeError):
        return raw[:300].decode(errors="replace") or f"HTTP {status}", None


async def _whole(client: httpx.AsyncClient, url: str, content: bytes, out: Outcome, t0: float) -> str | None:
    r = await client.post(url, content=content, headers=JSON_HEADERS)
    out.status = r.status_code
    if r.status_code != 200:
        out.error, out.error_type = _error_of(r.status_code, r.content)
        return r.headers.get("retry-after")
    body = r.json()
    choice = body["choices"][0]
    out.text = choice["message"]["content"] if "message" in choice else choice["text"]
    out.finish = choice.get("finish_reason")
    out.prompt_tokens = body["usage"]["prompt_tokens"]
    out.completion_tokens = body["usage"]["completion_tokens"]
    out.seconds = time.perf_counter() - t0
    return None


async def _stream(client: httpx.AsyncClient, url: str, content: bytes, out: Outcome, t0: float) -> str | None:
    parts = []
    async with client.stream("POST", url, content=content, headers=JSON_HEADERS) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error, out.error_type = _error_of(r.status_code, await r.aread())
            return r.headers.get("retry-after")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out.done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                out.error, out.error_type = obj["error"].get("message"), obj["error"].get("type")
                continue
            if obj.get("usage"):
                out.prompt_tokens = obj["usage"]["prompt_tokens"]
                out.completion_tokens = obj["usage"]["completion_tokens"]
            for ch in obj.get("choices") or ():
                text = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                if text:
                    parts.append(text)
                    if out.ttft is None:
                        out.ttft = time.perf_counter() - t0
                if ch.get("finish_reason"):
                    out.finish = ch["finish_reason"]
            if out.spec.leave_after_first and parts and out.finish is None:
                out.left = True
                break  # leaving the block closes the connection mid-stream
    out.text = "".join(parts)
    out.seconds = time.perf_counter() - t0
    return None


async def send(client: httpx.AsyncClient, base: str, spec: Spec) -> Outcome:
    """Send `spec` to the server at `base`; a 429 is retried after its Retry-After (at most MAX_RETRIES times)."""
    url = base + ("/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions")
    content = spec.body if isinstance(spec.body, bytes) else json.dumps(spec.body).encode()
    retries = 0
    while True:
        out = Outcome(spec, retries=retries)
        t0 = time.perf_counter()
        try:
            retry_after = await (_stream if spec.stream else _whole)(client, url, content, out, t0)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            out.error = f"{type(e).__name__}: {e}"
            out.seconds = time.perf_counter() - t0
            return out
        if out.status != 429 or retries >= MAX_RETRIES:
            return out
        retries += 1
        await asyncio.sleep(float(retry_after or 1))


async def send_all(base: str, specs: list[Spec], concurrency: int, on_done=None,
                   timeout: float = 900.0) -> list[Outcome]:
    """Closed-loop clients: `concurrency` of them, each sending the next unsent spec when its last answer ended,
    until every spec is sent. `on_done(outcome)` is called as each ends. Outcomes in the order of `specs`."""
    out: list[Outcome | None] = [None] * len(specs)
    todo = iter(range(len(specs)))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=60.0), limits=limits) as client:
        async def worker():
            for i in todo:
                out[i] = await send(client, base, specs[i])
                if on_done is not None:
                    on_done(out[i])

        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(specs))))))
    return out
