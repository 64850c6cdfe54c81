"""An OpenAI-compatible server: continuous batching with DFlash speculative decoding, the shape chosen per decode
chunk for the load (docs/serving.md).

    python -m infer.serve [--target DIR --drafter DIR] [--host H] [--port P] [--slots N] [--max-queue N]
        [--shape auto|chain:B|tree:N|off] [--api-key KEY] [--max-tokens-default N] [--cache-len N]
        [--mesh data=D,model=M] [--distributed --coordinator HOST:PORT --num-processes N --process-id I]

Without --target: the embedded reference pair on 127.0.0.1:8000. Needs the `serve` extra
(pip install -e ".[serve]"). With several hosts every process runs the same command; process 0 serves HTTP
(docs/serving.md, "Several devices and hosts").
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def parse_mesh(text: str) -> tuple[int, int]:
    """'data=D,model=M' (either part may be left out: data takes the devices the model axis leaves)."""
    out = {"data": None, "model": 1}
    for part in (x.strip() for x in text.split(",") if x.strip()):
        k, _, v = part.partition("=")
        if k.strip() not in out or not v.strip().isdigit() or int(v) < 1:
            raise argparse.ArgumentTypeError(f"--mesh expects data=D,model=M with positive integers, got {text!r}")
        out[k.strip()] = int(v)
    return out["data"], out["model"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.serve", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--target", help="target model directory (HF format); default: the embedded reference pair")
    p.add_argument("--drafter", help="DFlash drafter directory (z-lab format); without it: target-only")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=8, help="requests decoded at once (default 8)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429 (default 64)")
    p.add_argument("--shape", default="auto", help="auto (per chunk, for the load), chain:B, tree:N or off")
    p.add_argument("--auto-shapes", type=lambda s: tuple(x for x in s.split(",") if x),
                   help="what --shape auto chooses among, e.g. off,chain:4,chain:8,tree:15 "
                        "(default: off and the chains 4 / 8 / 16 within the drafter's block)")
    p.add_argument("--api-key", default=os.environ.get("DFLASH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $DFLASH_API_KEY; none: open)")
    p.add_argument("--max-tokens-default", type=int, default=256, help="max_tokens of requests without one")
    p.add_argument("--cache-len", type=int, default=1024, help="KV cache positions per slot: prompt + answer + block")
    p.add_argument("--chunk-cycles", type=int, default=8, help="the most decode cycles between two admissions")
    p.add_argument("--prompt-buckets", type=_ints, help="prompt lengths the prefill is compiled for, e.g. 64,256")
    p.add_argument("--batch-buckets", type=_ints, help="slot counts the decode is compiled for, e.g. 2,8")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for the requests in flight (default 30)")
    p.add_argument("--model-name", help="the model's name in the API (default: the target directory's name)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0, help="the sampling key (a request's seed picks its row)")
    p.add_argument("--mesh", type=parse_mesh, help="data=D,model=M over every device (all hosts'): slots split over "
                   "data, tensor-parallel over model (default: one device)")
    from dflash_jax.distributed import add_distributed_args
    add_distributed_args(p)
    p.add_argument("--quant", choices=("int8", "fp8"), help="target weights: 1 byte + a scale per output channel")
    p.add_argument("--kv-quant", choices=("int8", "fp8"), help="target KV cache: 1 byte + a scale per token and head")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: the server needs {' and '.join(missing)}: pip install 'dflash-jax[serve]' "
              f"(or pip install fastapi uvicorn)", file=sys.stderr)
        return 2
    if args.drafter and not args.target:
        print("error: --drafter needs --target", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mesh = None
    if args.mesh is not None or args.distributed:
        from dflash_jax.distributed import maybe_initialize
        from dflash_jax.sharding import make_mesh
        maybe_initialize(args)
        try:
            mesh = make_mesh(*(args.mesh or (None, 1)))
        except ValueError as e:
            print(f"error: --mesh: {e}", file=sys.stderr)
            return 2
    from dflash_jax.serve.server import Options, serve
    opts = Options(target=args.target, drafter=args.drafter, host=args.host, port=args.port, slots=args.slots,
                   max_queue=args.max_queue, shape=args.shape, auto_shapes=args.auto_shapes, api_key=args.api_key,
                   max_tokens_default=args.max_tokens_default, cache_len=args.cache_len,
                   chunk_cycles=args.chunk_cycles, prompt_buckets=args.prompt_buckets,
                   batch_buckets=args.batch_buckets, drain_timeout=args.drain_timeout, dtype=args.dtype,
                   model_name=args.model_name, seed=args.seed, mesh=mesh, quant=args.quant, kv_quant=args.kv_quant)
    try:
        return serve(opts)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from dflash_jax.cli import run
    sys.exit(run(main))
