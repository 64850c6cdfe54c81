"""Weights: Hugging Face tensor names, checkpoint load / save for targets and drafters, and placing
params on a mesh (KV-head replication included).

- Targets: HF checkpoints (config.json + model.safetensors or a sharded index) read tensor by tensor
  from the memory map; MoE expert tensors through dflash_jax.moe (stacked experts, MXFP4 dequantised).
- Drafters: the z-lab DFlash / DFlash2 format (config.json + model.safetensors, PyTorch [out, in] weights,
  optional `model.` prefix; DFlash2's extra tensor names in dflash_jax.drafter2).
- Placement: with a mesh, each device's shard is read straight from the checkpoint
  (`jax.make_array_from_callback`) in the layout that dflash_jax.sharding's spec rules give.
This module sits above model / drafter / sharding: it imports them, they do not import it.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import gemma4, hybrid, moe
from .config import DrafterConfig, TargetConfig, read_config_json
from .drafter import Drafter, check_compatible, param_shapes as drafter_param_shapes
from .drafter2 import HF_LAYER_NAMES as DFLASH2_LAYER_NAMES, HF_TOP_NAMES as DFLASH2_TOP_NAMES
from .layers import layer_slice, layout_name
from .model import Target, param_shapes as target_param_shapes
from .quant import Fp8Blocks, fp8_block_size, quantize_drafter, quantize_target
from .sharding import cache_spec, drafter_layout, layer_kv_layout, param_spec, target_layout
from .st_io import SafetensorsDir, check_names, save_file


# ----------------------------------------------------------------------------------------------
# Target checkpoints (HF names)
# ----------------------------------------------------------------------------------------------
_LAYER_MAP = {
    "input_norm": ("model.layers.{i}.input_layernorm.weight", False),
    "q": ("model.layers.{i}.self_attn.q_proj.weight", False),  # stored [out, in] like HF (layers.OUT_IN)
    "k": ("model.layers.{i}.self_attn.k_proj.weight", False),
    "v": ("model.layers.{i}.self_attn.v_proj.weight", False),
    "o": ("model.layers.{i}.self_attn.o_proj.weight", True),
    "q_bias": ("model.layers.{i}.self_attn.q_proj.bias", False),
    "k_bias": ("model.layers.{i}.self_attn.k_proj.bias", False),
    "v_bias": ("model.layers.{i}.self_attn.v_proj.bias", False),
    "o_bias": ("model.layers.{i}.self_attn.o_proj.bias", False),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", False),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", False),
    "sinks": ("model.layers.{i}.self_attn.sinks", False),
    "post_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "gate": ("model.layers.{i}.mlp.gate_proj.weight", True),
    "up": ("model.layers.{i}.mlp.up_proj.weight", True),
    "down": ("model.layers.{i}.mlp.down_proj.weight", True),
}


_TOP_MAP = {
    "embed": ("model.embed_tokens.weight", False),
    "norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def target_hf_expected(c: TargetConfig) -> dict[str, tuple[str, object, tuple]]:
    """HF tensor name -> (our key path, layer index or None, expected HF shape)."""
    shapes = target_param_shapes(c)
    out = {}
    for key, shape in shapes.items():
        if key == "layers":
            continue
        name, tr = _TOP_MAP[key]
        out[name] = ((key,), None, tuple(reversed(shape)) if tr else shape)
    for key, shape in shapes["layers"].items():
        if key in moe.EXPERT_KEYS:
            continue
        tmpl, tr = _LAYER_MAP[key]
        per = shape[1:]
        for i in range(c.num_layers):
            if not moe.hf_layer_has(c, key, i):
                continue
            out[tmpl.format(i=i)] = (("layers", key), i, tuple(reversed(per)) if tr else per)
    return out


def _is_transposed(path) -> bool:
    return (_LAYER_MAP if path[0] == "layers" else _TOP_MAP)[path[-1]][1]


def default_dtype(hf_config: dict | None = None) -> str:
    """float32 on CPU (parity with the fp32 references); elsewhere the checkpoint's torch_dtype when it
    is a float type JAX computes in, else bfloat16."""
    if jax.default_backend() == "cpu":
        return "float32"
    want = str((hf_config or {}).get("torch_dtype") or (hf_config or {}).get("dtype") or "").replace("torch.", "")
    return want if want in ("bfloat16", "float16", "float32") else "bfloat16"


def load_target(path: str, dtype: str | None = "auto", mesh=None, layout: str = "auto", quant: str | None = None,
                kv_quant: str | None = None) -> Target:
    """Load an HF checkpoint directory (config.json + model.safetensors or a sharded index); a block-scaled FP8
    checkpoint (quantization_config quant_method "fp8") is dequantized tensor by tensor (dflash_jax.quant).

    quant / kv_quant "int8" / "fp8": weight-only quantization (per-output-channel scales, after placement) / the KV
    cache the target's programs build (quant.quantize_target).
    dtype: parameter / activation dtype; "auto" (or None): `default_dtype` (fp32 on CPU, the
    checkpoint's torch_dtype or bf16 on TPU / GPU).
    `path` may also be a hub id when `huggingface_hub` is installed and the network allows.
    With `mesh`, each tensor is placed directly in its sharded layout (see `dflash_jax.sharding`).
    `layout`: 'stacked' (layers on a leading axis, lax.scan), 'unrolled' (per-layer arrays, a Python
    loop: fastest on CPU) or 'auto' (unrolled on CPU, stacked elsewhere).
    """
    path = resolve_model_path(path)
    hf = read_config_json(path)
    if dtype in (None, "auto"):
        dtype = default_dtype(hf)
    config = TargetConfig.from_hf(hf, dtype=dtype)
    quant_config = dataclasses.replace(config, quant=quant, kv_quant=kv_quant)  # refuses what is not supported
    block = fp8_block_size(hf)
    st = SafetensorsDir(path) if block is None else Fp8Blocks(SafetensorsDir(path), block)
    if config.is_hybrid or config.gemma4 is not None:  # per-layer kinds: their module (hybrid, gemma4) names and
        fam = hybrid if config.is_hybrid else gemma4  # builds the params, each tensor placed as it is read
        if mesh is None:
            return Target(params=fam.load_params(config, st, dtype), config=config)
        (rep, cfg), per_layer = target_layout(config, mesh), layer_kv_layout(config, mesh)
        place = param_placer(mesh, "target", rep, cfg.head_dim, per_layer)
        return Target(params=fam.load_params(config, st, dtype, place), config=cfg)
    expected = target_hf_expected(config)
    names = set(st.keys())
    ignorable = {n for n in names if n.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        ignorable.add("lm_head.weight")
    names_map: dict = {}
    for name, (p, i, _) in expected.items():
        names_map.setdefault(p, {})[i] = (name, _is_transposed(p))
    if config.num_experts:  # expert tensors (stacked per layer, MXFP4 dequantised) and zero fills
        shapes = target_param_shapes(config)["layers"]
        for i in range(config.num_layers):
            src, used = moe.hf_expert_sources(config, st, i) if config.is_sparse(i) else ({}, set())
            ignorable |= used
            for key, shape in shapes.items():
                if key in src:
                    names_map.setdefault(("layers", key), {})[i] = src[key]
                elif not moe.hf_layer_has(config, key, i):  # the other kind of FFN of a mixed model
                    names_map.setdefault(("layers", key), {})[i] = (moe.zeros_source(shape[1:]), False)
    check_names(f"checkpoint {path}", set(expected), names, ignorable)
    for name, (_, _, shape) in expected.items():
        if st.shape(name) != shape:
            raise ValueError(f"tensor {name!r} has shape {st.shape(name)}, expected {shape} from config.json")
    rep, laid_out = target_layout(config, mesh) if mesh is not None else (1, config)
    params = assemble_params(target_param_shapes(config), names_map, st, dtype, mesh, "target", rep, config.head_dim, layout)
    return quantize_target(Target(params=params, config=laid_out), quant_config.quant, quant_config.kv_quant)


def save_target(target: Target, path: str, extra_config: dict | None = None) -> None:
    """Write an HF-format directory (config.json + model.safetensors) that `transformers` loads."""
    if target.config.quant:
        raise ValueError("save_target writes unquantized checkpoints: save the target before quantizing it")
    os.makedirs(path, exist_ok=True)
    config = target.config
    if config.is_hybrid or config.gemma4 is not None:
        fam = hybrid if config.is_hybrid else gemma4
        save_file(fam.hf_tensors(config, target.params), os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**config.to_hf(), **(extra_config or {})}, f, indent=2)
        return
    params = unreplicate_kv(target.params, config.head_dim, config.num_kv_heads)
    tensors = {}
    for name, (p, i, _) in target_hf_expected(config).items():
        a = params[p[0]] if i is None else layer_slice(params["layers"], i)[p[1]]
        a = np.asarray(jax.device_get(a))
        tensors[name] = np.ascontiguousarray(a.T if _is_transposed(p) else a)
    for i in range(config.num_layers):
        if config.is_sparse(i):
            lp = {k: np.asarray(jax.device_get(v)) for k, v in layer_slice(params["layers"], i).items()
                  if k in moe.EXPERT_KEYS}
            tensors.update({k: np.ascontiguousarray(v) for k, v in moe.hf_expert_tensors(config, lp, i).items()})
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_hf()
    cfg.update(extra_config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def resolve_model_path(path: str) -> str:
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"{path} is a file; expected a model directory")
    if path.count("/") == 1 and not path.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise FileNotFoundError(f"{path} is not a local directory and huggingface_hub is not installed") from None
        try:
            return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        except Exception as e:  # offline, gated, missing
            raise FileNotFoundError(f"{path} is not a local directory and could not be downloaded: {e}") from None
    raise FileNotFoundError(f"model directory {path} does not exist")


# ----------------------------------------------------------------------------------------------
# Drafter checkpoints (z-lab format)
# ----------------------------------------------------------------------------------------------
_DRAFTER_LAYER_MAP = {
    "input_norm": ("layers.{i}.input_layernorm.weight", False),
    "q": ("layers.{i}.self_attn.q_proj.weight", False),  # [out, in] (layers.OUT_IN)
    "k": ("layers.{i}.self_attn.k_proj.weight", False),
    "v": ("layers.{i}.self_attn.v_proj.weight", False),
    "o": ("layers.{i}.self_attn.o_proj.weight", True),
    "q_norm": ("layers.{i}.self_attn.q_norm.weight", False),
    "k_norm": ("layers.{i}.self_attn.k_norm.weight", False),
    "post_norm": ("layers.{i}.post_attention_layernorm.weight", False),
    "gate": ("layers.{i}.mlp.gate_proj.weight", True),
    "up": ("layers.{i}.mlp.up_proj.weight", True),
    "down": ("layers.{i}.mlp.down_proj.weight", True),
}

_DRAFTER_BIAS_MAP = {
    "q_bias": ("layers.{i}.self_attn.q_proj.bias", False),
    "k_bias": ("layers.{i}.self_attn.k_proj.bias", False),
    "v_bias": ("layers.{i}.self_attn.v_proj.bias", False),
    "o_bias": ("layers.{i}.self_attn.o_proj.bias", False),
}

_DRAFTER_TOP_MAP = {"fc": ("fc.weight", True), "hidden_norm": ("hidden_norm.weight", False), "norm": ("norm.weight", False)}


def drafter_hf_expected(c: DrafterConfig) -> dict:
    shapes = drafter_param_shapes(c)
    out = {}
    two = c.is_dflash2
    for key, (name, tr) in {**_DRAFTER_TOP_MAP, **(DFLASH2_TOP_NAMES if two else {})}.items():
        out[name] = ((key,), None, tuple(reversed(shapes[key])) if tr else shapes[key], tr)
    for key, (tmpl, tr) in {**_DRAFTER_LAYER_MAP, **(_DRAFTER_BIAS_MAP if c.attention_bias else {}),
                            **(DFLASH2_LAYER_NAMES if two else {})}.items():
        s = shapes["layers"][key][1:]
        for i in range(c.num_layers):
            out[tmpl.format(i=i)] = (("layers", key), i, tuple(reversed(s)) if tr else s, tr)
    return out


def load_drafter(path: str, target: Target, dtype=None, mesh=None, layout: str = "auto", quant=None) -> Drafter:
    """Read a z-lab DFlash or DFlash2 drafter directory (config.json + model.safetensors; optional `model.` prefix).
    `layout` as for `load_target`; `quant` "int8" / "fp8": 1-byte matrices (quant.quantize_drafter)."""
    path = resolve_model_path(path)
    dtype = dtype or target.config.dtype
    cfg = DrafterConfig.from_hf(read_config_json(path), dtype=dtype)
    check_compatible(cfg, target)
    st = SafetensorsDir(path)
    names = set(st.keys())
    prefix = "model." if names and all(n.startswith("model.") for n in names if not n.startswith("lm_head")) \
        and "fc.weight" not in names else ""
    expected = drafter_hf_expected(cfg)
    ignorable = {n for n in names if n.endswith("rotary_emb.inv_freq") or n in ("lm_head.weight", prefix + "embed_tokens.weight")}
    check_names(f"drafter checkpoint {path}", {prefix + k for k in expected}, names, ignorable)
    for name, (_, _, shape, _) in expected.items():
        if st.shape(prefix + name) != shape:
            raise ValueError(f"drafter tensor {prefix + name!r} has shape {st.shape(prefix + name)}, expected {shape}")
    rep, laid_out = drafter_layout(cfg, mesh) if mesh is not None else (1, cfg)
    names: dict = {}
    for name, (p, i, _, tr) in expected.items():
        names.setdefault(p, {})[i] = (prefix + name, tr)
    params = assemble_params(drafter_param_shapes(cfg), names, st, dtype, mesh, "drafter", rep, cfg.head_dim, layout)
    return quantize_drafter(Drafter(params=params, config=laid_out), quant)


def save_drafter(drafter: Drafter, path: str, dtype: str | None = None) -> None:
    """Write the z-lab format: config.json + model.safetensors with PyTorch [out, in] weights."""
    cfg = drafter.config
    if cfg.quant:  # as save_target
        raise ValueError("save_drafter writes unquantized checkpoints: save the drafter before quantizing it")
    os.makedirs(path, exist_ok=True)
    out_dt = jnp.dtype(dtype) if dtype else None
    params = unreplicate_kv(drafter.params, cfg.head_dim, cfg.num_kv_heads)
    tensors = {}
    for name, (p, i, _, tr) in drafter_hf_expected(cfg).items():
        a = params[p[0]] if i is None else layer_slice(params["layers"], i)[p[1]]
        a = jax.device_get(a)
        a = np.asarray(a.astype(out_dt) if out_dt is not None else a)
        tensors[name] = np.ascontiguousarray(a.T if tr else a)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf()
    if dtype:
        hf["torch_dtype"] = str(jnp.dtype(dtype))
    tmp = os.path.join(path, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(hf, f, indent=2)
    os.replace(tmp, os.path.join(path, "config.json"))


# ----------------------------------------------------------------------------------------------
# Placing params on a mesh
# ----------------------------------------------------------------------------------------------
KV_REPLICATED = ("k", "v", "k_bias", "v_bias")  # replicated over the heads axis when TP > KV heads


def replicated_shape(name: str, shape, rep: int) -> tuple:
    """The global shape of a layer param whose KV heads are replicated `rep` times."""
    from .layers import heads_axis
    if rep == 1 or name not in KV_REPLICATED:
        return tuple(shape)
    ax = len(shape) + heads_axis(name)
    return tuple(shape[:ax]) + (shape[ax] * rep,) + tuple(shape[ax + 1:])


def _kv_cols(cols: np.ndarray, head_dim: int, rep: int) -> np.ndarray:
    """Columns of the replicated KV projection -> columns of the stored one."""
    return (cols // head_dim) // rep * head_dim + cols % head_dim


def place_param(path, shape, read, dtype, mesh=None, kind="target", kv_rep: int = 1, head_dim: int = 0):
    """Materialise one parameter of (stored) global `shape`.

    `read(index)` returns the numpy slice for `index` (a tuple of slices; None = everything). With
    a mesh, each device's shard is read straight from the checkpoint (memory-mapped), never the
    whole tensor on one device. `kv_rep` > 1 replicates KV heads along the heads axis of k/v
    (layers.heads_axis)."""
    from .layers import heads_axis
    dt = jnp.dtype(dtype)
    name = path[-1]
    rep = kv_rep if name in KV_REPLICATED else 1
    ax = len(shape) + heads_axis(name)
    gshape = replicated_shape(name, shape, rep)
    if mesh is None and rep == 1:
        a = read()
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"parameter {'.'.join(path)}: got shape {a.shape}, expected {shape}")
        return jnp.asarray(a, dtype=dt)

    def read_global(index):
        index = tuple(index) + (slice(None),) * (len(gshape) - len(index))
        if rep == 1:
            return np.asarray(read(index), dtype=dt)
        cols = np.arange(gshape[ax])[index[ax]]
        orig = _kv_cols(cols, head_dim, rep)
        lo, hi = int(orig.min()), int(orig.max()) + 1
        block = read(index[:ax] + (slice(lo, hi),) + index[ax + 1:])
        return np.asarray(np.take(block, orig - lo, axis=ax), dtype=dt)

    if mesh is None:
        return jnp.asarray(read_global(()))
    sharding = NamedSharding(mesh, param_spec(path, kind))
    return jax.make_array_from_callback(gshape, sharding, read_global)


def param_placer(mesh: Mesh, kind: str, kv_rep: int, head_dim: int, per_layer=None):
    """place(path, host array, dtype) -> the param on the mesh (KV heads replicated `kv_rep` times; `per_layer`:
    (replication, head size) per layer of an unrolled tree whose layers differ in them)."""
    def place(path, host, dtype):
        rep, hd = (kv_rep, head_dim) if per_layer is None or len(path) != 3 else per_layer[path[1]]
        return place_param(path, host.shape, lambda idx=None: host if idx is None else host[idx], dtype, mesh, kind,
                           rep, hd)
    return place


def shard_params(params: dict, mesh: Mesh, kind: str, kv_rep: int, head_dim: int, per_layer=None) -> dict:
    """Re-lay an in-memory param tree onto the mesh (`param_placer`)."""
    place = param_placer(mesh, kind, kv_rep, head_dim, per_layer)
    one = lambda path, a: place(path, np.asarray(jax.device_get(a)), a.dtype)  # noqa: E731
    from .layers import is_unrolled
    out = {k: one((k,), v) for k, v in params.items() if k != "layers"}
    if is_unrolled(params["layers"]):
        out["layers"] = tuple({k: one(("layers", i, k), v) for k, v in lp.items()} for i, lp in enumerate(params["layers"]))
    else:
        out["layers"] = {k: one(("layers", k), v) for k, v in params["layers"].items()}
    return out


def shard_target(target, mesh: Mesh):
    """Place an in-memory Target on the mesh (tensor-parallel over 'model', replicated over 'data')."""
    if is_sharded_on(target.params, mesh):
        return target
    (rep, cfg), per_layer = target_layout(target.config, mesh), layer_kv_layout(target.config, mesh)
    return type(target)(params=shard_params(target.params, mesh, "target", rep, cfg.head_dim, per_layer), config=cfg)


def shard_drafter(drafter, mesh: Mesh):
    if is_sharded_on(drafter.params, mesh):
        return drafter
    rep, cfg = drafter_layout(drafter.config, mesh)
    return type(drafter)(params=shard_params(drafter.params, mesh, "drafter", rep, drafter.config.head_dim), config=cfg)


def unreplicate_kv(params: dict, head_dim: int, num_kv_heads: int) -> dict:
    """Undo KV head replication (for saving a model that was laid out on a mesh)."""
    from .layers import heads_axis, is_unrolled

    def fix(layer):
        layer = dict(layer)
        for name in KV_REPLICATED:
            if name not in layer:
                continue
            a = layer[name]
            ax = a.ndim + heads_axis(name)
            rep = a.shape[ax] // (num_kv_heads * head_dim)
            if rep > 1:
                a = np.asarray(jax.device_get(a))
                a = a.reshape(a.shape[:ax] + (num_kv_heads, rep, head_dim) + a.shape[ax + 1:])
                layer[name] = np.take(a, 0, axis=ax + 1).reshape(
                    a.shape[:ax] + (num_kv_heads * head_dim,) + a.shape[ax + 3:])
        return layer

    layers = params["layers"]
    return dict(params, layers=tuple(fix(lp) for lp in layers) if is_unrolled(layers) else fix(layers))


def is_sharded_on(params, mesh) -> bool:
    from .layers import first_layer
    layer = first_layer(params["layers"])
    leaf = params["embed"] if "embed" in params else layer["q"]  # a drafter has no embedding of its own
    sh = getattr(leaf, "sharding", None)
    return isinstance(sh, NamedSharding) and sh.mesh == mesh


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
    dt = jnp.dtype(dtype)
    shapes = (target_param_shapes if kind == "target" else drafter_param_shapes)(config)
    rep, _ = (target_layout if kind == "target" else drafter_layout)(config, mesh)
    flat = [((k,), s) for k, s in shapes.items() if k != "layers"]
    flat += [(("layers", k), s) for k, s in shapes["layers"].items()]
    dev = total = replicated = 0
    for path, shape in flat:
        gshape = replicated_shape(path[-1], shape, rep)
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

    shapes: our param shapes (layers stacked; q / k / v [out, in], other matrices [in, out]), as `param_shapes(config)` gives;
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
    if layout_name(layout) == "unrolled":
        n = next(iter(layers.values()))[0]
        params["layers"] = tuple(
            {k: place_param(("layers", i, k), s[1:], read_layer(("layers", k), i), dtype, mesh, kind, kv_rep, head_dim)
             for k, s in layers.items()} for i in range(n))
    else:
        params["layers"] = {k: place_param(("layers", k), s, read_stacked(("layers", k)), dtype, mesh, kind, kv_rep,
                                           head_dim) for k, s in layers.items()}
    return params

