"""Pallas TPU kernel for the SwiGLU MLP of a verified block: down(silu(x @ gate) * (x @ up)) with the [N, I]
intermediates in VMEM.

In XLA the gate and up projections' outputs ([N, I], 3x the hidden width) go to HBM and are read back by the
down projection's fusion: at 256 tokens per chip and Qwen3-8B's I = 12,288 that is ~0.03 GB per layer next to
0.30 GB of weights. Here each step takes an I-tile of gate / up / down and adds its share of the output to a
float32 accumulator in VMEM; the tokens' inputs stay in VMEM for the whole pass, so the weights are read once. Used
on TPU by model's decoder layer where all tokens fit one row tile within the TPU's VMEM budget (dflash_jax.vmem;
Qwen3-8B on v5p: up to 1,024 tokens, 64 rows x 16 per chip);
tests run it in interpret mode on CPU.

With the attention's output and the o projection (`attn`, `wo`) the kernel also takes the layer's attention tail:
h = x + attn @ wo in column tiles first (attn copied into VMEM once, h built in the output's buffer), then the MLP
of h with h as its residual. In XLA the o projection's output and the residual sum each pass through HBM between
fusions (at 1,024 tokens per chip 0.027 GB per Qwen3-8B layer, next to the o weight's 0.034 GB).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import vmem
from .kernels import for_row_chunks, norm_rows

F32 = jnp.float32
I_TILE = 256  # the most intermediate features per step


def _vmem(N: int, H: int, ti: int, itemsize: int, A: int = 0, to: int = 0) -> int:
    """VMEM bytes: the tokens' input / output blocks, the accumulator, the weight tiles and the float32 products;
    with an o projection of A inputs in tiles of `to` columns: the attention output (then the normed h) in place of
    the input block, the x / o-weight column tiles."""
    blocks = N * max(A, H) * itemsize + 2 * N * to * itemsize + 2 * A * to * itemsize if A else N * H * itemsize
    return blocks + N * H * (itemsize + 4) + 6 * H * ti * itemsize + 4 * N * ti * 4


def _tiles(N: int, H: int, I: int, itemsize: int, A: int = 0) -> tuple[int, int] | None:
    """The widest I-tile (a multiple of 128 dividing I, at most I_TILE) and, with an o projection of A inputs, the
    widest column tile of it (a multiple of 128 dividing H, at most I_TILE) with which N tokens fit vmem.budget() (the
    tokens' inputs and outputs, one buffer each, the accumulator and the weight tiles: 44 MiB on v5p)."""
    cols = [t for t in range(min(I_TILE, H) // 128 * 128, 0, -128) if H % t == 0] if A else [0]
    return next(((ti, to) for ti in range(min(I_TILE, I) // 128 * 128, 0, -128) for to in cols
                 if I % ti == 0 and _vmem(N, H, ti, itemsize, A, to) <= vmem.budget()), None)


def applies(N: int, H: int, I: int, itemsize: int = 2, A: int = 0) -> bool:
    """Whether N tokens fit one row tile (the weights then pass once) with an I-tile of 128k features (A: with
    the o projection of A attention features in the kernel)."""
    return N % 8 == 0 and _tiles(N, H, I, itemsize, A) is not None


def _cols(buf, n: int):
    """buf's first n columns as a ref (buf itself when it has n)."""
    return buf if buf.shape[1] == n else buf.at[:, :n]


def _o_proj(k, x_ref, wo_ref, attn_hbm, o_ref, buf, sem, to: int):
    """Step k < n_o of the attention tail: attn [N, A] copied into VMEM (buf) at step 0; columns k * to.. of
    h = x + attn @ wo written into the output's buffer, rounded as x + mat(attn, o) is."""
    A = wo_ref.shape[0]

    @pl.when(k == 0)
    def _fetch():
        dma = pltpu.make_async_copy(attn_hbm, _cols(buf, A), sem)
        dma.start()
        dma.wait()

    a = buf[:, :A]
    o = jax.lax.dot_general(a, wo_ref[...].astype(a.dtype), (((1,), (0,)), ((), ())), preferred_element_type=F32)
    h = x_ref[...].astype(F32) + o.astype(o_ref.dtype).astype(F32)
    o_ref[:, pl.ds(pl.multiple_of(k * to, to), to)] = h.astype(o_ref.dtype)


def _kernel(layer_ref, x_ref, g_ref, u_ref, d_ref, *refs, eps, normed, residual, n_o, to, n_i):
    refs = list(refs)
    nw_ref = refs.pop(0) if normed else None
    wo_ref, attn_hbm = (refs.pop(0), refs.pop(0)) if n_o else (None, None)
    o_ref, acc = refs.pop(0), refs.pop(0)
    buf, sem = (refs.pop(0), refs.pop(0)) if n_o else (None, None)
    k = pl.program_id(0)
    if n_o:  # the attention tail first: h = x + attn @ wo into o_ref; then the MLP of h, h its residual
        @pl.when(k < n_o)
        def _tail():
            _o_proj(k, x_ref, wo_ref, attn_hbm, o_ref, buf, sem, to)

        @pl.when(k >= n_o)
        def _mlp():
            _mlp_step(k - n_o, o_ref, g_ref, u_ref, d_ref, nw_ref, o_ref, acc, _cols(buf, o_ref.shape[1]), eps=eps,
                      residual=True, n_i=n_i)
        return
    _mlp_step(k, x_ref, g_ref, u_ref, d_ref, nw_ref, o_ref, acc, o_ref if normed else None, eps=eps,
              residual=residual, n_i=n_i)


def _mlp_step(k, x_ref, g_ref, u_ref, d_ref, nw_ref, o_ref, acc, h_ref, *, eps, residual, n_i):
    """I-tile k of the MLP: acc += swiglu tile; x_ref the residual stream, h_ref (None: x_ref) the normed inputs
    (made at k = 0 from x_ref when nw_ref is given); the last step writes o_ref (after reading x_ref)."""
    @pl.when(k == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, F32)
        if nw_ref is not None:  # the MLP's input norm, held in VMEM (h_ref) until the end
            norm_rows(x_ref, nw_ref, h_ref, eps)

    x = (h_ref if h_ref is not None else x_ref)[...]
    dims = (((1,), (0,)), ((), ()))
    g = jax.lax.dot_general(x, g_ref[...].astype(x.dtype), dims, preferred_element_type=F32)  # [N, ti]
    u = jax.lax.dot_general(x, u_ref[...].astype(x.dtype), dims, preferred_element_type=F32)
    # as layers.swiglu rounds: silu(g) and up's output in x's dtype, their product rounded once more
    a = (jax.nn.silu(g).astype(x.dtype).astype(F32) * u.astype(x.dtype).astype(F32)).astype(x.dtype)
    acc[...] += jax.lax.dot_general(a, d_ref[...].astype(x.dtype), dims, preferred_element_type=F32)

    @pl.when(k == n_i - 1)
    def _done():  # kernels.for_row_chunks: float32 temporaries of a chunk of rows, not of the whole block
        def body(rows):
            out = acc[rows, :].astype(o_ref.dtype)
            if residual:  # the residual stream plus the MLP's output, rounded as x + swiglu(...) is
                out = (x_ref[rows, :].astype(F32) + out.astype(F32)).astype(o_ref.dtype)
            o_ref[rows, :] = out

        for_row_chunks(acc.shape[0], body)


def swiglu_mlp(x, gate, up, down, norm_w=None, *, eps: float = 1e-6, residual: bool = False, layer=None,
               attn=None, wo=None, interpret: bool = False):
    """x [N, H]; gate / up [H, I]; down [I, H] -> swiglu(h) [N, H] in x's dtype (layers.swiglu's arithmetic), with
    h = rms_norm(x, norm_w, eps) when norm_w [H] is given, else x; `residual`: x + that. gate / up / down may be
    stacks of layers ([L, H, I], [L, I, H]) with `layer` (an int or a traced scalar), read in place.

    attn [N, A] with wo [A, H] (or a stack [L, A, H], read at `layer`; needs norm_w): the attention tail first,
    y = x + attn @ wo (rounded as x + mat(attn, {"o": wo}) is), and the result is y + swiglu(rms_norm(y, norm_w))."""
    if gate.ndim == 2:
        gate, up, down, layer = gate[None], up[None], down[None], 0
        wo = None if wo is None else wo[None]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    N, H = x.shape
    I = gate.shape[2]
    A = 0 if attn is None else attn.shape[1]
    if A and (norm_w is None or wo.shape[1:] != (A, H)):
        raise ValueError(f"the attention tail needs the MLP's norm and an o projection of [{A}, {H}]")
    tiles = _tiles(N, H, I, x.dtype.itemsize, A)
    if tiles is None:
        raise ValueError(f"no single-row-tile tiling for {N} tokens x {H} x {I}")
    ti, to = tiles
    n_o, n_i = (H // to if A else 0), I // ti
    once = pl.Buffered(1)  # the tokens' block never changes: one VMEM buffer, fetched / written back once
    whole = lambda k, lay: (0, 0)  # noqa: E731
    mlp = lambda k: jnp.maximum(k - n_o, 0)  # noqa: E731  (the MLP's tiles wait at 0 during the o projection)
    col = lambda k: jnp.minimum(k, n_o - 1)  # noqa: E731
    normed = norm_w is not None
    item = x.dtype.itemsize
    cost = pl.CostEstimate(flops=6 * N * H * I + 2 * N * A * H, transcendentals=N * I,
                           bytes_accessed=(3 * H * I + A * H) * gate.dtype.itemsize + (2 * N * H + N * A) * item)
    in_specs = [pl.BlockSpec((N, to), lambda k, lay: (0, col(k))) if A else pl.BlockSpec((N, H), whole,
                                                                                          pipeline_mode=once),
                pl.BlockSpec((None, H, ti), lambda k, lay: (lay[0], 0, mlp(k))),
                pl.BlockSpec((None, H, ti), lambda k, lay: (lay[0], 0, mlp(k))),
                pl.BlockSpec((None, ti, H), lambda k, lay: (lay[0], mlp(k), 0))]
    args = [x, gate, up, down]
    if normed:
        in_specs.append(pl.BlockSpec((1, H), whole))
        args.append(norm_w.reshape(1, H))
    scratch = [pltpu.VMEM((N, H), F32)]
    if A:  # the o weight's column tiles; attn stays in HBM until the kernel copies it into VMEM once
        in_specs += [pl.BlockSpec((None, A, to), lambda k, lay: (lay[0], 0, col(k))), pl.BlockSpec(memory_space=pl.ANY)]
        args += [wo, attn.astype(x.dtype)]
        scratch += [pltpu.VMEM((N, max(A, H)), x.dtype), pltpu.SemaphoreType.DMA(())]
    est = _vmem(N, H, ti, item, A, to)
    return pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), normed=normed, residual=residual, n_o=n_o, to=to, n_i=n_i),
        out_shape=jax.ShapeDtypeStruct((N, H), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(n_o + n_i,), in_specs=in_specs,
            out_specs=pl.BlockSpec((N, H), whole, pipeline_mode=once),
            scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=vmem.limit(est)),
        cost_estimate=cost,
        interpret=interpret,
    )(layer, *args)
