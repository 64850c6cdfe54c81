"""Pallas TPU kernel for the SwiGLU MLP of a verified block: down(silu(x @ gate) * (x @ up)) with the [N, I]
intermediates in VMEM.

In XLA the gate and up projections' outputs ([N, I], 3x the hidden width) go to HBM and are read back by the
down projection's fusion: at 256 tokens per chip and Qwen3-8B's I = 12,288 that is ~0.03 GB per layer next to
0.30 GB of weights. Here each step takes an I-tile of gate / up / down and adds its share of the output to a
float32 accumulator in VMEM; the tokens' inputs stay in VMEM for the whole pass, so the weights are read once. Used
on TPU by model's decoder layer where all tokens fit one row tile (Qwen3-8B: up to 1,024 tokens, 64 rows x 16 per chip);
tests run it in interpret mode on CPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .kernels import norm_rows

F32 = jnp.float32
I_TILE = 256  # the most intermediate features per step
VMEM_BUDGET = 44 << 20  # the tokens' inputs and outputs (one buffer each), the accumulator, the weight tiles


def _vmem(N: int, H: int, ti: int, itemsize: int) -> int:
    return N * H * (2 * itemsize + 4) + 6 * H * ti * itemsize + 4 * N * ti * 4


def _tile(N: int, H: int, I: int, itemsize: int) -> int | None:
    """The widest I-tile (a multiple of 128 dividing I, at most I_TILE) with which N tokens fit VMEM_BUDGET."""
    return next((t for t in range(min(I_TILE, I) // 128 * 128, 0, -128)
                 if I % t == 0 and _vmem(N, H, t, itemsize) <= VMEM_BUDGET), None)


def applies(N: int, H: int, I: int, itemsize: int = 2) -> bool:
    """Whether N tokens fit one row tile (the weights then pass once) with an I-tile of 128k features."""
    return N % 8 == 0 and _tile(N, H, I, itemsize) is not None


def _kernel(layer_ref, x_ref, g_ref, u_ref, d_ref, *refs, eps, normed, residual):
    nw_ref, o_ref, acc = refs if normed else (None,) + tuple(refs)
    k = pl.program_id(0)

    @pl.when(k == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, F32)
        if normed:  # the MLP's input norm, held in the output's VMEM buffer until the end
            norm_rows(x_ref, nw_ref, o_ref, eps)

    x = o_ref[...] if normed else x_ref[...]
    dims = (((1,), (0,)), ((), ()))
    g = jax.lax.dot_general(x, g_ref[...].astype(x.dtype), dims, preferred_element_type=F32)  # [N, ti]
    u = jax.lax.dot_general(x, u_ref[...].astype(x.dtype), dims, preferred_element_type=F32)
    # as layers.swiglu rounds: silu(g) and up's output in x's dtype, their product rounded once more
    a = (jax.nn.silu(g).astype(x.dtype).astype(F32) * u.astype(x.dtype).astype(F32)).astype(x.dtype)
    acc[...] += jax.lax.dot_general(a, d_ref[...].astype(x.dtype), dims, preferred_element_type=F32)

    @pl.when(k == pl.num_programs(0) - 1)
    def _done():
        out = acc[...].astype(o_ref.dtype)
        if residual:  # the residual stream plus the MLP's output, rounded as x + swiglu(...) is
            out = (x_ref[...].astype(F32) + out.astype(F32)).astype(o_ref.dtype)
        o_ref[...] = out


def swiglu_mlp(x, gate, up, down, norm_w=None, *, eps: float = 1e-6, residual: bool = False, layer=None,
               interpret: bool = False):
    """x [N, H]; gate / up [H, I]; down [I, H] -> swiglu(h) [N, H] in x's dtype (layers.swiglu's arithmetic), with
    h = rms_norm(x, norm_w, eps) when norm_w [H] is given, else x; `residual`: x + that. gate / up / down may be
    stacks of layers ([L, H, I], [L, I, H]) with `layer` (an int or a traced scalar), read in place."""
    if gate.ndim == 2:
        gate, up, down, layer = gate[None], up[None], down[None], 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    N, H = x.shape
    I = gate.shape[2]
    if not applies(N, H, I, x.dtype.itemsize):
        raise ValueError(f"no single-row-tile tiling for {N} tokens x {H} x {I}")
    ti = _tile(N, H, I, x.dtype.itemsize)
    once = pl.Buffered(1)  # the tokens' block never changes: one VMEM buffer, fetched / written back once
    whole = lambda k, lay: (0, 0)  # noqa: E731
    normed = norm_w is not None
    cost = pl.CostEstimate(flops=6 * N * H * I, transcendentals=N * I,
                           bytes_accessed=3 * H * I * gate.dtype.itemsize + 2 * N * H * x.dtype.itemsize)
    vmem = _vmem(N, H, ti, x.dtype.itemsize)
    return pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), normed=normed, residual=residual),
        out_shape=jax.ShapeDtypeStruct((N, H), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(I // ti,),
            in_specs=[pl.BlockSpec((N, H), whole, pipeline_mode=once),
                      pl.BlockSpec((None, H, ti), lambda k, lay: (lay[0], 0, k)),
                      pl.BlockSpec((None, H, ti), lambda k, lay: (lay[0], 0, k)),
                      pl.BlockSpec((None, ti, H), lambda k, lay: (lay[0], k, 0))]
            + ([pl.BlockSpec((1, H), whole)] if normed else []),
            out_specs=pl.BlockSpec((N, H), whole, pipeline_mode=once),
            scratch_shapes=[pltpu.VMEM((N, H), F32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=max(32 << 20, int(vmem * 1.25))),
        cost_estimate=cost,
        interpret=interpret,
    )(layer, x, gate, up, down, *((norm_w.reshape(1, H),) if normed else ()))
