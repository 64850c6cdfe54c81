"""Tensor- and data-parallel layouts over a ('data', 'model') mesh, in one place.

Megatron-style rules (params stacked on a leading layer axis):
  column-parallel (out dim on 'model'): q, k, v (+ biases), gate, up
  row-parallel (in dim on 'model', followed by one psum): o, down
  vocab-parallel: embed [V, H] rows and lm_head [H, V] columns on 'model'
  replicated: norms, q/k norms, o bias, the drafter's fc
KV caches: [L, B, KV, S, D] with batch on 'data' and KV heads on 'model'. When the model axis is
larger than the number of KV heads, KV heads are replicated (as serving engines do): each KV head is
repeated model/KV times, which leaves the attention math unchanged.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"

_COLUMN = {"q", "k", "v", "gate", "up"}
_ROW = {"o", "down"}
_COL_BIAS = {"q_bias", "k_bias", "v_bias", "sinks"}
# expert parallel (MoE): the expert axis (first after the layer axis) on 'model'; the router replicated
_EXPERT = {"e_gate", "e_up", "e_down", "e_gate_bias", "e_up_bias", "e_down_bias"}


def param_spec(path, kind: str = "target") -> P:
    """PartitionSpec of one parameter from its key path (e.g. ('layers', 'q'))."""
    name = path[-1]
    if path[0] == "layers":
        lead = (None,) if len(path) == 2 else ()  # stacked ('layers', name) vs unrolled ('layers', i, name)
        if name in _COLUMN:
            return P(*lead, None, MODEL)
        if name in _ROW:
            return P(*lead, MODEL, None)
        if name in _COL_BIAS or name in _EXPERT:
            return P(*lead, MODEL)
        return P()
    if name == "embed":
        return P(MODEL, None)
    if name == "lm_head":
        return P(None, MODEL)
    return P()


def param_specs(params: dict, kind: str = "target") -> dict:
    """The PartitionSpec tree matching a param tree."""
    from .layers import is_unrolled
    out = {k: param_spec((k,), kind) for k in params if k != "layers"}
    if is_unrolled(params["layers"]):
        out["layers"] = tuple({k: param_spec(("layers", i, k), kind) for k in lp} for i, lp in enumerate(params["layers"]))
    else:
        out["layers"] = {k: param_spec(("layers", k), kind) for k in params["layers"]}
    return out


def cache_spec():
    from .model import KVCache
    return KVCache(k=P(None, DATA, MODEL, None, None), v=P(None, DATA, MODEL, None, None), lengths=P(DATA))


def model_axis(mesh) -> int:
    return 1 if mesh is None else mesh.shape[MODEL]


def data_axis(mesh) -> int:
    return 1 if mesh is None else mesh.shape[DATA]


def kv_replication(num_kv_heads: int, model: int) -> int:
    """How many times each KV head is repeated so that KV heads divide the model axis."""
    if num_kv_heads % model == 0:
        return 1
    if model % num_kv_heads == 0:
        return model // num_kv_heads
    raise ValueError(f"num_key_value_heads={num_kv_heads} and model axis {model}: neither divides the other")


def check_divisible(name: str, dims: dict, model: int) -> None:
    bad = {k: v for k, v in dims.items() if v % model}
    if bad:
        raise ValueError(f"{name}: dimension(s) {bad} not divisible by the model axis ({model})")


def _kv_cols(cols: np.ndarray, head_dim: int, rep: int) -> np.ndarray:
    """Columns of the replicated KV projection -> columns of the stored one."""
    return (cols // head_dim) // rep * head_dim + cols % head_dim


def place_param(path, shape, read, dtype, mesh=None, kind="target", kv_rep: int = 1, head_dim: int = 0):
    """Materialise one parameter of (stored) global `shape`.

    `read(index)` returns the numpy slice for `index` (a tuple of slices; None = everything). With
    a mesh, each device's shard is read straight from the checkpoint (memory-mapped), never the
    whole tensor on one device. `kv_rep` > 1 replicates KV heads along the last axis of k/v."""
    dt = jnp.dtype(dtype)
    name = path[-1]
    rep = kv_rep if name in ("k", "v", "k_bias", "v_bias") else 1
    gshape = tuple(shape[:-1]) + (shape[-1] * rep,)
    if mesh is None and rep == 1:
        a = read()
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"parameter {'.'.join(path)}: got shape {a.shape}, expected {shape}")
        return jnp.asarray(a, dtype=dt)

    def read_global(index):
        index = tuple(index) + (slice(None),) * (len(gshape) - len(index))
        if rep == 1:
            return np.asarray(read(index), dtype=dt)
        cols = np.arange(gshape[-1])[index[-1]]
        orig = _kv_cols(cols, head_dim, rep)
        lo, hi = int(orig.min()), int(orig.max()) + 1
        block = read(index[:-1] + (slice(lo, hi),))
        return np.asarray(block[..., orig - lo], dtype=dt)

    if mesh is None:
        return jnp.asarray(read_global(()))
    sharding = NamedSharding(mesh, param_spec(path, kind))
    return jax.make_array_from_callback(gshape, sharding, read_global)


def shard_params(params: dict, mesh: Mesh, kind: str, kv_rep: int, head_dim: int) -> dict:
    """Re-lay an in-memory param tree onto the mesh (KV heads replicated `kv_rep` times)."""
    def one(path, a):
        host = np.asarray(jax.device_get(a))
        return place_param(path, host.shape, lambda idx=None: host if idx is None else host[idx], a.dtype,
                           mesh, kind, kv_rep, head_dim)
    from .layers import is_unrolled
    out = {k: one((k,), v) for k, v in params.items() if k != "layers"}
    if is_unrolled(params["layers"]):
        out["layers"] = tuple({k: one(("layers", i, k), v) for k, v in lp.items()} for i, lp in enumerate(params["layers"]))
    else:
        out["layers"] = {k: one(("layers", k), v) for k, v in params["layers"].items()}
    return out


def target_layout(config, mesh):
    """(KV head replication factor, config); validates divisibility. The config keeps the
    checkpoint's true KV head count; replicated heads show only in the param shapes."""
    m = model_axis(mesh)
    dims = {"num_attention_heads": config.num_heads, "vocab_size": config.vocab_size}
    if getattr(config, "num_experts", 0):
        dims["num_experts"] = config.num_experts
    if not getattr(config, "num_experts", 0) or config.has_dense_mlp:
        dims["intermediate_size"] = config.intermediate_size
    check_divisible("target", dims, m)
    return kv_replication(config.num_kv_heads, m), config


def drafter_layout(config, mesh):
    m = model_axis(mesh)
    check_divisible("drafter", {"num_attention_heads": config.num_heads, "intermediate_size": config.intermediate_size}, m)
    return kv_replication(config.num_kv_heads, m), config


def shard_target(target, mesh: Mesh):
    """Place an in-memory Target on the mesh (tensor-parallel over 'model', replicated over 'data')."""
    if is_sharded_on(target.params, mesh):
        return target
    rep, cfg = target_layout(target.config, mesh)
    return type(target)(params=shard_params(target.params, mesh, "target", rep, target.config.head_dim), config=cfg)


def shard_drafter(drafter, mesh: Mesh):
    if is_sharded_on(drafter.params, mesh):
        return drafter
    rep, cfg = drafter_layout(drafter.config, mesh)
    return type(drafter)(params=shard_params(drafter.params, mesh, "drafter", rep, drafter.config.head_dim), config=cfg)


def unreplicate_kv(params: dict, head_dim: int, num_kv_heads: int) -> dict:
    """Undo KV head replication (for saving a model that was laid out on a mesh)."""
    from .layers import is_unrolled

    def fix(layer):
        layer = dict(layer)
        for name in ("k", "v", "k_bias", "v_bias"):
            if name not in layer:
                continue
            a = layer[name]
            rep = a.shape[-1] // (num_kv_heads * head_dim)
            if rep > 1:
                a = np.asarray(jax.device_get(a))
                a = a.reshape(a.shape[:-1] + (num_kv_heads * rep, head_dim))[..., ::rep, :]
                layer[name] = a.reshape(a.shape[:-2] + (num_kv_heads * head_dim,))
        return layer

    layers = params["layers"]
    return dict(params, layers=tuple(fix(lp) for lp in layers) if is_unrolled(layers) else fix(layers))


def is_sharded_on(params, mesh) -> bool:
    from .layers import first_layer
    leaf = first_layer(params["layers"])["q"]
    sh = getattr(leaf, "sharding", None)
    return isinstance(sh, NamedSharding) and sh.mesh == mesh


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A ('data', 'model') mesh over all devices (all hosts' under jax.distributed).

    `data=None` takes every device not used by the model axis."""
    devs = list(devices if devices is not None else jax.devices())
    if model < 1 or len(devs) % model:
        raise ValueError(f"model axis {model} does not divide the {len(devs)} available devices")
    if data is None:
        data = len(devs) // model
    if data * model != len(devs):
        raise ValueError(f"mesh data={data} x model={model} = {data * model} != {len(devs)} available devices")
    return Mesh(np.asarray(devs).reshape(data, model), (DATA, MODEL))


def put_global(host: np.ndarray, mesh: Mesh, spec: P):
    """A global array from a host array that every process holds in full (multi-host safe)."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])


def fetch(x):
    """Global (possibly multi-host) array -> numpy on every process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def per_device_bytes(config, mesh: Mesh, batch: int, cache_len: int, dtype="bfloat16", kind="target") -> dict:
    """Bytes one device holds for params and KV cache, from the actual shardings of abstract arrays
    (nothing is allocated). Returns totals too, and the replicated (unsharded) param bytes."""
    from . import drafter as drafter_mod
    from . import model as model_mod

    dt = jnp.dtype(dtype)
    shapes = (model_mod if kind == "target" else drafter_mod).param_shapes(config)
    rep, _ = (target_layout if kind == "target" else drafter_layout)(config, mesh)
    flat = [((k,), s) for k, s in shapes.items() if k != "layers"]
    flat += [(("layers", k), s) for k, s in shapes["layers"].items()]
    dev = total = replicated = 0
    for path, shape in flat:
        r = rep if path[-1] in ("k", "v", "k_bias", "v_bias") else 1
        gshape = tuple(shape[:-1]) + (shape[-1] * r,)
        spec = param_spec(path, kind)
        local = NamedSharding(mesh, spec).shard_shape(gshape)
        n_true = int(np.prod(shape)) * dt.itemsize
        total += n_true
        dev += int(np.prod(local)) * dt.itemsize
        if all(a is None for a in spec):
            replicated += n_true
    L = config.num_layers
    kv_shape = (L, batch, config.num_kv_heads * rep, cache_len, config.head_dim)
    kv_local = NamedSharding(mesh, cache_spec().k).shard_shape(kv_shape)
    kv_total = 2 * int(np.prod((L, batch, cache_len, config.num_kv_heads, config.head_dim))) * dt.itemsize
    return {"param_bytes_per_device": dev, "param_bytes_total": total, "param_bytes_replicated": replicated,
            "kv_bytes_per_device": 2 * int(np.prod(kv_local)) * dt.itemsize, "kv_bytes_total": kv_total,
            "kv_replication": rep}


def assemble_params(shapes: dict, names: dict, st, dtype, mesh=None, kind="target", kv_rep=1, head_dim=0,
                    layout="stacked") -> dict:
    """Build a param tree from checkpoint tensors.

    shapes: our param shapes (layers stacked, [in, out] matrices), as `param_shapes(config)` gives;
    names: key path -> {layer index or None: (checkpoint tensor name, transposed?)};
    st: a `SafetensorsDir`. Each tensor (or each device's shard of it) is read from the memory map
    directly; `layout` "unrolled" yields a tuple of per-layer dicts instead of stacked arrays."""
    def tensor(name, tr):
        a = st.get(name) if isinstance(name, str) else name  # or a lazily built tensor (dflash_jax.moe.Lazy)
        return a.T if tr else a

    def read_top(path):
        (name, tr), = names[path].values()
        return lambda index=None: np.asarray(tensor(name, tr)[index] if index is not None else tensor(name, tr))

    def read_stacked(path):
        entries = names[path]

        def read(index=None):
            idx = index or (slice(None),) * len(shapes["layers"][path[-1]])
            n_layers = shapes["layers"][path[-1]][0]
            return np.stack([np.asarray(tensor(*entries[i])[idx[1:]]) for i in range(n_layers)[idx[0]]])
        return read

    def read_layer(path, i):
        name, tr = names[path][i]
        return lambda index=None: np.asarray(tensor(name, tr)[index] if index is not None else tensor(name, tr))

    params = {k: place_param((k,), s, read_top((k,)), dtype, mesh, kind) for k, s in shapes.items() if k != "layers"}
    layers = shapes["layers"]
    if with_layout_name(layout) == "unrolled":
        n = next(iter(layers.values()))[0]
        params["layers"] = tuple(
            {k: place_param(("layers", i, k), s[1:], read_layer(("layers", k), i), dtype, mesh, kind, kv_rep, head_dim)
             for k, s in layers.items()} for i in range(n))
    else:
        params["layers"] = {k: place_param(("layers", k), s, read_stacked(("layers", k)), dtype, mesh, kind, kv_rep,
                                           head_dim) for k, s in layers.items()}
    return params


def with_layout_name(layout: str) -> str:
    from .layers import default_layout, LAYOUTS
    if layout == "auto":
        return default_layout()
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layer layout {layout!r}; use one of {LAYOUTS} or 'auto'")
    return layout
