"""Benchmark the OpenAI-compatible server (python -m infer.serve) with concurrent clients.

    python -m infer.bench_serve [--levels 1,4,8,16,32] [--runs 3] [--max-tokens 128]      # throughput, on vs off
    python -m infer.bench_serve --load [--requests 500] [--concurrency 64]                 # the load test
        [--target DIR --drafter DIR] [--shape auto] [--server-args "--slots 8 ..."] [--json FILE]

Throughput (the default): two servers in subprocesses, speculation on (--shape, default auto) and off (--shape
off), closed-loop clients at each concurrency level sending greedy chats of the same prompts (GSM8K by default,
chat-templated by the server), the runs of the two servers interleaved: generated tokens/s per run, the median and
range of --runs, the ratio on / off, time to first token, and the shapes the speculating server chose (/metrics).

--load: one server (--shape); --requests at --concurrency, --leave-fraction of them closed after the first
streamed text, --malformed-fraction malformed; prints the counts, the server's resident memory over the first and
the last 100 answers, its compilation counts when ready and after the load, the wall time and PASS / FAIL.
Without --target / --drafter: the embedded reference pair. Needs the `serve` extra (pip install -e ".[serve]").
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ints(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def parse_args(argv=None):
    from dflash_jax.prompts import DATASETS
    p = argparse.ArgumentParser(prog="python -m infer.bench_serve",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--load", action="store_true", help="run the load test instead of the throughput comparison")
    p.add_argument("--target", help="target model directory (HF format); default: the embedded reference pair")
    p.add_argument("--drafter", help="DFlash drafter directory (z-lab format)")
    p.add_argument("--shape", default="auto", help="the speculating server's --shape (default auto)")
    p.add_argument("--server-args", default="", help="more flags for python -m infer.serve, in one string")
    p.add_argument("--levels", type=_ints, default=(1, 4, 8, 16, 32), help="throughput: client concurrency levels")
    p.add_argument("--runs", type=int, default=3, help="throughput: timed runs per level and server (median)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (throughput; default max(16, 4 x concurrency)) or in all (--load; 500)")
    p.add_argument("--concurrency", type=int, default=64, help="--load: clients at once (default 64)")
    p.add_argument("--leave-fraction", type=float, default=0.1, help="--load: streams closed after the first text")
    p.add_argument("--malformed-fraction", type=float, default=0.05, help="--load: malformed requests")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    p.add_argument("--dataset", default="gsm8k", help=f"prompt set: one of {', '.join(DATASETS)} (first turns)")
    p.add_argument("--data-dir", help="local data sets (default: $DFLASH_DATA_DIR, else ../shared/data)")
    p.add_argument("--max-prompts", type=int, default=256, help="distinct prompts, used in turn (default 256)")
    p.add_argument("--warm", type=int, default=8, help="throughput: untimed requests per server first")
    p.add_argument("--seed", type=int, default=0, help="--load: the order of the request kinds, sampling seeds")
    p.add_argument("--start-timeout", type=float, default=1200.0, help="seconds a server may take to start")
    p.add_argument("--json", help="also write the report to this JSON file")
    return p.parse_args(argv)


def _check(args) -> str | None:
    if args.drafter and not args.target:
        return "--drafter needs --target"
    if args.runs < 1 or args.warm < 0 or args.max_tokens < 1 or args.max_prompts < 1:
        return "--runs, --max-tokens and --max-prompts must be >= 1 and --warm >= 0"
    if not args.levels or min(args.levels) < 1 or args.concurrency < 1 or (args.requests or 1) < 1:
        return "--levels, --concurrency and --requests must be >= 1"
    if not (0 <= args.leave_fraction <= 1 and 0 <= args.malformed_fraction <= 1
            and args.leave_fraction + args.malformed_fraction <= 1):
        return "--leave-fraction and --malformed-fraction must lie in [0, 1] and add up to at most 1"
    return None


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt


def server_command(args, shape: str) -> list[str]:
    cmd = [sys.executable, "-m", "infer.serve", "--shape", shape]
    if args.target:
        cmd += ["--target", args.target] + (["--drafter", args.drafter] if args.drafter else [])
    return cmd + shlex.split(args.server_args)


def main(argv=None) -> int:
    args = parse_args(argv)
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: the serving benchmark needs {', '.join(missing)}: pip install 'dflash-jax[serve]'",
              file=sys.stderr)
        return 2
    err = _check(args)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from dflash_jax.bench.serve_bench import print_load, print_throughput, run_load, run_throughput, write_json
    from dflash_jax.bench.serve_client import ServerProcess, questions
    try:
        prompts = questions(args.dataset, args.data_dir, args.max_prompts)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # the servers are stopped on the way out
    names = ["on"] if args.load else ["on", "off"]
    shapes = {"on": args.shape, "off": "off"}
    servers = {k: ServerProcess(server_command(args, shapes[k]), name=k, cwd=ROOT) for k in names}
    print(f"{len(prompts)} {args.dataset} prompts; server logs: "
          + ", ".join(s.log_path for s in servers.values()), flush=True)
    try:
        for k, s in servers.items():  # one at a time: a server's start-up measures its cost curve
            print(f"starting the {k} server: {s.command}", flush=True)
            s.start(args.start_timeout)
            print(f"  ready in {s.startup_s:.0f} s: shapes {s.ready_health.get('shapes')}, compiled "
                  f"{s.ready_health.get('compilations')}", flush=True)
        if args.load:
            rep = run_load(servers["on"], prompts, n=args.requests or 500, concurrency=args.concurrency,
                           leave=args.leave_fraction, malformed=args.malformed_fraction, max_tokens=args.max_tokens,
                           seed=args.seed)
        else:
            rep = run_throughput(servers, prompts, levels=args.levels, runs=args.runs, requests=args.requests,
                                 max_tokens=args.max_tokens, warm=args.warm,
                                 log=lambda m: print(m, flush=True))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        status = {k: s.stop() for k, s in servers.items()}
    rep["server_exit_status"] = status
    rep["settings"]["dataset"] = args.dataset
    print()
    (print_load if args.load else print_throughput)(rep)
    print("server exit status: " + ", ".join(f"{k} {v}" for k, v in status.items()))
    if args.json:
        write_json(rep, args.json)
        print(f"wrote {args.json}")
    return 0 if rep.get("pass", True) else 1


if __name__ == "__main__":
    from dflash_jax.cli import run
    sys.exit(run(main))
