"""python -m train.export --config configs/X.yaml [--step N] [--out DIR]: checkpoint -> z-lab drafter."""
import sys

from dflash_jax.cli import run
from dflash_jax.training.cli import main_export

if __name__ == "__main__":
    sys.exit(run(main_export))
