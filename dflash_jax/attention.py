"""Attention behind one function, for every path: target prefill / decode / verify, the drafter's
context + block attention, and training.

Shape of the problem. Queries come in A groups of Q rows per batch row (target: A = 1, Q = the new
tokens; drafter: one group per block). Each group attends to
  * a committed context `k_ctx/v_ctx` [B, KV, S, D] (a KV cache, or fresh context rows in training),
    of which group a of row b sees slots s < ctx_len[b, a] (and, with a sliding window w > 0, only
    slots with q_pos - s < w), and
  * its own new keys `k_new/v_new` [B, A, R, KV, D] under a small dense mask `new_mask` [B, A, Q, R]
    (causal for the target's new tokens, all-ones / windowed for a drafter block; later: tree masks).
The result is softmax over the union of both key sets. Heads are grouped (GQA): NH query heads share
KV heads, NH // KV each, without repeating K/V.

Implementations (`impl`):
  "reference": scores over all S slots and the new keys, masked, one softmax (tests, tiny shapes,
               and the differentiable training path);
  "blockwise": the new part dense, then an online softmax (flash style) over context blocks of
               `block` slots, from the first block a window can see up to the block holding the
               longest group's fill: a `lax.while_loop` with a dynamic trip count, so work and
               memory follow the fill, not S. Not reverse-differentiable (dynamic loop).
  "pallas":    the new part dense, the cache part by a Pallas TPU kernel (dflash_jax.kernels): K / V
               blocks up to each row's fill pass through VMEM once per tile of 512 query rows, scores
               never reach HBM; with a sliding window a row starts at the first block its window
               reaches. One query group per row, no sinks, a cache length that is a multiple of 128
               (other calls fall back to "blockwise");
               interpreted off TPU (tests), compiled on TPU and by the planner (`for_tpu`).
The default is picked by `default_impl()` and can be overridden with `set_default_impl` / `use_impl`:
"pallas" on TPU; on a GPU "reference" while a call's float32 scores fit in DENSE_GPU_BYTES (decode,
verify, the drafter's block: on an H200 at Qwen3-8B, 1536-token context, the target step took 6.75 ms
dense against 10.23 ms blockwise, whose `while_loop` over cache blocks costs a device-to-host
round trip per block per layer there; reports/accelerator_cycle/h200), "blockwise" past that
(long prefill chunks); on CPU "reference" for decode-size calls over a cache of at most DENSE_CPU_SLOTS slots,
else "blockwise" with CPU_BLOCK-slot blocks (measurements at the constants).

KV writes: `write_rows` stores new K/V with one `dynamic_update_slice` per batch row, which XLA
performs in place on a donated or loop-carried cache (a scatter `.at[...].set` copies the cache).
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from .cache import ring_lap, ring_put, slot_positions
from .quant import dequantize_kv, quantize_kv

F32 = jnp.float32
NEG = -1e30
IMPLS = ("reference", "blockwise", "pallas")
DEFAULT_BLOCK = 512
UNROLL_ROWS = 32  # write_rows off TPU: up to this many rows as straight-line updates, more in a loop
UNROLL_ROWS_TPU = 512  # on TPU: up to this many (a program's size grows with them; past it, a loop)

_default = {"impl": None, "every_block": False, "tpu": False}


DENSE_GPU_BYTES = 256 << 20  # a GPU call whose dense float32 scores stay under this takes "reference"
# CPU: a cache of at most DENSE_CPU_SLOTS slots read by a call of at most DENSE_CPU_ROW_BYTES of float32 scores per
# batch row takes "reference" (embedded pair, 2-core CPU, 6 layers, cache 512 at a fill of 300: 1 / 5 / 24 query rows
# 0.28 / 0.42 / 1.02 ms dense against 0.45 / 0.67 / 1.57 blockwise; at cache 1024 and more blockwise, which reads up
# to the fill, wins; a 256-token prefill chunk: 55 ms dense against 19 ms blockwise)
DENSE_CPU_SLOTS = 512
DENSE_CPU_ROW_BYTES = 4 << 20
CPU_BLOCK = 128  # the blockwise path's context block on CPU: work follows the fill more closely (same cases,
# cache 1024, 24 rows: 1.33 ms at 128-slot blocks, 1.72 at 512; cache 2048, fill 1200: 4.07 against 5.11)


def default_impl(score_bytes: int | None = None, slots: int | None = None, rows: int = 1) -> str:
    """The implementation used when a call site does not name one: the one set by `set_default_impl` /
    `use_impl`, else "pallas" on TPU; on a GPU "reference" for a call whose dense scores take at most
    DENSE_GPU_BYTES (`score_bytes`; None: a call of decode size), "blockwise" above; on CPU "reference" for a
    call over a cache of at most DENSE_CPU_SLOTS `slots` whose scores take at most DENSE_CPU_ROW_BYTES per
    batch row (of `rows`), else "blockwise" (`slots` None: the answer for a long cache)."""
    if _default["impl"]:
        return _default["impl"]
    backend = jax.default_backend()
    if backend == "tpu":
        return "pallas"
    if backend == "gpu" and (score_bytes is None or score_bytes <= DENSE_GPU_BYTES):
        return "reference"
    if (backend == "cpu" and slots is not None and slots <= DENSE_CPU_SLOTS
            and (score_bytes is None or score_bytes <= DENSE_CPU_ROW_BYTES * max(int(rows), 1))):
        return "reference"
    return "blockwise"


def program_key() -> tuple:
    """What of this module's settings a traced program depends on beyond its shapes and the backend (part of
    generate's compile-cache key): the implementation set by `set_default_impl` / `use_impl` (None: chosen per
    call) and the default block."""
    return _default["impl"], default_block()


def default_block() -> int:
    """The blockwise path's context block when a call names none: CPU_BLOCK on CPU (not while tracing for a
    TPU), else DEFAULT_BLOCK."""
    return CPU_BLOCK if jax.default_backend() == "cpu" and not _default["tpu"] else DEFAULT_BLOCK


def set_default_impl(impl: str | None) -> None:
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; use one of {IMPLS}")
    _default["impl"] = impl


@contextlib.contextmanager
def use_impl(impl: str | None):
    """Temporarily change the default implementation (read at trace time)."""
    old = _default["impl"]
    set_default_impl(impl)
    try:
        yield
    finally:
        _default["impl"] = old


@contextlib.contextmanager
def for_tpu():
    """Trace as the runtime does on TPU (the default implementation "pallas", kernels compiled, not
    interpreted) while the host backend is CPU: the planner's compiles for TPU topologies."""
    old = dict(_default)
    _default["tpu"] = True
    if _default["impl"] is None:
        _default["impl"] = "pallas"
    try:
        yield
    finally:
        _default.update(old)


def tracing_for_tpu() -> bool:
    """Inside `for_tpu` (the planner compiling for a TPU topology from a CPU host)."""
    return bool(_default["tpu"])


def compiles_for_tpu() -> bool:
    """On TPU, or tracing a TPU program here: the Pallas kernels compile (elsewhere Pallas interprets them)."""
    return jax.default_backend() == "tpu" or tracing_for_tpu()


@contextlib.contextmanager
def count_every_block(fill: int | None = None):
    """Trace the blockwise path with a static, unrolled loop over the context blocks up to `fill`
    slots (None: every block the cache holds) instead of the dynamic loop up to the fill; a sliding
    window bounds it for one row of one query group, whose span is static. Results are the same
    (blocks past the fill are masked out); the point is costing: the TPU compiler counts a loop body
    once, so the planner traces its cost programs this way, with the fill it plans for, and every
    KV block read is counted (dflash_jax.planner)."""
    old = _default["every_block"]
    _default["every_block"] = True if fill is None else max(int(fill), 1)
    try:
        yield
    finally:
        _default["every_block"] = old


def write_rows(buf, layer, starts, new, uniform: bool = False, ring: bool = False):
    """buf [L, B, KV, S, D] (or [B, KV, S, D] with layer=None); new [B, T, KV, D] -> buf with row b's
    T entries stored at slots starts[b] .. starts[b]+T-1 of `layer`. One dynamic_update_slice per
    row (in place), or one for all rows when `uniform` (every start equals starts[0], as in a chunked
    prefill); the caller guarantees starts[b] + T <= S (a start past that would be clamped). A quantized
    cache's scales are written the same way: buf [L, B, KV, S], new [B, T, KV] (`write_kv`). `ring`: a ring cache
    (cache.ring_put: slots (starts[b] + t) mod S, any start; T <= S)."""
    B = new.shape[0]
    upd = jnp.swapaxes(new, 1, 2).astype(buf.dtype)  # [B, KV, T, D] (scales: [B, KV, T])
    starts = starts.astype(jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    tail = (zero,) * (upd.ndim - 3)  # the head dim (none for scales)
    if ring:
        lead = () if layer is None else (layer,)
        if uniform:
            return ring_put(buf, lead + (0, 0, 0) + tail, len(lead) + 2, upd.reshape((1,) * len(lead) + upd.shape),
                            starts[0])

        def put_ring(b, buf):
            blk = jax.lax.dynamic_index_in_dim(upd, b, 0, keepdims=True)
            return ring_put(buf, lead + (b, 0, 0) + tail, len(lead) + 2, blk.reshape((1,) * len(lead) + blk.shape),
                            starts[b])
    if uniform:
        if layer is None:
            return jax.lax.dynamic_update_slice(buf, upd, (zero, zero, starts[0]) + tail)
        return jax.lax.dynamic_update_slice(buf, upd[None], (jnp.asarray(layer, jnp.int32), zero, zero, starts[0]) + tail)
    def put(b, buf):
        blk = jax.lax.dynamic_index_in_dim(upd, b, 0, keepdims=True)  # [1, KV, T, D]
        idx = (jnp.asarray(b, jnp.int32), zero, starts[b]) + tail
        if layer is not None:
            blk, idx = blk[None], (jnp.asarray(layer, jnp.int32),) + idx
        return jax.lax.dynamic_update_slice(buf, blk, idx)

    if ring:
        put = put_ring
    if B <= (UNROLL_ROWS if loop_rows_ok() else UNROLL_ROWS_TPU):  # straight-line updates
        for b in range(B):
            buf = put(b, buf)
        return buf
    return jax.lax.fori_loop(0, B, put, buf)  # more rows: one update in a loop (still in place)


def write_kv(cache, layer, starts, k, v, uniform: bool = False):
    """Store new K / V rows [B, T, KV, D] of `layer` into a KVCache at slots starts[b].. (`write_rows`), quantized
    with per-token, per-head scales when the cache is (dflash_jax.quant.quantize_kv). Returns (cache, k, v): the
    new rows as the cache holds them (in the cache dtype, or dequantized to k's dtype), so that the new
    tokens see each other exactly as later steps will see them in the cache."""
    if not cache.quantized:
        cache = cache.replace(k=write_rows(cache.k, layer, starts, k, uniform),
                              v=write_rows(cache.v, layer, starts, v, uniform))
        return cache, k.astype(cache.k.dtype), v.astype(cache.v.dtype)
    mode = "int8" if cache.k.dtype == jnp.int8 else "fp8"
    (kq, ks), (vq, vs) = quantize_kv(k, mode), quantize_kv(v, mode)
    cache = cache.replace(k=write_rows(cache.k, layer, starts, kq, uniform),
                          v=write_rows(cache.v, layer, starts, vq, uniform),
                          k_scale=write_rows(cache.k_scale, layer, starts, ks, uniform),
                          v_scale=write_rows(cache.v_scale, layer, starts, vs, uniform))
    return cache, dequantize_kv(kq, ks, k.dtype), dequantize_kv(vq, vs, v.dtype)


def loop_rows_ok() -> bool:
    """Whether `write_rows` may store many rows with one update in a `fori_loop` (smaller programs, faster
    compiles): not on TPU. There the compiler gives a loop-carried cache the layout that suits a one-slot update
    ([L, B, S, KV, D] in memory: KV heads x head dim fill a tile) and converts the whole cache to it and back
    around every layer's attention kernel: the target step at 64 rows per chip (Qwen3-8B, v5p, cache 4096) read
    2.9 TB for a 54 GB minimum. Straight-line updates keep the cache's own layout
    (tests/test_plan.py::test_large_batch_programs_stay_in_place), up to UNROLL_ROWS_TPU rows per device (Qwen3-8B
    on v5p fits at most ~180 rows per chip at a 2688-slot cache); a tiny model's batch of thousands of rows per
    chip takes the loop again, cache conversions included."""
    return jax.default_backend() != "tpu" and not tracing_for_tpu()


def attention(q, k_new, v_new, new_mask, k_ctx=None, v_ctx=None, ctx_len=None, *, q_pos=None, window=0,
              layer=None, scale=None, impl=None, block=None, sinks=None, k_scale=None, v_scale=None, ring=False):
    """Grouped-query attention of new queries over a committed context plus their own new keys.

    q [B, A, Q, NH, D]; k_new / v_new [B, A, R, KV, D]; new_mask bool, broadcastable to [B, A, Q, R];
    k_ctx / v_ctx [B, KV, S, D], or [L, B, KV, S, D] with `layer` (an index: only that layer's
    blocks are read, no per-layer copy); ctx_len [B, A] int (None with no context);
    q_pos [B, A, Q] absolute query positions (needed with a window); window: 0 = no window, else
    context slot s is visible only when q_pos - s < window (static int or traced scalar).
    sinks [NH] (gpt-oss): one extra logit per head that joins every softmax normaliser and attends
    to nothing (it only scales the output down).
    k_scale / v_scale: a quantized context's per-token, per-head scales, [B, KV, S] or [L, B, KV, S] (k_ctx / v_ctx
    then hold int8 / float8 values; every implementation multiplies the scales back in).
    ring: the context is a ring cache (dflash_jax.cache: slot s holds the latest position = s mod S below the fill;
    ctx_len is the fill), read with the window.
    Returns [B, A, Q, NH * D] in q.dtype; scores, softmax and accumulation in float32."""
    B, A, Q, NH, D = q.shape
    KV = k_new.shape[3]
    if impl is None:
        S = 0 if k_ctx is None else k_ctx.shape[-2]
        impl = default_impl(4 * B * A * NH * Q * (S + k_new.shape[2]), slots=S if k_ctx is not None else None, rows=B)
    if impl not in IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; use one of {IMPLS}")
    if NH % KV:
        raise ValueError(f"{NH} query heads are not a multiple of {KV} KV heads")
    scale = D ** -0.5 if scale is None else scale
    qg = q.reshape(B, A, Q, KV, NH // KV, D)
    new_mask = jnp.broadcast_to(new_mask, (B, A, Q, k_new.shape[2]))
    sk = None if sinks is None else sinks.astype(F32).reshape(1, 1, KV, NH // KV, 1)  # [1, 1, KV, G, 1]
    if k_ctx is None:
        out = _dense_new_only(qg, k_new, v_new, new_mask, scale, sk)
    elif impl == "reference":
        kc = k_ctx if layer is None else k_ctx[layer]
        vc = v_ctx if layer is None else v_ctx[layer]
        if k_scale is not None:
            kc = dequantize_kv(kc, k_scale if layer is None else k_scale[layer], q.dtype)
            vc = dequantize_kv(vc, v_scale if layer is None else v_scale[layer], q.dtype)
        out = _reference(qg, k_new, v_new, new_mask, kc, vc, ctx_len, q_pos, window, scale, sk, ring)
    elif impl == "pallas" and _kernel_applies(qg, k_ctx, q_pos, window, sk, block, k_scale, k_new.shape[2]):
        out = _pallas(qg, k_new, v_new, new_mask, k_ctx, v_ctx, ctx_len, layer, scale, block or DEFAULT_BLOCK,
                      k_scale, v_scale, q_pos, window, ring)
    else:
        out = _blockwise(qg, k_new, v_new, new_mask, k_ctx, v_ctx, ctx_len, q_pos, window, layer, scale,
                         block or default_block(), sk, k_scale, v_scale, ring)
    return out.reshape(B, A, Q, NH * D).astype(q.dtype)


def _no_window(window) -> bool:
    return isinstance(window, (int, np.integer)) and int(window) == 0


def _ctx_mask(s_pos, ctx_len, q_pos, window, ring: int = 0):
    """Visibility of context slots s_pos [N] for every query: [B, A, Q or 1, N]. ring: the size of a ring cache
    (its slots hold the positions cache.ring_lap gives), 0: slot = position."""
    if ring:
        p = slot_positions(ctx_len, ring, s_pos)[:, :, None, :]
        m = p >= 0
    else:
        p = s_pos
        m = s_pos[None, None, None, :] < ctx_len[:, :, None, None]
    if q_pos is not None and not _no_window(window):
        w = jnp.asarray(window, jnp.int32)
        m = m & ((w <= 0) | (q_pos[..., None] - p < w))
    return m


def _new_scores(qg, k_new, new_mask, scale):
    s = jnp.einsum("baqkgd,barkd->bakgqr", qg, k_new, preferred_element_type=F32) * scale
    return jnp.where(new_mask[:, :, None, None], s, NEG)


def _softmax_with_sink(s, sk):
    """softmax over the last axis, with the sink logit (broadcast [.., KV, G, 1]) in the normaliser."""
    if sk is None:
        return jax.nn.softmax(s, axis=-1)
    sink = jnp.broadcast_to(sk[..., None], s.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]


def _dense_new_only(qg, k_new, v_new, new_mask, scale, sk=None):
    s = _new_scores(qg, k_new, new_mask, scale)
    p = _softmax_with_sink(s, sk)
    return jnp.einsum("bakgqr,barkd->baqkgd", p.astype(v_new.dtype), v_new, preferred_element_type=F32)


def _reference(qg, k_new, v_new, new_mask, kc, vc, ctx_len, q_pos, window, scale, sk=None, ring=False):
    S = kc.shape[2]
    m_ctx = _ctx_mask(jnp.arange(S, dtype=jnp.int32), ctx_len, q_pos, window, S if ring else 0)
    s_ctx = jnp.einsum("baqkgd,bksd->bakgqs", qg, kc, preferred_element_type=F32) * scale
    s_ctx = jnp.where(m_ctx[:, :, None, None], s_ctx, NEG)
    s_new = _new_scores(qg, k_new, new_mask, scale)
    p = _softmax_with_sink(jnp.concatenate([s_ctx, s_new], axis=-1), sk)
    return (jnp.einsum("bakgqs,bksd->baqkgd", p[..., :S].astype(vc.dtype), vc, preferred_element_type=F32)
            + jnp.einsum("bakgqr,barkd->baqkgd", p[..., S:].astype(v_new.dtype), v_new, preferred_element_type=F32))


def _new_part(qg, k_new, v_new, new_mask, scale):
    """Online-softmax partials (max, normaliser, unnormalised output) of the dense part over the new
    tokens: the start of the blockwise loop and one side of the Pallas path's log-sum-exp merge."""
    s = _new_scores(qg, k_new, new_mask, scale)  # [B, A, KV, G, Q, R]
    m = jnp.max(s, axis=-1)
    p = jnp.where(new_mask[:, :, None, None], jnp.exp(s - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    acc = jnp.einsum("bakgqr,barkd->bakgqd", p.astype(v_new.dtype), v_new, preferred_element_type=F32)
    return m, l, acc


def _normalised(l, acc):
    """acc / l ([B, A, KV, G, Q, D], rows that see nothing stay 0) -> [B, A, Q, KV, G, D]."""
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.moveaxis(out, 4, 2)


def _kernel_applies(qg, k_ctx, q_pos, window, sk, block, k_scale=None, new: int = 0) -> bool:
    """The Pallas cache kernel covers one query group per row (decode, verify, the drafter's block at
    decode, a prefill chunk), with or without a sliding window (given the queries' positions), no sinks, a cache length
    with a KV block that is a multiple of 128, and a row tile whose VMEM (with the `new` new tokens) fits this TPU's
    budget (kernels.tiling); other calls take the blockwise path."""
    A = qg.shape[1]
    if not (A == 1 and (_no_window(window) or q_pos is not None) and sk is None):
        return False
    blk, tr = _tiling(qg, k_ctx, window, block or DEFAULT_BLOCK, k_scale, new)
    return blk is not None and tr is not None


def _tiling(qg, k_ctx, window, block, k_scale, n_new: int, groups: int = 0):
    """kernels.tiling of this call: (KV block, query rows per step) of the cache kernel, None where none fits."""
    from .kernels import tiling
    B, A, Q, KV, G, D = qg.shape
    return tiling(G * Q, k_ctx.shape[-2], D, block=block, item=qg.dtype.itemsize, kv_item=k_ctx.dtype.itemsize,
                  KV=KV, quant=k_scale is not None, windowed=not _no_window(window), n_new=n_new, groups=groups)


def _pallas(qg, k_new, v_new, new_mask, k_ctx, v_ctx, ctx_len, layer, scale, block, k_scale=None, v_scale=None,
            q_pos=None, window=0, ring=False):
    """The Pallas kernel (dflash_jax.kernels) over the cache and the new tokens: the new keys / values join its
    online softmax in VMEM, and it writes the normalised output in q's dtype."""
    from .kernels import cache_attention
    B, A, Q, KV, G, D = qg.shape
    N = k_new.shape[2]
    mask = new_mask[:, 0]  # [B, Q, N]: row (g, q) sees what token q sees (the kernel shares the row over g)
    fill = _default["every_block"]
    kw = dict(scale=scale, block=block, interpret=not compiles_for_tpu(),
              cost_fill=None if fill is True or fill is False else fill, k_scale=k_scale, v_scale=v_scale,
              q_pos=None if _no_window(window) else q_pos[:, 0], window=window,
              ring=ring_lap(ctx_len[:, 0], k_ctx.shape[-2]) if ring else None)
    grouped = Q % 16 == 0 and D % 128 == 0 and _tiling(qg, k_ctx, window, block, k_scale, N, groups=G)[1] == G * Q
    if grouped:  # the projections' layout: no transposes
        out = cache_attention(qg.reshape(B, Q, KV * G * D), k_ctx, v_ctx, ctx_len[:, 0], layer, groups=G,
                              new=(k_new.reshape(B, N, KV * D), v_new.reshape(B, N, KV * D), mask), **kw)
        return out.reshape(B, 1, Q, KV, G, D)
    q = jnp.transpose(qg[:, 0], (0, 2, 3, 1, 4)).reshape(B, KV, G * Q, D)  # rows (g, q) per KV head
    kn, vn = jnp.transpose(k_new[:, 0], (0, 2, 1, 3)), jnp.transpose(v_new[:, 0], (0, 2, 1, 3))  # [B, KV, N, D]
    out = cache_attention(q, k_ctx, v_ctx, ctx_len[:, 0], layer, new=(kn, vn, mask), **kw)
    return jnp.transpose(out.reshape(B, KV, G, Q, D), (0, 3, 1, 2, 4))[:, None]  # [B, 1, Q, KV, G, D]


def _blockwise(qg, k_new, v_new, new_mask, k_ctx, v_ctx, ctx_len, q_pos, window, layer, scale, block, sk=None,
               k_scale=None, v_scale=None, ring=False):
    B, A, Q, KV, G, D = qg.shape
    S = k_ctx.shape[-2]
    blk = min(block, S)
    # the dense new part starts the online softmax (the log-sum-exp merge of the two parts)
    m, l, acc = _new_part(qg, k_new, v_new, new_mask, scale)

    ctx_len = ctx_len.astype(jnp.int32)
    hi = jnp.minimum(jnp.max(ctx_len), S)
    n_blocks = (hi + blk - 1) // blk
    first = jnp.zeros((), jnp.int32)
    windowed = q_pos is not None and not _no_window(window)
    if windowed and not ring:  # blocks entirely before every query's window are skipped (a ring: any block may hold them)
        w = jnp.asarray(window, jnp.int32)
        lo = jnp.maximum(jnp.min(q_pos) - w + 1, 0) // blk
        first = jnp.where(w > 0, lo, 0).astype(jnp.int32)

    def read(buf, start):  # [B, KV, blk, D] (scales: [B, KV, blk])
        if layer is None:
            return jax.lax.dynamic_slice_in_dim(buf, start, blk, axis=2)
        tail = buf.shape[4:]
        idx = (jnp.asarray(layer, jnp.int32), 0, 0, start) + (0,) * len(tail)
        return jax.lax.dynamic_slice(buf, idx, (1, B, KV, blk) + tail)[0]

    def read_kv(buf, sc, start):
        return read(buf, start) if sc is None else dequantize_kv(read(buf, start), read(sc, start), qg.dtype)

    def body(j, carry):
        m, l, acc = carry
        lo = j * blk
        start = jnp.minimum(lo, S - blk)  # a last partial block overlaps its predecessor:
        s_pos = start + jnp.arange(blk, dtype=jnp.int32)  # slots below `lo` were counted already
        vis = _ctx_mask(s_pos, ctx_len, q_pos if windowed else None, window, S if ring else 0) & (s_pos >= lo)
        kb, vb = read_kv(k_ctx, k_scale, start), read_kv(v_ctx, v_scale, start)
        sc = jnp.einsum("baqkgd,bksd->bakgqs", qg, kb, preferred_element_type=F32) * scale
        vis = vis[:, :, None, None]  # [B, A, 1, 1, Q or 1, blk]
        m_new = jnp.maximum(m, jnp.max(jnp.where(vis, sc, NEG), axis=-1))
        alpha = jnp.exp(m - m_new)
        pb = jnp.where(vis, jnp.exp(sc - m_new[..., None]), 0.0)
        l = l * alpha + jnp.sum(pb, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("bakgqs,bksd->bakgqd", pb.astype(vb.dtype), vb,
                                                  preferred_element_type=F32)
        return m_new, l, acc

    if _default["every_block"]:  # costing: a static loop, unrolled, over the blocks the cache can hold
        fill = _default["every_block"]
        n_static = -(-S // blk) if fill is True else min(-(-S // blk), -(-fill // blk))
        if windowed and not ring and isinstance(window, int) and B == 1 and A == 1:  # one row's window: a static span
            n_static = min(n_static, -(-(window + Q) // blk) + 1)
        for i in range(n_static):
            m, l, acc = body(first + i, (m, l, acc))
    else:
        m, l, acc = jax.lax.fori_loop(first, n_blocks, body, (m, l, acc))
    if sk is not None:  # the sink joins the normaliser only: one more term of the running sum
        m_new = jnp.maximum(m, sk)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.exp(sk - m_new)
        acc = acc * alpha[..., None]
    return _normalised(l, acc)
