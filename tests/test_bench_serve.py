"""python -m infer.bench_serve at a tiny size (servers of the embedded pair in subprocesses): the load test's and the
throughput comparison's printed and JSON fields exist and agree with each other (not their timings)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

import infer.bench_serve as cli  # noqa: E402
from dflash_jax.bench.serve_bench import load_specs  # noqa: E402

# a small server: 4 slots, one batch bucket, auto over off and B=4, one prompt bucket (the engine keeps only the
# cache-sized one: 192 does not fit below it)
SERVER = ("--slots 4 --cache-len 192 --prompt-buckets 192 --batch-buckets 4 --auto-shapes off,chain:4 "
          "--chunk-cycles 4")


def test_load_specs_mix():
    specs = load_specs([f"q{i}" for i in range(7)], 40, leave=0.1, malformed=0.05, max_tokens=9, seed=3)
    kinds = [s.kind for s in specs]
    assert len(specs) == 40 and kinds.count("cancel") == 4 and sum(s.malformed for s in specs) == 2
    assert all(s.stream and s.leave_after_first and s.body["ignore_eos"] for s in specs if s.kind == "cancel")
    assert {s.endpoint for s in specs if not s.malformed} == {"chat", "completion"}
    assert all(s.body["max_tokens"] == 9 for s in specs if not s.malformed)


def test_bad_flags_exit_2(capsys):
    assert cli.main(["--drafter", "somewhere"]) == 2
    assert cli.main(["--load", "--leave-fraction", "0.9", "--malformed-fraction", "0.2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --drafter needs --target",
                   "error: --leave-fraction and --malformed-fraction must lie in [0, 1] and add up to at most 1"]


def test_load_test_counts(tmp_path, capsys):
    out = tmp_path / "load.json"
    assert cli.main(["--load", "--requests", "20", "--concurrency", "4", "--max-tokens", "8", "--server-args",
                     SERVER, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())
    c = rep["counts"]
    assert (c["well_formed"], c["cancelled"], c["malformed"]) == (17, 2, 1)
    assert c["completed"] == c["well_formed"] and c["malformed_400"] == c["malformed"]
    assert c["cancelled_mid_stream"] == c["cancelled"]
    assert rep["server_counters"]["cancelled"] <= c["cancelled"]  # a short answer may end before the server sees it
    assert rep["server_counters"]["status_400"] == c["malformed"] and rep["server_counters"]["failed"] == 0
    r = rep["rss_bytes"]
    assert r["samples"] == 20 and rep["settings"]["rss_window"] == 10
    assert r["first_window_mean"] > 0 and r["last_window_mean"] > 0 and r["growth_pct"] == pytest.approx(
        100 * (r["last_window_mean"] - r["first_window_mean"]) / r["first_window_mean"])
    assert rep["compilations"]["at_ready"] == rep["compilations"]["after_load"] == {"prefill": 1, "decode": 2}
    assert rep["checks"] and all(rep["checks"].values()) and rep["pass"] is True
    assert rep["server_exit_status"] == {"on": 0} and rep["wall_s"] > 0
    for needle in ("well-formed completed   17 / 17", "malformed -> 400        1 / 1", "server RSS",
                   "compilations            at ready", "PASS: "):
        assert needle in text, needle


def test_throughput_on_against_off(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert cli.main(["--levels", "4", "--runs", "1", "--requests", "8", "--warm", "1", "--max-tokens", "8",
                     "--server-args", SERVER, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["servers"]["on"]["shapes"] == ["off", "chain:4"] and rep["servers"]["off"]["shapes"] == ["off"]
    (row,) = rep["levels"]
    assert (row["concurrency"], row["requests"]) == (4, 8)
    for k in ("on", "off"):
        s = row[k]
        assert s["completed_runs"] == [8] and not s["errors"]
        assert len(s["tokens_per_second_runs"]) == 1 and s["min"] == s["median"] == s["max"] > 0
        assert s["tokens_runs"] == s["server_generated_tokens_runs"]  # the clients got what the server generated
        assert s["median"] == pytest.approx(s["tokens_runs"][0] / (s["wall_s_runs"][0] - s["paused_s_runs"][0]))
        assert 0 <= s["paused_s_runs"][0] < s["wall_s_runs"][0] and s["server_cpu_s_runs"][0] > 0
        assert s["ttft_p50_s"] <= s["ttft_p99_s"]
    assert row["on"]["tokens_runs"] == row["off"]["tokens_runs"] and row["same_answers"] == 8  # greedy: lossless
    assert set(row["off"]["chunks"]) == {"off"} and sum(row["on"]["chunks"].values()) > 0
    assert set(row["on"]["chunks"]) <= {"off", "chain:4"}
    assert row["ratio"] == pytest.approx(row["on"]["median"] / row["off"]["median"])
    assert rep["on_at_least_off_every_level"] == (row["ratio"] >= 1)
    assert rep["server_exit_status"] == {"on": 0, "off": 0}
    assert "on/off" in text and "on chunks by shape" in text and ("PASS: " in text or "FAIL: " in text)
