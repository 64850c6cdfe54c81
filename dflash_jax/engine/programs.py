"""The engine's device programs: its state (every slot's decode state, row id, budget, stop ids, cycles and
sampling setting), the prefill that writes new prompts into free slots, and the decode that runs a chunk of
cycles of one shape on the first b slots (dflash_jax.engine.core drives them)."""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ..cache import KVCache
from ..decode.programs import accept_stage, cycle, prefill, verify_stage
from ..decode.state import DecodeState, even_chunk
from ..drafter import append_context
from ..sampling import RowSampling


@flax.struct.dataclass
class EngineState:
    dec: DecodeState  # the decode state of every slot (out width = max_new_tokens + the largest block)
    rows: jax.Array  # [B] row id of each slot's prompt (sampling keys)
    budget: jax.Array  # [B] max new tokens of each slot's prompt
    stop: jax.Array  # [B, K] stop ids (-1 = none)
    cycles: jax.Array  # [B] decode cycles while the slot was active (acceptance statistics)
    sp: RowSampling  # [B] each slot's sampling setting



def put_rows(big, small, slots):
    """Write the [L, R, KV, P, D] rows of `small` into slots `slots` of `big` (positions 0..P-1);
    slot indices past the batch are dropped. A hybrid target's cache (hybrid.HybridCache): its KV part so, its
    recurrent state's rows [Lg, R, ...] whole; a Gemma 4 target's (gemma4.Gemma4Cache): each kind's KV part so."""
    from ..gemma4 import Gemma4Cache
    if isinstance(big, Gemma4Cache):
        return big.replace(sliding=put_rows(big.sliding, small.sliding, slots), full=put_rows(big.full, small.full, slots))
    if not isinstance(big, KVCache):
        lin = jax.tree.map(lambda b, s: b.at[:, slots].set(s.astype(b.dtype), mode="drop"), big.lin, small.lin)
        return big.replace(kv=put_rows(big.kv, small.kv, slots), lin=lin)
    P = small.k.shape[3]
    put = lambda b, s: b.at[:, slots, :, :P].set(s.astype(b.dtype), mode="drop")  # noqa: E731
    scales = {} if not big.quantized else {"k_scale": put(big.k_scale, small.k_scale),
                                            "v_scale": put(big.v_scale, small.v_scale)}
    return big.replace(k=put(big.k, small.k), v=put(big.v, small.v),
                       lengths=big.lengths.at[slots].set(small.lengths, mode="drop"), **scales)


def engine_prefill(target, drafter, st: EngineState, tokens, lens, rows, slots, budget, stop, sp, key, *,
                   Bk, width, tp=None):
    """Prefill `tokens` [R, P] (sampling settings `sp` [R]) and write them into `slots` [R] (index >= B: padding,
    dropped). Bk: the largest block the engine verifies (it sizes the token buffer)."""
    small = prefill(target, drafter, tokens, lens, rows, key, stop, budget, S=tokens.shape[1], Bk=Bk,
                    M=width - Bk, sp=sp, tp=tp, chunk=even_chunk(tokens.shape[1]))  # a long prompt: chunk by chunk
    d = st.dec

    def put(big, new):
        return big.at[slots].set(new.astype(big.dtype), mode="drop")

    dec = DecodeState(
        tcache=put_rows(d.tcache, small.tcache, slots),
        dcache=put_rows(d.dcache, small.dcache, slots) if drafter is not None else None,
        anchor=put(d.anchor, small.anchor), out=put(d.out, small.out), gen_len=put(d.gen_len, small.gen_len),
        done=put(d.done, small.done | (budget <= 1)), acc_hist=d.acc_hist, cycle=d.cycle)
    return EngineState(dec=dec, rows=put(st.rows, rows), budget=put(st.budget, budget), stop=put(st.stop, stop),
                       cycles=put(st.cycles, jnp.zeros_like(rows)), sp=jax.tree.map(put, st.sp, sp))


def _rows_of(st: EngineState, b: int, new: EngineState | None = None) -> EngineState:
    """The first b slots of `st` as a state of b rows; with `new` (b rows): `st` with them written back."""
    def f(axis):
        if new is None:
            return lambda x: jax.lax.slice_in_dim(x, 0, b, axis=axis)
        return lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), 0, axis=axis)

    def cache(c, n):  # every cache leaf has its rows on axis 1 ([L, B, ...]) but the fill lengths [B]
        if c is None:
            return None
        one = lambda *xs: f(0 if xs[0].ndim == 1 else 1)(*xs)
        return jax.tree.map(one, c) if new is None else jax.tree.map(one, c, n)

    d = st.dec
    nd = new.dec if new is not None else None
    row = f(0)
    pick = (lambda name: row(getattr(d, name))) if new is None else (lambda name: row(getattr(d, name),
                                                                                        getattr(nd, name)))
    dec = DecodeState(tcache=cache(d.tcache, nd and nd.tcache), dcache=cache(d.dcache, nd and nd.dcache),
                      anchor=pick("anchor"), out=pick("out"), gen_len=pick("gen_len"), done=pick("done"),
                      acc_hist=pick("acc_hist"), cycle=d.cycle if new is None else nd.cycle)
    if new is None:
        return EngineState(dec=dec, rows=row(st.rows), budget=row(st.budget), stop=row(st.stop),
                           cycles=row(st.cycles), sp=jax.tree.map(row, st.sp))
    return EngineState(dec=dec, rows=row(st.rows, new.rows), budget=row(st.budget, new.budget),
                       stop=row(st.stop, new.stop), cycles=row(st.cycles, new.cycles),
                       sp=jax.tree.map(row, st.sp, new.sp))


PENDING = 8  # target-only cycles whose drafter-context upkeep is batched into one append (engine_decode)


def engine_decode(target, drafter, st: EngineState, key, stop_free, limit, cancel, *, b, Bk, tree=None, tp=None,
                  dp=None, pending=1):
    """Draft/verify cycles on the first `b` slots until at least `stop_free` of them are done (over all data
    shards) or after `limit` cycles. `cancel` [B]: slots marked done first (their requests were dropped). Bk 1
    with a drafter: target-only cycles that keep the drafter's context (the target's taps of each committed
    token) for a later drafted call; `pending` > 1: those taps wait in a buffer of that many tokens per row and
    enter the drafter's cache `pending` cycles at a time and at the end of the call (one append of a block
    instead of one per token; the cache must hold `pending` slots past every row's committed tokens)."""
    st = st.replace(dec=st.dec.replace(done=st.dec.done | cancel))
    whole = st
    if b < st.rows.shape[0]:
        st = _rows_of(st, b)
    deferred = Bk == 1 and drafter is not None and pending > 1

    def flush(dec, buf, cnt):
        return dec.replace(dcache=append_context(drafter, buf, dec.dcache, count=cnt)), jnp.zeros_like(cnt)

    def cond(c):
        s, i = c[:2]
        free = jnp.sum(s.dec.done.astype(jnp.int32))
        if dp is not None:
            free = jax.lax.psum(free, dp)
        return (free < stop_free) & (i < limit)

    def body(c):
        s, i = c[:2]
        active = ~s.dec.done
        if Bk == 1 and drafter is not None:
            block = s.dec.anchor[:, None]
            post, tcache, feats = verify_stage(target, drafter, s.dec.tcache, block, s.rows, key, sp=s.sp, tp=tp)
            if deferred:  # commit without the drafter; the taps wait in the buffer
                buf, cnt = c[2:]
                dec = accept_stage(None, s.dec, block, post, tcache, feats, s.stop, s.budget)
                buf = buf.at[jnp.arange(buf.shape[0]), cnt].set(feats[:, 0].astype(buf.dtype))
                cnt = cnt + (dec.gen_len - s.dec.gen_len)
                dec, cnt = jax.lax.cond((i + 1) % pending == 0, flush, lambda d, _, n: (d, n), dec, buf, cnt)
                return s.replace(dec=dec, cycles=s.cycles + active.astype(jnp.int32)), i + 1, buf, cnt
            dec = accept_stage(drafter, s.dec, block, post, tcache, feats, s.stop, s.budget)
        else:
            dec = cycle(target, drafter, s.dec, s.rows, key, s.stop, s.budget, Bk=Bk, sp=s.sp, tp=tp, tree=tree)
        return s.replace(dec=dec, cycles=s.cycles + active.astype(jnp.int32)), i + 1

    carry = (st, jnp.zeros((), jnp.int32))
    if deferred:
        rows = st.rows.shape[0]
        width = len(drafter.config.target_layer_ids) * target.config.hidden_size
        carry += (jnp.zeros((rows, pending, width), target.dtype), jnp.zeros((rows,), jnp.int32))
    carry = jax.lax.while_loop(cond, body, carry)
    st = carry[0]
    if deferred:
        dec, _ = flush(st.dec, *carry[2:])
        st = st.replace(dec=dec)
    return _rows_of(whole, b, st) if b < whole.rows.shape[0] else st
