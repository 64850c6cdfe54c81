"""An OpenAI-compatible server over the continuous-batching engine (`python -m infer.serve`; docs/serving.md).

Modules, in import order (each imports only those above it):

    policy      the load-aware shape: expected committed tokens per second per shape at a batch bucket, from the
                start-up cost curve and the acceptance seen so far (pure Python)
    metrics     the Prometheus metrics (prometheus_client)
    textstream  the tokenizer behind a lock; a request's text as it grows (stop strings, partial characters)
    protocol    OpenAI request bodies checked into Params (400s naming the field), error and response bodies
    warmup      start-up: every program compiled, the cost curve and the acceptance priors measured
    scheduler   the engine as a request stream: a thread running bounded decode chunks, admitting between them
    app         the HTTP routes (FastAPI), streaming as server-sent events
    server      options, loading, uvicorn with a draining SIGTERM

Only `policy` is imported here: the rest needs the `serve` extra (fastapi, uvicorn).
"""
from .policy import Acceptance, best_shape, choose, cycle_seconds, expected_rate

__all__ = ["Acceptance", "best_shape", "choose", "cycle_seconds", "expected_rate"]
