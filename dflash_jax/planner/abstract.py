"""Abstract models for the planner: ShapeDtypeStructs of params laid out on a mesh as the runtime lays
them out, and the bytes one chip holds of them."""
from __future__ import annotations

from .topology import PlanError


def abstract_params(kind: str, config, mesh, layout: str = "stacked") -> dict:
    """ShapeDtypeStructs of a Target's / Drafter's params, laid out on `mesh` as the runtime does
    (sharding.param_spec; KV heads replicated when the model axis exceeds them)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from .. import drafter as drafter_mod
    from .. import model as model_mod
    from ..sharding import drafter_layout, layer_kv_layout, param_spec, target_layout
    from ..weights import replicated_shape

    shapes = (model_mod if kind == "target" else drafter_mod).param_shapes(config)
    rep, _ = (target_layout if kind == "target" else drafter_layout)(config, mesh)
    per_layer = layer_kv_layout(config, mesh) if kind == "target" else None  # Gemma 4: KV heads per layer kind
    dt = jnp.dtype(config.dtype)

    def sds(path, shape):
        g = replicated_shape(path[-1], shape, rep if per_layer is None or len(path) != 3 else per_layer[path[1]][0])
        return jax.ShapeDtypeStruct(g, dt, sharding=NamedSharding(mesh, param_spec(path, kind)))

    params = {k: sds((k,), s) for k, s in shapes.items() if k != "layers"}
    layers = shapes["layers"]
    if isinstance(layers, tuple):  # per-layer kinds (hybrid and Gemma 4 targets): always one dict per layer
        params["layers"] = tuple({k: sds(("layers", i, k), s) for k, s in lp.items()} for i, lp in enumerate(layers))
    elif layout == "unrolled":
        n = next(iter(layers.values()))[0]
        params["layers"] = tuple({k: sds(("layers", i, k), s[1:]) for k, s in layers.items()} for i in range(n))
    elif layout == "stacked":
        params["layers"] = {k: sds(("layers", k), s) for k, s in layers.items()}
    else:
        raise PlanError(f"unknown layout {layout!r}")
    if getattr(config, "quant", None):  # 1-byte matrices + per-output-channel float32 scales
        from ..quant import SCALE, quantize_params, scale_shape, storage_dtype
        qd = storage_dtype(config.quant)

        def place(path, fn, a):
            scale_path = tuple(path[:-1]) + (path[-1] + SCALE,)
            return (jax.ShapeDtypeStruct(a.shape, qd, sharding=a.sharding),
                    jax.ShapeDtypeStruct(scale_shape(path[-1], a.shape), jnp.float32,
                                         sharding=NamedSharding(mesh, param_spec(scale_path, kind))))
        params = quantize_params(params, config.quant, place)
    return params


def bytes_per_chip(tree) -> int:
    """Bytes one chip holds for a tree of ShapeDtypeStructs with NamedShardings."""
    import jax
    import numpy as np
    total = 0
    for a in jax.tree_util.tree_leaves(tree):
        total += int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
    return total


def local_shape(mesh, spec, shape) -> tuple:
    from jax.sharding import NamedSharding
    return NamedSharding(mesh, spec).shard_shape(tuple(shape))


def with_specs(tree, specs, mesh):
    """Attach NamedShardings (from a matching PartitionSpec tree) to a tree of ShapeDtypeStructs."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    return jax.tree_util.tree_map(
        lambda spec, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)),
        specs, tree, is_leaf=lambda x: isinstance(x, PartitionSpec))

