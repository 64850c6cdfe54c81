"""Pallas TPU kernel for a query / key projection with its per-head RMS norm and rotary embedding.

x [N, H] @ W^T (W held [out, in]) -> per head of D outputs: RMS norm over the head (times its weight), then the
rotate-half rotary embedding, written once in the model's dtype. In XLA the projection's float32 output, the norm's
reduction, the rotation's halves and their concatenation are separate fusions, each writing and reading the
[N, heads, D] activations through HBM (at 256 verified tokens per chip about 0.09 GB per Qwen3-8B layer, as much
as the q / k / v / o weights' 0.084 GB); here the projection's tile stays in VMEM through the epilogue. Used on
TPU by model's decoder layer (qk_norm families); tests run it in interpret mode on CPU against the XLA composition.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .kernels import pick_rows

F32 = jnp.float32
COL_TILE = 512  # output features per step: W tiles of [512, H] (4 MiB at H = 4096 in bf16)
ROW_BYTES = 8 << 20  # the tokens' inputs held in VMEM at once (W is read once per such tile)


def _kernel(x_ref, w_ref, nw_ref, cos_ref, sin_ref, o_ref, *, D, eps):
    y = jax.lax.dot_general(x_ref[...], w_ref[...].astype(x_ref.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=F32)  # [tm, tc]
    nw = nw_ref[...].astype(F32)  # [1, D]
    c, s = cos_ref[...], sin_ref[...]  # [tm, D]: cos twice, (-sin, sin)
    for j in range(y.shape[1] // D):
        yh = y[:, j * D:(j + 1) * D]
        yh = yh * jax.lax.rsqrt(jnp.mean(yh * yh, axis=1, keepdims=True) + eps) * nw
        yh = yh * c + pltpu.roll(yh, D // 2, 1) * s  # roll by half a head: [x2, x1]
        o_ref[:, j * D:(j + 1) * D] = yh.astype(o_ref.dtype)


def _tiles(N: int, H: int, O: int, D: int, itemsize: int):
    tc = next((t for t in range(min(COL_TILE, O) // D * D, 0, -D) if O % t == 0), None) if D else None
    tm = pick_rows(N, max(8, ROW_BYTES // (H * itemsize) // 8 * 8))
    return (tm, tc) if tc is not None and tm is not None and O % D == 0 and D % 128 == 0 else None


def applies(N: int, H: int, O: int, D: int, itemsize: int = 2) -> bool:
    """Whether the kernel tiles N tokens x O outputs in heads of D (a multiple of 128 lanes)."""
    return _tiles(N, H, O, D, itemsize) is not None


def proj_norm_rope(x, w, norm_w, cos, sin, *, eps: float, interpret: bool = False):
    """x [N, H]; w [heads * D, H]; norm_w [D]; cos / sin [N, D / 2] (layers.rope_cos_sin) -> [N, heads * D] in x's
    dtype: apply_rope(rms_norm(x @ w^T per head, norm_w), cos, sin), the scores in float32."""
    N, H = x.shape
    O, D = w.shape[0], norm_w.shape[0]
    tiles = _tiles(N, H, O, D, x.dtype.itemsize)
    if tiles is None:
        raise ValueError(f"no tiling for {N} tokens x {O} outputs in heads of {D}")
    tm, tc = tiles
    cos2 = jnp.concatenate([cos, cos], axis=-1).astype(F32)
    sin2 = jnp.concatenate([-sin, sin], axis=-1).astype(F32)
    rows = pl.BlockSpec((tm, D), lambda r, c: (r, 0))
    vmem = 2 * (tm * H * x.dtype.itemsize + tc * H * w.dtype.itemsize + tm * tc * x.dtype.itemsize) + 4 * tm * tc * 4
    cost = pl.CostEstimate(flops=2 * N * H * O + 10 * N * O, transcendentals=N * O // D,
                           bytes_accessed=(N // tm) * O * H * w.dtype.itemsize + N * H * x.dtype.itemsize
                           + N * O * x.dtype.itemsize + 2 * N * D * 4)
    return pl.pallas_call(
        functools.partial(_kernel, D=D, eps=float(eps)),
        out_shape=jax.ShapeDtypeStruct((N, O), x.dtype),
        grid=(N // tm, O // tc),
        in_specs=[pl.BlockSpec((tm, H), lambda r, c: (r, 0)), pl.BlockSpec((tc, H), lambda r, c: (c, 0)),
                  pl.BlockSpec((1, D), lambda r, c: (0, 0)), rows, rows],
        out_specs=pl.BlockSpec((tm, tc), lambda r, c: (r, c)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=max(32 << 20, int(vmem * 1.25))),
        cost_estimate=cost,
        interpret=interpret,
    )(x, w, norm_w.reshape(1, D), cos2, sin2)
