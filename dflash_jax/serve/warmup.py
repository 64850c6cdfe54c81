"""Start-up measurement: every program compiled, then the cost curve (seconds per cycle of each shape at each
batch bucket, every row of the bucket active) and each shape's acceptance on a few prompts, the priors of the
load-aware shape (serve.policy)."""
from __future__ import annotations

import logging
import statistics
import time

from ..engine import Engine, Request
from ..sampling import SamplingParams

log = logging.getLogger(__name__)

# Questions of the kinds a chat model serves (word problems first: the embedded pair was trained on GSM8K chats).
WARM_PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she "
    "earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her "
    "parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much "
    "more money does Betty need to buy the wallet?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
    "Write a short Python function that returns the sum of the squares of a list of integers.",
    "Explain in a few sentences why the sky is blue.",
)


def measure(engine: Engine, prompts: list[list[int]], shapes, *, cycles: int = 8, rounds: int = 2) -> tuple:
    """(curve {batch bucket: {shape name: seconds per cycle}}, prior {shape name: committed tokens per row-cycle})
    of `shapes` on `engine` (programs compiled first), greedy on `prompts` (token ids) with no stop tokens; the
    median of `rounds` chunks of up to `cycles` cycles after an untimed one, per shape and bucket. Leaves the
    engine empty."""
    t0 = time.perf_counter()
    engine.warm()
    log.info(f"compiled {sum(engine.compilations.values())} programs in {time.perf_counter() - t0:.1f} s")
    curve = {b: {} for b in engine.batch_buckets}
    seen: dict = {}
    longest = max(len(p) for p in prompts)
    room = engine.S - engine.verify_max - longest
    for b in engine.batch_buckets:
        for shape in shapes:
            name = str(shape)
            n = max(1, min(cycles, room // ((rounds + 1) * shape.block)))
            engine.reset()
            engine.admit([Request(prompts[i % len(prompts)], i, min(room, engine.max_new), (), SamplingParams())
                          for i in range(b)])
            prev = engine.decode(shape, cycles=n, batch=b)  # untimed: a program's first run carries one-time costs
            times = []
            for _ in range(rounds):
                snap = engine.decode(shape, cycles=n, batch=b)
                if snap.done[:b].any():
                    break
                times.append(snap.seconds / n)
                t = seen.setdefault(name, [0, 0])
                t[0] += int((snap.gen_len[:b] - prev.gen_len[:b]).sum())
                t[1] += n * b
                prev = snap
            curve[b][name] = statistics.median(times) if times else prev.seconds / n
    engine.reset()
    prior = {s: (t[0] / t[1] if t[1] else 1.0) for s, t in seen.items()}
    log.info(f"cost curve and acceptance in {time.perf_counter() - t0:.1f} s: " + "; ".join(
        f"batch {b}: " + ", ".join(f"{s} {1e3 * c:.1f} ms" for s, c in row.items()) for b, row in curve.items())
        + "; tau " + ", ".join(f"{s} {t:.2f}" for s, t in prior.items()))
    return curve, prior
