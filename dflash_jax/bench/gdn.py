"""Gated DeltaNet prefill speed (python -m infer.bench_gdn): a stack of GDN layers over one long prompt in three forms
on the same inputs, each timed `runs` times after a compile:

  block       the prefill (gdn.mixer: projections as matrices, the delta rule in sub-blocks, gdn.delta_sequence);
  token       the layer one token at a time, as its decode step (a scan over tokens of gdn.mixer on one row: the
              projections, the conv window and the state advanced per token), what prefilling by decode steps costs;
  recurrence  the block form's projections with the delta rule run token by token (gdn.recurrent_reference)."""
from __future__ import annotations

import time

import numpy as np


def prefill_stack(tokens: int = 8192, layers: int = 2, hidden: int = 1024, k_heads: int = 16, v_heads: int = 32,
                  head_dim: int = 128, runs: int = 3, seed: int = 0, log=print) -> dict:
    """Seconds per prefill of `tokens` tokens through `layers` GDN mixers (residual stream, fp32; default head sizes
    those of Qwen3.5-9B's GDN layers: 16 key / 32 value heads of 128), every form: median and range of `runs` timed
    runs each, its outputs' max relative difference to the block form's, and the block form's speedup over it."""
    import jax
    import jax.numpy as jnp

    from .. import gdn
    from ..config import GDNConfig
    cfg = GDNConfig(k_heads, v_heads, head_dim, head_dim, 4)
    r = np.random.default_rng(seed)
    shapes = gdn.param_shapes(cfg, hidden)
    stack = [{k: jnp.asarray(r.normal(0, 0.05 if len(s) == 2 and "conv" not in k else 0.5, size=s), jnp.float32)
              for k, s in shapes.items()} for _ in range(layers)]
    for lp in stack:
        lp["lin_norm"] = jnp.ones_like(lp["lin_norm"])
        lp["A_log"] = jnp.log(jnp.asarray(r.uniform(1, 16, size=v_heads), jnp.float32))
    x0 = jnp.asarray(r.normal(size=(1, tokens, hidden)), jnp.float32)

    def run(x, form: str):
        st = gdn.init_state(cfg, 1, 1, jnp.float32)
        for lp in stack:
            if form == "block":
                o, _ = gdn.mixer(cfg, lp, x, st.conv[0], st.rec[0], eps=1e-6)
            elif form == "token":
                o = _layer_by_token(cfg, lp, x, st.conv[0], st.rec[0])
            else:
                o = _mixer_by_token(cfg, lp, x, st.conv[0], st.rec[0])
            x = x + o
        return x

    fns = {f: jax.jit(lambda x, f=f: run(x, f)) for f in ("block", "token", "recurrence")}
    out, res = {}, {}
    for name, f in fns.items():
        t0 = time.perf_counter()
        res[name] = jax.block_until_ready(f(x0))
        log(f"{name}: compiled and ran once in {time.perf_counter() - t0:.1f} s")
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x0))
            ts.append(time.perf_counter() - t0)
        out[name] = {"median_s": float(np.median(ts)), "min_s": min(ts), "max_s": max(ts), "runs": ts}
    a = np.asarray(res["block"])
    for f in ("token", "recurrence"):
        b = np.asarray(res[f])
        out[f]["max_rel_diff_to_block"] = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
        out[f]["block_speedup"] = out[f]["median_s"] / out["block"]["median_s"]
    out["config"] = dict(tokens=tokens, layers=layers, hidden=hidden, k_heads=k_heads, v_heads=v_heads,
                         head_dim=head_dim, dtype="float32")
    return out


def _layer_by_token(cfg, lp, h, conv_state, rec_state):
    """gdn.mixer applied to one token at a time (a scan carrying the conv window and the state)."""
    import jax

    from .. import gdn

    def step(carry, x):
        conv, rec = carry
        o, (conv, rec) = gdn.mixer(cfg, lp, x[:, None], conv, rec, eps=1e-6)
        return (conv.astype(conv_state.dtype), rec), o[:, 0]

    _, o = jax.lax.scan(step, (conv_state, rec_state), h.swapaxes(0, 1))
    return o.swapaxes(0, 1)


def _mixer_by_token(cfg, lp, h, conv_state, rec_state):
    """gdn.mixer with the delta rule run token by token (the reference recurrence); everything else the same."""
    from .. import gdn
    o, _ = gdn.mixer(cfg, lp, h, conv_state, rec_state, eps=1e-6, sequence=gdn.recurrent_reference)
    return o
