"""Gated DeltaNet prefill: the block form against the token-by-token recurrence.

  python -m infer.bench_gdn                          # 8192 tokens through 2 GDN layers, 3 timed runs per form
  python -m infer.bench_gdn --tokens 2048 --layers 1 --json out.json

Forms (dflash_jax/bench/gdn.py): block (the prefill), token (the layer's decode step per token), recurrence (the
delta rule token by token, projections as matrices). Prints each form's median seconds (and range), the block
form's speedup over the others, and the outputs' max relative difference (fp32).
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer.bench_gdn", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    from dflash_jax.bench.gdn import prefill_stack
    out = prefill_stack(tokens=a.tokens, layers=a.layers, hidden=a.hidden, runs=a.runs)
    c = out["config"]
    print(f"{c['tokens']} tokens, {c['layers']} GDN layers, hidden {c['hidden']}, {c['k_heads']} key / {c['v_heads']} "
          f"value heads of {c['head_dim']}, fp32")
    for name in ("block", "token", "recurrence"):
        r = out[name]
        extra = "" if name == "block" else (f"; block form {r['block_speedup']:.1f}x faster, outputs differ by "
                                            f"{r['max_rel_diff_to_block']:.1e} (max relative)")
        print(f"{name:>10}: median {r['median_s']:.3f} s over {a.runs} runs (range {r['min_s']:.3f} - "
              f"{r['max_s']:.3f}){extra}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    from dflash_jax.cli import cpu_unless_accelerator, run
    cpu_unless_accelerator()
    sys.exit(run(main))
