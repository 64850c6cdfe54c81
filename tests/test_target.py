"""Target models: parity with transformers, KV-cached decoding, generate() (greedy, ragged batches,
sampling, stop tokens, max_new_tokens) and the compilation cache. All fp32 on CPU, tiny random models."""
from __future__ import annotations

import dataclasses
import importlib
import shutil

import jax
import numpy as np
import pytest

import dflash_jax
from dflash_jax.model import forward, init_cache, lm_head
from tests.hf_utils import LLAMA3_ROPE, edit_config_json, hf_layer_outputs, hf_logits, rel_err

# the decode package: COMPILE_COUNTS / clear_compile_cache and the default ProgramCache (its row-layout copies)
gen_mod = importlib.import_module("dflash_jax.decode")

_fwd = jax.jit(forward, static_argnames=("taps",))
_head = jax.jit(lm_head)

PARITY_TOL = 1e-4

# name -> (family, config overrides). Defaults (tests/hf_utils.py): hidden 32, 4 heads, 2 KV heads (GQA),
# qwen3 head_dim 16 (!= 32 / 4), vocab 96, 2 layers.
VARIANTS = {
    "qwen3_gqa_qknorm_headdim": ("qwen3", {}),
    "qwen3_tied": ("qwen3", dict(tie_word_embeddings=True)),
    "llama3_rope_scaling": ("llama", dict(rope_scaling=LLAMA3_ROPE)),
    "llama_untied": ("llama", {}),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "llama_mha": ("llama", dict(num_key_value_heads=4)),
    "llama_attention_bias": ("llama", dict(attention_bias=True)),
    "qwen2_qkv_bias": ("qwen2", {}),
}


def _ids(B, T, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=(B, T)).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# 1. Parity with transformers
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(hf_models, variant):
    family, overrides = VARIANTS[variant]
    path, hf = hf_models(family, **overrides)
    target = dflash_jax.load_target(path)
    c = target.config
    # the loaded config reflects the variant (so each case really tests what it says)
    assert c.family == family
    assert c.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert ("lm_head" in target.params) != c.tie_word_embeddings
    assert c.num_kv_heads == overrides.get("num_key_value_heads", 2)
    assert c.qk_norm == (family == "qwen3")
    assert c.qkv_bias == (family == "qwen2" or overrides.get("attention_bias", False))
    if family == "qwen3":
        assert c.head_dim == 16 != c.hidden_size // c.num_heads
    assert (c.rope_scaling is not None) == ("rope_scaling" in overrides)

    ids = _ids(2, 48, c.vocab_size, seed=1)
    ours = np.asarray(dflash_jax.target_logits(target, ids))
    ref = hf_logits(hf, ids)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (2, 48, c.vocab_size)
    err = rel_err(ours, ref)
    assert err <= PARITY_TOL, f"{variant}: relative logit error {err:.3e}"


def test_llama3_rope_scaling_is_exercised(hf_models, tmp_path):
    """The llama3 parity case would fail without the scaling: dropping it from config.json changes the
    logits far beyond the tolerance at these positions."""
    path, hf = hf_models("llama", rope_scaling=LLAMA3_ROPE)
    plain = str(tmp_path / "no_scaling")
    shutil.copytree(path, plain)
    cfg = edit_config_json(plain)
    rp = dict(cfg.get("rope_parameters") or {})
    edit_config_json(plain, rope_parameters={"rope_type": "default", "rope_theta": rp.get("rope_theta", 10000.0)},
                     rope_scaling=None)
    t_plain = dflash_jax.load_target(plain)
    assert t_plain.config.rope_scaling is None
    ids = _ids(1, 48, t_plain.config.vocab_size, seed=2)
    assert rel_err(np.asarray(dflash_jax.target_logits(t_plain, ids)), hf_logits(hf, ids)) > 100 * PARITY_TOL


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tap_features_match_hidden_states(hf_models, family):
    path, hf = hf_models(family, num_hidden_layers=3)
    target = dflash_jax.load_target(path)
    L, H = target.config.num_layers, target.config.hidden_size
    ids = _ids(2, 20, target.config.vocab_size, seed=3)
    hs, raw = hf_layer_outputs(hf, ids)
    assert len(hs) == L + 1 and len(raw) == L

    for taps in [(2, 0, 1, 1)]:  # every layer; features follow the order of `taps`, duplicates included
        h, cache, feats = _fwd(target, ids, init_cache(target, 2, 20), taps=taps)
        feats = np.asarray(feats).reshape(2, 20, len(taps), H)
        for j, l in enumerate(taps):
            assert rel_err(feats[:, :, j], raw[l]) <= PARITY_TOL, (taps, l)
            if l + 1 < L:  # HF's last hidden_states entry is after the final norm
                assert rel_err(feats[:, :, j], hs[l + 1]) <= PARITY_TOL, (taps, l)
    # final-normed hidden equals HF's last hidden state; cache advanced by T
    assert rel_err(np.asarray(h), hs[L]) <= PARITY_TOL
    np.testing.assert_array_equal(np.asarray(cache.lengths), [20, 20])
    with pytest.raises(ValueError, match="tap layer 3 out of range"):
        forward(target, ids, init_cache(target, 2, 20), taps=(3,))


# ----------------------------------------------------------------------------------------------
# Shared small target for the decoding tests
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(hf_models):
    path, _ = hf_models("qwen3")
    return dflash_jax.load_target(path)


# ----------------------------------------------------------------------------------------------
# 2. KV-cached decoding == full forward
# ----------------------------------------------------------------------------------------------
def test_cached_decoding_equals_full_forward_ragged(target):
    V = target.config.vocab_size
    B, P, N, C = 3, 12, 8, 3  # prefill bucket, single-token steps, then one 3-token chunk
    lens = np.array([12, 5, 9], np.int32)
    total = P + N + C
    seq = _ids(B, total, V, seed=4)
    full = np.asarray(dflash_jax.target_logits(target, seq))

    # prefill: right padded with garbage tokens that must never influence a row
    pre = seq[:, :P].copy()
    for r in range(B):
        pre[r, lens[r]:] = (7 * np.arange(P - lens[r]) + 3) % V
    cache = init_cache(target, B, 64)
    h, cache, _ = _fwd(target, pre, cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [P] * B)
    logits = np.asarray(_head(target, h))
    cache = cache.rollback(jax.numpy.asarray(lens))
    got = [[logits[r, :lens[r]]] for r in range(B)]

    pos = lens.copy()
    for _ in range(N):
        tok = seq[np.arange(B), pos][:, None]
        h, cache, _ = _fwd(target, tok, cache)
        pos += 1
        np.testing.assert_array_equal(np.asarray(cache.lengths), pos)
        lg = np.asarray(_head(target, h))
        for r in range(B):
            got[r].append(lg[r])
    # a rejected 3-token "draft" rolled back, then the real chunk: the rejected tokens leave no trace
    chunk = np.stack([seq[r, pos[r]:pos[r] + C] for r in range(B)])
    _, cache, _ = _fwd(target, (chunk + 1) % V, cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), pos + C)
    cache = cache.rollback(jax.numpy.asarray(pos))
    h, cache, _ = _fwd(target, chunk, cache)
    lg = np.asarray(_head(target, h))
    for r in range(B):
        got[r].append(lg[r])
    np.testing.assert_array_equal(np.asarray(cache.lengths), pos + C)

    for r in range(B):
        ours = np.concatenate(got[r], axis=0)
        n = lens[r] + N + C
        err = rel_err(ours, full[r, :n])
        assert err <= 1e-5, f"row {r} (prefill {lens[r]}): cached vs full relative error {err:.3e}"


# ----------------------------------------------------------------------------------------------
# 3 / 4. generate(): ragged batch == one at a time == plain argmax loop
# ----------------------------------------------------------------------------------------------
PROMPTS = [list(_ids(1, n, 96, seed=10 + n)[0]) for n in (3, 17, 9, 30)]
MAX_NEW = 10  # one value everywhere: compiled executables are shared between tests


def _gen(target, prompts, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    kw.setdefault("stop_token_ids", [])
    return dflash_jax.generate(target, None, prompts, **kw)


def _argmax_loop(target, prompt, n_new):
    """Greedy reference: the full forward re-run after every token (padded to one length: causal)."""
    total = len(prompt) + n_new
    seq = list(prompt)
    for _ in range(n_new):
        padded = np.zeros((1, total), np.int32)
        padded[0, :len(seq)] = seq
        logits = np.asarray(dflash_jax.target_logits(target, padded))
        seq.append(int(np.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_greedy_generate_equals_argmax_loop(target):
    for p in (PROMPTS[0], PROMPTS[3]):
        res = _gen(target, [p])
        assert res.tokens[0] == _argmax_loop(target, p, MAX_NEW)
        assert res.block_size == 1 and res.acceptance_lengths[0] == [1] * (MAX_NEW - 1)


def test_ragged_batch_equals_one_at_a_time(target):
    batch = _gen(target, PROMPTS)
    assert [len(t) for t in batch.tokens] == [MAX_NEW] * len(PROMPTS)
    singles = [_gen(target, [p]).tokens[0] for p in PROMPTS]
    assert batch.tokens == singles
    # not a degenerate model: different prompts continue differently
    assert len({tuple(t) for t in singles}) == len(PROMPTS)


# ----------------------------------------------------------------------------------------------
# 5. Sampling, stop tokens, max_new_tokens
# ----------------------------------------------------------------------------------------------
PAIR = [PROMPTS[1], PROMPTS[2]]
SAMPLE_NEW = MAX_NEW


def test_sampling_seeded(target):
    kw = dict(max_new_tokens=SAMPLE_NEW, temperature=1.0)
    a = _gen(target, PAIR, seed=3, **kw).tokens
    counts = dict(gen_mod.COMPILE_COUNTS)
    b = _gen(target, PAIR, seed=3, **kw).tokens
    c = _gen(target, PAIR, seed=4, **kw).tokens
    assert gen_mod.COMPILE_COUNTS == counts  # the seed is data, not a compile-time static
    greedy = _gen(target, PAIR, max_new_tokens=SAMPLE_NEW).tokens
    assert a == b
    assert a != c
    assert a != greedy
    assert all(len(t) == SAMPLE_NEW for t in a + c)
    # a row's stream depends on (seed, row id, position) only: row 1 alone with row_ids=[1] matches
    assert _gen(target, [PAIR[1]], seed=3, row_ids=[1], **kw).tokens[0] == a[1]
    # top_k=1 is greedy whatever the temperature
    assert _gen(target, PAIR, seed=3, max_new_tokens=SAMPLE_NEW, temperature=1.5, top_k=1).tokens == greedy


def _first_index(seq, tok):
    return seq.index(tok)


def test_stop_tokens(target):
    ga, gb = _gen(target, PAIR, max_new_tokens=SAMPLE_NEW).tokens
    # a shared stop token that row A emits early and row B never emits
    cands = [t for t in ga[1:6] if t not in gb]
    assert cands, "test setup: no suitable stop token"
    s = cands[0]
    ia = _first_index(ga, s)
    res = _gen(target, PAIR, max_new_tokens=SAMPLE_NEW, stop_token_ids=[s])
    assert res.tokens[0] == ga[:ia + 1]  # stop token kept, nothing after it
    assert res.tokens[1] == gb  # the other row runs on, undisturbed by the idle row
    assert _gen(target, [PAIR[1]], max_new_tokens=SAMPLE_NEW, stop_token_ids=[s]).tokens[0] == gb
    assert sum(res.acceptance_lengths[0]) == ia and sum(res.acceptance_lengths[1]) == SAMPLE_NEW - 1

    # per-row stop lists: each row stops on its own token only
    tb = gb[4]
    ib = _first_index(gb, tb)
    res = _gen(target, PAIR, max_new_tokens=SAMPLE_NEW, stop_token_ids=[[s], [tb]])
    assert res.tokens == [ga[:ia + 1], gb[:ib + 1]]
    # a stop list that only row B's token is in: row A unaffected even if it emits tb later
    res = _gen(target, PAIR, max_new_tokens=SAMPLE_NEW, stop_token_ids=[[], [tb]])
    assert res.tokens == [ga, gb[:ib + 1]]
    # the first (prefill) token can be a stop token
    res = _gen(target, PAIR, max_new_tokens=SAMPLE_NEW, stop_token_ids=[[ga[0]], []])
    assert res.tokens == [[ga[0]], gb]
    # None = the target's eos ids
    t_eos = target.replace(config=dataclasses.replace(target.config, eos_token_ids=(s,)))
    res = dflash_jax.generate(t_eos, None, PAIR, max_new_tokens=SAMPLE_NEW)
    assert res.tokens == [ga[:ia + 1], gb]
    with pytest.raises(ValueError, match="per-row stop_token_ids has 1 rows for 2 prompts"):
        _gen(target, PAIR, stop_token_ids=[[s]])


def test_stop_tokens_while_sampling(target):
    kw = dict(max_new_tokens=SAMPLE_NEW, temperature=1.0, seed=7)
    sa, sb = _gen(target, PAIR, **kw).tokens
    s = sa[2]
    ia = _first_index(sa, s)
    res = _gen(target, PAIR, stop_token_ids=[[s], []], **kw)
    assert res.tokens == [sa[:ia + 1], sb]
    assert _gen(target, [PAIR[1]], row_ids=[1], **kw).tokens[0] == sb


def test_max_new_tokens_respected(target):
    greedy = _gen(target, PAIR, max_new_tokens=SAMPLE_NEW).tokens
    assert [len(g) for g in greedy] == [SAMPLE_NEW] * 2
    for m in (1, 4):
        res = _gen(target, PAIR, max_new_tokens=m)
        assert res.tokens == [g[:m] for g in greedy], m
        assert res.cycles == m - 1
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        _gen(target, PROMPTS[:1], max_new_tokens=0)


# ----------------------------------------------------------------------------------------------
# 7. Compilation count
# ----------------------------------------------------------------------------------------------
def test_compilations_one_per_bucket(target):
    lengths = [int(x) for x in np.linspace(3, 60, 20).round()]
    assert len(set(lengths)) == 20
    prompts = [list(_ids(1, n, 96, seed=100 + n)[0]) for n in lengths]
    max_new = 4

    def bucket(n):  # our own statement of the documented rule: 16, 32, 64, ...
        return next(b for b in (16, 32, 64, 128) if n <= b)

    def cache_size(n):  # slots: prompt + max_new + 1 (Bk), at least the bucket, rounded up to 128
        need = max(bucket(n), n + max_new + 1)
        return -(-need // 128) * 128

    gen_mod.clear_compile_cache()
    before = dict(gen_mod.COMPILE_COUNTS)
    first = [dflash_jax.generate(target, None, [p], max_new_tokens=max_new, stop_token_ids=[]) for p in prompts]
    d1 = {k: gen_mod.COMPILE_COUNTS[k] - before[k] for k in before}
    assert d1["prefill"] == len({bucket(n) for n in lengths}) == 3
    assert d1["loop"] == len({cache_size(n) for n in lengths}) == 1
    assert sum(r.compile_time > 0 for r in first) == 3  # exactly the calls that compiled report it

    mid = dict(gen_mod.COMPILE_COUNTS)
    second = [dflash_jax.generate(target, None, [p], max_new_tokens=max_new, stop_token_ids=[]) for p in prompts]
    assert gen_mod.COMPILE_COUNTS == mid
    assert all(r.compile_time == 0.0 for r in second)
    assert [r.tokens for r in first] == [r.tokens for r in second]


def test_max_new_tokens_is_runtime_data(target):
    """One cache size, any max_new_tokens: the same prefill and loop programs (the budget is data), and
    a shorter budget gives a prefix of the longer run's tokens; any number of stop ids up to STOP_ALIGN too."""
    prompt = list(_ids(1, 20, 96, seed=7)[0])
    kw = dict(stop_token_ids=[], max_cache_len=128)
    long = dflash_jax.generate(target, None, [prompt], max_new_tokens=40, **kw)
    before = dict(gen_mod.COMPILE_COUNTS)
    short = [dflash_jax.generate(target, None, [prompt], max_new_tokens=n, **kw) for n in (1, 2, 7, 33)]
    assert gen_mod.COMPILE_COUNTS == before
    assert [len(r.tokens[0]) for r in short] == [1, 2, 7, 33]
    assert all(r.tokens[0] == long.tokens[0][:len(r.tokens[0])] for r in short)
    assert [r.cycles for r in short] == [0, 1, 6, 32]
    # nor does the number of stop ids (up to generate.STOP_ALIGN), e.g. none (the cost curve) vs a chat's eos ids
    dflash_jax.generate(target, None, [prompt], max_new_tokens=5, stop_token_ids=[3, 9, 11], max_cache_len=128)
    assert gen_mod.COMPILE_COUNTS == before



def test_layer_layouts_agree(hf_models):
    """The stacked (lax.scan) and unrolled (Python loop) layer layouts compute the same thing."""
    path, _ = hf_models("qwen3")
    stacked = dflash_jax.load_target(path, layout="stacked")
    unrolled = dflash_jax.load_target(path, layout="unrolled")
    assert isinstance(stacked.params["layers"], dict) and isinstance(unrolled.params["layers"], tuple)
    assert len(unrolled.params["layers"]) == stacked.config.num_layers
    ids = np.arange(20, dtype=np.int32)[None] * 7 % stacked.config.vocab_size
    np.testing.assert_allclose(np.asarray(dflash_jax.target_logits(stacked, ids)),
                               np.asarray(dflash_jax.target_logits(unrolled, ids)), rtol=1e-6, atol=1e-6)
    back = dflash_jax.relayout(unrolled, "stacked")
    for x, y in zip(jax.tree_util.tree_leaves(back.params), jax.tree_util.tree_leaves(stacked.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="unknown layer layout"):
        dflash_jax.load_target(path, layout="diagonal")


def test_row_layout_computes_the_same_and_is_used_only_where_it_pays(hf_models):
    """layers.by_rows (the CPU speculative loop's transposed copy of the [in, out] matrices) gives the same
    target forward and drafter pass; generate.rows_layout takes it on CPU for a drafter and >= 4 rows
    only where layers.rows_faster says it pays (never for target-only decoding, 2-row blocks, or a TPU
    topology traced from the CPU host). rows_faster's probe answers once per shape and process."""
    from dflash_jax import layers
    from dflash_jax.layers import rows_choice
    probe = layers.rows_faster(64, 128, 5)
    assert isinstance(probe, bool) and layers._ROWS_PROBED[(64, 128, 8)] is probe
    assert layers.rows_faster(64, 128, 7) is probe  # same width bucket: no second probe
    with rows_choice(True):
        _check_row_layout(hf_models)
    path, _ = hf_models("qwen3")
    target = dflash_jax.load_target(path, layout="unrolled")
    drafter = dflash_jax.init_drafter(target, num_layers=1, block_size=8, mask_token_id=3, layout="unrolled")
    from dflash_jax.decode import rows_layout
    with rows_choice(False):
        assert rows_layout(target, drafter, 8)[0] is target


def _check_row_layout(hf_models):
    import jax.numpy as jnp
    from dflash_jax.attention import for_tpu
    from dflash_jax.drafter import append_context, draft_hidden_cached, init_context_cache
    from dflash_jax.decode import rows_layout
    from dflash_jax.layers import ROWS
    path, _ = hf_models("qwen3")
    target = dflash_jax.load_target(path, layout="unrolled")
    drafter = dflash_jax.init_drafter(target, num_layers=2, block_size=8, mask_token_id=3, seed=5, std=0.2,
                                      target_layer_ids=(0, 1), layout="unrolled")
    rt, rd = rows_layout(target, drafter, 8)
    assert "o" + ROWS in rt.params["layers"][0] and "o" not in rt.params["layers"][0]
    assert "fc" + ROWS in rd.params and "down" + ROWS in rd.params["layers"][1]
    ids = jnp.asarray(np.arange(24, dtype=np.int32)[None] * 5 % target.config.vocab_size)
    taps = drafter.config.target_layer_ids
    outs = [forward(t, ids, init_cache(t, 1, 128), taps) for t in (target, rt)]
    np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(outs[1][0]), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(outs[0][2]), np.asarray(outs[1][2]), rtol=2e-5, atol=2e-5)
    dc = append_context(drafter, outs[0][2], init_context_cache(drafter, 1, 128))
    dc_r = append_context(rd, outs[0][2], init_context_cache(drafter, 1, 128))
    np.testing.assert_allclose(np.asarray(dc.k), np.asarray(dc_r.k), rtol=2e-5, atol=2e-5)
    anchor = jnp.asarray([7], jnp.int32)
    np.testing.assert_allclose(np.asarray(draft_hidden_cached(drafter, target, anchor, dc, 8)),
                               np.asarray(draft_hidden_cached(rd, rt, anchor, dc_r, 8)), rtol=2e-5, atol=2e-5)
    for args in ((target, None, 8), (target, drafter, 2)):
        assert rows_layout(*args)[0] is target
    with for_tpu():
        assert rows_layout(target, drafter, 8)[0] is target
    # generate() keeps the transposed copy for the latest pair: a second call transposes nothing and
    # reuses the compiled loop; speculative greedy output is the target's
    gen_mod.clear_compile_cache()
    prompts = [[1, 2, 3, 4, 5]]
    ref = dflash_jax.generate(target, None, prompts, max_new_tokens=12, stop_token_ids=[])
    before = dict(gen_mod.COMPILE_COUNTS)
    runs = [dflash_jax.generate(target, drafter, prompts, max_new_tokens=12, stop_token_ids=[], block_size=4)
            for _ in range(2)]
    assert [r.tokens for r in runs] == [ref.tokens] * 2
    assert gen_mod.COMPILE_COUNTS["loop"] - before["loop"] == 1
    (tp_, dp_, rt2, _), = gen_mod.DEFAULT.rows
    assert tp_ is target.params and dp_ is drafter.params and "o" + ROWS in rt2.params["layers"][0]


def test_device_random_init_matches_the_host_init_in_form():
    """init_target / init_drafter(rng="device") (benchmarks at real sizes: weights drawn on the accelerator)
    give the host init's shapes, dtypes, ones / zeros and std, the same draws for the same seed, other draws
    for another seed; an unknown rng is a one-line ValueError."""
    from dflash_jax.config import TargetConfig
    cfg = TargetConfig(family="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, qk_norm=True,
                       qkv_bias=True, dtype="bfloat16")
    host = dflash_jax.init_target(cfg, seed=0)
    dev, dev2, other = (dflash_jax.init_target(cfg, seed=s, rng="device") for s in (0, 0, 1))
    flat = lambda t: jax.tree_util.tree_flatten_with_path(t.params)[0]  # noqa: E731
    for (path, h), (_, d), (_, d2), (_, o) in zip(flat(host), flat(dev), flat(dev2), flat(other)):
        name = jax.tree_util.keystr(path)
        assert h.shape == d.shape and h.dtype == d.dtype, name
        np.testing.assert_array_equal(np.asarray(d, np.float32), np.asarray(d2, np.float32))
        if "norm" in name or "bias" in name:
            np.testing.assert_array_equal(np.asarray(d, np.float32), np.asarray(h, np.float32))
        else:
            assert abs(float(np.std(np.asarray(d, np.float32))) - 0.02) < 0.004, name
            assert not np.array_equal(np.asarray(d, np.float32), np.asarray(o, np.float32)), name
    dr = dflash_jax.init_drafter(dev, num_layers=1, block_size=4, mask_token_id=3, rng="device")
    dh = dflash_jax.init_drafter(host, num_layers=1, block_size=4, mask_token_id=3)
    assert jax.tree_util.tree_structure(dr.params) == jax.tree_util.tree_structure(dh.params)
    with pytest.raises(ValueError, match="rng must be"):
        dflash_jax.init_target(cfg, rng="gpu")
