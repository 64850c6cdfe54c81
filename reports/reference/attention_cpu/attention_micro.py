"""Six layers of the embedded target's attention alone, jitted, per path: dense ("reference") and blockwise with
512 / 256 / 128-slot blocks; prints ms (median of 3 x best of 30) per (cache slots, query rows, fill).

    JAX_PLATFORMS=cpu python reports/reference/attention_cpu/attention_micro.py
"""
import numpy as np, jax, jax.numpy as jnp
from dflash_jax.bench.bandwidth import best_time
from dflash_jax import attention as A
L, B, KV, NH, D = 6, 1, 2, 6, 64
def run(S, Q, ctx):
    r = np.random.RandomState(0)
    kc = jnp.asarray(r.randn(L, B, KV, S, D).astype(np.float32)); vc = jnp.asarray(r.randn(L, B, KV, S, D).astype(np.float32))
    q = jnp.asarray(r.randn(L, B, 1, Q, NH, D).astype(np.float32))
    kn = jnp.asarray(r.randn(L, B, 1, Q, KV, D).astype(np.float32)); vn = kn * 0.5
    mask = jnp.tril(jnp.ones((Q, Q), bool))[None, None]
    cl = jnp.full((B, 1), ctx, jnp.int32)
    res = {}
    for impl, blk in [("reference", None), ("blockwise", 512), ("blockwise", 256), ("blockwise", 128)]:
        @jax.jit
        def f(q, kn, vn, kc, vc, cl):
            return [A.attention(q[i], kn[i], vn[i], mask, kc, vc, cl, layer=i, impl=impl, block=blk) for i in range(L)]
        jax.block_until_ready(f(q, kn, vn, kc, vc, cl))
        res[f"{impl}{blk or ''}"] = 1e3 * np.median([best_time(lambda: f(q, kn, vn, kc, vc, cl), 30) for _ in range(3)])
    print(S, Q, ctx, {k: round(v, 3) for k, v in res.items()}, flush=True)
for S, Q, ctx in [(512, 1, 300), (512, 5, 300), (512, 24, 300), (1024, 1, 300), (1024, 24, 300), (2048, 1, 1200),
                  (2048, 24, 1200), (2048, 5, 1200), (1024, 256, 512)]:
    run(S, Q, ctx)
