"""Continuous-batching generation engine: a fixed set of slots, programs compiled once per engine.

`generate()` runs one static batch: every row waits for the longest one, and each new batch shape
(prompt bucket, cache size, max_new_tokens) compiles a new prefill and loop. The engine instead owns
`slots` rows with a cache of `cache_len` positions, fixed for its lifetime:

  prefill program  - prefills up to `refill` new prompts (padded to a prompt bucket) and writes them into
                     free slots (their KV rows, first token, budget, stop ids, row id, sampling setting);
  decode program   - one `lax.while_loop` of draft/verify cycles (decode.programs) over the slots, ending
                     when enough slots are done or after a given number of cycles (a chunk), one program per
                     shape (target-only, chain, tree) and per batch bucket (the cycles then run on the
                     first b slots only: fewer rows cost less where the verify is compute-bound).

Each slot carries its own sampling setting (sampling.RowSampling: runtime arrays) and its sampling-key row, so
requests with different temperature / top-k / top-p / seed share the programs. Shapes switch between two decode
calls in place: every drafted shape shares one state layout, and target-only with a drafter keeps the drafter's
context up to date (the target's taps of each committed token, appended a block of `PENDING` at a time), so a
later drafted chunk goes on from it.

Two ways to drive it: `run(requests)` (a finished list: prefill into free slots, decode until `refill`
slots are free, repeat) or the step API a server uses between chunks: `admit`, `decode`, `peek`, `release`.
Results equal `generate()`'s for the same (prompt, row id, setting): sampling keys depend on (seed, row id,
position) only, each row's budget is its own `max_new_tokens`, and a slot's stale KV past its fill index is
never attended (slot s holds position s; attention is masked by position).
"""
from .core import FOREVER, Completion, Engine, EngineStats, Request, Snapshot, fetch, generate_all
from .programs import EngineState, engine_decode, engine_prefill, put_rows

__all__ = ["FOREVER", "Completion", "Engine", "EngineState", "EngineStats", "Request", "Snapshot", "engine_decode",
           "engine_prefill", "fetch", "generate_all", "put_rows"]
