"""Attention / KV cache at real sizes, through the public API.

  python -m infer.bench_attention                      # decode ms/token vs max_cache_len + long prefill
  python -m infer.bench_attention --caches 512 32768 --prefill-len 16384 --repeats 3

Decode: target-only `dflash_jax.generate`, a short prompt, at each `max_cache_len`; the same fill
(~prompt + new tokens) in every run, so any growth with the cache size is attention or cache
traffic that does not follow the fill. Prefill: one prompt of `--prefill-len` tokens (chunked by
`--chunk`) in a fresh subprocess, whose peak RSS is reported. Model: Qwen3-0.6B's shape with
`--layers` layers and a `--vocab` vocabulary (random weights), fp32 on CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np


def _model(args):
    import dflash_jax as dj
    from dflash_jax.bench.models import bench_target_config
    cfg = bench_target_config("qwen3-0.6b", layers=args.layers, vocab_size=args.vocab, dtype=args.dtype)
    return dj.init_target(cfg, seed=0, layout="auto")


def _prompt(n, vocab, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(0, vocab, size=n)]


def decode_figures(args) -> dict:
    import dflash_jax as dj
    from dflash_jax.attention import default_impl
    target = _model(args)
    prompt = _prompt(args.prompt_len, args.vocab)
    out = {"attention": default_impl(), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "caches": {}}
    for S in args.caches:
        kw = dict(max_new_tokens=args.new_tokens, max_cache_len=S, stop_token_ids=[])
        dj.generate(target, None, [prompt], **kw)  # compile
        ms = []
        for _ in range(args.repeats):
            r = dj.generate(target, None, [prompt], **kw)
            ms.append(1e3 * r.time_per_output_token)
        out["caches"][S] = {"median_ms": float(np.median(ms)), "min_ms": float(min(ms)), "max_ms": float(max(ms))}
        print(f"  max_cache_len {S:6d}: {np.median(ms):7.2f} ms/token (range {min(ms):.2f}-{max(ms):.2f}, "
              f"{args.repeats} runs)", flush=True)
    return out


def _peak_rss() -> int:
    """Peak resident set of this process's own address space: VmHWM from /proc (getrusage's ru_maxrss
    would include the parent's resident set at fork time, which Linux carries across exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def prefill_child(args) -> None:
    """Runs in a fresh process: one long prompt, prints a JSON line."""
    import dflash_jax as dj
    target = _model(args)
    prompt = _prompt(args.prefill_len, args.vocab, seed=1)
    t0 = time.perf_counter()
    r = dj.generate(target, None, [prompt], max_new_tokens=2, stop_token_ids=[], prefill_chunk=args.chunk)
    total = time.perf_counter() - t0
    rss = _peak_rss()
    print(json.dumps({"prefill_s": r.prefill_time, "compile_s": r.compile_time, "total_s": total,
                      "peak_rss_bytes": rss}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--caches", type=int, nargs="+", default=[512, 8192, 32768], help="max_cache_len values")
    p.add_argument("--prompt-len", type=int, default=50)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-len", type=int, default=16384, help="0 skips the long-prefill measurement")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: generate's)")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--prefill-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.chunk is None:
        from dflash_jax.decode.state import PREFILL_CHUNK
        args.chunk = PREFILL_CHUNK
    if args.prefill_child:
        return prefill_child(args)
    import jax
    print(f"backend {jax.default_backend()}, model: qwen3-0.6b shape, {args.layers} layers, vocab {args.vocab}, "
          f"{args.dtype}")
    if not args.skip_decode:
        print(f"decode, target-only, {args.prompt_len}-token prompt, {args.new_tokens} new tokens:")
        res = decode_figures(args)
        base = res["caches"][args.caches[0]]["median_ms"]
        for S, f in res["caches"].items():
            print(f"  ratio max_cache_len {S} / {args.caches[0]}: {f['median_ms'] / base:.2f}x "
                  f"(attention: {res['attention']})")
    if args.prefill_len:
        cmd = [sys.executable, "-m", "infer.bench_attention", "--prefill-child", "--layers", str(args.layers),
               "--vocab", str(args.vocab), "--dtype", args.dtype, "--prefill-len", str(args.prefill_len),
               "--chunk", str(args.chunk)]
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"prefill of {args.prefill_len} tokens FAILED (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
            sys.exit(1)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"prefill {args.prefill_len} tokens (chunk {args.chunk}): {r['prefill_s']:.1f} s run, "
              f"{r['compile_s']:.1f} s compile, peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB")


if __name__ == "__main__":
    from dflash_jax.cli import run
    sys.exit(run(main))
