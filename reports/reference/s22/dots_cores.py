"""6 layers of [M, 384] x [384, 1024] and back (the embedded target's MLP shapes), jitted, best of 5 x 200 calls:
ms and GF/s per row count M. Run on both cores and on one: python reports/reference/s22/dots_cores.py;
taskset -c 0 python reports/reference/s22/dots_cores.py (session 22)."""
import time, numpy as np, jax, jax.numpy as jnp, os
def bench(M, reps=200):
    x = jnp.ones((M, 384), jnp.float32); ws = [jnp.asarray(np.random.randn(384, 1024).astype(np.float32) * 0.05) for _ in range(6)]
    vs = [jnp.asarray(np.random.randn(1024, 384).astype(np.float32) * 0.05) for _ in range(6)]
    @jax.jit
    def f(x, ws, vs):
        for w, v in zip(ws, vs):
            x = x + jnp.tanh(x @ w) @ v * 1e-3
        return x
    f(x, ws, vs).block_until_ready()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps): y = f(x, ws, vs)
        y.block_until_ready(); ts.append((time.perf_counter() - t0) / reps)
    t = min(ts); fl = 6 * 2 * 2 * M * 384 * 1024
    return t * 1e3, fl / t / 1e9
for M in (1, 8, 24, 64):
    ms, gf = bench(M); print(f"M={M}: {ms:.3f} ms, {gf:.0f} GF/s")
