import time, numpy as np, jax, jax.numpy as jnp
from dflash_jax import bench, model, drafter as dm
from dflash_jax.layers import by_rows
t, d = bench.load_models(*bench.reference_paths())
t = t.replace(params=by_rows(t.params)); d = d.replace(params=by_rows(d.params))
S, fill, iters = 1024, 150, 32
def mk(Bk, what):
    @jax.jit
    def run(dc, anchor, feats):
        def body(i, carry):
            dc, a = carry
            if what in ("draft", "both"):
                h = dm.draft_hidden_cached(d, t, a, dc, Bk)
                lg = dm.draft_logits_from_hidden(d, t, h[:, 1:])
                a = jnp.argmax(lg[:, 0], -1).astype(jnp.int32) % 5 + 1
            if what in ("ctx", "both"):
                dc2 = dm.append_context(d, feats * a[:, None, None].astype(feats.dtype), dc, count=jnp.zeros((1,), jnp.int32))
                dc = dc2
            return dc, a
        dc, a = jax.lax.fori_loop(0, iters, body, (dc, anchor)); return dc.k.sum() + a.sum()
    return run
runs = {}
for Bk in (4, 8, 16):
    for what in ("draft", "ctx", "both"):
        dc = dm.init_context_cache(d, 1, S).rollback(jnp.full((1,), fill, jnp.int32))
        feats = jnp.ones((1, Bk, 3 * 384), jnp.float32)
        a = jnp.ones((1,), jnp.int32)
        f = mk(Bk, what); jax.block_until_ready(f(dc, a, feats)); runs[(Bk, what)] = (f, dc, a, feats)
res = {}
for rnd in range(5):
    for k, (f, *args) in runs.items():
        t0 = time.perf_counter(); jax.block_until_ready(f(*args)); res.setdefault(k, []).append((time.perf_counter() - t0) / iters * 1e3)
for k, v in res.items():
    print(k, "%.2f ms (%.2f-%.2f)" % (np.median(v), min(v), max(v)))
