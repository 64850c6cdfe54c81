"""The serving benchmark (python -m infer.bench_serve) over running servers (bench.serve_client.ServerProcess).

- `run_load`: N requests from closed-loop clients at one concurrency, a fraction of them closed after their first
  streamed text and a fraction malformed (bad JSON, a field of the wrong type, max_tokens 0); the rest chat and
  text completions, streamed or whole, greedy or seeded sampling. Counts what completed, what was left, what was
  answered 400 with a message; the server's resident memory after each answer (mean of the first and the last
  `window` answers, growth in %); its compilation counts when it was ready and after the load; and the verdict on
  the serving acceptance criteria.
- `run_throughput`: closed-loop clients at each concurrency level against a speculating server ("on": --shape
  auto) and a target-only one ("off"), greedy, the same prompts, the runs of the two interleaved: generated
  tokens/s per run (median and range), the ratio on / off, time to first token, the shapes the speculating server's
  chunks ran (from /metrics) and their tau, and whether the greedy answers of the two servers agree.

Tokens/s are completion tokens over a run's wall time less the seconds this process stood stopped from outside
(serve_client.PauseClock: on a shared machine another user's profiling may SIGSTOP every other process); both
times, and the server's CPU seconds, are in the report.
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import statistics
import time

from .serve_client import PauseClock, ServerProcess, Spec, by_label, send_all, value

MALFORMED = ("bad-json", "wrong-type", "max-tokens-0", "content-not-text")


def _malformed(what: str) -> Spec:
    msg = [{"role": "user", "content": "What is 2 + 2?"}]
    body = {"bad-json": b'{"messages": [{"role": "user", "content": "What is 2 + 2?"}',
            "wrong-type": {"messages": msg, "temperature": "hot"},
            "max-tokens-0": {"messages": msg, "max_tokens": 0},
            "content-not-text": {"messages": [{"role": "user", "content": 5}]}}[what]
    return Spec("malformed:" + what, "chat", body)


def load_specs(prompts: list[str], n: int, *, leave: float = 0.1, malformed: float = 0.05, max_tokens: int = 128,
               seed: int = 0) -> list[Spec]:
    """`n` requests in a shuffled order: round(n * malformed) malformed ones (the kinds of MALFORMED in turn),
    round(n * leave) streamed chats whose client leaves after the first text (ignore_eos, so they are still
    running then), and chat / text completions, streamed or whole, greedy or sampled with a seed, for the rest."""
    rng = random.Random(seed)
    n_bad, n_leave = round(n * malformed), round(n * leave)
    kinds = ["malformed"] * n_bad + ["leave"] * n_leave + ["ok"] * (n - n_bad - n_leave)
    rng.shuffle(kinds)
    specs, bad = [], 0
    for i, k in enumerate(kinds):
        q = prompts[i % len(prompts)]
        if k == "malformed":
            specs.append(_malformed(MALFORMED[bad % len(MALFORMED)]))
            bad += 1
            continue
        sampled = {} if i % 3 else {"temperature": 0.7, "top_p": 0.95, "seed": i}
        common = {"max_tokens": max_tokens, "temperature": 0.0, **sampled}
        chat = {"messages": [{"role": "user", "content": q}], **common}
        if k == "leave":
            specs.append(Spec("cancel", "chat", {**chat, "stream": True, "ignore_eos": True}, stream=True,
                              leave_after_first=True, index=i))
        elif i % 4 == 0:
            specs.append(Spec("completion", "completion", {"prompt": f"Question: {q}\nAnswer:", **common,
                                                           "stream": bool(i % 8), "stream_options":
                                                           {"include_usage": True}}, stream=bool(i % 8), index=i))
        else:
            stream = i % 2 == 1
            specs.append(Spec("chat", "chat", {**chat, "stream": stream, "stream_options": {"include_usage": True}},
                              stream=stream, index=i))
    return specs


def _pct(xs, q: float):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def machine() -> dict:
    """What the figures ran on: the CPU, its cores, the load average when asked."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "load_average_1_5_15": [round(x, 2) for x in load] if load else None}


def run_load(server: ServerProcess, prompts: list[str], *, n: int = 500, concurrency: int = 64, leave: float = 0.1,
             malformed: float = 0.05, max_tokens: int = 128, seed: int = 0, window: int = 100,
             rss_limit_pct: float = 10.0) -> dict:
    """The load test against a running server; the report (dict, JSON-ready) with its verdict under "pass"."""
    specs = load_specs(prompts, n, leave=leave, malformed=malformed, max_tokens=max_tokens, seed=seed)
    before = server.metrics()
    compiled_ready = dict(server.ready_health.get("compilations") or server.health()["compilations"])
    rss = []  # the server's resident bytes after each answer, in the order they ended

    def on_done(_):
        r = server.rss()
        if r is not None:
            rss.append(r)

    m0 = machine()
    rss_start = server.rss()
    with PauseClock() as pause:
        t0 = time.perf_counter()
        outs = asyncio.run(send_all(server.base, specs, concurrency, on_done))
        wall = time.perf_counter() - t0
    running = max(wall - pause.paused, 1e-9)
    idle = server.wait_idle()
    after = server.metrics()
    compiled_after = dict(server.health()["compilations"])

    bad = [o for o in outs if o.spec.malformed]
    left = [o for o in outs if o.spec.kind == "cancel"]
    good = [o for o in outs if not o.spec.malformed and o.spec.kind != "cancel"]
    bad_400 = [o for o in bad if o.status == 400 and o.error and o.error_type == "invalid_request_error"]
    done = [o for o in good if o.completed]
    really_left = [o for o in left if o.left]
    w = max(1, min(window, len(rss) // 2)) if rss else 0
    first = statistics.fmean(rss[:w]) if w else None
    last = statistics.fmean(rss[-w:]) if w else None
    growth = 100.0 * (last - first) / first if first else None
    d = lambda name: value(after, name) - value(before, name)  # noqa: E731
    failures = [f"{o.spec.kind} #{o.spec.index}: HTTP {o.status}: {o.error}" for o in good if not o.completed]
    failures += [f"{o.spec.kind}: HTTP {o.status}: {o.error}" for o in bad if o not in bad_400]
    failures += [f"cancel #{o.spec.index}: HTTP {o.status}: {o.error or 'ended before the client left'}"
                 for o in left if not o.left]
    checks = {
        "every_well_formed_request_completed": len(done) == len(good),
        "every_malformed_request_got_400_with_a_message": len(bad_400) == len(bad),
        f"rss_growth_below_{rss_limit_pct:g}_pct": growth is not None and growth < rss_limit_pct,
        "no_compilation_after_warm_up": compiled_after == compiled_ready,
    }
    kinds = {}
    for o in outs:
        kinds[o.spec.kind] = kinds.get(o.spec.kind, 0) + 1
    return {
        "mode": "load", "machine": m0, "load_average_after": machine()["load_average_1_5_15"],
        "settings": {"requests": n, "concurrency": concurrency, "leave_fraction": leave,
                     "malformed_fraction": malformed, "max_tokens": max_tokens, "seed": seed, "rss_window": w,
                     "server": server.command},
        "wall_s": wall, "paused_s": pause.paused, "server_startup_s": server.startup_s,
        "requests_by_kind": kinds,
        "counts": {"well_formed": len(good), "completed": len(done), "cancelled": len(left),
                   "cancelled_mid_stream": len(really_left), "malformed": len(bad), "malformed_400": len(bad_400),
                   "retried_429": sum(o.retries for o in outs)},
        "malformed_messages": sorted({f"{o.spec.kind[len('malformed:'):]}: {o.error}" for o in bad_400}),
        "server_counters": {"generated_tokens": d("dflash_generated_tokens_total"),
                            "cancelled": d("dflash_requests_cancelled_total"),
                            "failed": d("dflash_requests_failed_total"),
                            "status_400": sum(v - before.get(k, 0) for k, v in after.items()
                                              if k[0] == "dflash_requests_total" and ("status", "400") in k[1]),
                            "idle_after": idle},
        "client_tokens": sum(o.completion_tokens for o in done),
        "tokens_per_second": sum(o.completion_tokens for o in done) / running,
        "latency_s": {"ttft_p50": _pct([o.ttft for o in done if o.spec.stream], 50),
                      "ttft_p99": _pct([o.ttft for o in done if o.spec.stream], 99),
                      "request_p50": _pct([o.seconds for o in done], 50),
                      "request_p99": _pct([o.seconds for o in done], 99)},
        "rss_bytes": {"at_start": rss_start, "first_window_mean": first, "last_window_mean": last,
                      "growth_pct": growth, "samples": len(rss), "max": max(rss) if rss else None},
        "compilations": {"at_ready": compiled_ready, "after_load": compiled_after},
        "failures": failures[:20], "checks": checks, "pass": all(checks.values()),
    }


def print_load(rep: dict, log=print) -> None:
    c, r, s = rep["counts"], rep["rss_bytes"], rep["settings"]
    mib = lambda b: f"{b / 2**20:.1f} MiB" if b is not None else "n/a"  # noqa: E731
    paused = f", {rep['paused_s']:.1f} s of it stopped from outside" if rep["paused_s"] > 0 else ""
    log(f"load test: {s['requests']} requests at concurrency {s['concurrency']}, max_tokens {s['max_tokens']}, "
        f"{rep['wall_s']:.1f} s wall{paused} ({rep['tokens_per_second']:.0f} generated tokens/s)")
    log(f"  well-formed completed   {c['completed']} / {c['well_formed']}")
    log(f"  cancelled mid-stream    {c['cancelled_mid_stream']} / {c['cancelled']} (server counted "
        f"{rep['server_counters']['cancelled']:.0f})")
    log(f"  malformed -> 400        {c['malformed_400']} / {c['malformed']}")
    for m in rep["malformed_messages"]:
        log(f"      {m}")
    log(f"  429 retried             {c['retried_429']}")
    g = r["growth_pct"]
    log(f"  server RSS              first {s['rss_window']} answers {mib(r['first_window_mean'])}, last "
        f"{s['rss_window']} {mib(r['last_window_mean'])}: growth {'n/a' if g is None else f'{g:+.2f}%'}")
    log(f"  compilations            at ready {rep['compilations']['at_ready']}, after the load "
        f"{rep['compilations']['after_load']}")
    lat = rep["latency_s"]
    if lat["ttft_p50"] is not None:
        log(f"  TTFT p50 / p99          {lat['ttft_p50']:.3f} / {lat['ttft_p99']:.3f} s; request p50 / p99 "
            f"{lat['request_p50']:.2f} / {lat['request_p99']:.2f} s")
    for f in rep["failures"]:
        log(f"  failure: {f}")
    log(("PASS" if rep["pass"] else "FAIL") + ": " + ", ".join(
        f"{k.replace('_', ' ')} {'yes' if v else 'NO'}" for k, v in rep["checks"].items()))


# ---------------------------------------------------------------------------------------------------------------
# Throughput: speculation on against off
# ---------------------------------------------------------------------------------------------------------------
def throughput_specs(prompts: list[str], n: int, max_tokens: int) -> list[Spec]:
    """`n` greedy streamed chats over `prompts` in order (usage in the last chunk)."""
    return [Spec("chat", "chat", {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                                  "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                                  "stream_options": {"include_usage": True}}, stream=True, index=i)
            for i in range(n)]


def _one_run(server: ServerProcess, specs: list[Spec], concurrency: int) -> dict:
    before = server.metrics()
    cpu = server.cpu_seconds()
    with PauseClock() as pause:
        t0 = time.perf_counter()
        outs = asyncio.run(send_all(server.base, specs, concurrency))
        wall = time.perf_counter() - t0
    cpu = server.cpu_seconds() - cpu if cpu is not None else None
    after = server.metrics()
    done = [o for o in outs if o.completed]
    tokens = sum(o.completion_tokens for o in done)
    running = max(wall - pause.paused, 1e-9)
    shapes = {s: round(v - by_label(before, "dflash_chunks_total", "shape").get(s, 0))
              for s, v in by_label(after, "dflash_chunks_total", "shape").items()}
    tau_n = value(after, "dflash_chunk_tau_count") - value(before, "dflash_chunk_tau_count")
    tau_s = value(after, "dflash_chunk_tau_sum") - value(before, "dflash_chunk_tau_sum")
    return {"wall_s": wall, "paused_s": pause.paused, "tokens": tokens, "tokens_per_second": tokens / running,
            "server_cpu_s": cpu,
            "completed": len(done), "errors": [f"#{o.spec.index}: HTTP {o.status}: {o.error}" for o in outs
                                               if not o.completed][:5],
            "ttft_s": [o.ttft for o in done], "texts": [o.text for o in outs],
            "server_generated_tokens": value(after, "dflash_generated_tokens_total")
            - value(before, "dflash_generated_tokens_total"),
            "chunks": {s: v for s, v in shapes.items() if v}, "tau_chunks": tau_n,
            "tau": tau_s / tau_n if tau_n else None}


def _side(runs: list[dict]) -> dict:
    tps = [r["tokens_per_second"] for r in runs]
    chunks: dict = {}
    for r in runs:
        for s, v in r["chunks"].items():
            chunks[s] = chunks.get(s, 0) + v
    n_tau = sum(r["tau_chunks"] for r in runs)
    ttft = [t for r in runs for t in r["ttft_s"]]
    return {"tokens_per_second_runs": tps, "median": statistics.median(tps), "min": min(tps), "max": max(tps),
            "wall_s_runs": [r["wall_s"] for r in runs], "paused_s_runs": [r["paused_s"] for r in runs],
            "server_cpu_s_runs": [r["server_cpu_s"] for r in runs], "tokens_runs": [r["tokens"] for r in runs],
            "server_generated_tokens_runs": [r["server_generated_tokens"] for r in runs],
            "completed_runs": [r["completed"] for r in runs], "errors": [e for r in runs for e in r["errors"]],
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "chunks": chunks,
            "tau": (sum((r["tau"] or 0) * r["tau_chunks"] for r in runs) / n_tau) if n_tau else None}


def run_throughput(servers: dict[str, ServerProcess], prompts: list[str], *, levels=(1, 4, 8, 16, 32),
                   runs: int = 3, requests: int | None = None, max_tokens: int = 128, warm: int = 8,
                   log=print) -> dict:
    """Closed-loop greedy clients at each concurrency of `levels` against `servers` ({"on": ..., "off": ...}),
    `runs` timed runs per level and server, the servers' runs interleaved (the first server first in even runs,
    second in odd ones); `requests` per run (default max(16, 4 x concurrency)). `warm` untimed requests per
    server first. The report (dict) holds every run's figures."""
    names = list(servers)
    m0 = machine()
    for s in servers.values():
        _one_run(s, throughput_specs(prompts, warm, max_tokens), max(1, warm))
    out = []
    for c in levels:
        n = requests or max(16, 4 * c)
        specs = throughput_specs(prompts, n, max_tokens)
        got = {k: [] for k in names}
        for r in range(runs):
            for k in (names if r % 2 == 0 else names[::-1]):
                got[k].append(_one_run(servers[k], specs, c))
        row = {"concurrency": c, "requests": n}
        for k in names:
            row[k] = _side(got[k])
        if len(names) == 2:
            a, b = (row[k] for k in names)
            row["ratio"] = a["median"] / b["median"] if b["median"] else None
            spread = max(a["max"] - a["min"], b["max"] - b["min"])
            row["difference_within_range"] = abs(a["median"] - b["median"]) <= spread
            ta, tb = got[names[0]][0]["texts"], got[names[1]][0]["texts"]
            row["same_answers"] = sum(x == y for x, y in zip(ta, tb))
        out.append(row)
        log(_level_line(row, names))
    rep = {"mode": "throughput", "machine": m0, "load_average_after": machine()["load_average_1_5_15"],
           "settings": {"levels": list(levels), "runs": runs, "requests": requests, "max_tokens": max_tokens,
                        "warm_requests": warm, "prompts": len(prompts), "temperature": 0.0},
           "servers": {k: {"command": s.command, "startup_s": s.startup_s,
                           "compilations": s.ready_health.get("compilations"), "shapes": s.ready_health.get("shapes"),
                           "slots": s.ready_health.get("slots")} for k, s in servers.items()},
           "levels": out}
    if len(names) == 2:
        rep["on_at_least_off_every_level"] = all(r["ratio"] is not None and r["ratio"] >= 1.0 for r in out)
    return rep


def _fmt_side(s: dict) -> str:
    return f"{s['median']:7.1f} [{s['min']:.1f}-{s['max']:.1f}]"


def _level_line(row: dict, names: list[str]) -> str:
    parts = [f"concurrency {row['concurrency']:3d} ({row['requests']} requests)"]
    parts += [f"{k} {_fmt_side(row[k])} tok/s" for k in names]
    if "ratio" in row:
        parts.append(f"{names[0]}/{names[1]} {row['ratio']:.2f}x")
    return ", ".join(parts)


def print_throughput(rep: dict, log=print) -> None:
    names = list(rep["servers"])
    log(f"generated tokens/s, median of {rep['settings']['runs']} run(s) [min-max], greedy, max_tokens "
        f"{rep['settings']['max_tokens']}")
    head = ["concurrency", "requests"] + [f"{k} tok/s" for k in names]
    if len(names) == 2:
        head += [f"{names[0]}/{names[1]}", "difference", "same answers"]
    head += [f"{k} TTFT p50/p99 s" for k in names] + [f"{names[0]} chunks by shape", f"{names[0]} tau"]
    rows = []
    for r in rep["levels"]:
        row = [str(r["concurrency"]), str(r["requests"])] + [_fmt_side(r[k]).strip() for k in names]
        if len(names) == 2:
            row += [f"{r['ratio']:.2f}x", "within the runs' range" if r["difference_within_range"] else
                    ("on faster" if r["ratio"] >= 1 else "on slower"), f"{r['same_answers']}/{r['requests']}"]
        row += [f"{r[k]['ttft_p50_s']:.3f}/{r[k]['ttft_p99_s']:.3f}" if r[k]["ttft_p50_s"] is not None else "n/a"
                for k in names]
        ch = r[names[0]]["chunks"]
        tot = sum(ch.values()) or 1
        row.append(", ".join(f"{s} {100 * v / tot:.0f}%" for s, v in sorted(ch.items(), key=lambda x: -x[1])))
        tau = r[names[0]]["tau"]
        row.append(f"{tau:.2f}" if tau is not None else "-")
        rows.append(row)
    widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    log("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in rows:
        log("  ".join(x.ljust(w) for x, w in zip(row, widths)))
    for r in rep["levels"]:
        for k in names:
            side = r[k]
            cpu = "/".join(f"{x:.0f}" if x is not None else "-" for x in side["server_cpu_s_runs"])
            log(f"  concurrency {r['concurrency']}, {k}: runs " + ", ".join(
                f"{x:.1f}" for x in side["tokens_per_second_runs"]) + " tok/s; wall " + "/".join(
                f"{x:.1f}" for x in side["wall_s_runs"]) + " s, stopped from outside " + "/".join(
                f"{x:.1f}" for x in side["paused_s_runs"]) + f" s; server CPU {cpu} s")
            for e in r[k]["errors"]:
                log(f"  concurrency {r['concurrency']}, {k}: failed request {e}")
    if "on_at_least_off_every_level" in rep:
        worse = [str(r["concurrency"]) for r in rep["levels"] if r["ratio"] < 1]
        noise = [str(r["concurrency"]) for r in rep["levels"] if r["ratio"] < 1 and r["difference_within_range"]]
        log(("PASS" if rep["on_at_least_off_every_level"] else "FAIL") + f": {names[0]} >= {names[1]} (medians) at "
            f"every concurrency" + (f"; below at {', '.join(worse)}" if worse else "")
            + (f" (within the run-to-run range at {', '.join(noise)})" if noise else ""))


def write_json(rep: dict, path: str) -> None:
    """The report as JSON (the per-request answer texts and times left out)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("texts", "ttft_s")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(strip(rep), f, indent=1)
        f.write("\n")
