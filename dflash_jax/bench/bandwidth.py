"""Target-only decode throughput against this machine's memory bandwidth (python -m infer.bench_decode), and the
timing helpers of the micro benchmarks (`best_time`, `time_decode`).
"""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from .args import cache_len_for, log
from .models import bench_target_config, random_prompts, tree_bytes


def best_time(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn() (each waited for), after one untimed call."""
    import jax
    jax.block_until_ready(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def memory_bandwidth(nbytes: int, repeats: int = 5) -> dict:
    """Best-of-`repeats` bandwidths in GB/s on an `nbytes` float32 array.

    numpy_copy: np.copyto into a preallocated array (read + write bytes counted);
    jax_copy: a jitted `x * c` into a fresh output (read + write; includes first-touch page faults
    of the new buffer, which XLA CPU pays on every call); jax_inplace: `x * c` with the input donated
    (read + write, same buffer); jax_read: jnp.sum (read only); jax_gemv: [1, 1024] @ [1024, n/1024]
    (read only: the access pattern of batch-1 weight streaming)."""
    import jax
    import jax.numpy as jnp
    n = max(nbytes // 4 // 1024, 1) * 1024
    out = {}

    def best(f):
        jax.block_until_ready(f())
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            ts.append(time.perf_counter() - t0)
        return min(ts)

    a = np.ones(n, np.float32)
    b = np.empty_like(a)
    out["numpy_copy"] = 2 * a.nbytes / best(lambda: np.copyto(b, a)) / 1e9
    a = b = None  # freed (the timed closures are done with them)
    x = jnp.ones((n,), jnp.float32)
    cp = jax.jit(lambda v: v * 1.0001)
    out["jax_copy"] = 2 * x.nbytes / best(lambda: cp(x)) / 1e9
    box = [jnp.ones((n,), jnp.float32)]
    ip = jax.jit(lambda v: v * 1.0001, donate_argnums=(0,))

    def run_inplace():
        box[0] = ip(box[0])
        return box[0]

    out["jax_inplace"] = 2 * x.nbytes / best(run_inplace) / 1e9
    box = None
    rd = jax.jit(jnp.sum)
    out["jax_read"] = x.nbytes / best(lambda: rd(x)) / 1e9
    w = x.reshape(1024, n // 1024)
    h = jnp.ones((1, 1024), jnp.float32)
    mv = jax.jit(lambda h, w: h @ w)
    out["jax_gemv"] = x.nbytes / best(lambda: mv(h, w)) / 1e9
    x = w = None
    return out


def copy_bandwidth(bw: dict) -> float:
    """The reference 'copy bandwidth': the best of numpy's copy and XLA's in-place update."""
    return max(bw["numpy_copy"], bw["jax_inplace"])


def time_decode(target, drafter, batch: int, steps: int, prompt_len: int = 32, block_size: int | None = None,
                repeats: int = 2) -> dict:
    """Decode `steps` loop iterations (no stop tokens) at batch `batch`; best of `repeats` runs after the
    compiling one. Returns per-step seconds and the result of the best run."""
    from ..decode.api import generate
    prompts = random_prompts(batch, prompt_len, target.config.vocab_size)
    kw = dict(max_new_tokens=steps + 1, stop_token_ids=[], block_size=block_size)
    t0 = time.perf_counter()
    first = generate(target, drafter, prompts, **kw)
    compile_s = time.perf_counter() - t0
    best = None
    for _ in range(repeats):
        r = generate(target, drafter, prompts, **kw)
        if best is None or r.decode_time / r.cycles < best.decode_time / best.cycles:
            best = r
    return {"step_s": best.decode_time / max(best.cycles, 1), "cycles": best.cycles, "result": best,
            "first_call_s": compile_s, "compile_s": first.compile_time}


def bench_decode(config_name="qwen3-0.6b", layers=None, vocab_size=None, batch_sizes=(1, 8), steps=32,
                 copy_mb=1024, dtype="float32", repeats=2) -> dict:
    """Target-only ms per step at each batch size, and the weight-streaming bandwidth it implies against the
    measured copy / read / matvec bandwidths."""
    import jax
    from ..model import init_target
    cfg = bench_target_config(config_name, layers, vocab_size, dtype)
    log(f"config: {config_name} layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_heads}/"
        f"{cfg.num_kv_heads} head_dim={cfg.head_dim} inter={cfg.intermediate_size} vocab={cfg.vocab_size} "
        f"tied={cfg.tie_word_embeddings} dtype={dtype}")
    log(f"jax {jax.__version__} backend={jax.default_backend()} devices={jax.devices()} cpus={os.cpu_count()}")
    t0 = time.perf_counter()
    target = init_target(cfg, seed=0, layout="auto", rng="device")
    jax.block_until_ready(target.params)
    pbytes = tree_bytes(target.params)
    nparams = sum(x.size for x in jax.tree_util.tree_leaves(target.params))
    log(f"init_target: {time.perf_counter() - t0:.1f}s, {nparams / 1e6:.1f}M params, {pbytes / 1e9:.3f} GB")
    log(f"measuring memory bandwidth on a {copy_mb} MB array ...")
    bw = memory_bandwidth(copy_mb * 1024 * 1024)
    copy_bw = copy_bandwidth(bw)
    log("  " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in bw.items()))
    rows = []
    for B in batch_sizes:
        r = time_decode(target, None, B, steps, repeats=repeats)
        S = cache_len_for([32], steps + 1, 1)  # the cache generate() allocates for this run
        kv_bytes = 2 * cfg.num_layers * B * S * cfg.num_kv_heads * cfg.head_dim * target.dtype.itemsize
        stream = pbytes / r["step_s"] / 1e9
        row = {"batch": B, "step_ms": 1e3 * r["step_s"], "tokens_per_s": B / r["step_s"], "steps": r["cycles"],
               "weight_stream_GBps": stream, "with_kv_GBps": (pbytes + kv_bytes) / r["step_s"] / 1e9,
               "ratio_to_copy": stream / copy_bw, "ratio_to_numpy_copy": stream / bw["numpy_copy"],
               "ratio_to_gemv": stream / bw["jax_gemv"],
               "compile_s": r["compile_s"]}
        rows.append(row)
        log(f"  batch {B}: {row['step_ms']:.1f} ms/step, {row['tokens_per_s']:.2f} tok/s, weight streaming "
            f"{stream:.2f} GB/s = {row['ratio_to_numpy_copy']:.2f} x numpy copy, {row['ratio_to_copy']:.2f} x best copy "
            f"(compile {r['compile_s']:.1f}s)")
    return {"config": dataclasses.asdict(cfg), "param_bytes": pbytes, "bandwidth_GBps": bw, "rows": rows}


def print_decode_table(res: dict) -> None:
    bw = res["bandwidth_GBps"]
    copy_bw = copy_bandwidth(bw)
    log("")
    log(f"parameter bytes per step: {res['param_bytes'] / 1e9:.3f} GB")
    log(f"memory bandwidth: numpy copy {bw['numpy_copy']:.2f} GB/s, jax copy (fresh output) {bw['jax_copy']:.2f} GB/s, "
        f"jax in-place {bw['jax_inplace']:.2f} GB/s, jax read (sum) {bw['jax_read']:.2f} GB/s, "
        f"jax gemv {bw['jax_gemv']:.2f} GB/s  (copies count read + write bytes)")
    log(f"{'batch':>5} {'ms/step':>9} {'tok/s':>8} {'stream GB/s':>12} {'+KV GB/s':>9} "
        f"{'/np-copy':>8} {'/best':>6} {'/gemv':>6}")
    for r in res["rows"]:
        log(f"{r['batch']:>5} {r['step_ms']:>9.1f} {r['tokens_per_s']:>8.2f} {r['weight_stream_GBps']:>12.2f} "
            f"{r['with_kv_GBps']:>9.2f} {r['ratio_to_numpy_copy']:>8.2f} {r['ratio_to_copy']:>6.2f} "
            f"{r['ratio_to_gemv']:>6.2f}")
    log(f"(ratios of the weight-streaming bandwidth (parameter bytes / step time) to: /np-copy the numpy copy, "
        f"/best the best copy ({copy_bw:.2f} GB/s), /gemv the jitted batch-1 matvec's read bandwidth)")
