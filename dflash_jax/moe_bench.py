"""Batch-1 decode cost of a MoE target against its expert count: a decode step must read only the
experts its token selected, so ms/token with 64 experts should stay close to that with 8 (same top-k).

    python -m dflash_jax.moe_bench [--experts 8 64] [--top-k 2] [--runs 3] [--tokens 64]

Tiny random Qwen3-MoE targets whose expert weights dominate the bytes (hidden 256, expert width 1024,
4 layers, fp32; the expert MiB are printed). Each run times
`generate(target, None, ...)` (one jitted while_loop decode), median of `--runs` with range. The
"all experts" row (`--all-experts`) replaces the decode's expert step by a dense einsum over every
expert (routing weights zero off the selected ones): what a decode that does not exploit routing
costs, the contrast that shows the benchmark can tell the two apart. (The grouped `ragged_dot` path is
no such contrast on XLA:CPU: it skips empty groups.)
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np


def _target(E: int, k: int, args):
    from .config import TargetConfig
    from .model import init_target
    cfg = TargetConfig(family="qwen3_moe", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden,
                       num_layers=args.layers, num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True,
                       num_experts=E, num_experts_per_tok=k, moe_intermediate_size=args.expert_width,
                       norm_topk_prob=True)
    return init_target(cfg, seed=0, std=0.05, layout="auto")


def experts_dense(c, lp, x, w, e):
    """Every expert computed for every token (the contrast; not used by the library)."""
    import jax.numpy as jnp
    from .layers import F32
    from .moe import activation
    E = lp["e_gate"].shape[0]
    dense_w = jnp.zeros((x.shape[0], E), F32).at[jnp.arange(x.shape[0])[:, None], jnp.clip(e, 0, E - 1)].add(w)
    g = jnp.einsum("nh,ehf->nef", x, lp["e_gate"], preferred_element_type=F32)
    u = jnp.einsum("nh,ehf->nef", x, lp["e_up"], preferred_element_type=F32)
    a = activation(c, g, u).astype(x.dtype)
    y = jnp.einsum("nef,efh->neh", a, lp["e_down"], preferred_element_type=F32)
    return jnp.einsum("neh,ne->nh", y, dense_w).astype(x.dtype)


def _ms_per_token(target, args) -> list[float]:
    from .decode.api import generate
    prompt = [list(np.random.default_rng(0).integers(0, args.vocab, size=8))]
    kw = dict(max_new_tokens=args.tokens, stop_token_ids=[])
    generate(target, None, prompt, **kw)  # compile + warm
    out = []
    for _ in range(args.runs):
        r = generate(target, None, prompt, **kw)
        out.append(1e3 * r.decode_time / max(r.cycles, 1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--expert-width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--all-experts", action="store_true", help="also time a decode that computes every expert (dense einsum)")
    args = ap.parse_args(argv)
    import jax

    from . import moe
    from .decode.cache import clear_compile_cache
    rows = []
    modes = [("selected", moe.experts_gathered)] + ([("all experts", experts_dense)] if args.all_experts else [])
    orig = moe.experts_gathered
    try:
        for mode, fn in modes:
            moe.experts_gathered = fn
            jax.clear_caches()  # same configs as the other mode: retrace with this expert step
            clear_compile_cache()
            for E in args.experts:
                t = _target(E, args.top_k, args)
                mib = sum(int(np.prod(lp[k].shape)) * 4 for lp in t.params["layers"] for k in ("e_gate", "e_up", "e_down")) / 2 ** 20
                ms = _ms_per_token(t, args)
                rows.append((mode, E, mib, ms))
                print(f"{mode:12s} experts={E:4d} top-{args.top_k}  expert MiB={mib:7.1f}  ms/token median "
                      f"{statistics.median(ms):7.3f}  range [{min(ms):.3f}, {max(ms):.3f}]", flush=True)
    finally:
        moe.experts_gathered = orig
    sel = {E: statistics.median(ms) for mode, E, _, ms in rows if mode == "selected"}
    if len(sel) >= 2:
        lo, hi = min(sel), max(sel)
        print(f"ratio ms/token {hi} experts / {lo} experts (selected-experts decode): {sel[hi] / sel[lo]:.2f}x")


if __name__ == "__main__":
    main()
