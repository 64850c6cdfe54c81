"""Time the embedded target's weight matrices (per layer q, k, v, o, gate, up, down, then the LM head; shapes read
from its config.json) multiplied by n rows, on both layouts ([in, out] as a target step uses them, [out, in] as the speculative loop's
row layout does), in one jitted program: what verifying n tokens costs in matrix work alone on this CPU.

    python reports/reference/trees_cpu/rows_matmul.py    # run 3 times, quote medians
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.models import reference_paths
from dflash_jax.config import TargetConfig, read_config_json


def matrix_shapes(c: TargetConfig) -> list[tuple[int, int]]:
    """[in, out] of every matrix a dense target's forward multiplies by its rows."""
    h, q, kv, f = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]
    return layer * c.num_layers + [(h, c.vocab_size)]


def main():
    target, _ = reference_paths()
    shapes = matrix_shapes(TargetConfig.from_hf(read_config_json(target)))
    width = max(i for i, _ in shapes)
    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(key, s, jnp.float32) for s in shapes]
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
        x = jnp.ones((n, width), jnp.float32)
        print(f"{n} rows: [in, out] {ms(in_out, x, ws):.2f} ms, [out, in] {ms(out_in, x, ws_t):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
