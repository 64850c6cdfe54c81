"""Per-device parameter and KV-cache bytes of a Qwen3-8B-shaped target under model axis 1/2/4/8.

Computed from the real shardings of abstract arrays (no allocation), on 8 fake CPU devices.
    python -m infer.bench_sharding [--batch 8] [--cache-len 4096]
"""
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402

from dflash_jax.config import TargetConfig  # noqa: E402
from dflash_jax.drafter import drafter_config_for  # noqa: E402
from dflash_jax.model import Target  # noqa: E402
from dflash_jax.sharding import make_mesh  # noqa: E402
from dflash_jax.weights import per_device_bytes  # noqa: E402

QWEN3_8B = dict(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6, dtype="bfloat16")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m infer.bench_sharding", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cache-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    cfg = TargetConfig(**dict(QWEN3_8B, dtype=args.dtype))
    dcfg = drafter_config_for(Target(params={}, config=cfg), num_layers=5, block_size=16, mask_token_id=151669)
    gib = 1024 ** 3
    print(f"Qwen3-8B-shaped target + 5-layer drafter, {args.dtype}, batch {args.batch}, cache {args.cache_len}")
    hdr = (f"{'model':>5} | {'target params/dev':>17} | {'(total-repl)/m+repl':>19} | {'KV/dev':>8} | {'KV/(d*m)':>8}"
           f" | {'drafter params/dev':>18} | ok")
    print(hdr)
    print("-" * len(hdr))
    all_ok = True
    for m in (1, 2, 4, 8):
        mesh = make_mesh(data=8 // m, model=m)
        t = per_device_bytes(cfg, mesh, args.batch, args.cache_len, args.dtype)
        d = per_device_bytes(dcfg, mesh, args.batch, args.cache_len, args.dtype, kind="drafter")
        expect = (t["param_bytes_total"] - t["param_bytes_replicated"]) / m + t["param_bytes_replicated"]
        # batch is split over 'data' (8/m) and KV heads over 'model' (m): KV/dev = total / 8
        kv_expect = t["kv_bytes_total"] / (8 // m) / m
        ok = abs(t["param_bytes_per_device"] - expect) < 1 and abs(t["kv_bytes_per_device"] - kv_expect) < 1
        all_ok &= ok
        print(f"{m:>5} | {t['param_bytes_per_device'] / gib:>13.3f} GiB | {expect / gib:>15.3f} GiB |"
              f" {t['kv_bytes_per_device'] / gib:>4.2f} GiB | {kv_expect / gib:>4.2f} GiB |"
              f" {d['param_bytes_per_device'] / gib:>14.3f} GiB | {'yes' if ok else 'NO'}")
    print(f"KV cache total {t['kv_bytes_total'] / gib:.2f} GiB: batch split over data (8/m), KV heads over model (m)")
    print(f"replicated target params (norms): {t['param_bytes_replicated'] / 1024 ** 2:.2f} MiB; "
          f"per-device bytes equal total/model-axis for every sharded tensor: {all_ok}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    from dflash_jax.cli import run
    raise SystemExit(run(main))
