"""Shared building blocks: RMSNorm, rotary embeddings (default / linear / llama3), SwiGLU.

Conventions: activations are [B, T, ...]; norms, softmax and logits are computed in float32 and
cast back to the activation dtype.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


# The q / k / v projections are stored [out, in] (the checkpoint's own layout), the other matrices
# [in, out]. Measured with the TPU compiler (reports/tpu_plan, Qwen3-8B, v5p): with q and k stored
# [in, out], a verify block of 16 tokens makes the compiler transpose every q and k weight before its
# dot (2.7 GB of copies per cycle, 14% of the cycle's HBM traffic); stored [out, in] there are none,
# and the one-token step is unchanged.
OUT_IN = frozenset({"q", "k", "v"})


def proj(x, w):
    """x [..., in] times a projection stored [out, in] (OUT_IN) -> [..., out]."""
    return jnp.einsum("...i,oi->...o", x, w)


# XLA:CPU multiplies a few rows (2-32: a verify block, a drafter block) by a matrix stored [out, in]
# about 1.5x faster than by one stored [in, out], while a single row (a target-only step) is faster
# [in, out] (measured on the CI machine, YNNPACK dots, fp32: 24 [384, 1024] matrices, 16 rows 17.7 ->
# 10.7 ms, 1 row 4.3 vs 6.0 ms). The speculative decode loop on CPU therefore takes a transposed copy
# of the other matrices once, before its loop (`by_rows`), under the key name + ROWS; `mat` uses
# whichever is there. Stored checkpoints and every other program keep the layout above.
ROWS = ":rows"


def mat(x, p: dict, name: str):
    """x [..., in] times matrix `name` of the param dict `p` -> [..., out], however it is held:
    [out, in] (OUT_IN, or name + ROWS after `by_rows`) or [in, out]."""
    if name in OUT_IN:
        return proj(x, p[name])
    if name + ROWS in p:
        return jnp.einsum("...i,oi->...o", x, p[name + ROWS])
    return x @ p[name]


ROW_NAMES = frozenset({"o", "gate", "up", "down", "lm_head", "fc"})  # the [in, out] matrices `mat` reads
ROWS_MIN_WIDTH = 4  # rows per dot from which the [out, in] copy pays (2 rows: 8.7 vs 7.3 ms above)


def by_rows(p: dict) -> dict:
    """A model's params with every [in, out] matrix (ROW_NAMES) of its top level and of its unrolled
    layers transposed to [out, in], held under name + ROWS (see `mat`); the rest unchanged. Stacked
    layers (a lax.scan over [L, ...] arrays: TPU, training) are returned as they are."""
    def rows(d):
        return {(k + ROWS if k in ROW_NAMES else k): (jnp.swapaxes(v, -1, -2) if k in ROW_NAMES else v)
                for k, v in d.items()}
    out = rows({k: v for k, v in p.items() if k != "layers"})
    if "layers" in p:
        out["layers"] = tuple(rows(lp) for lp in p["layers"]) if is_unrolled(p["layers"]) else p["layers"]
    return out


def heads_axis(name: str) -> int:
    """The axis of a layer param that runs over attention heads (where tensor parallelism splits
    them and KV heads are replicated): the out axis, first of the two for OUT_IN matrices."""
    return -2 if name in OUT_IN else -1


def kv_heads(layer_params, head_dim: int) -> int:
    """KV heads of a layer's k projection (device-local under shard_map)."""
    return layer_params["k"].shape[heads_axis("k")] // head_dim


def rms_norm(x, w, eps: float):
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(F32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, with HF's rope scaling rules."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling:
        s = dict(scaling)
        kind = s.get("rope_type", "default")
        factor = float(s.get("factor", 1.0))
        if kind == "linear":
            inv = inv / factor
        elif kind == "llama3":
            low = float(s.get("low_freq_factor", 1.0))
            high = float(s.get("high_freq_factor", 4.0))
            old_ctx = float(s.get("original_max_position_embeddings", 8192))
            low_wl, high_wl = old_ctx / low, old_ctx / high
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wl, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            inv = np.where(medium, smoothed, scaled)
        elif kind == "yarn":
            inv = _yarn_inv_freq(head_dim, theta, s)
    return inv.astype(np.float32)


def _yarn_inv_freq(dim: int, theta: float, s: dict) -> np.ndarray:
    """YaRN (NTK-by-parts) inverse frequencies, HF's rule: interpolate (divide by `factor`) the low
    frequencies, keep the high ones, a linear ramp between the correction dims of beta_fast/beta_slow."""
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extra = 1.0 - ramp  # weight of the unscaled (extrapolated) frequency
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra


def rope_attention_factor(scaling: tuple | None) -> float:
    """The factor YaRN multiplies cos/sin by (1.0 for every other rope type)."""
    if not scaling:
        return 1.0
    s = dict(scaling)
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(factor, float(s["mscale"])) / mscale(factor, float(s["mscale_all_dim"])))
    return float(mscale(factor))


def rope_cos_sin(positions, inv_freq, scale: float = 1.0):
    """positions [..., T] int -> cos, sin [..., T, D/2] float32 (times `scale`: YaRN's attention factor)."""
    ang = positions.astype(F32)[..., None] * jnp.asarray(inv_freq)
    if scale != 1.0:
        return jnp.cos(ang) * scale, jnp.sin(ang) * scale
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin):
    """x [B, T, H, D]; cos/sin [B, T, D/2] (rotate-half convention, as HF)."""
    d2 = x.shape[-1] // 2
    xf = x.astype(F32)
    x1, x2 = xf[..., :d2], xf[..., d2:]
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def swiglu(x, lp: dict):
    """The SwiGLU MLP of layer params lp (gate, up, down) on x [..., H]."""
    g = mat(x, lp, "gate")
    return mat(jax.nn.silu(g.astype(F32)).astype(x.dtype) * mat(x, lp, "up"), lp, "down")


# ----------------------------------------------------------------------------------------------
# Layer layouts: "stacked" (one dict of [L, ...] arrays, scanned with lax.scan: fast to compile,
# the training layout) or "unrolled" (a tuple of per-layer dicts, a Python loop). XLA:CPU copies a
# layer's weights out of a stacked array before every matmul, which costs a second full read and a
# write of all weights per decode step, so CPU inference prefers the unrolled layout.
# ----------------------------------------------------------------------------------------------
LAYOUTS = ("stacked", "unrolled")


def is_unrolled(layers) -> bool:
    return isinstance(layers, (list, tuple))


def layer_slice(layers, i: int) -> dict:
    """Layer i's params (a view in the unrolled layout, a slice of the stacked one)."""
    return layers[i] if is_unrolled(layers) else {k: v[i] for k, v in layers.items()}


def first_layer(layers) -> dict:
    """Any one layer's params with their leading layer axis removed (for shape queries)."""
    return layers[0] if is_unrolled(layers) else layers


def unstack_layers(layers) -> tuple:
    if is_unrolled(layers):
        return tuple(layers)
    n = len(next(iter(layers.values())))
    return tuple({k: v[i] for k, v in layers.items()} for i in range(n))


def stack_layers(layers) -> dict:
    if not is_unrolled(layers):
        return layers
    return {k: jnp.stack([lp[k] for lp in layers]) for k in layers[0]}


def default_layout() -> str:
    return "unrolled" if jax.default_backend() == "cpu" else "stacked"


def with_layout(layers, layout: str):
    if layout == "auto":
        layout = default_layout()
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layer layout {layout!r}; use one of {LAYOUTS} or 'auto'")
    return unstack_layers(layers) if layout == "unrolled" else stack_layers(layers)


def scan_layers(body, carry, layers, *xs):
    """`lax.scan(body, carry, (layers, *xs))` for stacked layers; a Python loop (static per-layer
    params, xs indexed per layer) for unrolled ones. Returns the final carry (per-layer outputs are
    not collected)."""
    if is_unrolled(layers):
        for i, lp in enumerate(layers):
            carry, _ = body(carry, (lp,) + tuple(x[i] for x in xs))
        return carry
    carry, _ = jax.lax.scan(body, carry, (layers,) + tuple(xs))
    return carry
