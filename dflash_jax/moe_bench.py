"""Batch-1 decode cost of a MoE target against its expert count: a decode step must read only the
experts its token selected, so ms/token with 64 experts should stay close to that with 8 (same top-k).

    python -m dflash_jax.moe_bench [--experts 8 64] [--top-k 2] [--runs 3] [--tokens 64]

Tiny random Qwen3-MoE targets whose expert weights dominate the bytes (hidden 256, expert width 1024,
4 layers, fp32; the expert MiB are printed). Each run times
`generate(target, None, ...)` (one jitted while_loop decode), median of `--runs` with range. The
"all experts" row forces the grouped (ragged_dot) path at decode, which on XLA:CPU computes every
expert: what a decode that does not exploit routing would cost.
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


def _ms_per_token(target, args) -> list[float]:
    from .generate import generate
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
    ap.add_argument("--all-experts", action="store_true", help="also time the decode forced to compute every expert")
    args = ap.parse_args(argv)
    from . import moe
    rows = []
    modes = [("selected", moe.experts_gathered)] + ([("all experts", moe.experts_grouped)] if args.all_experts else [])
    orig = moe.experts_gathered
    try:
        for mode, fn in modes:
            moe.experts_gathered = fn
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
