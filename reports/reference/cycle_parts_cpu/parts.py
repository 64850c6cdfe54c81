"""Fused-loop costs of a drafted cycle's parts on this machine (embedded pair): the target's forward + lm_head on n
rows, and the drafter's block pass (+ its context append). Each program runs ITERS iterations in one fori_loop whose
every result feeds the next iteration or the output (nothing is dead code or loop-invariant); ROUNDS rounds, every
program once per round; medians (range) in ms per iteration.

    JAX_PLATFORMS=cpu python reports/reference/cycle_parts_cpu/parts.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import model
from dflash_jax.bench.models import load_models, reference_paths
from dflash_jax import drafter as dm
from dflash_jax.layers import by_rows

S, FILL, ITERS, ROUNDS = 1024, 150, 32, 5
TAPS = (1, 3, 4)  # the embedded drafter's target layers


def target_rows(t, n):
    """forward + lm_head of n tokens at a fixed fill; the argmax of the first row feeds the next tokens."""
    @jax.jit
    def run(cache, toks):
        def body(i, carry):
            c, tk = carry
            h, c2, _ = model.forward(t, tk, c, TAPS)
            nxt = jnp.argmax(model.lm_head(t, h)[:, 0], -1).astype(jnp.int32) % 5 + 1
            return c2.rollback(c.lengths), jnp.broadcast_to(nxt[:, None], tk.shape)
        c, tk = jax.lax.fori_loop(0, ITERS, body, (cache, toks))
        return c.k.sum() + tk.sum()
    cache = model.init_cache(t, 1, S).rollback(jnp.full((1,), FILL, jnp.int32))
    return run, (cache, jnp.ones((1, n), jnp.int32))


def drafter_block(t, d, Bk, append):
    """the drafter's block pass + logits (and, with append, the context append of Bk rows); the drafted token feeds
    the next anchor and the appended features."""
    @jax.jit
    def run(dc, anchor, feats):
        def body(i, carry):
            dc, a = carry
            h = dm.draft_hidden_cached(d, t, a, dc, Bk)
            a = jnp.argmax(dm.draft_logits_from_hidden(d, t, h[:, 1:])[:, 0], -1).astype(jnp.int32) % 5 + 1
            if append:
                dc = dm.append_context(d, feats * a[:, None, None].astype(feats.dtype), dc,
                                       count=jnp.zeros((1,), jnp.int32))
            return dc, a
        dc, a = jax.lax.fori_loop(0, ITERS, body, (dc, anchor))
        return dc.k.sum() + a.sum()
    dc = dm.init_context_cache(d, 1, S).rollback(jnp.full((1,), FILL, jnp.int32))
    return run, (dc, jnp.ones((1,), jnp.int32), jnp.ones((1, Bk, len(TAPS) * t.config.hidden_size), jnp.float32))


def main():
    t, d = load_models(*reference_paths())
    tr, dr = t.replace(params=by_rows(t.params)), d.replace(params=by_rows(d.params))
    progs = {"target 1 row [in, out]": target_rows(t, 1)}
    progs.update({f"target {n} rows": target_rows(tr, n) for n in (1, 4, 8, 16, 24, 32)})
    progs.update({f"drafter B={b}{' + append' if ap else ''}": drafter_block(tr, dr, b, ap)
                  for b in (4, 8, 16) for ap in (False, True)})
    for f, args in progs.values():
        jax.block_until_ready(f(*args))  # compile
    ms = {k: [] for k in progs}
    for _ in range(ROUNDS):
        for k, (f, args) in progs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ms[k].append((time.perf_counter() - t0) / ITERS * 1e3)
    for k, v in ms.items():
        print(f"{k}: {np.median(v):.2f} ms ({min(v):.2f}-{max(v):.2f})")


if __name__ == "__main__":
    main()
