"""The OpenAI-compatible server (python -m infer.serve) in a subprocess on 127.0.0.1 with the embedded pair, driven
by the official `openai` client: answers equal dj.generate's target-only output, concurrency, errors, a client that
leaves, metrics, no compilation after warm-up, SIGTERM; and the pure parts (shape policy, text stream)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from dflash_jax.serve.policy import Acceptance, best_shape, choose, cycle_seconds  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key"
MARKER = "PLEASE-FAIL-HERE"
ARGS = ["--slots", "4", "--cache-len", "256", "--auto-shapes", "off,chain:4", "--batch-buckets", "2,4",
        "--prompt-buckets", "64", "--max-queue", "20", "--chunk-cycles", "4", "--api-key", KEY,
        "--max-tokens-default", "32"]
QUESTIONS = ["Tom has 3 apples and buys 5 more. How many apples does he have?",
             "A baker makes 12 loaves a day. How many loaves does he make in 5 days?",
             "Sara reads 20 pages a day. How many pages does she read in a week?"]


# ---- the pure parts ----
def test_policy_picks_speculation_at_low_load_and_target_only_when_verify_is_dear():
    curve = {1: {"off": 10.0, "chain:4": 14.0, "chain:8": 18.0}, 8: {"off": 12.0, "chain:4": 30.0, "chain:8": 60.0}}
    taus = {"off": 1.0, "chain:4": 2.5, "chain:8": 3.6}
    assert best_shape(1, 1, curve, taus)[0] == "chain:8"  # 3.6 / 18 > 2.5 / 14 > 1 / 10
    assert best_shape(8, 8, curve, taus)[0] == "off"  # 1 / 12 > 2.5 / 30 > 3.6 / 60
    assert cycle_seconds(curve, 4, "chain:4") == pytest.approx(14.0 + 16.0 * 3 / 7)  # between the buckets
    assert cycle_seconds(curve, 16, "off") == 12.0 and cycle_seconds(curve, 0, "off") == 10.0
    _, rates = best_shape(3, 8, curve, taus)
    assert rates["off"] == pytest.approx(3 / 12.0)
    with pytest.raises(ValueError, match="no measured cost"):
        cycle_seconds(curve, 1, "tree:7")


def test_choose_drafts_now_and_then_while_target_only_leads_by_little():
    curve = {4: {"off": 10.0, "chain:4": 27.0, "chain:8": 60.0}}
    taus = {"off": 1.0, "chain:4": 2.5, "chain:8": 3.0}  # chain:4 expects 0.93x target-only's rate
    assert choose(4, 4, curve, taus, since_drafted=5)[0] == "off"
    shape, _, explore = choose(4, 4, curve, taus, since_drafted=32)
    assert (shape, explore) == ("chain:4", True)
    assert choose(4, 4, curve, {"off": 1.0, "chain:4": 1.5}, since_drafted=99)[0] == "off"  # 0.56x: never


def test_acceptance_moves_unseen_shapes_with_the_seen_ones():
    acc = Acceptance({"off": 1.0, "chain:4": 2.5, "chain:8": 3.0})
    assert acc.tau("chain:8") == 3.0 and acc.tau("off") == 1.0
    for _ in range(20):  # the served text drafts half as well as the start-up prompts
        acc.observe("chain:4", tokens=175, row_cycles=100)  # tau 1.75: (1.75 - 1) / (2.5 - 1) = 0.5
    assert acc.scale() == pytest.approx(0.5)
    assert acc.tau("chain:8") == pytest.approx(1 + 2.0 * 0.5)  # predicted from its prior
    assert acc.tau("chain:4") == pytest.approx(1.75, abs=0.01)  # its own evidence
    acc.observe("off", 100, 100)  # target-only teaches nothing about drafts
    assert acc.scale() == pytest.approx(0.5)


class _CharTok:
    """A tokenizer of one character per id (id = code point)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_a_stop_string_across_chunks():
    from dflash_jax.serve.textstream import TextStream, Tokens
    ts = TextStream(Tokens(_CharTok()), stop_ids=(0,), stop_strings=("STOP",))
    ids = [ord(c) for c in "ab ST"]
    assert ts.push(ids) == "ab "  # "ST" may start the stop string
    assert ts.push([ord("x")]) == "STx" and not ts.stopped
    assert ts.push([ord(c) for c in "y STOP zz"]) == "y " and ts.stopped and ts.text == "ab STxy "
    t2 = TextStream(Tokens(_CharTok()), stop_ids=(0,))
    assert t2.push([ord("h"), ord("i"), 0, ord("!")]) == "hi" and t2.stopped


def test_the_cli_says_what_to_install_without_the_serve_extra(monkeypatch, capsys):
    import importlib.util

    import infer.serve as cli
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m in ("fastapi", "uvicorn") else real(m, *a))
    assert cli.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'dflash-jax[serve]'" in err[0]


# ---- the server ----
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc, port, log):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"

    def client(self, key=KEY, **kw):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.base + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def tail(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]


def wait_for_health(base: str, procs, tail, timeout: float, poll: float = 0.3) -> None:
    """Until `base`/health answers 200; fails the test (with `tail()`, the servers' log) when a process of `procs`
    exits first or `timeout` seconds pass."""
    end = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"a server process exited with {p.returncode}:\n{tail()}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > end:
            pytest.fail(f"the server did not start:\n{tail()}")
        time.sleep(poll)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w")
    env = dict(os.environ, DFLASH_SERVE_FAULT_MARKER=MARKER)
    proc = subprocess.Popen([sys.executable, "-m", "infer.serve", "--port", str(port), *ARGS], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    srv = Server(proc, port, log)
    try:
        wait_for_health(srv.base, [proc], srv.tail, timeout=300)
        srv.warm = httpx.get(srv.base + "/health").json()["compilations"]
        yield srv
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def ref():
    """The embedded pair's tokenizer and dj.generate's target-only answers (one batch per setting)."""
    import dflash_jax as dj
    from dflash_jax.text import decode, encode_chat, encode_text, stop_token_ids
    target, _, tok = dj.load_reference()
    stops = stop_token_ids(tok, target.config)
    chats = [encode_chat(tok, q) for q in QUESTIONS]
    raw = encode_text(tok, "Question: what is 7 times 6?\nAnswer:", add_special_tokens=True)
    prompts = chats + [raw]
    greedy = dj.generate(target, None, prompts, max_new_tokens=40, stop_token_ids=stops, max_cache_len=256)
    sampled = dj.generate(target, None, chats[:2], max_new_tokens=24, temperature=0.8, top_k=20, top_p=0.9,
                          stop_token_ids=stops, row_ids=[11, 12], max_cache_len=256)

    def texts(res):
        return [(decode(tok, t, stops), len(t)) for t in res.tokens]

    return {"greedy": texts(greedy), "sampled": texts(sampled), "raw": "Question: what is 7 times 6?\nAnswer:"}


def _chat(client, q, **kw):
    return client.chat.completions.create(model="dflash-reference", messages=[{"role": "user", "content": q}], **kw)


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list()] == ["dflash-reference"]
    h = httpx.get(server.base + "/health").json()
    assert h["status"] == "ok" and h["slots"] == 4 and h["shapes"] == ["off", "chain:4"]


def test_chat_and_completions_equal_target_only_generate_streamed_or_not(server, ref):
    c = server.client()
    text, n = ref["greedy"][0]
    r = _chat(c, QUESTIONS[0], temperature=0, max_tokens=40)
    assert r.choices[0].message.content == text and r.usage.completion_tokens == n
    assert r.choices[0].finish_reason == ("stop" if n < 40 else "length")
    parts = [ch.choices[0].delta.content or "" for ch in _chat(c, QUESTIONS[0], temperature=0, max_tokens=40,
                                                                 stream=True) if ch.choices]
    assert "".join(parts) == text and len(parts) >= 2  # a role chunk, then text
    raw_text, raw_n = ref["greedy"][3]
    r = c.completions.create(model="dflash-reference", prompt=ref["raw"], temperature=0, max_tokens=40)
    assert r.choices[0].text == raw_text and r.usage.completion_tokens == raw_n
    s = c.completions.create(model="dflash-reference", prompt=ref["raw"], temperature=0, max_tokens=40, stream=True,
                             stream_options={"include_usage": True})
    chunks = list(s)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == raw_text
    assert chunks[-1].usage.completion_tokens == raw_n


def test_concurrent_requests_with_mixed_settings(server, ref):
    """Greedy and seeded sampled answers equal dj.generate's while 16 other requests with other settings are in
    flight and arriving; every request completes."""
    c = server.client()
    out, errors = {}, []

    def run(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {e!r}")

    def other(i):
        kw = dict(temperature=[0.7, 1.0, 1.3, 0.0][i % 4], top_p=[1.0, 0.9, 0.8, 1.0][i % 4], seed=100 + i,
                  max_tokens=8 + 4 * (i % 5), extra_body={"top_k": [0, 5, 50, 0][i % 4]})
        if i % 3 == 0:
            return "".join(ch.choices[0].delta.content or "" for ch in _chat(c, QUESTIONS[i % 3], stream=True, **kw)
                           if ch.choices)
        return _chat(c, QUESTIONS[i % 3], **kw).choices[0].message.content

    threads = [threading.Thread(target=run, args=(f"other{i}", lambda i=i: other(i))) for i in range(16)]
    for i in range(3):
        threads.append(threading.Thread(target=run, args=(f"greedy{i}", lambda i=i: _chat(
            c, QUESTIONS[i], temperature=0, max_tokens=40).choices[0].message.content)))
    for i in range(2):
        threads.append(threading.Thread(target=run, args=(f"sampled{i}", lambda i=i: _chat(
            c, QUESTIONS[i], temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=24,
            extra_body={"top_k": 20}).choices[0].message.content)))
    for k, t in enumerate(threads):
        t.start()
        if k % 4 == 3:
            time.sleep(0.05)  # arriving while the first ones decode
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(out) == 21
    assert [out[f"greedy{i}"] for i in range(3)] == [t for t, _ in ref["greedy"][:3]]
    assert [out[f"sampled{i}"] for i in range(2)] == [t for t, _ in ref["sampled"]]


def test_bad_requests_answer_400_naming_the_problem(server):
    c = server.client()
    post = lambda body, **kw: httpx.post(server.base + "/v1/chat/completions", content=body,  # noqa: E731
                                        headers={"Authorization": f"Bearer {KEY}", **kw}, timeout=30)
    msg = [{"role": "user", "content": "hi"}]
    for body, needle in [(b"{not json", "not valid JSON"),
                         (json.dumps({"messages": msg, "temperature": "hot"}), "'temperature'"),
                         (json.dumps({"messages": msg, "max_tokens": 0}), "'max_tokens' must be at least 1"),
                         (json.dumps({"messages": msg, "n": 2}), "'n' must be 1"),
                         (json.dumps({"messages": [{"role": "user", "content": 5}]}), "'messages.0.content'"),
                         (json.dumps({"messages": msg, "max_tokens": 250}), "exceed the cache")]:
        r = post(body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] == "invalid_request_error", (needle, err)
    with pytest.raises(openai.BadRequestError, match="at most 251 fit the cache"):
        _chat(c, "many words " * 200)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        c.chat.completions.create(model="gpt-4", messages=msg)


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError, match="API key"):
        _chat(server.client(key="wrong"), "hi", max_tokens=2)
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"  # no key at all
    assert httpx.get(server.base + "/v1/models").status_code == 401
    assert httpx.get(server.base + "/health").status_code == 200  # health and metrics stay open


def test_a_full_queue_answers_429_with_retry_after(server):
    codes, retry = [], []

    def one(i):
        r = httpx.post(server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                       json={"prompt": f"Count to {i}:", "max_tokens": 48, "ignore_eos": True, "temperature": 0})
        codes.append(r.status_code)
        if r.status_code == 429:
            retry.append(r.headers.get("retry-after"))
        else:
            assert r.json()["usage"]["completion_tokens"] == 48

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(codes) == {200, 429} and len(codes) == 40, codes
    assert all(r and int(r) >= 1 for r in retry)


def test_a_client_that_leaves_frees_its_slot(server):
    before = server.metrics()
    with httpx.stream("POST", server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "Tell a long story:", "max_tokens": 200, "ignore_eos": True, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then the client goes away
    end = time.monotonic() + 30
    while time.monotonic() < end:
        m = server.metrics()
        if m[("dflash_slots_active", ())] == 0 and m[("dflash_requests_cancelled_total", ())] > \
                before[("dflash_requests_cancelled_total", ())]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the slot was not freed: {m}")
    assert m[("dflash_generated_tokens_total", ())] - before[("dflash_generated_tokens_total", ())] < 200


def test_an_exception_in_one_request_is_a_500_and_the_server_goes_on(server, ref):
    c = server.client()
    with pytest.raises(openai.InternalServerError, match="failure injected"):
        _chat(c, f"{MARKER} what is 2 plus 2?", max_tokens=8)
    r = _chat(c, QUESTIONS[0], temperature=0, max_tokens=40)
    assert r.choices[0].message.content == ref["greedy"][0][0]


def test_metrics_move_and_nothing_compiles_after_warm_up(server):
    m = server.metrics()
    assert m[("dflash_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] >= 20
    assert m[("dflash_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "400")))] >= 6
    assert m[("dflash_requests_total", (("endpoint", "/v1/completions"), ("status", "429")))] >= 1
    assert m[("dflash_prompt_tokens_total", ())] > 100 and m[("dflash_generated_tokens_total", ())] > 100
    assert m[("dflash_time_to_first_token_seconds_count", ())] >= 20
    assert m[("dflash_inter_token_latency_seconds_count", ())] > 0 and m[("dflash_requests_failed_total", ())] >= 1
    assert 1.0 <= m[("dflash_tau", ())] <= 4.0 and m[("dflash_slots", ())] == 4
    assert sum(m[("dflash_shape", (("shape", s),))] for s in ("off", "chain:4")) == 1
    assert sum(m[("dflash_chunks_total", (("shape", s),))] for s in ("off", "chain:4")) > 10
    got = {p: m[("dflash_compilations", (("program", p),))] for p in ("prefill", "decode")}
    print("compilations after warm-up:", server.warm, "now:", got)
    assert got == server.warm == {"prefill": 2, "decode": 4}  # 2 prompt buckets; 2 shapes x 2 batch buckets


def test_sigterm_finishes_in_flight_requests_and_exits_zero(server):
    c = server.client()
    got, first = [], threading.Event()

    def long_one():
        for ch in c.completions.create(model="dflash-reference", prompt="Once upon a time", max_tokens=120,
                                       temperature=1.0, stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True}):
            got.append(ch)
            first.set()

    t = threading.Thread(target=long_one)
    t.start()
    assert first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    late = httpx.post(server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "hi", "max_tokens": 4}, timeout=30)
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    t.join(60)
    assert got[-1].usage.completion_tokens == 120
    assert [ch.choices[0].finish_reason for ch in got if ch.choices][-1] == "length"
    assert server.proc.wait(60) == 0, server.tail()
