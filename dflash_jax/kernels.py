"""Pallas TPU kernel for attention over a committed KV cache (decode and verify).

One kernel serves the target's one-token step, its verification of a block (several query tokens per
row) and the drafter's block attention to its context cache: queries of one batch row and one KV head
(the G query heads of that KV head times the Q new tokens: G*Q rows) attend to the cache slots
s < ctx_len[b] of layer `layer`, flash style: K / V blocks of `block` slots are copied from HBM into
VMEM, scores and the online softmax stay in VMEM, and blocks past a row's fill are neither copied
nor computed (the block index stops at the row's last block, so the pipeline fetches nothing new,
and the body is skipped). `attention.py` passes the call's new tokens too (`new`): their keys join the
online softmax after the cache and the kernel writes the normalised output; alone, it returns the running
max, the normaliser and the unnormalised output.

Why a kernel: in pure XLA the f32 scores of each block are a fusion output, written to HBM and read
back (the compiler does not fuse two dots). For a 16-token verify with 4 query heads per KV head that
is as many bytes as the K block itself, per block (reports/tpu_plan: the B=16 cycle at a 32k cache).

Used by `attention(impl="pallas")` (the default on TPU); tests run it in Pallas interpret mode on CPU
against the reference einsum, and the planner compiles it for TPU topologies.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import vmem

F32 = jnp.float32
NEG = -1e30
LANES = 128  # m / l are kept lane-replicated ([rows, 128]): the TPU's native tile


def pick_block(S: int, block: int) -> int | None:
    """The largest KV block <= `block` that divides S and is a multiple of 128 (None: no such)."""
    b = min(block, S) // 128 * 128
    while b >= 128:
        if S % b == 0:
            return b
        b -= 128
    return None


def vmem_bytes(tr: int, blk: int, D: int, *, item: int = 2, kv_item: int = 2, KV: int = 1, quant: bool = False,
               windowed: bool = False, N: int = 0, R: int = 0, groups: int = 0) -> int:
    """cache_attention's VMEM bytes for tr query rows per step and KV blocks of blk slots (double-buffered blocks,
    scratch, and the float32 temporaries of one block's scores; with N new tokens: their keys / values, the mask
    rows and the scores over them; groups: all R rows gathered once)."""
    b = 2 * tr * D * item + 4 * blk * D * kv_item + 2 * tr * LANES * 4 + tr * D * 4 + 4 * tr * blk * 4
    b += 4 * KV * blk * 4 if quant else 0
    b += 2 * tr * LANES * 4 if windowed else 0
    if N:
        b += 4 * N * D * item + 2 * tr * N * 4 + 3 * tr * N * 4 + 2 * tr * D * item
        b += R * D * item if groups else 0
    else:
        b += 2 * (2 * tr * LANES * 4 + tr * D * 4)
    return b


def fit_rows(R: int, rows: int, fits) -> int | None:
    """The most query rows per step (pick_rows(R, t) for t = rows, rows - 8, ...) whose step fits(t) VMEM."""
    t = rows
    while t >= 8:
        tr = pick_rows(R, t)
        if tr is None:
            return None
        if fits(tr):
            return tr
        t = tr - 8
    return None


def pick_rows(R: int, rows: int = 512) -> int | None:
    """Query rows per kernel step: all R when R <= rows, else the largest multiple of 8 <= rows that
    divides R (None: no such)."""
    if R <= rows:
        return R
    t = rows // 8 * 8
    while t >= 8:
        if R % t == 0:
            return t
        t -= 8
    return None


NORM_ROWS = 128  # rows norm_rows takes at a time


def row_chunk(n: int) -> int:
    """The rows an in-kernel pass over n rows takes at a time: the most of NORM_ROWS, 64, 32, 16, 8 dividing n
    (else n): its float32 temporaries are [chunk, H], not [n, H]."""
    return next((c for c in (NORM_ROWS, 64, 32, 16, 8) if n % c == 0), n)


def for_row_chunks(n: int, body) -> None:
    """body(rows) for each row_chunk(n)-row slice (a pl.ds) of n rows, in a loop inside a kernel: float32
    temporaries of [chunk, H], not of the whole block (at 1,040 tokens those would overflow a v5p core's 64 MiB
    of VMEM)."""
    c = row_chunk(n)

    def chunk(i, carry):
        body(pl.ds(pl.multiple_of(i * c, c), c))
        return carry

    jax.lax.fori_loop(0, n // c, chunk, 0)


def norm_rows(x_ref, w_ref, o_ref, eps: float):
    """o_ref = layers.rms_norm(x_ref, w_ref) inside a kernel, for_row_chunks at a time; x_ref / o_ref [N, H],
    w_ref [1, H]."""
    def body(rows):
        xf = x_ref[rows, :].astype(F32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + eps)
        o_ref[rows, :] = (xf * w_ref[...].astype(F32)).astype(o_ref.dtype)

    for_row_chunks(x_ref.shape[0], body)


def _ring_block(step, first, nb):
    """The ring block a step visits: first + step, wrapped past the last of nb blocks."""
    j = first + step
    return jnp.where(j >= nb, j - nb, j)


def _kernel(len_ref, layer_ref, first_ref, win_ref, lap_ref, cut_ref, q_ref, k_ref, v_ref, *refs, blk, scale, quant,
            windowed, ring, fused, groups):
    refs = list(refs)
    qp_ref = refs.pop(0) if windowed else None  # [R, 1] each query row's position (a sliding window)
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quant else (None, None)  # the blocks' per-slot scales [KV, blk]
    kn_ref, vn_ref, nm_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if fused else (None,) * 3  # the new tokens
    if groups:  # q / output [Q, G * D] as the projections hold them: rows (g, t) gathered once into q_scr
        o_ref, m_scr, l_scr, acc_scr, q_scr = refs
    elif fused:  # one output: the normalised attention over the cache and the new tokens
        o_ref, m_scr, l_scr, acc_scr = refs
    else:
        m_ref, l_ref, o_ref, m_scr, l_scr, acc_scr = refs
    D = acc_scr.shape[1]

    def load_q():
        return q_scr[...] if groups else q_ref[...]
    b, h = pl.program_id(0), pl.program_id(1)
    if ring:  # len_ref: blocks to visit, from first_ref around the ring
        j = _ring_block(pl.program_id(3), first_ref[b], ring // blk)
        run = pl.program_id(3) < len_ref[b]
    else:
        j = pl.program_id(3) + first_ref[b]  # the block: windowed rows start at the first block their window reaches
        run = j * blk < len_ref[b]
    n = len_ref[b]

    @pl.when(pl.program_id(3) == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, NEG, F32)
        l_scr[...] = jnp.zeros(l_scr.shape, F32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, F32)
        if groups:
            x = q_ref[...]  # [Q, G * D]
            q_scr[...] = jnp.concatenate([x[:, g * D:(g + 1) * D] for g in range(groups)], axis=0)

    @pl.when(run)
    def _body():
        q = load_q()  # [R, D]
        k = k_ref[...].astype(q.dtype)  # [blk, D]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32) * scale  # [R, blk]
        if quant:  # K's scale per slot multiplies its column of scores
            s = s * ks_ref[pl.ds(h, 1), :]
        pos = j * blk + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        if ring:  # a ring cache: the slot's position (cache.ring_lap), negative where it holds none
            pos = lap_ref[b] + pos - ring * (pos > cut_ref[b]).astype(jnp.int32)
            vis = pos >= 0
        else:
            vis = pos < n
        if windowed:  # slot s visible to a query at position p when p - s < window (a traced 0: no window)
            vis = vis & ((win_ref[0] <= 0) | (qp_ref[...] - pos < win_ref[0]))
        s = jnp.where(vis, s, NEG)
        m_prev = m_scr[...]  # [R, LANES]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # lane-broadcast
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new[:, :1]), 0.0)
        l_scr[...] = l_scr[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        m_scr[...] = m_new
        if quant:  # V's scale per slot folded into the probabilities: (p * s) v_q = p (s * v_q)
            pv = jax.lax.dot_general((p * vs_ref[pl.ds(h, 1), :]).astype(q.dtype), v_ref[...].astype(q.dtype),
                                     (((1,), (0,)), ((), ())), preferred_element_type=F32)
        else:
            pv = jax.lax.dot_general(p.astype(v_ref.dtype), v_ref[...], (((1,), (0,)), ((), ())),
                                     preferred_element_type=F32)  # [R, D]
        acc_scr[...] = acc_scr[...] * alpha[:, :1] + pv

    @pl.when(pl.program_id(3) == pl.num_programs(3) - 1)
    def _done():
        if not fused:
            m_ref[...] = m_scr[...]
            l_ref[...] = l_scr[...]
            o_ref[...] = acc_scr[...]
            return
        # the new tokens' keys (in VMEM since the row's first step) join the online softmax last
        q = load_q()
        s = jax.lax.dot_general(q, kn_ref[...].astype(q.dtype), (((1,), (1,)), ((), ())),
                                preferred_element_type=F32) * scale  # [R, Qn]
        vis = nm_ref[...] > 0
        s = jnp.where(vis, s, NEG)
        m_prev = m_scr[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new[:, :1]), 0.0)
        l = l_scr[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        acc = acc_scr[...] * alpha[:, :1] + jax.lax.dot_general(
            p.astype(vn_ref.dtype), vn_ref[...], (((1,), (0,)), ((), ())), preferred_element_type=F32)
        o = (acc / jnp.where(l > 0, l, 1.0)[:, :1]).astype(o_ref.dtype)
        if groups:  # rows (g, t) back to [Q, G * D]
            Q = o.shape[0] // groups
            o = jnp.concatenate([o[g * Q:(g + 1) * Q] for g in range(groups)], axis=1)
        o_ref[...] = o


def _padded(n: int) -> int:
    """n new tokens padded to the bf16 sublane tile (Mosaic's dots want whole tiles)."""
    return -(-n // 16) * 16


def tiling(R: int, S: int, D: int, *, block: int = 512, rows: int = 512, item: int = 2, kv_item: int = 2, KV: int = 1,
           quant: bool = False, windowed: bool = False, n_new: int = 0, groups: int = 0):
    """(KV block, query rows per step) of cache_attention for R query rows over a cache of S slots (with n_new new
    tokens in VMEM): the most rows <= `rows` whose step's VMEM (vmem_bytes) stays within vmem.budget() (a prefill
    chunk's thousands of new tokens take fewer rows per step than a verify's 16). (blk, None) / (None, tr): no such
    tiling; the caller takes the XLA path (attention's rule) or raises."""
    blk = pick_block(S, block)
    if blk is None:
        return None, pick_rows(R, rows)
    N = _padded(n_new)
    cap = vmem.budget()

    def fits(tr):
        return vmem_bytes(tr, blk, D, item=item, kv_item=kv_item, KV=KV, quant=quant, windowed=windowed, N=N, R=R,
                          groups=groups) <= cap
    if groups:
        return blk, (R if R <= rows and fits(R) else None)
    return blk, fit_rows(R, rows, fits)


def cache_attention(q, k_cache, v_cache, ctx_len, layer=None, *, scale: float, block: int = 512, rows: int = 512,
                    interpret: bool = False, cost_fill: int | None = None, k_scale=None, v_scale=None,
                    q_pos=None, window=0, ring=None, new=None, groups: int = 0):
    """Online-softmax partials of q over the committed cache slots (with `new`: the whole attention).

    q [B, KV, R, D] (R = query heads per KV head x new tokens); k_cache / v_cache [L, B, KV, S, D] with
    `layer` (an int or a traced scalar), or [B, KV, S, D] with layer None; ctx_len [B] int.
    Returns (m [B, KV, R], l [B, KV, R], acc [B, KV, R, D]) in float32: the running max of the scores,
    sum exp(s - m) and sum exp(s - m) v over the visible slots (m = -1e30, l = 0, acc = 0 where a row
    sees none). `block`: KV slots per step; `rows`: query rows per step (VMEM holds rows x block f32
    scores). `cost_fill`: the fill to declare in the kernel's cost estimate (the planner's), else S:
    the TPU compiler cannot see inside a kernel and takes its bytes and flops from this estimate.
    k_scale / v_scale ([L, B, KV, S] or [B, KV, S]): a quantized cache's per-slot, per-head scales (int8 / float8
    K / V): each step copies the row's scales of the block for all KV heads ([KV, blk], S on the lanes) beside the
    1-byte K / V block and applies them in VMEM. q_pos [B, Q] (the new tokens' positions; R = heads x Q, rows
    (head, token)) with window w > 0 (an int or a traced scalar): a sliding window, slot s visible to a query at
    position p when p - s < w; each row's steps start at the first block its earliest query's window reaches, so a
    row reads about w slots, not its fill. ring: (lap, cut) [B] of a ring cache (dflash_jax.cache.ring_lap; slot s holds
    position lap + s - S * (s > cut)): a row visits the blocks from its window's first slot around the ring (all blocks
    that hold anything without a window), each slot masked by the position it holds.
    new: (k_new, v_new [B, KV, N, D], mask [B, R, N] or [B, Q, N]) the new tokens' keys / values and which of them
    each query row sees (mask > 0; [B, Q, N]: one row per new token t, shared by its query rows (g, t), so a prefill
    chunk's mask is not repeated per head): they join the online softmax after the cache, in VMEM, and the kernel
    returns the normalised output [B, KV, R, D] in q.dtype instead of the partials (no float32 partials written, no
    merge outside). The query rows per step are the most <= `rows` whose VMEM fits this TPU's budget (tiling).
    groups G > 0 (with `new`): q [B, Q, KV * G * D], k_new / v_new [B, N, KV * D] and the output [B, Q, KV * G * D]
    in the projections' layout (query head h * G + g of KV head h), so no transposes surround the kernel; the rows
    (g, t) are gathered in VMEM. Needs the R = G * Q rows in one step."""
    quant = k_scale is not None
    if k_cache.ndim == 4:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
        if quant:
            k_scale, v_scale = k_scale[None], v_scale[None]
    L, B, KV, S, D = k_cache.shape
    R = q.shape[2] if not groups else groups * q.shape[1]
    windowed = q_pos is not None and not (isinstance(window, int) and window <= 0)
    n_new = 0 if new is None else new[0].shape[1 if groups else 2]
    blk, tr = tiling(R, S, D, block=block, rows=rows, item=q.dtype.itemsize, kv_item=k_cache.dtype.itemsize, KV=KV,
                     quant=quant, windowed=windowed, n_new=n_new, groups=groups)
    if groups and tr != R:
        raise ValueError(f"the projections' layout needs all {R} query rows in one step")
    if blk is None or tr is None:
        raise ValueError(f"no kernel tiling for cache length {S} (a multiple of 128) and {R} query rows"
                         + (f" with {n_new} new tokens" if n_new else "")
                         + f" within {vmem.budget() >> 20} MiB of VMEM")
    est = vmem_bytes(tr, blk, D, item=q.dtype.itemsize, kv_item=k_cache.dtype.itemsize, KV=KV, quant=quant,
                     windowed=windowed, N=_padded(n_new), R=R, groups=groups)
    nb = S // blk
    lens = jnp.clip(ctx_len.astype(jnp.int32), 0, S)
    lap, cut = ring if ring is not None else (jnp.zeros((B,), jnp.int32),) * 2
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    win = jnp.asarray(window if windowed else 0, jnp.int32).reshape(1)
    if windowed:
        Q = q_pos.shape[1]
        if R % Q:
            raise ValueError(f"{R} query rows are not heads x {Q} new tokens")
        qp = jnp.tile(q_pos.astype(jnp.int32), (1, R // Q))[..., None]  # [B, R, 1]: row (g, t) -> q_pos[:, t]
        lo = jnp.maximum(jnp.min(q_pos.astype(jnp.int32), axis=1) - win[0] + 1, 0)
        first = jnp.where(win[0] > 0, lo // blk, 0).astype(jnp.int32)  # [B] the first block any query sees
    else:
        first = jnp.zeros((B,), jnp.int32)
    if ring is not None:  # the window's slots run from its first position's slot around the ring to the fill's
        n = jnp.maximum(ctx_len.astype(jnp.int32), 0)
        lo = jnp.where(win[0] > 0, lo, 0) if windowed else jnp.zeros((B,), jnp.int32)
        lo_slot = jnp.mod(lo, S)
        first = lo_slot // blk
        lens = jnp.minimum(nb, (lo_slot % blk + jnp.maximum(n - lo, 0) + blk - 1) // blk)  # blocks to visit

    def kv_index(b, h, r, j, len_ref, layer_ref, first_ref, *_):
        if ring is not None:  # past the last block to visit: the same block, not fetched again
            return layer_ref[0], b, h, _ring_block(jnp.maximum(jnp.minimum(j, len_ref[b] - 1), 0), first_ref[b], nb), 0
        last = jax.lax.div(jnp.maximum(len_ref[b] - 1, 0), blk)  # past the row's fill: the same block, not fetched again
        return layer_ref[0], b, h, jnp.minimum(j + first_ref[b], last), 0

    fill = S if cost_fill is None else min(int(cost_fill), S)
    if windowed and isinstance(window, int):  # a row reads the blocks its window spans
        fill = min(fill, (-(-(window + Q) // blk) + 1) * blk)
    kv_bytes = 2 * B * KV * (R // tr) * fill * D * k_cache.dtype.itemsize  # K / V pass once per row tile
    if quant:  # and the scales of every KV head with each head's block
        kv_bytes += 2 * B * KV * (R // tr) * fill * KV * 4
    fused = new is not None
    row = lambda b, h, r, j, *_: (b, h, r, 0)
    if fused:
        k_new, v_new, new_mask = new
        ax = 1 if groups else 2  # the new tokens' axis
        N = _padded(k_new.shape[ax])  # padded to the bf16 sublane tile: Mosaic's dots want whole tiles
        if N != k_new.shape[ax]:  # the padding's keys are masked out
            pad = [(0, 0)] * k_new.ndim
            pad[ax] = (0, N - k_new.shape[ax])
            k_new, v_new = jnp.pad(k_new, pad), jnp.pad(v_new, pad)
            new_mask = jnp.pad(new_mask, ((0, 0), (0, 0), (0, N - new_mask.shape[2])))
        Qm = new_mask.shape[1]  # the mask's rows: one per query row, or one per new token (rows (g, t) -> t)
        if Qm != R and R % Qm:
            raise ValueError(f"a mask of {Qm} rows for {R} query rows: give one per query row or one per new token")
        if Qm % tr:  # a row tile spans several heads' rows: one mask row per query row
            new_mask, Qm = jnp.tile(new_mask, (1, R // Qm, 1)), R
        per_token = Qm // tr  # row tile r reads the mask rows (r % per_token) * tr.. (the heads share a token's row)
        if groups:
            kn_spec = pl.BlockSpec((None, N, D), lambda b, h, r, j, *_: (b, 0, h))
            out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
            out_specs = pl.BlockSpec((None, q.shape[1], groups * D), lambda b, h, r, j, *_: (b, 0, h))
        else:
            kn_spec = pl.BlockSpec((None, None, N, D), lambda b, h, r, j, *_: (b, h, 0, 0))
            out_shape = jax.ShapeDtypeStruct((B, KV, R, D), q.dtype)
            out_specs = pl.BlockSpec((None, None, tr, D), row)
        new_specs = [kn_spec] * 2 + [pl.BlockSpec((None, tr, N), lambda b, h, r, j, *_: (b, r % per_token, 0))]
        new_args = (k_new, v_new, new_mask.astype(F32))
        out_bytes = B * KV * R * D * q.dtype.itemsize + 2 * k_new.size * k_new.dtype.itemsize + B * Qm * N * 4
    else:
        N, new_specs, new_args = 0, [], ()
        out_bytes = B * KV * R * (D + 2 * LANES) * 4
        out_shape = (jax.ShapeDtypeStruct((B, KV, R, LANES), F32), jax.ShapeDtypeStruct((B, KV, R, LANES), F32),
                     jax.ShapeDtypeStruct((B, KV, R, D), F32))
        out_specs = [pl.BlockSpec((None, None, tr, LANES), row), pl.BlockSpec((None, None, tr, LANES), row),
                     pl.BlockSpec((None, None, tr, D), row)]
    cost = pl.CostEstimate(flops=4 * B * KV * R * (fill + N) * D, transcendentals=B * KV * R * (fill + N),
                           bytes_accessed=kv_bytes + q.size * q.dtype.itemsize + out_bytes)

    def scale_index(b, h, r, j, *refs):  # every KV head's scales of the K / V block
        lay, b, _, jb, _ = kv_index(b, h, r, j, *refs)
        return lay, b, 0, jb

    kv_spec = pl.BlockSpec((None, None, None, blk, D), kv_index)
    scale_specs = [pl.BlockSpec((None, None, KV, blk), scale_index)] * 2 if quant else []
    qp_specs = [pl.BlockSpec((None, tr, 1), lambda b, h, r, j, *_: (b, r, 0))] if windowed else []
    q_spec = (pl.BlockSpec((None, q.shape[1], groups * D), lambda b, h, r, j, *_: (b, 0, h)) if groups
              else pl.BlockSpec((None, None, tr, D), row))
    out = pl.pallas_call(
        functools.partial(_kernel, blk=blk, scale=float(scale), quant=quant, windowed=windowed,
                          ring=S if ring is not None else 0, fused=fused, groups=groups),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(B, KV, R // tr, nb),
            in_specs=[q_spec, kv_spec, kv_spec] + qp_specs + scale_specs + new_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((tr, LANES), F32), pltpu.VMEM((tr, LANES), F32), pltpu.VMEM((tr, D), F32)]
            + ([pltpu.VMEM((R, D), q.dtype)] if groups else [])),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem.limit(est)),
        cost_estimate=cost,
        interpret=interpret,
    )(lens, layer_arr, first, win, lap, cut, q, k_cache, v_cache, *((qp,) if windowed else ()),
      *((k_scale, v_scale) if quant else ()), *new_args)
    if fused:
        return out
    m, l, acc = out
    return m[..., 0], l[..., 0], acc

