import time, sys, numpy as np, jax, jax.numpy as jnp
from dflash_jax import bench, model
from dflash_jax.layers import by_rows
from dflash_jax.generate import rows_layout
t, d = bench.load_models(*bench.reference_paths())
S, fill, iters = 1024, 150, 32
def make(n, rows):
    tt = t.replace(params=by_rows(t.params)) if rows else t
    @jax.jit
    def run(cache, toks):
        def body(i, c):
            h, c2, f = model.forward(tt, toks, c, (1, 3, 4))
            lg = model.lm_head(tt, h)
            return c2.rollback(c.lengths + (jnp.argmax(lg[:, 0], -1) * 0).astype(jnp.int32))
        return jax.lax.fori_loop(0, iters, body, cache)
    return run
res = {}
cfgs = [(1, False), (1, True), (4, True), (8, True), (16, True), (24, True), (32, True)]
runs = {}
for n, r in cfgs:
    cache = model.init_cache(t, 1, S)
    cache = cache.rollback(jnp.full((1,), fill, jnp.int32))
    toks = jnp.ones((1, n), jnp.int32)
    f = make(n, r); jax.block_until_ready(f(cache, toks))
    runs[(n, r)] = (f, cache, toks)
for rnd in range(5):
    for k, (f, c, tk) in runs.items():
        t0 = time.perf_counter(); jax.block_until_ready(f(c, tk)); res.setdefault(k, []).append((time.perf_counter() - t0) / iters * 1e3)
for k, v in res.items():
    print(k, "%.2f ms (%.2f-%.2f)" % (np.median(v), min(v), max(v)))
