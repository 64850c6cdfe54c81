"""python -m train.generate_data --config configs/X.yaml [overrides]: target-generated training data."""
import sys

from dflash_jax.training.cli import main_generate

if __name__ == "__main__":
    sys.exit(main_generate())
