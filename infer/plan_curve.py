"""python -m infer.plan_curve: the concurrency curve of a target on a TPU slice, from the TPU compiler (no TPU).

    python -m infer.plan_curve --target configs/models/qwen3-8b --tpu v5p-8 --out reports/tpu_plan/concurrency

Per cache length and rows per chip (1 ... the largest that fits): the target-only step's roofline time and
cycle / step (= break-even tau) for chains and trees (dflash_jax.concurrency); writes curve.json, curve.md
and curve.png to --out. Each point is kept in --out/curve.partial.json as it is made: run the same command again
after an interruption and it goes on from there. Needs libtpu (pip install "dflash-jax[plan]").
"""
from __future__ import annotations

import argparse
import sys


def ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.plan_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="configs/models/qwen3-8b", help="target config.json (or its directory)")
    p.add_argument("--drafter", help="drafter config.json (or its directory); default: --drafter-layers, block 16")
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--tpu", default="v5p-8")
    p.add_argument("--rows", type=ints, default=(1, 4, 16, 32, 64, 128), help="rows per chip, comma list")
    p.add_argument("--caches", type=ints, default=(4096, 32768), help="cache lengths, comma list")
    p.add_argument("--blocks", type=ints, default=(4, 8, 16))
    p.add_argument("--trees", type=ints, default=(16, 64))
    p.add_argument("--no-largest", action="store_true", help="skip the largest-batch search per cache")
    p.add_argument("--cost-method", choices=("full", "layers"), default="full")
    p.add_argument("--out", default="reports/tpu_plan/concurrency")
    a = p.parse_args(argv)
    from dflash_jax import concurrency, planner
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        previous = concurrency.read_partial(a.out)
        if previous:
            say(f"resuming from {a.out}/{concurrency.PARTIAL} ({len(previous.get('points', []))} points made)")
        res = concurrency.curve(a.target, a.tpu, rows_per_chip=a.rows, caches=a.caches, blocks=a.blocks,
                                trees=a.trees, drafter=a.drafter, drafter_layers=a.drafter_layers,
                                largest=not a.no_largest, cost_method=a.cost_method, log=say, previous=previous,
                                on_point=lambda r: concurrency.write_partial(r, a.out))
    except (planner.PlanError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the points made so far are in {a.out}/{concurrency.PARTIAL}; the same command "
              "goes on from there", file=sys.stderr)
        return 130
    print(concurrency.markdown(res))
    paths = concurrency.write(res, a.out)
    print("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
