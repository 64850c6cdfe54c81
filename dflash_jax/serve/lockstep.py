"""Multi-host serving: process 0 runs the HTTP server and the scheduler, every process holds the same engine and runs
the same programs.

The engine's calls that touch the devices (reset, warm, admit, decode, peek) or the slots' bookkeeping (release)
are made on process 0 through `Leader`, which broadcasts each call (a small JSON message, `broadcast`) to the other
processes before running it; the others run `follow`, which applies the calls in the order they come until process
0 sends `stop`. So every process enters each sharded program, and each gather of its results, in the same order.
While no request is in flight the scheduler sends `idle` now and then, so the followers' wait never reaches a
collective's timeout. One process alone needs none of this: the server uses the engine directly.
"""
from __future__ import annotations

import json
import logging
from typing import Callable

import numpy as np

from ..engine import Engine, Request
from ..sampling import SamplingParams

log = logging.getLogger(__name__)

MIN_MESSAGE = 256  # bytes; messages are padded to a power of two >= this (one compiled broadcast per size)


def request_to_dict(r: Request) -> dict:
    sp = r.sampling
    return {"prompt": [int(t) for t in r.prompt], "row_id": int(r.row_id), "max_new_tokens": int(r.max_new_tokens),
            "stop_token_ids": [int(t) for t in r.stop_token_ids],
            "sampling": None if sp is None else [float(sp.temperature), int(sp.top_k), float(sp.top_p)]}


def request_from_dict(d: dict) -> Request:
    sp = d["sampling"]
    return Request(list(d["prompt"]), d["row_id"], d["max_new_tokens"], tuple(d["stop_token_ids"]),
                   None if sp is None else SamplingParams(sp[0], int(sp[1]), sp[2]))


def broadcast(message: bytes | None) -> bytes:
    """Process 0's `message` on every process (the others pass None): its length, then its bytes padded to a power
    of two, each by one `broadcast_one_to_all` over every device."""
    import jax
    from jax.experimental import multihost_utils
    lead = jax.process_index() == 0
    n = np.asarray([len(message) if lead else 0], np.int32)
    n = int(np.asarray(multihost_utils.broadcast_one_to_all(n, is_source=lead))[0])
    size = max(MIN_MESSAGE, 1 << max(n - 1, 0).bit_length())
    buf = np.zeros((size,), np.uint8)
    if lead:
        buf[:n] = np.frombuffer(message, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=lead))
    return buf[:n].tobytes()


class Leader:
    """`engine` on process 0 of several: each call below is sent to the other processes (`send`, default
    `broadcast`) before it runs here. Every other attribute is the engine's own."""

    def __init__(self, engine: Engine, send: Callable[[bytes], object] | None = None):
        self.engine = engine
        self._send = send or broadcast
        self.sent = 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _tell(self, op: str, **kw) -> None:
        self._send(json.dumps({"op": op, **kw}).encode())
        self.sent += 1

    def reset(self) -> None:
        self._tell("reset")
        return self.engine.reset()

    def warm(self) -> None:
        self._tell("warm")
        return self.engine.warm()

    def admit(self, reqs) -> list[int]:
        reqs = list(reqs)
        self._tell("admit", reqs=[request_to_dict(r) for r in reqs])
        return self.engine.admit(reqs)

    def decode(self, shape=None, *, cycles=None, stop_free=None, cancel=(), batch=None):
        cancel = [int(s) for s in cancel]
        self._tell("decode", shape=None if shape is None else str(shape), cycles=cycles, stop_free=stop_free,
                   cancel=cancel, batch=batch)
        return self.engine.decode(shape, cycles=cycles, stop_free=stop_free, cancel=cancel, batch=batch)

    def peek(self):
        self._tell("peek")
        return self.engine.peek()

    def release(self, slots) -> None:
        slots = [int(s) for s in slots]
        self._tell("release", slots=slots)
        return self.engine.release(slots)

    def idle(self) -> None:
        """Nothing to do: keeps the followers' wait short of a collective's timeout."""
        self._tell("idle")

    def close(self) -> None:
        """The followers leave `follow`."""
        self._tell("stop")


def apply(engine: Engine, msg: dict) -> bool:
    """Run one call sent by `Leader` on this process's engine; False for `stop`."""
    op = msg["op"]
    if op == "stop":
        return False
    if op == "reset":
        engine.reset()
    elif op == "warm":
        engine.warm()
    elif op == "admit":
        engine.admit([request_from_dict(d) for d in msg["reqs"]])
    elif op == "decode":
        engine.decode(msg["shape"], cycles=msg["cycles"], stop_free=msg["stop_free"], cancel=msg["cancel"],
                      batch=msg["batch"])
    elif op == "peek":
        engine.peek()
    elif op == "release":
        engine.release(msg["slots"])
    elif op != "idle":
        raise ValueError(f"unknown lockstep call {op!r}")
    return True


def follow(engine: Engine, receive: Callable[[], bytes] | None = None) -> int:
    """Apply process 0's engine calls here until it sends stop; the number of calls applied. A call that fails
    here fails on process 0 as well (same programs, same inputs), whose scheduler then resets the engine - a reset
    this loop receives like any other call."""
    receive = receive or (lambda: broadcast(None))
    n = 0
    while True:
        msg = json.loads(receive().decode())
        try:
            if not apply(engine, msg):
                return n
        except Exception:  # noqa: BLE001 - process 0 sees the same failure and decides what follows
            log.exception(f"engine call {msg['op']} failed on this process")
        n += 1
