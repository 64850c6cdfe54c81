"""python -m train.generate_data --config configs/X.yaml [overrides]: target-generated training data."""
import sys

from dflash_jax.cli import run
from dflash_jax.training.cli import main_generate

if __name__ == "__main__":
    sys.exit(run(main_generate))  # an interrupted generation says where it stopped (training.cli)
