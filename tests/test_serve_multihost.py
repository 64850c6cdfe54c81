"""Multi-host serving: two jax.distributed processes on CPU (one device each) run `python -m infer.serve --mesh data=2`;
process 0 serves HTTP and broadcasts its engine calls, process 1 follows (dflash_jax.serve.lockstep). Answers through
the official `openai` client equal dj.generate's target-only output; SIGTERM to process 0 ends both with status 0.
And the lockstep protocol itself on one process: a follower engine fed process 0's messages ends in the same state."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.test_serve import wait_for_health  # noqa: E402
from tests.xla_env import subprocess_xla_flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = ["Tom has 3 apples and buys 5 more. How many apples does he have?",
             "A baker makes 12 loaves a day. How many loaves does he make in 5 days?",
             "Sara reads 20 pages a day. How many pages does she read in a week?"]
ARGS = ["--slots", "4", "--cache-len", "256", "--shape", "chain:4", "--prompt-buckets", "64", "--chunk-cycles", "4",
        "--mesh", "data=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_follower_fed_the_leaders_calls_ends_in_the_leaders_state():
    """serve.lockstep on one process: every call the Leader makes reaches the follower as a message, and the
    follower's engine, applying them, holds the same slots and tokens (reset, warm, admit, decode, peek, release)."""
    import dflash_jax as dj
    from dflash_jax.engine import Engine, Request
    from dflash_jax.sampling import SamplingParams
    from dflash_jax.serve.lockstep import Leader, follow
    target, drafter, _ = dj.load_reference()
    kw = dict(slots=2, prompt_len=32, max_new_tokens=16, cache_len=64, shapes=["chain:4", "off"], prompt_buckets=(32,))
    a, b = Engine(target, drafter, **kw), Engine(target, drafter, **kw)
    sent = []
    lead = Leader(a, send=sent.append)
    lead.reset()
    lead.admit([Request([5, 6, 7, 8], 0, 12, (), SamplingParams(0.7, 5, 0.9)), Request([9, 10, 11], 1, 10)])
    lead.decode("chain:4", cycles=2, cancel=[1])
    lead.release([1])
    lead.admit([Request([12, 13], 2, 6)])
    snap = lead.decode("off", cycles=3)
    lead.close()
    assert lead.sent == len(sent) == 7 and lead.B == 2  # other attributes are the engine's
    msgs = iter(sent)
    assert follow(b, receive=lambda: next(msgs)) == 6
    other = b.peek()
    for x, y in zip((snap.done, snap.gen_len, snap.out, snap.cycles), (other.done, other.gen_len, other.out, other.cycles)):
        np.testing.assert_array_equal(x, y)
    assert list(a.busy) == list(b.busy)


@pytest.mark.slow
def test_two_processes_serve_one_mesh(tmp_path):
    import dflash_jax as dj
    from dflash_jax.text import decode, encode_chat, stop_token_ids
    target, _, tok = dj.load_reference()
    stops = stop_token_ids(tok, target.config)
    ref = dj.generate(target, None, [encode_chat(tok, q) for q in QUESTIONS], max_new_tokens=32,
                      stop_token_ids=stops, max_cache_len=256)
    want = [decode(tok, t, stops) for t in ref.tokens]

    port, coord = _free_port(), f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=subprocess_xla_flags(1), PYTHONPATH=ROOT)
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "infer.serve", "--port", str(port), *ARGS, "--distributed",
                               "--coordinator", coord, "--num-processes", "2", "--process-id", str(i)],
                              cwd=ROOT, env=env, stdout=logs[i], stderr=subprocess.STDOUT) for i in range(2)]

    def tails():
        out = []
        for i, f in enumerate(logs):
            f.flush()
            out.append(f"--- process {i} ---\n" + open(f.name).read()[-3000:])
        return "\n".join(out)

    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base, procs, tails, timeout=400, poll=0.5)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)

        def ask(q, stream=False):
            kw = dict(model="dflash-reference", messages=[{"role": "user", "content": q}], temperature=0, max_tokens=32)
            if stream:
                return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                               if c.choices)
            return client.chat.completions.create(**kw).choices[0].message.content

        with ThreadPoolExecutor(3) as pool:  # three at once: both data shards hold rows
            got = list(pool.map(ask, QUESTIONS, [False, True, False]))
        assert got == want, tails()
        time.sleep(6)  # an idle spell: process 0 keeps process 1's wait alive
        assert ask(QUESTIONS[0]) == want[0], tails()
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in procs]
        assert codes == [0, 0], tails()
        assert "process 0 stopped after" in open(logs[1].name).read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
