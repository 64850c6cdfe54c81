"""Time the embedded target's 43 weight matrices (6 layers x q, k, v, o, gate, up, down, and the LM head)
multiplied by n rows, on both layouts ([in, out] as a target step uses them, [out, in] as the speculative loop's
row layout does), in one jitted program: what verifying n tokens costs in matrix work alone on this CPU.

    python reports/reference/trees_rows_cpu/rows_matmul.py    # run 3 times, quote medians
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = [(384, 384), (384, 128), (384, 128), (384, 384), (384, 1024), (384, 1024), (1024, 384)] * 6 + [(384, 2048)]


def main():
    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(key, s, jnp.float32) for s in SHAPES]
    ws_t = [w.T.copy() for w in ws]

    @jax.jit
    def in_out(x, ws):
        return sum((x[:, :w.shape[0]] @ w).sum() for w in ws)

    @jax.jit
    def out_in(x, ws):
        return sum(jnp.einsum("ni,oi->no", x[:, :w.shape[1]], w).sum() for w in ws)

    def ms(f, x, w):
        f(x, w).block_until_ready()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(20):
                r = f(x, w)
            r.block_until_ready()
            times.append((time.perf_counter() - t0) / 20)
        return 1e3 * float(np.median(times))

    for n in (1, 9, 16, 17, 18, 19, 20, 21, 22, 24, 25):
        x = jnp.ones((n, 1024), jnp.float32)
        print(f"{n} rows: [in, out] {ms(in_out, x, ws):.2f} ms, [out, in] {ms(out_in, x, ws_t):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
