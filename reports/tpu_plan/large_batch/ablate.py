"""Where a verify cycle's HBM bytes above `min_bytes` go, per target layer: the B-token cycle of Qwen3-8B on one
v5p chip (v5p-8, data=4) compiled at 1 and 2 target layers (unrolled, every KV block counted), as is and with a
layer's attention and / or MLP replaced by a pass-through, so that the per-layer difference splits into the
attention's, the MLP's and the rest's (norms, q / k / v / o projections, residual).

    python reports/tpu_plan/large_batch/ablate.py --rows 16 --cache 4096 --block 16

prints one line per variant: per-layer HBM bytes, per-layer min_bytes, their difference (the per-layer excess),
and the fixed excess (the part that does not grow with the layers: logits, embedding, drafter)."""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from dflash_jax import model as target_model
from dflash_jax import moe
from dflash_jax.attention import count_every_block
from dflash_jax.planner.decode import (
    DecodePrograms,
    DecodeSetup,
    load_target_config,
    make_drafter_config,
    with_target_layers,
)
from dflash_jax.planner.hlo import as_on_tpu, compile_program
from dflash_jax.planner.topology import (
    make_mesh,
    parse_mesh,
    resolve_tpu,
    topology_devices,
)

VARIANTS = ("as is", "no attention", "no MLP", "neither")


def pass_attention(q, k_new, v_new, *args, **kwargs):
    B, A, Q, NH, D = q.shape
    return q.reshape(B, A, Q, NH * D)


@as_on_tpu
def per_layer(target: str, rows: int, cache: int, block: int, variant: str) -> dict:
    real_attention, real_ffn, real_mlp = target_model.attention, moe.ffn, target_model.mlp_kernel_applies
    if variant in ("no attention", "neither"):
        target_model.attention = pass_attention
    if variant in ("no MLP", "neither"):  # the MLP (the kernel with its norm and residual add, or XLA's) passed by
        moe.ffn = lambda c, lp, x, i, tp: x * 2
        target_model.mlp_kernel_applies = lambda lp, N, tail=False: False
    try:
        sl = resolve_tpu("v5p-8")
        data, mdl = parse_mesh(None, sl.chips)
        tc = load_target_config(target)
        dec = DecodePrograms(DecodeSetup(tc, make_drafter_config(tc, None, 1, block), make_mesh(topology_devices(sl), data, mdl),
                                         rows * data, cache - 512, 496, cache))
        got = {}
        for n in (1, 2):
            d = with_target_layers(dec, n)
            with count_every_block(cache - 16):
                c = compile_program(*d.args("cycle", block, "unrolled"))
            got[n] = (c["hbm_bytes"], d.min_bytes("cycle", block))
    finally:
        target_model.attention, moe.ffn, target_model.mlp_kernel_applies = real_attention, real_ffn, real_mlp
    (h1, m1), (h2, m2) = got[1], got[2]
    excess = (h2 - h1) - (m2 - m1)
    return {"variant": variant, "hbm_per_layer_gb": (h2 - h1) / 1e9, "min_per_layer_gb": (m2 - m1) / 1e9,
            "excess_per_layer_gb": excess / 1e9, "fixed_excess_gb": (h1 - m1 - excess) / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="configs/models/qwen3-8b")
    ap.add_argument("--rows", type=int, default=16, help="rows per chip")
    ap.add_argument("--cache", type=int, default=4096)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    out = []
    for v in VARIANTS:
        r = per_layer(a.target, a.rows, a.cache, a.block, v)
        out.append(r)
        print(f"{v:13s} per layer: HBM {r['hbm_per_layer_gb']:.3f} GB, min {r['min_per_layer_gb']:.3f} GB, "
              f"excess {r['excess_per_layer_gb']:.3f} GB; fixed excess {r['fixed_excess_gb']:.3f} GB", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows_per_chip": a.rows, "cache": a.cache, "block": a.block, "variants": out}, f, indent=1)


if __name__ == "__main__":
    main()
