"""Quantized targets: weight-only int8 / fp8 with per-output-channel scales, and int8 / fp8 KV caches with
per-token, per-head scales (plain JAX; docs/design.md "Quantized targets" says why not a library).

Weights. A quantized matrix `name` of a param dict holds its int8 (or float8_e4m3fn) values in the matrix's own
layout and shape, and a float32 scale per output channel under `name + SCALE` (the matrix's shape without its
input axis: [out], [L, out] for stacked layers, [E, out] per expert of a MoE layer). `layers.mat` multiplies by the values converted to the
activation dtype and scales the product, `(x @ w.astype(dtype)) * scale`, so the device reads the 1-byte values
from memory. The matrices quantized are MATRICES (attention, MLP, LM head); embeddings, norms and biases stay in
the compute dtype, and the drafter is never quantized.

KV cache. `quantize_kv` turns new K or V rows [..., D] into 1-byte values and a float32 scale per token and head
(the amax over D); the cache holds the scales [L, B, KV, S] beside the values (dflash_jax.cache.KVCache) and every
attention path multiplies them back in (dflash_jax.attention, dflash_jax.kernels).

Pre-quantized FP8 checkpoints (the hub layout: float8_e4m3fn weights with `weight_scale_inv` block scales
[ceil(out / 128), ceil(in / 128)], config.json's quantization_config {"quant_method": "fp8", "weight_block_size":
[128, 128]}) are dequantized tensor by tensor at load (`dequant_blocks`), then kept in the compute dtype or
requantized per output channel.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("int8", "fp8")
SCALE = ":scale"  # the key suffix of a quantized matrix's per-output-channel scales
EXPERT_MATRICES = frozenset({"e_gate", "e_up", "e_down"})  # MoE experts, [E, in, out] (dflash_jax.moe)
MATRICES = frozenset({"q", "k", "v", "o", "gate", "up", "down", "lm_head", "fc"}) | EXPERT_MATRICES  # fc: a drafter's
OUT_IN = frozenset({"q", "k", "v"})  # stored [out, in] (layers.OUT_IN); the others [in, out]
F32 = jnp.float32


def storage_dtype(mode: str):
    """The 1-byte dtype of a quantization mode."""
    check_mode(mode, "quant")
    return jnp.dtype(jnp.int8) if mode == "int8" else jnp.dtype(jnp.float8_e4m3fn)


def qmax(mode: str) -> float:
    """The largest magnitude a mode stores: 127 (int8), 448 (float8_e4m3fn)."""
    return 127.0 if mode == "int8" else float(jnp.finfo(jnp.float8_e4m3fn).max)


def check_mode(mode, what: str = "quant") -> None:
    if mode not in MODES:
        raise ValueError(f"{what} must be one of {MODES} (or None), got {mode!r}")


def matrix_ndim(name: str) -> int:
    """Dims of matrix `name` without a layer axis: 3 for the stacked experts [E, in, out], else 2."""
    return 3 if name in EXPERT_MATRICES else 2


def in_axis(name: str, ndim: int) -> int:
    """The input (contracted) axis of matrix `name` with `ndim` dims: the last for [out, in] (OUT_IN), else the
    one before it."""
    return ndim - 1 if name in OUT_IN else ndim - 2


def scale_shape(name: str, shape) -> tuple:
    """The scales' shape of matrix `name` of `shape`: the shape without its input axis."""
    ax = in_axis(name, len(shape))
    return tuple(s for i, s in enumerate(shape) if i != ax)


def _cast(x, mode: str):
    x = jnp.clip(x, -qmax(mode), qmax(mode))
    return jnp.round(x).astype(jnp.int8) if mode == "int8" else x.astype(jnp.float8_e4m3fn)


def quantize_matrix(w, name: str, mode: str):
    """w (any float dtype, the layout of `name`) -> (1-byte values of w's shape, float32 scales `scale_shape`)
    with w ~= values * scales broadcast over the input axis; an all-zero channel gets scale 1."""
    ax = in_axis(name, w.ndim)
    wf = w.astype(F32)
    amax = jnp.max(jnp.abs(wf), axis=ax, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax(mode), 1.0)
    return _cast(wf / scale, mode), jnp.squeeze(scale, ax)


def dequantize_matrix(values, scale, name: str, dtype=F32):
    """values * scales (broadcast over the input axis of `name`) in `dtype`."""
    return (values.astype(F32) * jnp.expand_dims(scale, in_axis(name, values.ndim))).astype(dtype)


def quantize_kv(x, mode: str):
    """New K or V rows x [..., KV, D] -> (1-byte values [..., KV, D], float32 scales [..., KV]): one scale per
    token and head, amax / qmax (1 for an all-zero row)."""
    xf = x.astype(F32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / qmax(mode), 1.0)
    return _cast(xf / scale[..., None], mode), scale


def dequantize_kv(values, scale, dtype):
    """values [..., S, D] times scales [..., S] in `dtype`."""
    return (values.astype(F32) * scale[..., None]).astype(dtype)


def quantize_params(params: dict, mode: str, place=None) -> dict:
    """A target's param tree (stacked or unrolled layers) with every matrix of MATRICES quantized: values under
    the matrix's name, scales under name + SCALE. `place(path, fn, array)` may run the quantization itself (e.g. a
    jit with output shardings); default: `fn(array)`. Already quantized params are returned as they are."""
    check_mode(mode)
    place = place or (lambda path, fn, a: fn(a))

    def one(d: dict, prefix: tuple) -> dict:
        out = {}
        for k, a in d.items():
            if k in MATRICES and k + SCALE not in d:
                out[k], out[k + SCALE] = place(prefix + (k,), lambda w, k=k: quantize_matrix(w, k, mode), a)
            else:
                out[k] = a
        return out

    top = one({k: v for k, v in params.items() if k != "layers"}, ())
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        top["layers"] = tuple(one(lp, ("layers", i)) for i, lp in enumerate(layers))
    else:
        top["layers"] = one(layers, ("layers",))
    return top


def is_quantized(params: dict) -> bool:
    layers = params["layers"]
    lp = layers[0] if isinstance(layers, (list, tuple)) else layers
    return any(k.endswith(SCALE) for k in lp)


# ----------------------------------------------------------------------------------------------
# Pre-quantized FP8 checkpoints (block scales)
# ----------------------------------------------------------------------------------------------
SCALE_INV = "_scale_inv"  # "<name>.weight_scale_inv" beside "<name>.weight"


def fp8_block_size(hf_config: dict) -> tuple[int, int] | None:
    """(out, in) block of a config.json's fp8 quantization_config; None for an unquantized checkpoint. Other
    quantization methods are refused with a one-line error."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config quant_method {method!r} is not supported (only 'fp8' block scales)")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", None):
        raise ValueError(f"fp8 activation_scheme {qc.get('activation_scheme')!r} is not supported (only 'dynamic')")
    bs = qc.get("weight_block_size") or [128, 128]
    if len(bs) != 2 or min(bs) < 1:
        raise ValueError(f"fp8 weight_block_size must be two positive ints, got {bs!r}")
    return int(bs[0]), int(bs[1])


def dequant_blocks(w, scale_inv, block: tuple[int, int]) -> np.ndarray:
    """An [out, in] fp8 tensor times its block scales [ceil(out / bo), ceil(in / bi)] -> float32 [out, in]."""
    w = np.asarray(w)
    s = np.asarray(scale_inv, np.float32)
    bo, bi = block
    out, inn = w.shape
    want = (-(-out // bo), -(-inn // bi))
    if s.shape != want:
        raise ValueError(f"weight_scale_inv has shape {s.shape}, expected {want} for a [{out}, {inn}] weight in "
                         f"{bo}x{bi} blocks")
    full = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:out, :inn]
    return w.astype(np.float32) * full


def quant_blocks(w, block: tuple[int, int] = (128, 128)):
    """float32 [out, in] -> (float8_e4m3fn values, float32 block scales [ceil(out / bo), ceil(in / bi)]): the
    hub layout, for building test checkpoints."""
    import ml_dtypes
    w = np.asarray(w, np.float32)
    bo, bi = block
    out, inn = w.shape
    no, ni = -(-out // bo), -(-inn // bi)
    pad = np.zeros((no * bo, ni * bi), np.float32)
    pad[:out, :inn] = w
    amax = np.abs(pad.reshape(no, bo, ni, bi)).max(axis=(1, 3))
    s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:out, :inn]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), s


class Fp8Blocks:
    """A checkpoint's tensors (a st_io.SafetensorsDir) with each fp8 "<name>" that has a "<name>_scale_inv" beside it
    read as float32 (`dequant_blocks`) and the scale tensors hidden: what the loaders see of a block-scaled FP8
    checkpoint. Each `get` dequantizes the whole tensor."""

    def __init__(self, st, block: tuple[int, int]):
        self.st, self.block = st, block
        self.path = getattr(st, "path", None)
        names = set(st.keys())
        self._scaled = {n for n in names if n + SCALE_INV in names}
        self._keys = [n for n in st.keys() if not (n.endswith(SCALE_INV) and n[:-len(SCALE_INV)] in names)]

    def keys(self):
        return self._keys

    def __contains__(self, name):
        return name in self._keys

    def shape(self, name: str) -> tuple[int, ...]:
        return self.st.shape(name)

    def get(self, name: str) -> np.ndarray:
        if name in self._scaled:
            return dequant_blocks(self.st.get(name), self.st.get(name + SCALE_INV), self.block)
        return self.st.get(name)


def placed_quantizer():
    """`place` for quantize_params: each matrix quantized by a jit whose outputs keep the matrix's sharding on a mesh
    (the scales laid out as the matrix's output axis); arrays on one device by a plain jit."""
    from jax.sharding import NamedSharding, PartitionSpec

    def place(path, fn, a):
        sh = getattr(a, "sharding", None)
        if not isinstance(sh, NamedSharding):
            return jax.jit(fn)(a)
        spec = tuple(sh.spec) + (None,) * (a.ndim - len(tuple(sh.spec)))
        ax = in_axis(path[-1], a.ndim)
        scale_sh = NamedSharding(sh.mesh, PartitionSpec(*(s for i, s in enumerate(spec) if i != ax)))
        return jax.jit(fn, out_shardings=(sh, scale_sh))(a)
    return place


def quantize_target(target, quant: str | None = None, kv_quant: str | None = None):
    """The target (a model.Target, on one device or a mesh) with its matrices quantized (`quant` "int8" / "fp8":
    per-output-channel scales, laid out on the mesh as the matrix's output axis) and its config asking for a
    quantized KV cache (`kv_quant`). None leaves either as it is; a matrix already quantized stays so. Dense
    targets only: others get a one-line error from TargetConfig."""
    import dataclasses
    if quant and target.config.quant and quant != target.config.quant:
        raise ValueError(f"the target's weights are already quantized to {target.config.quant}, not {quant}")
    config = dataclasses.replace(target.config, quant=quant or target.config.quant,
                                 kv_quant=kv_quant or target.config.kv_quant)
    if not quant or quant == target.config.quant and is_quantized(target.params):
        return target.replace(config=config)
    return target.replace(params=quantize_params(target.params, quant, placed_quantizer()), config=config)


def quantize_drafter(drafter, quant: str | None = None):
    """The drafter (drafter.Drafter) with its matrices (fc, q / k / v / o, the MLP) quantized like a target's
    (`quant` "int8" / "fp8", per-output-channel scales); None leaves it as it is. Only drafts change: speculative
    decoding stays lossless, and the cycle reads half the drafter's bytes (or a quarter from float32)."""
    import dataclasses
    if not quant:
        return drafter
    if drafter.config.quant and quant != drafter.config.quant:
        raise ValueError(f"the drafter's weights are already quantized to {drafter.config.quant}, not {quant}")
    config = dataclasses.replace(drafter.config, quant=quant)
    if is_quantized(drafter.params):
        return drafter.replace(config=config)
    return drafter.replace(params=quantize_params(drafter.params, quant, placed_quantizer()), config=config)


def tree_bytes(tree) -> int:
    """Bytes of a tree of arrays (or ShapeDtypeStructs)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree))
