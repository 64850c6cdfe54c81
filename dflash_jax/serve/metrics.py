"""The server's Prometheus metrics, in a registry of their own (several servers may share a process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


class Metrics:
    """Every metric the server exports (names prefixed `dflash_`)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        disable_created_metrics()  # no `_created` series beside each counter (process-wide in prometheus_client)
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dflash_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("dflash_generated_tokens", "tokens generated", registry=r)
        self.cancelled = Counter("dflash_requests_cancelled", "requests dropped by their client before the end",
                                 registry=r)
        self.failed = Counter("dflash_requests_failed", "requests that failed inside the server", registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dflash_inter_token_latency_seconds", "seconds per generated token after the first, "
                             "per request and decode chunk", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dflash_request_seconds", "arrival to the last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.queue = Gauge("dflash_queue_depth", "requests waiting for a slot", registry=r)
        self.active = Gauge("dflash_slots_active", "slots holding a request", registry=r)
        self.slots = Gauge("dflash_slots", "slots of the engine", registry=r)
        self.tau = Gauge("dflash_tau", "committed tokens per row-cycle of the latest drafted chunks (decayed mean)",
                         registry=r)
        self.tau_chunk = Histogram("dflash_chunk_tau", "committed tokens per row-cycle of each decode chunk",
                                   buckets=TAU_BUCKETS, registry=r)
        self.shape = Gauge("dflash_shape", "1 for the shape of the latest decode chunk, 0 for the others",
                           ["shape"], registry=r)
        self.chunks = Counter("dflash_chunks", "decode chunks by shape", ["shape"], registry=r)
        self.batch = Gauge("dflash_chunk_batch", "slots the latest decode chunk ran on (its batch bucket)",
                           registry=r)
        self.compilations = Gauge("dflash_compilations", "programs compiled by the engine", ["program"], registry=r)
        self.expected = Gauge("dflash_expected_tokens_per_second", "the shape policy's expected committed tokens "
                              "per second at the latest chunk's load", ["shape"], registry=r)
        self._tau = [0.0, 0.0]

    def shapes(self, names) -> None:
        for n in names:
            self.shape.labels(n).set(0)
            self.chunks.labels(n)

    def chunk(self, shape: str, batch: int, tokens: int, row_cycles: int, drafted: bool) -> None:
        for s in list(self._shape_names()):
            self.shape.labels(s).set(1 if s == shape else 0)
        self.chunks.labels(shape).inc()
        self.batch.set(batch)
        if drafted and row_cycles > 0:
            self.tau_chunk.observe(tokens / row_cycles)
            self._tau = [0.9 * self._tau[0] + tokens, 0.9 * self._tau[1] + row_cycles]
            self.tau.set(self._tau[0] / self._tau[1])

    def _shape_names(self):
        for m in self.shape.collect():
            for s in m.samples:
                yield s.labels["shape"]

    def render(self) -> bytes:
        return generate_latest(self.registry)
