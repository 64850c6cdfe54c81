"""Pallas TPU kernel for the query / key / value projections with their per-head RMS norm and rotary embedding.

x [N, H] @ W^T (W held [out, in]) -> per head of D outputs: RMS norm over the head (times its weight), then the
rotate-half rotary embedding, written once in the model's dtype. Several projections of the same inputs (a layer's q, k and v)
run as one kernel: the inputs (and their RMS norm) pass into VMEM once for all of them. In XLA the projection's float32 output, the norm's
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

from . import vmem
from .kernels import NORM_ROWS, norm_rows, pick_rows

F32 = jnp.float32
COL_TILE = 256  # output features per step: W tiles of [256, H] (2 MiB at H = 4096 in bf16), one per projection
ROW_BYTES = 8 << 20  # the tokens' inputs held in VMEM at once (W is read once per such tile)


def _kernel(layer_ref, x_ref, *refs, D, eps, in_norm, heads, spans):
    """Grid (row tile r, column step c); projection j owns the steps spans[j] = (first, count) and writes its
    output's column tile c - first; heads[j]: with the per-head norm and rotary."""
    refs = list(refs)
    n = len(spans)
    w_refs = [refs.pop(0) for _ in range(n)]
    inw_ref = refs.pop(0) if in_norm else None
    nw_refs = [refs.pop(0) if hd else None for hd in heads]
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if any(heads) else (None, None)
    o_refs = [refs.pop(0) for _ in range(n)]
    h_ref = refs.pop(0) if in_norm else x_ref  # in_norm: the normed inputs, made once per row tile
    c = pl.program_id(1)

    if in_norm:
        @pl.when(c == 0)
        def _norm():
            norm_rows(x_ref, inw_ref, h_ref, eps)

    for j, (first, count) in enumerate(spans):
        @pl.when((c >= first) & (c < first + count))
        def _proj(j=j):
            _project(h_ref[...], w_refs[j], nw_refs[j], cos_ref, sin_ref, o_refs[j], D, eps)


def _project(h, w_ref, nw_ref, cos_ref, sin_ref, o_ref, D, eps):
    y = jax.lax.dot_general(h, w_ref[...].astype(h.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=F32)  # [tm, tc]
    if nw_ref is None:
        o_ref[...] = y.astype(o_ref.dtype)
        return
    nw = nw_ref[...].astype(F32)  # [1, D]
    c, s = cos_ref[...], sin_ref[...]  # [tm, D]: cos twice, (-sin, sin)
    for j in range(y.shape[1] // D):
        yh = y[:, j * D:(j + 1) * D]
        yh = yh * jax.lax.rsqrt(jnp.mean(yh * yh, axis=1, keepdims=True) + eps) * nw
        yh = yh * c + pltpu.roll(yh, D // 2, 1) * s  # roll by half a head: [x2, x1]
        o_ref[:, j * D:(j + 1) * D] = yh.astype(o_ref.dtype)


def _tiles(N: int, H: int, outs, D: int, itemsize: int):
    """(row tile, column tile): the widest column tile of whole heads (at most COL_TILE) dividing every output."""
    tc = next((t for t in range(min([COL_TILE] + list(outs)) // D * D, 0, -D) if all(o % t == 0 for o in outs)),
              None) if D else None
    tm = pick_rows(N, max(8, ROW_BYTES // (H * itemsize) // 8 * 8))
    ok = tc is not None and tm is not None and all(o % D == 0 for o in outs) and D % 128 == 0
    return (tm, tc) if ok and vmem_bytes(tm, tc, H, len(outs), itemsize) <= vmem.budget() else None


def vmem_bytes(tm: int, tc: int, H: int, n: int, itemsize: int, w_itemsize: int | None = None,
               in_norm: bool = True) -> int:
    """VMEM bytes of a step: the tokens' rows and n projections' weight / output tiles (double-buffered), the float32
    product, and with the input norm the normed rows and its row-chunk temporaries."""
    w = itemsize if w_itemsize is None else w_itemsize
    b = 2 * (tm * H * itemsize + n * tc * H * w + n * tm * tc * itemsize) + 4 * tm * tc * 4
    return b + ((tm * H * itemsize + 2 * NORM_ROWS * H * 4) if in_norm else 0)


def applies(N: int, H: int, O, D: int, itemsize: int = 2) -> bool:
    """Whether the kernel tiles N tokens x O outputs (an int, or one per projection) in heads of D (a multiple of
    128 lanes)."""
    return _tiles(N, H, (O,) if isinstance(O, int) else tuple(O), D, itemsize) is not None


def proj_heads(x, ws, norms, cos=None, sin=None, *, eps: float, in_norm=None, layer=None, head_dim: int = 128,
               interpret: bool = False):
    """x [N, H]; ws: projections [heads_j * D, H] (or stacks [L, heads_j * D, H], read in place at `layer`, an int or
    a traced scalar: a slice of the stack passed to a kernel would be copied first); norms: per projection its
    per-head norm weight [D] or None -> one [N, heads_j * D] per projection in x's dtype: h @ w_j^T with
    h = rms_norm(x, in_norm) when in_norm [H] is given (else x), then where norms[j] is given, per head
    apply_rope(rms_norm(., norms[j]), cos, sin) (cos / sin [N, D / 2], layers.rope_cos_sin); float32 inside."""
    ws = [w[None] if w.ndim == 2 else w for w in ws]
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    N, H = x.shape
    outs = tuple(w.shape[1] for w in ws)
    heads = tuple(nw is not None for nw in norms)
    D = next((nw.shape[0] for nw in norms if nw is not None), head_dim)
    tiles = _tiles(N, H, outs, D, x.dtype.itemsize)
    if tiles is None:
        raise ValueError(f"no tiling for {N} tokens x {outs} outputs in heads of {D}")
    tm, tc = tiles
    spans, first = [], 0
    for o in outs:
        spans.append((first, o // tc))
        first += o // tc

    def cols(first, count):  # projection's column tile at step c (held at its ends outside its steps)
        return lambda c: jnp.clip(c - first, 0, count - 1)

    rows = pl.BlockSpec((tm, D), lambda r, c, lay: (r, 0))
    in_specs = [pl.BlockSpec((tm, H), lambda r, c, lay: (r, 0))]
    in_specs += [pl.BlockSpec((None, tc, H), lambda r, c, lay, f=cols(*sp): (lay[0], f(c), 0)) for sp in spans]
    args = [x, *ws]
    if in_norm is not None:
        in_specs.append(pl.BlockSpec((1, H), lambda r, c, lay: (0, 0)))
        args.append(in_norm.reshape(1, H))
    for nw in norms:
        if nw is not None:
            in_specs.append(pl.BlockSpec((1, D), lambda r, c, lay: (0, 0)))
            args.append(nw.reshape(1, D))
    if any(heads):
        in_specs += [rows, rows]
        args += [jnp.concatenate([cos, cos], axis=-1).astype(F32), jnp.concatenate([-sin, sin], axis=-1).astype(F32)]
    item = x.dtype.itemsize
    n = len(ws)
    est = vmem_bytes(tm, tc, H, n, item, ws[0].dtype.itemsize, in_norm is not None)
    O = sum(outs)
    cost = pl.CostEstimate(flops=2 * N * H * O + 10 * N * O, transcendentals=N * O // D,
                           bytes_accessed=(N // tm) * O * H * ws[0].dtype.itemsize + N * H * item + N * O * item
                           + (2 * N * D * 4 if any(heads) else 0))
    return tuple(pl.pallas_call(
        functools.partial(_kernel, D=D, eps=float(eps), in_norm=in_norm is not None, heads=heads, spans=tuple(spans)),
        out_shape=[jax.ShapeDtypeStruct((N, o), x.dtype) for o in outs],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(N // tm, first), in_specs=in_specs,
            out_specs=[pl.BlockSpec((tm, tc), lambda r, c, lay, f=cols(*sp): (r, f(c))) for sp in spans],
            scratch_shapes=[pltpu.VMEM((tm, H), x.dtype)] if in_norm is not None else []),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem.limit(est)),
        cost_estimate=cost,
        interpret=interpret,
    )(layer, *args))


def proj_norm_rope(x, w, norm_w=None, cos=None, sin=None, *, eps: float, in_norm=None, layer=None,
                   interpret: bool = False):
    """One projection of proj_heads: x [N, H]; w [heads * D, H] (or a stack with `layer`) -> [N, heads * D]."""
    return proj_heads(x, [w], [norm_w], cos, sin, eps=eps, in_norm=in_norm, layer=layer, interpret=interpret)[0]
