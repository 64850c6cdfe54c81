"""python -m train --config configs/X.yaml [section.key=value ...]: generate data, train, export."""
import sys

from dflash_jax.cli import run
from dflash_jax.training.cli import main_all

if __name__ == "__main__":
    sys.exit(run(main_all))  # an interrupted pipeline says where it stopped (training.cli)
