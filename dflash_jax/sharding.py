"""Tensor- and data-parallel layouts over a ('data', 'model') mesh, in one place: spec rules over
parameter paths and shapes, the divisibility checks, and the mesh. Placing arrays by these rules
(checkpoint shards, KV-head replication) is dflash_jax.weights.

Megatron-style rules (params stacked on a leading layer axis):
  column-parallel (out dim on 'model'): q, k, v (+ biases), gate, up
  row-parallel (in dim on 'model', followed by one psum): o, down
  vocab-parallel: embed [V, H] rows and lm_head [H, V] columns on 'model'
  replicated: norms, q/k norms, o bias, the drafter's fc, routers, Gemma 4's per-layer input (PLE) tables
KV caches: [L, B, KV, S, D] with batch on 'data' and KV heads on 'model'. When the model axis is
larger than the number of KV heads, KV heads are replicated (as serving engines do): each KV head is
repeated model/KV times, which leaves the attention math unchanged.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .cache import KVCache
from .layers import OUT_IN
from .quant import SCALE, in_axis, matrix_ndim

DATA, MODEL = "data", "model"

_COLUMN = {"q", "k", "v", "gate", "up"}
_ROW = {"o", "down"}
_COL_BIAS = {"q_bias", "k_bias", "v_bias", "sinks"}
# expert parallel (MoE): the expert axis (first after the layer axis) on 'model'; the router replicated
_EXPERT = {"e_gate", "e_up", "e_down", "e_gate_bias", "e_up_bias", "e_down_bias"}
# hybrids (dflash_jax.hybrid / gdn): Gated DeltaNet heads on 'model' (key heads and their value heads together),
# the shared expert column / row parallel, its gate and the router replicated
_COLUMN |= {"lin_q", "lin_k", "lin_v", "lin_z", "lin_b", "lin_a", "sh_gate", "sh_up"}
_ROW |= {"lin_out", "sh_down", "conv_q", "conv_k", "conv_v"}  # conv taps [channels, K]: channels on 'model'
_COL_BIAS |= {"dt_bias", "A_log"}


def param_spec(path, kind: str = "target") -> P:
    """PartitionSpec of one parameter from its key path (e.g. ('layers', 'q')). A quantized matrix's scales
    (name + quant.SCALE: the matrix's shape without its input axis) are laid out as the matrix's output axis."""
    name = path[-1]
    if name.endswith(SCALE):
        base = name[:-len(SCALE)]
        spec = tuple(param_spec(tuple(path[:-1]) + (base,), kind))
        lead = 1 if path[0] == "layers" and len(path) == 2 else 0
        nd = lead + matrix_ndim(base)  # the matrix's dims (a replicated P() stays replicated)
        spec = spec + (None,) * (nd - len(spec)) if spec else ()
        return P(*(s for i, s in enumerate(spec) if i != in_axis(base, nd))) if spec else P()
    if path[0] == "layers":
        lead = (None,) if len(path) == 2 else ()  # stacked ('layers', name) vs unrolled ('layers', i, name)
        if name in _COLUMN:  # split the out axis (first of the two for q / k / v, see layers.OUT_IN)
            return P(*lead, MODEL, None) if name in OUT_IN else P(*lead, None, MODEL)
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


def cache_spec(quantized: bool = False):
    """KVCache of partition specs; `quantized`: with the per-token scales [L, B, KV, S] laid out as K / V."""
    kv, sc = P(None, DATA, MODEL, None, None), P(None, DATA, MODEL, None)
    return KVCache(k=kv, v=kv, lengths=P(DATA), k_scale=sc if quantized else None, v_scale=sc if quantized else None)



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


def target_layout(config, mesh):
    """(KV head replication factor, config); validates divisibility. The config keeps the
    checkpoint's true KV head count; replicated heads show only in the param shapes."""
    m = model_axis(mesh)
    dims = {"num_attention_heads": config.num_heads, "vocab_size": config.vocab_size}
    if getattr(config, "num_experts", 0):
        dims["num_experts"] = config.num_experts
    if not getattr(config, "num_experts", 0) or config.has_dense_mlp:
        dims["intermediate_size"] = config.intermediate_size
    if getattr(config, "is_hybrid", False):
        dims["linear_num_key_heads"] = config.gdn.num_k_heads
        if config.shared_expert_size:
            dims["shared_expert_intermediate_size"] = config.shared_expert_size
    if getattr(config, "gemma4", None) is not None:
        kv_replication(config.gemma4.global_kv_heads, m)  # the full layers' KV heads (their own replication)
        dims["intermediate_size"] = config.intermediate_size  # the dense MLP runs beside the experts
    check_divisible("target", dims, m)
    return kv_replication(config.num_kv_heads, m), config


def layer_kv_layout(config, mesh) -> list[tuple[int, int]] | None:
    """Per layer (KV head replication, head size) of a target whose layers differ in KV heads or head size (Gemma 4:
    sliding and full layers); None when every layer shares the config's."""
    g = getattr(config, "gemma4", None)
    if g is None:
        return None
    m = model_axis(mesh)
    rep = {0: kv_replication(g.global_kv_heads, m), 1: kv_replication(config.num_kv_heads, m)}
    return [(rep[1], config.head_dim) if w else (rep[0], g.global_head_dim) for w in config.layer_windows]


def drafter_layout(config, mesh):
    m = model_axis(mesh)
    check_divisible("drafter", {"num_attention_heads": config.num_heads, "intermediate_size": config.intermediate_size}, m)
    return kv_replication(config.num_kv_heads, m), config


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


