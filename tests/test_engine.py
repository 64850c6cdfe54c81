"""Continuous-batching engine: two compiled programs whatever the prompts, outputs equal generate()."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from dflash_jax.config import TargetConfig
from dflash_jax.drafter import init_drafter
from dflash_jax.engine import Engine, Request, generate_all
from dflash_jax import generate
from dflash_jax.model import init_target

HF = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 320, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
      "tie_word_embeddings": False, "eos_token_id": 1}


@pytest.fixture(scope="module")
def setup():
    t = init_target(TargetConfig.from_hf(HF), seed=0, std=0.1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 300, size=int(rng.integers(3, 17))).tolist() for _ in range(13)]
    budgets = [[3, 25][i % 2] for i in range(len(prompts))]  # two values: two reference compilations
    # stop ids the target does emit (its 2 most frequent greedy tokens), so some rows stop early
    free = generate(t, None, prompts, max_new_tokens=25, stop_token_ids=[])
    vals, counts = np.unique([x for r in free.tokens for x in r[1:]], return_counts=True)
    stops = vals[np.argsort(-counts)[:2]].tolist()
    return t, prompts, budgets, stops


@pytest.mark.parametrize("spec,temp", [(False, 1.0), (True, 0.0)])
def test_engine_equals_generate(setup, spec, temp):
    t, prompts, budgets, STOPS = setup
    drafter = init_drafter(t, 1, 4, 3, seed=0, target_layer_ids=[1, 3]) if spec else None
    eng = Engine(t, drafter, slots=4, prompt_len=24, max_new_tokens=32, refill=2, temperature=temp, seed=3)
    ids = list(range(100, 100 + len(prompts)))
    got = generate_all(eng, prompts, max_new_tokens=budgets, stop_token_ids=STOPS, row_ids=ids)
    assert [c.index for c in got] == list(range(len(prompts)))
    # 13 prompts of 3..19 tokens with budgets 1..29 in 4 slots: one prefill and one decode program
    assert eng.compilations == {"prefill": 1, "decode": 1}
    assert eng.stats.prefill_calls >= 4 and eng.stats.decode_calls >= 4  # slots were refilled
    stopped = 0
    for b in sorted(set(budgets)):
        idx = [i for i in range(len(prompts)) if budgets[i] == b]
        ref = generate(t, drafter, [prompts[i] for i in idx], max_new_tokens=b, stop_token_ids=STOPS, temperature=temp,
                       seed=3, row_ids=[ids[i] for i in idx], max_cache_len=eng.S, block_size=None)
        for j, i in enumerate(idx):
            assert got[i].tokens == ref.tokens[j], i
            assert got[i].row_id == ids[i]
            stopped += got[i].tokens[-1] in STOPS
            if spec:
                assert got[i].cycles == len(ref.acceptance_lengths[j])
    assert 0 < stopped < len(prompts)  # some rows stop early, others run to their budget
    assert eng.stats.tokens == sum(len(c.tokens) for c in got)


def test_engine_rejects_bad_requests(setup):
    t, prompts, _, _ = setup
    eng = Engine(t, None, slots=2, prompt_len=8, max_new_tokens=8, refill=1)
    for req, msg in [(Request([], 0, 4), "empty prompt"), (Request(list(range(4, 14)), 1, 4), "exceeds the engine's"),
                     (Request([4, 5], 2, 9), r"max_new_tokens 9 outside \[1, 8\]"),
                     (Request([4, 5], 3, 2, (1, 2, 3, 4, 5)), "stop ids"),
                     (Request([4, 999], 4, 2), r"token ids must lie in \[0, 320\)")]:
        with pytest.raises(ValueError, match=msg):
            list(eng.run([req]))
    with pytest.raises(ValueError, match="refill must be in"):
        Engine(t, None, slots=2, prompt_len=8, max_new_tokens=8, refill=3)


def test_step_api_switches_shapes_and_batch_buckets_with_per_request_sampling(setup):
    """Chunks of chain / target-only (keeping the drafter's context) / tree cycles on 1- or 3-slot batch buckets,
    requests joining between chunks with their own sampling settings: each output equals generate()'s target-only
    output for its (prompt, row id, setting), and nothing compiles after the first round."""
    from dflash_jax.sampling import SamplingParams
    t, prompts, _, stops = setup
    drafter = init_drafter(t, 1, 4, 3, seed=0, target_layer_ids=[1, 3])
    eng = Engine(t, drafter, slots=3, prompt_len=24, max_new_tokens=20, refill=1, seed=5,
                 shapes=["chain:4", "off", "tree:5"], prompt_buckets=[8], batch_buckets=[1])
    assert [str(s) for s in eng.shapes] == ["chain:4", "off", "tree:5:4"] and eng.batch_buckets == [1, 3]
    settings = [SamplingParams(), SamplingParams(0.9, 8, 0.9)]
    reqs = [Request(p, 40 + i, 20, tuple(stops), settings[i % 2]) for i, p in enumerate(prompts[:6])]
    for round_ in range(2):
        eng.reset()
        pending, owner, got, k = list(reqs), {}, {}, 0
        while pending or owner:
            if pending and eng.free_slots() and (k % 2 or not owner):
                r = pending.pop(0)
                owner[eng.admit([r])[0]] = r
            snap = eng.decode(["chain:4", "off", "tree:5"][k % 3], cycles=2)
            k += 1
            for s in [s for s in owner if snap.done[s]]:
                got[owner.pop(s).row_id] = snap.out[s, :snap.gen_len[s]].tolist()
                eng.release([s])
        if round_ == 0:
            compiled = dict(eng.compilations)
    buckets = {8 if len(r.prompt) <= 8 else 24 for r in reqs}
    assert compiled == eng.compilations == {"prefill": len(buckets), "decode": 6}  # 3 shapes x 2 batch buckets
    for j, sp in enumerate(settings):
        mine = [r for i, r in enumerate(reqs) if i % 2 == j]
        ref = generate(t, None, [r.prompt for r in mine], max_new_tokens=20, stop_token_ids=stops, seed=5,
                       temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, row_ids=[r.row_id for r in mine],
                       max_cache_len=eng.S)
        for r, toks in zip(mine, ref.tokens):
            assert got[r.row_id] == toks, (r.row_id, sp)


def test_target_only_chunks_batch_the_drafter_upkeep(setup, monkeypatch):
    """Target-only cycles with a drafter buffer the committed tokens' taps and append them to the drafter's cache a
    block at a time (engine.PENDING): after 7 cycles (two flushes inside the loop, one at the end; one row done
    after 3 tokens, so rows hold different counts) the drafter's cache equals the one kept token by token, and a
    drafted chunk after it commits the same tokens."""
    import dflash_jax.engine.core as core
    t, prompts, _, _ = setup
    drafter = init_drafter(t, 1, 4, 3, seed=0, target_layer_ids=[1, 3])
    reqs = [Request(prompts[0], 1, 3), Request(prompts[1], 2, 20), Request(prompts[2], 3, 20)]
    states, outs = [], []
    for pending in (1, 3):
        monkeypatch.setattr(core, "PENDING", pending)
        eng = Engine(t, drafter, slots=3, prompt_len=24, max_new_tokens=20, refill=3, shapes=["chain:4", "off"])
        eng.admit(reqs)
        eng.decode("off", cycles=7)
        states.append(jax.device_get(eng.state.dec))
        outs.append(eng.decode("chain:4", cycles=2).out)
    old, new = states
    np.testing.assert_array_equal(new.dcache.lengths, new.tcache.lengths)
    np.testing.assert_array_equal(old.dcache.lengths, new.dcache.lengths)
    assert sorted(new.dcache.lengths - [len(r.prompt) for r in reqs]) == [2, 7, 7]  # the first row: 3 tokens
    for r, n in enumerate(new.dcache.lengths):
        for a, b in ((old.dcache.k, new.dcache.k), (old.dcache.v, new.dcache.v)):
            np.testing.assert_allclose(b[:, r, :, :n], a[:, r, :, :n], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_engine_prefill_chunk_divides_its_prompt_bucket():
    """The engine prefills a prompt bucket longer than a chunk chunk by chunk (its kernels then see a chunk's tokens,
    not the whole bucket's), in chunks that divide the bucket (a recurrent target sees every token once)."""
    from dflash_jax.decode.state import PREFILL_CHUNK, even_chunk
    assert even_chunk(64) is None and even_chunk(PREFILL_CHUNK) is None
    assert even_chunk(4 * PREFILL_CHUNK) == PREFILL_CHUNK and even_chunk(3000) == 1500
    assert even_chunk(3001) is None  # a prime: one chunk rather than thousands
    for P in (3000, 8448, 32768):
        c = even_chunk(P)
        assert P % c == 0 and PREFILL_CHUNK // 16 <= c <= PREFILL_CHUNK
