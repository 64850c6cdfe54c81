"""Shared building blocks: RMSNorm, rotary embeddings (default / linear / llama3), SwiGLU.

Conventions: activations are [B, T, ...]; norms, softmax and logits are computed in float32 and
cast back to the activation dtype.
"""
from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from .quant import OUT_IN, SCALE

F32 = jnp.float32


# The q / k / v projections are stored [out, in] (the checkpoint's own layout), the other matrices
# [in, out]. Measured with the TPU compiler (reports/tpu_plan, Qwen3-8B, v5p): with q and k stored
# [in, out], a verify block of 16 tokens makes the compiler transpose every q and k weight before its
# dot (2.7 GB of copies per cycle, 14% of the cycle's HBM traffic); stored [out, in] there are none,
# and the one-token step is unchanged. (OUT_IN is defined in dflash_jax.quant, which also reads it.)


def psum(x, axis):
    """All-reduce over the tensor-parallel mesh axis (identity without one)."""
    return x if axis is None else jax.lax.psum(x, axis)


def random_init(seed: int, std: float, dtype, rng: str = "numpy"):
    """make(name, shape, zero) for init_target / init_drafter: ones for norms, zeros where `zero` (the
    caller's bias rule), else normal(0, std). rng "numpy" draws on the host in call order (the reproducible default that
    tests and training rely on); "device" draws each matrix on the default device with jax.random
    (fold_in of the call index), for benchmarks at real sizes: a Qwen3-8B's 8.2e9 host draws take
    minutes, on an accelerator a second."""
    dt = jnp.dtype(dtype)
    if rng == "numpy":
        g = np.random.default_rng(seed)
        draw = lambda i, shape: jnp.asarray(g.normal(0.0, std, size=shape).astype(np.float32), dt)
    elif rng == "device":
        key = jax.random.PRNGKey(seed)
        normal = jax.jit(lambda k, std, shape: (std * jax.random.normal(k, shape, F32)).astype(dt),
                         static_argnums=2)
        draw = lambda i, shape: normal(jax.random.fold_in(key, i), std, tuple(shape))
    else:
        raise ValueError(f"rng must be 'numpy' or 'device', got {rng!r}")
    count = [0]

    def make(name, shape, zero):
        if "norm" in name:
            return jnp.ones(shape, dt)
        if zero:
            return jnp.zeros(shape, dt)
        count[0] += 1
        return draw(count[0], shape)
    return make


def proj(x, w):
    """x [..., in] times a projection stored [out, in] (OUT_IN) -> [..., out]."""
    return jnp.einsum("...i,oi->...o", x, w)


# Whether XLA:CPU multiplies a few rows (a verify block, a drafter block) faster by a matrix stored
# [out, in] than by one stored [in, out] depends on the jax / XLA release and the machine: on 2-core AMD EPYC
# VMs [out, in] has measured ~1.5x faster from 4 rows (16 rows 17.7 -> 10.7 ms for 24 [384, 1024] matrices) and,
# with jax 0.10.2, 1.1-1.4x slower at 1-24 rows (the loop with the copy 15-20% slower a cycle)
# (reports/reference/trees_cpu/rows_matmul.py times both layouts). So the decode loop
# takes a transposed copy of the other matrices (`by_rows`, under name + ROWS; `mat` uses whichever is
# there) only where `rows_faster` measured it to pay in this process. Stored checkpoints and every other
# program keep the layout above.
ROWS = ":rows"


def mat(x, p: dict, name: str):
    """x [..., in] times matrix `name` of the param dict `p` -> [..., out], however it is held:
    [out, in] (OUT_IN, or name + ROWS after `by_rows`) or [in, out]. A quantized matrix (1-byte values with
    per-output-channel scales under name + SCALE, dflash_jax.quant) is converted to x's dtype inside the dot
    and the float32 product scaled: the device reads the 1-byte values."""
    scale = p.get(name + SCALE)
    if scale is None:
        if name in OUT_IN:
            return proj(x, p[name])
        if name + ROWS in p:
            return jnp.einsum("...i,oi->...o", x, p[name + ROWS])
        return x @ p[name]
    if name in OUT_IN or name + ROWS in p:
        w = p[name] if name in OUT_IN else p[name + ROWS]
        y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=F32)
    else:
        y = jnp.einsum("...i,io->...o", x, p[name].astype(x.dtype), preferred_element_type=F32)
    return (y * scale).astype(x.dtype)


ROW_NAMES = frozenset({"o", "gate", "up", "down", "lm_head", "fc"})  # the [in, out] matrices `mat` reads
ROWS_MIN_WIDTH = 4  # 1-3 row dots are not probed (2 rows: 8.7 vs 7.3 ms [out, in] even where the copy paid)
ROWS_MARGIN = 0.9  # the [out, in] copy is taken where its dots take at most this fraction of the [in, out] time
_ROWS_PROBED: dict = {}  # (in, out, width bucket) -> bool, once per process
_ROWS_FORCED = {"value": None}


@contextlib.contextmanager
def rows_choice(value: bool | None):
    """Force `rows_faster`'s answer (True / False; None = measure), e.g. to test both layouts."""
    old = _ROWS_FORCED["value"]
    _ROWS_FORCED["value"] = value
    try:
        yield
    finally:
        _ROWS_FORCED["value"] = old


def rows_faster(in_dim: int, out_dim: int, width: int) -> bool:
    """Whether `width` rows times [in_dim, out_dim] matrices run at least 1 / ROWS_MARGIN times faster here
    with the matrices held [out, in]: measured once per process and shape (a jitted loop of chained dots,
    both layouts alternately, median of 7 calls each; ~0.5 s), the width rounded up to a power of two."""
    if _ROWS_FORCED["value"] is not None:
        return bool(_ROWS_FORCED["value"])
    bucket = 1 << max(int(min(width, 64)) - 1, 0).bit_length()
    key = (int(in_dim), int(out_dim), bucket)
    if key not in _ROWS_PROBED:
        _ROWS_PROBED[key] = _probe_rows(*key)
    return _ROWS_PROBED[key]


def _probe_rows(in_dim: int, out_dim: int, rows: int) -> bool:
    import time
    n = int(np.clip((64 << 20) // (4 * in_dim * out_dim), 1, 8))  # matrices: at most ~64 MB of weights
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((in_dim, out_dim), np.float32) * in_dim ** -0.5 for _ in range(n)]

    def chain(transposed):
        def f(ws, x):
            def body(_, x):
                for w in ws:
                    y = jnp.einsum("ri,oi->ro", x, w) if transposed else x @ w
                    x = x + 1e-3 * jnp.mean(y, axis=-1, keepdims=True)
                return x
            return jax.lax.fori_loop(0, 4, body, x)
        # host arrays, evaluated eagerly: the probe may run while a caller traces (engine's decode program)
        args = (tuple(np.ascontiguousarray(w.T) if transposed else w for w in ws), np.ones((rows, in_dim), np.float32))
        exe = jax.jit(f).lower(*args).compile()
        for _ in range(2):  # warm: the first calls of a process also start its thread pool
            exe(*args).block_until_ready()
        return exe, args

    times = [[], []]
    with jax.ensure_compile_time_eval():
        progs = [chain(False), chain(True)]
        for _ in range(7):
            for i, (exe, args) in enumerate(progs):
                t0 = time.perf_counter()
                exe(*args).block_until_ready()
                times[i].append(time.perf_counter() - t0)
    return float(np.median(times[1])) <= ROWS_MARGIN * float(np.median(times[0]))


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
    """The layer layout for "auto": stacked (one array per weight, lax.scan over layers) on TPU, unrolled
    (one array per layer) on CPU and GPU: on an H200 XLA copied each layer's dynamic slice of the stacked
    weights before its dot (HLO checked), so a Qwen3-8B batch-1 step read its weights ~3 times (18.55 vs
    10.23 ms; reports/accelerator_cycle/h200)."""
    return "stacked" if jax.default_backend() == "tpu" else "unrolled"


def layout_name(layout: str) -> str:
    """'stacked' or 'unrolled' for a layout argument ('auto': `default_layout`); unknown names are refused."""
    if layout == "auto":
        layout = default_layout()
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layer layout {layout!r}; use one of {LAYOUTS} or 'auto'")
    return layout


def with_layout(layers, layout: str):
    return unstack_layers(layers) if layout_name(layout) == "unrolled" else stack_layers(layers)


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
