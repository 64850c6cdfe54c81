"""Pallas TPU kernel for the SwiGLU MLP of a verified block: down(silu(x @ gate) * (x @ up)) with the [N, I]
intermediates in VMEM.

In XLA the gate and up projections' outputs ([N, I], 3x the hidden width) go to HBM and are read back by the
down projection's fusion: at 256 tokens per chip and Qwen3-8B's I = 12,288 that is ~0.03 GB per layer next to
0.30 GB of weights. Here each step takes an I-tile of gate / up / down and adds its share of the output to a
float32 accumulator in VMEM; the tokens' inputs stay in VMEM for the whole pass, so the weights are read once. Used
on TPU by model's decoder layer where all tokens fit one row tile; tests run it in interpret mode on CPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
I_TILE = 256  # intermediate features per step
VMEM_BUDGET = 40 << 20  # inputs and outputs (double-buffered), the accumulator and the weight tiles


def _tile(I: int) -> int | None:
    return next((t for t in range(min(I_TILE, I) // 128 * 128, 0, -128) if I % t == 0), None)


def _vmem(N: int, H: int, ti: int, itemsize: int) -> int:
    return N * H * (2 * itemsize + 2 * itemsize + 4) + 6 * H * ti * itemsize + 4 * N * ti * 4


def applies(N: int, H: int, I: int, itemsize: int = 2) -> bool:
    """Whether N tokens fit one row tile (the weights then pass once) and I has a tile of 128k features."""
    ti = _tile(I)
    return ti is not None and N % 8 == 0 and _vmem(N, H, ti, itemsize) <= VMEM_BUDGET


def _kernel(x_ref, g_ref, u_ref, d_ref, o_ref, acc):
    k = pl.program_id(0)

    @pl.when(k == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, F32)

    x = x_ref[...]
    dims = (((1,), (0,)), ((), ()))
    g = jax.lax.dot_general(x, g_ref[...].astype(x.dtype), dims, preferred_element_type=F32)  # [N, ti]
    u = jax.lax.dot_general(x, u_ref[...].astype(x.dtype), dims, preferred_element_type=F32)
    # as layers.swiglu rounds: silu(g) and up's output in x's dtype, their product rounded once more
    a = (jax.nn.silu(g).astype(x.dtype).astype(F32) * u.astype(x.dtype).astype(F32)).astype(x.dtype)
    acc[...] += jax.lax.dot_general(a, d_ref[...].astype(x.dtype), dims, preferred_element_type=F32)

    @pl.when(k == pl.num_programs(0) - 1)
    def _done():
        o_ref[...] = acc[...].astype(o_ref.dtype)


def swiglu_mlp(x, gate, up, down, *, interpret: bool = False):
    """x [N, H]; gate / up [H, I]; down [I, H] -> [N, H] in x's dtype (layers.swiglu's arithmetic)."""
    N, H = x.shape
    I = gate.shape[1]
    if not applies(N, H, I, x.dtype.itemsize):
        raise ValueError(f"no single-row-tile tiling for {N} tokens x {H} x {I}")
    ti = _tile(I)
    cost = pl.CostEstimate(flops=6 * N * H * I, transcendentals=N * I,
                           bytes_accessed=3 * H * I * gate.dtype.itemsize + 2 * N * H * x.dtype.itemsize)
    return pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct((N, H), x.dtype),
        grid=(I // ti,),
        in_specs=[pl.BlockSpec((N, H), lambda k: (0, 0)), pl.BlockSpec((H, ti), lambda k: (0, k)),
                  pl.BlockSpec((H, ti), lambda k: (0, k)), pl.BlockSpec((ti, H), lambda k: (k, 0))],
        out_specs=pl.BlockSpec((N, H), lambda k: (0, 0)),
        scratch_shapes=[pltpu.VMEM((N, H), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=max(32 << 20, int(_vmem(N, H, ti, 2) * 1.25))),
        cost_estimate=cost,
        interpret=interpret,
    )(x, gate, up, down)
