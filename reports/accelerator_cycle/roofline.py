"""What one batch-1 decode step could cost on this accelerator: the time to multiply one token by every
matrix of a Qwen3-8B-shaped target (random bf16, the project's init_target), in one jitted program, with
the layers stacked (lax.scan, as the decode loop runs them on accelerators) and unrolled (one array per
layer), and a plain read (sum) of the same bytes. Prints ms and GB/s per variant (median of 20 calls).

    python reports/accelerator_cycle/roofline.py [--config configs/models/qwen3-8b] [--layers N]
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.models import bench_target_config, tree_bytes
from dflash_jax.layers import OUT_IN
from dflash_jax.model import init_target


def _dot(x, w, name):
    # a [in]-vector times the matrix as the model stores it ([out, in] for OUT_IN, else [in, out])
    return jnp.einsum("i,oi->o", x[: w.shape[1]], w) if name in OUT_IN else jnp.einsum("i,io->o", x[: w.shape[0]], w)


def _layer(x, lp):
    acc = jnp.zeros((), jnp.float32)
    for name, w in lp.items():
        if w.ndim == 2:
            acc = acc + jnp.mean(_dot(x, w, name).astype(jnp.float32))
    return acc


def programs(params):
    stacked, unrolled = params["stacked"], params["unrolled"]
    width = 1 << 16

    def head(x, p):
        return jnp.mean((x[: p["lm_head"].shape[0]] @ p["lm_head"]).astype(jnp.float32))

    def f_stacked(x, p, layers):
        def body(c, lp):
            return c + _layer(x + c.astype(x.dtype), lp), None
        c, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), layers)
        return c + head(x, p)

    def f_unrolled(x, p, layers):
        c = jnp.zeros((), jnp.float32)
        for lp in layers:
            c = c + _layer(x + c.astype(x.dtype), lp)
        return c + head(x, p)

    def f_read(x, p, layers):
        return sum(jnp.sum(v.astype(jnp.float32)) for v in jax.tree_util.tree_leaves((p, layers)))

    x = jnp.ones((width,), stacked["layers"]["q"].dtype)
    top = {"lm_head": stacked["lm_head"]}
    return {"gemv, layers stacked (scan)": (jax.jit(f_stacked), (x, top, stacked["layers"])),
            "gemv, layers unrolled": (jax.jit(f_unrolled), (x, top, unrolled["layers"])),
            "read (sum), unrolled": (jax.jit(f_read), (x, top, unrolled["layers"]))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/models/qwen3-8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    cfg = bench_target_config(a.config, a.layers, None, "bfloat16")
    t = init_target(cfg, seed=0, layout="stacked", rng="device")
    unrolled = {"layers": tuple({k: v[i] for k, v in t.params["layers"].items()} for i in range(cfg.num_layers))}
    jax.block_until_ready(unrolled)
    mats = {k: v for k, v in t.params["layers"].items() if v.ndim == 3}
    nbytes = tree_bytes(mats) + t.params["lm_head"].nbytes
    print(f"jax {jax.__version__} {jax.devices()[0].device_kind}: {cfg.num_layers} layers, matrices + lm_head "
          f"{nbytes / 1e9:.3f} GB", flush=True)
    out = {"bytes": nbytes, "device": jax.devices()[0].device_kind, "ms": {}}
    for name, (fn, args) in programs({"stacked": t.params, "unrolled": unrolled}).items():
        jax.block_until_ready(fn(*args))
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
        ms = 1e3 * float(np.median(ts))
        out["ms"][name] = ms
        print(f"  {name}: {ms:.2f} ms ({1e3 * min(ts):.2f}-{1e3 * max(ts):.2f}), {nbytes / ms / 1e6:.0f} GB/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
