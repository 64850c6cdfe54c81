"""python -m train.bench data|train: pipeline benchmarks (see dflash_jax/training/bench.py)."""
import sys

from dflash_jax.cli import run
from dflash_jax.training.bench import main

if __name__ == "__main__":
    sys.exit(run(main))
