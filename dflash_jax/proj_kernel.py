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

from .kernels import NORM_ROWS, norm_rows, pick_rows

F32 = jnp.float32
COL_TILE = 512  # output features per step: W tiles of [512, H] (4 MiB at H = 4096 in bf16)
ROW_BYTES = 8 << 20  # the tokens' inputs held in VMEM at once (W is read once per such tile)


def _kernel(layer_ref, x_ref, w_ref, *refs, D, eps, in_norm, head):
    refs = list(refs)
    inw_ref = refs.pop(0) if in_norm else None
    nw_ref, cos_ref, sin_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if head else (None,) * 3
    o_ref = refs.pop(0)
    h_ref = refs.pop(0) if in_norm else x_ref  # in_norm: the normed inputs, made once per row tile

    if in_norm:
        @pl.when(pl.program_id(1) == 0)
        def _norm():
            norm_rows(x_ref, inw_ref, h_ref, eps)

    h = h_ref[...]
    y = jax.lax.dot_general(h, w_ref[...].astype(h.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=F32)  # [tm, tc]
    if not head:
        o_ref[...] = y.astype(o_ref.dtype)
        return
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


def proj_norm_rope(x, w, norm_w=None, cos=None, sin=None, *, eps: float, in_norm=None, layer=None,
                   interpret: bool = False):
    """x [N, H]; w [heads * D, H] -> [N, heads * D] in x's dtype: h @ w^T with h = rms_norm(x, in_norm) when in_norm
    [H] is given (else x), then, given norm_w [D] and cos / sin [N, D / 2] (layers.rope_cos_sin), per head
    apply_rope(rms_norm(., norm_w), cos, sin); float32 inside. w may be a stack of layers [L, heads * D, H] with
    `layer` (an int or a traced scalar): the kernel reads that layer's tiles in place (a slice of the stack passed
    to a kernel would be copied first)."""
    if w.ndim == 2:
        w, layer = w[None], 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    N, H = x.shape
    O = w.shape[1]
    head = norm_w is not None
    D = norm_w.shape[0] if head else 128
    tiles = _tiles(N, H, O, D, x.dtype.itemsize)
    if tiles is None:
        raise ValueError(f"no tiling for {N} tokens x {O} outputs in heads of {D}")
    tm, tc = tiles
    rows = pl.BlockSpec((tm, D), lambda r, c, lay: (r, 0))
    in_specs = [pl.BlockSpec((tm, H), lambda r, c, lay: (r, 0)),
                pl.BlockSpec((None, tc, H), lambda r, c, lay: (lay[0], c, 0))]
    args = [x, w]
    if in_norm is not None:
        in_specs.append(pl.BlockSpec((1, H), lambda r, c, lay: (0, 0)))
        args.append(in_norm.reshape(1, H))
    if head:
        in_specs += [pl.BlockSpec((1, D), lambda r, c, lay: (0, 0)), rows, rows]
        args += [norm_w.reshape(1, D), jnp.concatenate([cos, cos], axis=-1).astype(F32),
                 jnp.concatenate([-sin, sin], axis=-1).astype(F32)]
    item = x.dtype.itemsize
    vmem = 2 * (tm * H * item + tc * H * w.dtype.itemsize + tm * tc * item) + 4 * tm * tc * 4
    vmem += (tm * H * item + 2 * NORM_ROWS * H * 4) if in_norm is not None else 0
    cost = pl.CostEstimate(flops=2 * N * H * O + 10 * N * O, transcendentals=N * O // D,
                           bytes_accessed=(N // tm) * O * H * w.dtype.itemsize + N * H * item + N * O * item
                           + (2 * N * D * 4 if head else 0))
    return pl.pallas_call(
        functools.partial(_kernel, D=D, eps=float(eps), in_norm=in_norm is not None, head=head),
        out_shape=jax.ShapeDtypeStruct((N, O), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(N // tm, O // tc), in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, tc), lambda r, c, lay: (r, c)),
            scratch_shapes=[pltpu.VMEM((tm, H), x.dtype)] if in_norm is not None else []),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=max(32 << 20, int(vmem * 1.25))),
        cost_estimate=cost,
        interpret=interpret,
    )(layer, *args)
