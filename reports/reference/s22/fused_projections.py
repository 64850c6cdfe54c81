"""Fused q/k/v and gate/up projections against separate ones on XLA:CPU (session 22): 6 layers of the embedded
target's shapes (hidden 384, 6 / 2 heads of 64, MLP 1024), jitted, best of 7 x 300 calls, per row count M.
Run: python reports/reference/s22/fused_projections.py"""
import time, numpy as np, jax, jax.numpy as jnp
H, I, NH, KV = 384, 1024, 384, 128
r = np.random.default_rng(0)
def W(*s): return jnp.asarray(r.standard_normal(s).astype(np.float32) * 0.05)
L = 6
sep = [dict(q=W(NH, H), k=W(KV, H), v=W(KV, H), o=W(H, NH), g=W(H, I), u=W(H, I), d=W(I, H)) for _ in range(L)]
fus = [dict(qkv=jnp.concatenate([p["q"], p["k"], p["v"]], 0), o=p["o"], gu=jnp.concatenate([p["g"], p["u"]], 1), d=p["d"]) for p in sep]
def proj(x, w): return jnp.einsum("...i,oi->...o", x, w)
@jax.jit
def f_sep(x, ps):
    for p in ps:
        q, k, v = proj(x, p["q"]), proj(x, p["k"]), proj(x, p["v"])
        a = q + jnp.pad(k + v, ((0, 0), (0, NH - KV)))
        x = x + a @ p["o"].T * 1e-3
        x = x + (jax.nn.silu(x @ p["g"]) * (x @ p["u"])) @ p["d"] * 1e-3
    return x
@jax.jit
def f_fus(x, ps):
    for p in ps:
        qkv = proj(x, p["qkv"])
        q, k, v = qkv[:, :NH], qkv[:, NH:NH + KV], qkv[:, NH + KV:]
        a = q + jnp.pad(k + v, ((0, 0), (0, NH - KV)))
        x = x + a @ p["o"].T * 1e-3
        gu = x @ p["gu"]
        x = x + (jax.nn.silu(gu[:, :I]) * gu[:, I:]) @ p["d"] * 1e-3
    return x
def bench(f, ps, M, reps=300):
    x = jnp.ones((M, H), jnp.float32); f(x, ps).block_until_ready()
    best = 1e9
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(reps): y = f(x, ps)
        y.block_until_ready(); best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3
for M in (1, 4, 8, 16, 24, 32):
    a, b = bench(f_sep, sep, M), bench(f_fus, fus, M)
    print(f"M={M}: separate {a:.3f} ms, fused {b:.3f} ms, ratio {b / a:.3f}")
