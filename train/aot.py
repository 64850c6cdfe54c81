"""python -m train.aot: AOT-compile the training step for a TPU topology (see dflash_jax/training/aot.py)."""
import sys

from dflash_jax.training.aot import main

if __name__ == "__main__":
    sys.exit(main())
