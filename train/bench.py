"""python -m train.bench data|train: pipeline benchmarks (see dflash_jax/bench/training.py)."""
import sys

from dflash_jax.cli import run
from dflash_jax.bench.training import main

if __name__ == "__main__":
    sys.exit(run(main))
