"""Placement of parameters on devices (single device now; mesh layouts in one place)."""
from __future__ import annotations

import jax.numpy as jnp


def place_param(path, shape, read, dtype, mesh=None, kind="target"):
    """Materialise one parameter. `read(index)` returns the numpy slice for `index` (None = all)."""
    if mesh is not None:
        raise NotImplementedError("sharded loading (mesh=...) is not implemented yet")
    a = read()
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"parameter {'.'.join(path)}: got shape {a.shape}, expected {shape}")
    return jnp.asarray(a, dtype=jnp.dtype(dtype))
