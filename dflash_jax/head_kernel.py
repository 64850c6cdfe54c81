"""Pallas TPU kernel for the greedy LM head: the argmax of h @ W over the vocabulary without writing the logits.

A greedy verify of B rows x Bk tokens otherwise writes float32 logits [B, Bk, V] to HBM and reads them back for the
max and for the lowest index holding it: at Qwen3-8B's vocabulary of 151,936 and 256 tokens per chip that is 0.16 GB
written and 0.31 GB read per pass, about as much as the LM head's weight itself, and the draft does it again. Here
the tokens' hidden states stay in VMEM while W streams through in vocabulary tiles; each tile's scores stay in VMEM
and only a running (max, index) per token is kept. Ties go to the lowest id and NaN counts as the maximum, as in
jnp.argmax. Used on TPU by model.lm_head_argmax; tests run it in interpret mode on CPU against the einsum + argmax.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import vmem
from .kernels import LANES, pick_rows

F32 = jnp.float32
VOCAB_TILE = 512  # vocabulary entries per step: W tiles of [H, 512] (4 MiB at H = 4096 in bf16)
ROW_BYTES = 8 << 20  # the tokens' hidden states held in VMEM at once (W is read once per such tile): 1,024 tokens at
# H = 4096 in bf16; with W's tiles and the scores about 30 MiB of VMEM (v5p: 64 MiB, v5e / v6e: 128 MiB)


def _kernel(h_ref, w_ref, *refs, tv, V, mult, cap, scaled, rows_w):
    if scaled:
        s_ref, idx_ref, val_ref, best_v, best_i = refs
    else:
        idx_ref, val_ref, best_v, best_i = refs
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        best_v[...] = jnp.full(best_v.shape, -jnp.inf, F32)
        best_i[...] = jnp.zeros(best_i.shape, jnp.int32)

    h = h_ref[...]
    w = w_ref[...].astype(h.dtype)
    dims = (((1,), (1,)), ((), ())) if rows_w else (((1,), (0,)), ((), ()))
    x = jax.lax.dot_general(h, w, dims, preferred_element_type=F32)  # [tn, tv]
    if scaled:
        x = x * s_ref[...]
    if mult != 1.0:
        x = x * mult
    if cap:
        x = jnp.tanh(x / cap) * cap
    ids = j * tv + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    x = jnp.where(ids < V, x, -jnp.inf)  # a last partial tile's padding
    nan = jnp.isnan(x)
    big = jnp.iinfo(jnp.int32).max
    m = jnp.max(jnp.where(nan, -jnp.inf, x), axis=1, keepdims=True)
    any_nan = jnp.max(jnp.where(nan, 1.0, 0.0), axis=1, keepdims=True) > 0
    cand = jnp.where(any_nan, jnp.where(nan, ids, big), jnp.where(x == m, ids, big))
    i = jnp.min(cand, axis=1, keepdims=True)  # [tn, 1]
    m = jnp.where(any_nan, jnp.nan, m)
    prev = best_v[...]  # [tn, LANES] lane-replicated
    better = (m > prev) | (jnp.isnan(m) & ~jnp.isnan(prev))  # an earlier tile keeps a tie (its ids are lower)
    best_v[...] = jnp.where(better, m, prev)
    best_i[...] = jnp.where(better, i, best_i[...])

    @pl.when(j == pl.num_programs(1) - 1)
    def _done():
        idx_ref[...] = best_i[...]
        val_ref[...] = best_v[...]


def head_argmax(h, w, *, vocab_axis: int = 1, scale=None, mult: float = 1.0, cap: float = 0.0,
                interpret: bool = False):
    """h [N, H]; w [H, V] (vocab_axis 1) or [V, H] (vocab_axis 0); scale [V] (a quantized head's per-entry scale)
    or None. Returns (ids [N] int32, max [N] float32) of cap * tanh(mult * scale * (h @ w) / cap) (cap 0: no tanh),
    scores in float32: the lowest id holding each row's maximum, NaN counting as the maximum."""
    N, H = h.shape
    V = w.shape[vocab_axis]
    cap_rows = max(8, ROW_BYTES // (H * h.dtype.itemsize) // 8 * 8)
    tn = pick_rows(N, cap_rows)
    n_pad = 0
    if tn is None:  # equal tiles of a multiple of 8 rows, the last rows padded (their ids are dropped)
        tiles = -(-N // cap_rows)
        tn = -(-(-(-N // tiles)) // 8) * 8
        n_pad = tiles * tn - N
        h = jnp.pad(h, ((0, n_pad), (0, 0)))
    tv = min(VOCAB_TILE, -(-V // 128) * 128)
    nv = -(-V // tv)
    rows_w = vocab_axis == 0
    w_spec = pl.BlockSpec((tv, H) if rows_w else (H, tv), (lambda r, j: (j, 0)) if rows_w else (lambda r, j: (0, j)))
    in_specs = [pl.BlockSpec((tn, H), lambda r, j: (r, 0)), w_spec]
    args = [h, w]
    if scale is not None:
        in_specs.append(pl.BlockSpec((1, tv), lambda r, j: (0, j)))
        args.append(scale.reshape(1, V).astype(F32))
    out = pl.BlockSpec((tn, LANES), lambda r, j: (r, 0))
    item = h.dtype.itemsize
    est = 2 * (tn * H * item + tv * H * w.dtype.itemsize) + 4 * tn * tv * 4 + 6 * tn * LANES * 4  # VMEM bytes
    cost = pl.CostEstimate(flops=2 * N * H * V, transcendentals=N * V if cap else 0,
                           bytes_accessed=((N + n_pad) // tn) * V * H * w.dtype.itemsize + N * H * item + 2 * N * LANES * 4)
    ids, val = pl.pallas_call(
        functools.partial(_kernel, tv=tv, V=V, mult=float(mult), cap=float(cap or 0.0), scaled=scale is not None,
                          rows_w=rows_w),
        out_shape=(jax.ShapeDtypeStruct((N + n_pad, LANES), jnp.int32),
                   jax.ShapeDtypeStruct((N + n_pad, LANES), F32)),
        grid=((N + n_pad) // tn, nv),
        in_specs=in_specs,
        out_specs=[out, out],
        scratch_shapes=[pltpu.VMEM((tn, LANES), F32), pltpu.VMEM((tn, LANES), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem.limit(est)),
        cost_estimate=cost,
        interpret=interpret,
    )(*args)
    return ids[:N, 0], val[:N, 0]
