"""Gemma 4 text targets: parity with transformers in the released checkpoint layouts (5:1 sliding : full layers with
the window crossed many times, k_eq_v with a global head size, the MoE block, per-layer inputs with KV-shared layers),
full and cached; sliding attention bounded by its window; the drafter's hooks (scaled block embeddings, soft-capped
draft logits, taps after layer_scalar); lossless speculative decoding (chains and trees, ragged batches)."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dflash_jax as dj
from dflash_jax import generate, target_logits
from dflash_jax.attention import use_impl
from dflash_jax.drafter import draft_logits_from_hidden
from dflash_jax.model import embed, forward, init_cache, lm_head

from .hf_utils import FAMILIES, edit_config_json, hf_layer_outputs, hf_logits, make_hf_model, randomize_, rel_err
from .gemma4_tiny import tiny_gemma4
from .test_lossless import _train_drafter

FAMS = ("gemma4", "gemma4_kv", "gemma4_moe", "gemma4_ple")
VOCAB = 96


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    return {fam: make_hf_model(root, fam) for fam in FAMS}


def test_config_reads_each_layer_kind(hf_models):
    c = dj.load_target(hf_models["gemma4"][0]).config
    assert c.layer_windows == (8,) * 5 + (0,) and c.head_dim == 16 and c.num_kv_heads == 2
    assert c.gemma4.global_head_dim == 32 and c.gemma4.global_kv_heads == 2 and not c.gemma4.k_eq_v
    assert c.gemma4.full_rope == (10000.0, "proportional", 0.25, 1.0) and c.rope_theta == 100.0
    assert c.embed_scale == 32 ** 0.5 and c.logit_softcap == 5.0 and c.tie_word_embeddings
    kv = dj.load_target(hf_models["gemma4_kv"][0]).config.gemma4
    assert kv.k_eq_v and kv.global_kv_heads == 1
    moe = dj.load_target(hf_models["gemma4_moe"][0]).config
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 24) and moe.has_dense_mlp
    ple = dj.load_target(hf_models["gemma4_ple"][0]).config.gemma4
    assert (ple.ple_dim, ple.kv_shared_layers, ple.double_wide_mlp) == (8, 3, True)


@pytest.mark.parametrize("family", FAMS)
def test_logits_match_transformers(hf_models, family):
    """A full forward over 70 tokens (the window of 8 crossed many times), two rows, fp32."""
    path, hf = hf_models[family]
    target = dj.load_target(path)
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(2, 70))
    assert rel_err(np.asarray(target_logits(target, ids)), hf_logits(hf, ids)) <= 1e-4


def test_taps_are_decoder_layer_outputs_after_layer_scalar(hf_models):
    """The drafter's taps are the decoder layers' outputs (layer_scalar applied), KV-shared layers included."""
    path, hf = hf_models["gemma4_ple"]
    target = dj.load_target(path)
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(1, 30))
    _, raw = hf_layer_outputs(hf, ids)
    taps = (1, 5, 7)
    _, _, feats = forward(target, jnp.asarray(ids, jnp.int32), None, taps)
    H = target.config.hidden_size
    for j, l in enumerate(taps):
        assert rel_err(np.asarray(feats[..., j * H:(j + 1) * H]), raw[l]) <= 1e-4


def _cached_logits(target, ids, prompt, steps, size, impl):
    """The prompt in one cached pass, then one-token steps: logits [B, steps + 1, V] after positions prompt - 1 ..."""
    f = jax.jit(lambda t, x, c: forward(t, x, c, attn_impl=impl))
    h, cache, _ = f(target, jnp.asarray(ids[:, :prompt], jnp.int32), init_cache(target, ids.shape[0], size))
    got = [np.asarray(lm_head(target, h[:, -1]))]
    for t in range(prompt, prompt + steps):
        h, cache, _ = f(target, jnp.asarray(ids[:, t:t + 1], jnp.int32), cache)
        got.append(np.asarray(lm_head(target, h[:, -1])))
    return np.stack(got, axis=1)


@pytest.mark.parametrize("family,impl", [(f, "reference") for f in FAMS]
                         + [("gemma4", "blockwise"), ("gemma4_ple", "blockwise")])
def test_cached_step_by_step_logits_match_transformers(hf_models, family, impl):
    """A 150-token prompt into the caches (each kind its own), then 9 one-token steps: every step's logits match
    transformers' full forward at that position. The blockwise path starts at the first 128-slot block a sliding
    layer's window reaches."""
    path, hf = hf_models[family]
    target = dj.load_target(path)
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(1, 160))
    ref = hf_logits(hf, ids)[:, 149:159]
    got = _cached_logits(target, ids, 150, 9, 256 if impl == "reference" else 1024, impl)
    assert rel_err(got, ref) <= 1e-4


def test_pallas_path_serves_the_full_layers(hf_models):
    """With the TPU kernel (interpreted here) the full layers read the cache through it and the sliding layers fall
    back to the windowed blockwise path; logits as transformers'."""
    path, hf = hf_models["gemma4_kv"]
    target = dj.load_target(path)
    ids = np.random.default_rng(4).integers(0, VOCAB, size=(2, 48))
    with use_impl("pallas"):
        jaxpr = str(jax.make_jaxpr(lambda t, x, c: forward(t, x, c))(
            target, jnp.zeros((2, 1), jnp.int32), init_cache(target, 2, 256)))
        got = _cached_logits(target, ids, 40, 4, 256, None)
    assert "pallas_call" in jaxpr
    assert rel_err(got, hf_logits(hf, ids)[:, 39:44]) <= 1e-4


def test_sliding_layers_read_only_their_window(hf_models):
    """Blockwise: a one-token step at position 300 with the sliding layers' cache slots 0..255 poisoned (NaN) gives
    the clean step's logits: the blocks wholly before the window (8) are never read."""
    target = dj.load_target(hf_models["gemma4"][0])
    ids = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, size=(1, 301)), jnp.int32)
    f = jax.jit(lambda t, x, c: forward(t, x, c, attn_impl="blockwise"))
    _, cache, _ = f(target, ids[:, :300], init_cache(target, 1, 1024))
    nan = lambda a: a.at[:, :, :, :256].set(jnp.nan)
    poisoned = cache.replace(sliding=cache.sliding.replace(k=nan(cache.sliding.k), v=nan(cache.sliding.v)))
    clean = np.asarray(lm_head(target, f(target, ids[:, 300:], cache)[0]))
    got = np.asarray(lm_head(target, f(target, ids[:, 300:], poisoned)[0]))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, clean, rtol=1e-6, atol=1e-6)


def test_multimodal_checkpoint_layout_loads_the_text_model(tmp_path):
    """Gemma4ForConditionalGeneration: text weights under model.language_model., the vision tower present and
    skipped, the text config under text_config (per-layer inputs and KV-shared layers included)."""
    from transformers import Gemma4Config as HFGemma4Config, Gemma4ForConditionalGeneration
    text = dict(FAMILIES["gemma4_ple"][2])
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(HFGemma4Config(text_config=text, vision_config=vision, audio_config=None))
    model = randomize_(model.float().eval())
    path = str(tmp_path / "mm")
    model.save_pretrained(path)
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "np") as st:
        names = list(st.keys())
    assert any(n.startswith("model.language_model.") for n in names) and any("vision_tower" in n for n in names)
    target = dj.load_target(path)
    ids = np.random.default_rng(6).integers(0, VOCAB, size=(1, 40))
    with torch.no_grad():
        ref = model(input_ids=torch.as_tensor(ids)).logits.float().numpy()
    assert rel_err(np.asarray(target_logits(target, ids)), ref) <= 1e-4


@pytest.mark.parametrize("family", ["gemma4_moe", "gemma4_ple"])
def test_save_load_roundtrip_is_read_by_transformers(hf_models, tmp_path, family):
    from transformers import Gemma4ForCausalLM
    target = dj.load_target(hf_models[family][0])
    out = str(tmp_path / "out")
    dj.save_target(target, out)
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["Gemma4ForCausalLM"]
    hf = Gemma4ForCausalLM.from_pretrained(out).float().eval()
    ids = np.random.default_rng(2).integers(0, VOCAB, size=(1, 30))
    assert rel_err(np.asarray(target_logits(target, ids)), hf_logits(hf, ids)) <= 1e-4
    assert rel_err(np.asarray(target_logits(dj.load_target(out), ids)), hf_logits(hf, ids)) <= 1e-4


@pytest.mark.parametrize("change,message", [
    (dict(use_bidirectional_attention="all"), "bidirectional"),
    (dict(hidden_activation="silu"), "hidden_activation 'silu'"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 2.0},
                           "full_attention": {"rope_type": "proportional", "rope_theta": 1e4}}), "rope_type 'yarn'"),
    (dict(num_kv_shared_layers=6), "num_kv_shared_layers=6"),
])
def test_unsupported_settings_are_a_clear_error(hf_models, tmp_path, change, message):
    path = str(tmp_path / "bad")
    shutil.copytree(hf_models["gemma4"][0], path)
    edit_config_json(path, **change)
    with pytest.raises(ValueError, match=message):
        dj.load_target(path)


def test_loads_onto_a_mesh(hf_models):
    """load_target(mesh=) places every tensor by sharding.param_spec; the placed target's logits are the same."""
    path = hf_models["gemma4"][0]
    ids = jnp.asarray([[3, 95, 7, 12]], jnp.int32)
    placed = dj.load_target(path, mesh=dj.make_mesh(data=1, model=1))
    assert placed.params["layers"][0]["q"].sharding.mesh.axis_names == ("data", "model")
    np.testing.assert_allclose(dj.target_logits(placed, ids), dj.target_logits(dj.load_target(path), ids), rtol=1e-5,
                               atol=1e-5)


def test_sharded_equals_single_device():
    """8 fake CPU devices in a subprocess (tests/gemma4_sharding_worker.py): on (2, 4) and (8, 1) meshes the heads,
    MLP width and experts split over 'model' (KV heads of both kinds replicated at model 4), rows over 'data'; a
    greedy chain and target-only decode the one-device tokens; a checkpoint loaded onto (2, 4) tensor by tensor holds
    the same params as the in-memory target placed there."""
    import json
    import os
    import subprocess
    import sys
    from tests.xla_env import subprocess_xla_flags
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=subprocess_xla_flags(),
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    worker = os.path.join(os.path.dirname(__file__), "gemma4_sharding_worker.py")
    p = subprocess.run([sys.executable, worker], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(res) == 7 and all(res.values()), res


def test_drafter_uses_scaled_embeddings_and_the_soft_cap(hf_models):
    """Block tokens are embedded with the target's sqrt(H) scale; draft logits are soft-capped once, by the drafter
    config's own cap when it has one, else by the target's."""
    target = dj.load_target(hf_models["gemma4"][0])
    toks = jnp.asarray([[3, 95, 7]], jnp.int32)
    np.testing.assert_allclose(embed(target, toks), target.params["embed"][toks] * 32 ** 0.5, rtol=1e-6)
    drafter = dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=95, seed=3, target_layer_ids=(1, 4))
    h = jnp.asarray(np.random.default_rng(7).normal(size=(2, 3, 32)) * 3, jnp.float32)
    raw = np.asarray(lm_head(target, h, softcap=0.0))
    assert np.abs(raw).max() > 5.0  # the cap bends these
    np.testing.assert_allclose(lm_head(target, h), 5 * np.tanh(raw / 5), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(draft_logits_from_hidden(drafter, target, h), 5 * np.tanh(raw / 5), rtol=1e-5, atol=1e-6)
    own = drafter.replace(config=dataclasses.replace(drafter.config, final_logit_softcapping=2.0))
    np.testing.assert_allclose(draft_logits_from_hidden(own, target, h), 2 * np.tanh(raw / 2), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------
V = 16


@pytest.fixture(scope="module")
def world():
    target = tiny_gemma4()
    return target, _train_drafter(target)


def _same(a, b, what):
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        assert x == y, f"{what}: row {i} differs\n spec   {x}\n target {y}"


def test_greedy_chains_and_trees_equal_target_only(world):
    """Ragged prompts, 40 new tokens (positions past 50: the window of 8 crossed many times): chains of 8 and 16 and a
    tree of 16 nodes commit target-only's tokens, with partial acceptance in every shape."""
    target, drafter = world
    rng = np.random.default_rng(100)
    ragged = [rng.integers(0, V, size=n).tolist() for n in (3, 15, 8)]
    ref = generate(target, None, ragged, max_new_tokens=40)
    for kw in (dict(block_size=8), dict(block_size=16), dict(tree_budget=16)):
        out = generate(target, drafter, ragged, max_new_tokens=40, **kw)
        _same(out, ref, str(kw))
        accs = [a for r in out.acceptance_lengths for a in r]
        assert any(a > 1 for a in accs) and any(a == 1 for a in accs), (kw, accs)


def test_sampled_equals_target_only_same_seed(world):
    target, drafter = world
    rng = np.random.default_rng(7)
    ragged = [rng.integers(0, V, size=n).tolist() for n in (4, 11)]
    kw = dict(max_new_tokens=30, temperature=1.0, seed=3)
    _same(generate(target, drafter, ragged, block_size=8, **kw), generate(target, None, ragged, **kw), "sampled chain")


def test_speculative_equals_target_only_on_a_released_layout_target(hf_models):
    """The 5:1 checkpoint with a random drafter: a chain, and a tree over a 640-slot cache (the blockwise path,
    windowed for the sliding layers, under the tree's ancestor mask)."""
    target = dj.load_target(hf_models["gemma4"][0])
    drafter = dj.init_drafter(target, num_layers=1, block_size=8, mask_token_id=95, seed=3, std=0.1,
                              target_layer_ids=(1, 4))
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 30, 17)]
    ref = generate(target, None, prompts, max_new_tokens=40)
    _same(generate(target, drafter, prompts, max_new_tokens=40, block_size=4), ref, "chain")
    _same(generate(target, drafter, prompts, max_new_tokens=40, tree_budget=12, max_cache_len=640), ref, "tree")


@pytest.mark.parametrize("family", ["gemma4_moe", "gemma4_ple"])
def test_bfloat16_logits_are_as_close_as_transformers_own(hf_models, family):
    """bf16 params and activations (norms, softmax, logits in fp32) are off the fp32 logits by no more than twice what
    transformers' own bf16 model is (these tiny random models are sensitive: scale-1 attention over normed q / k,
    routing flips)."""
    path, hf = hf_models[family]
    t32, t16 = dj.load_target(path), dj.load_target(path, dtype="bfloat16")
    assert t16.params["embed"].dtype == jnp.bfloat16
    ids = np.random.default_rng(8).integers(0, VOCAB, size=(1, 40))
    ref32 = hf_logits(hf, ids)
    ref16 = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids)
    ours = rel_err(np.asarray(target_logits(t16, ids)), np.asarray(target_logits(t32, ids)))
    assert ours <= 2 * rel_err(ref16, ref32), (ours, rel_err(ref16, ref32))


def test_engine_equals_generate():
    """The continuous-batching engine holds a Gemma4Cache (one KVCache per kind) and decodes generate()'s tokens."""
    from dflash_jax.engine import Engine, generate_all
    target = tiny_gemma4()
    drafter = dj.init_drafter(target, 1, 4, V - 1, seed=0, std=0.1, target_layer_ids=(1, 2))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, V - 1, size=n).tolist() for n in (3, 12, 7)]
    eng = Engine(target, drafter, slots=2, prompt_len=16, max_new_tokens=12, refill=1)
    got = generate_all(eng, prompts, max_new_tokens=12, stop_token_ids=[])
    ref = generate(target, drafter, prompts, max_new_tokens=12, stop_token_ids=[], max_cache_len=eng.S, block_size=None)
    assert [g.tokens for g in got] == ref.tokens


def ringed(target, ring_write=16):
    """The target with the sliding layers' ring caches sized for at most `ring_write` rows per call: window 8 + 16,
    rounded up: 128 slots."""
    c = target.config
    return target.replace(config=dataclasses.replace(c, gemma4=dataclasses.replace(c.gemma4, ring_write=ring_write)))


@pytest.mark.parametrize("family,impl", [("gemma4", "reference"), ("gemma4", "blockwise"), ("gemma4", "pallas"),
                                         ("gemma4_ple", "reference")])
def test_sliding_ring_caches_match_transformers(hf_models, family, impl):
    """The sliding layers' caches are 128-slot rings (slot = position mod 128) beside a 512-slot full cache: a
    150-token prompt (prefilled in chunks of 16), then 40 one-token steps up to position 190 (the rings wrapped):
    every step's logits match transformers' full forward (Pallas kernel interpreted)."""
    path, hf = hf_models[family]
    target = ringed(dj.load_target(path))
    cache = init_cache(target, 1, 512)
    assert (cache.sliding.size, cache.full.size, cache.sliding.ring) == (128, 512, True)
    ids = np.random.default_rng(13).integers(0, VOCAB, size=(1, 191))
    ref = hf_logits(hf, ids)[:, 149:190]
    with use_impl(impl):
        got = _cached_logits_chunked(target, ids, 150, 40, 512)
    assert rel_err(got, ref) <= 1e-4


def _cached_logits_chunked(target, ids, prompt, steps, size):
    from dflash_jax.decode.programs import prefill
    from dflash_jax.sampling import SamplingParams
    P = prompt
    st = prefill(target, None, jnp.asarray(ids[:, :P], jnp.int32), jnp.asarray([P], jnp.int32),
                 jnp.zeros((1,), jnp.int32), jax.random.PRNGKey(0), jnp.full((1, 4), -1, jnp.int32),
                 jnp.asarray([steps + 2], jnp.int32), S=size, Bk=1, sp=SamplingParams(), chunk=64)
    f = jax.jit(lambda t, x, c: forward(t, x, c))
    h, cache, _ = f(target, jnp.asarray(ids[:, P - 1:P], jnp.int32), st.tcache.rollback(jnp.asarray([P - 1])))
    got = [np.asarray(lm_head(target, h[:, -1]))]
    for t in range(P, P + steps):
        h, cache, _ = f(target, jnp.asarray(ids[:, t:t + 1], jnp.int32), cache)
        got.append(np.asarray(lm_head(target, h[:, -1])))
    return np.stack(got, axis=1)


def test_speculative_with_sliding_ring_caches_equals_target_only(world):
    """With 128-slot sliding rings (at most 16 rows per call), 100-token prompts and 60 new tokens (the rings wrap
    during decoding): target-only equals the full-length caches' output, and chains of 8 / 16 and a 15-node tree
    (verify and path compaction across the wrap) commit its tokens; a 31-node tree, wider than the rings allow, is
    refused with a message naming ring_write."""
    target, drafter = world
    ring = ringed(target)
    rng = np.random.default_rng(101)
    prompts = [rng.integers(0, V, size=n).tolist() for n in (100, 93)]
    ref = generate(target, None, prompts, max_new_tokens=60)
    _same(generate(ring, None, prompts, max_new_tokens=60), ref, "target-only on rings")
    for kw in (dict(block_size=8), dict(block_size=16), dict(tree_budget=15)):
        out = generate(ring, drafter, prompts, max_new_tokens=60, **kw)
        _same(out, ref, str(kw))
        assert any(a > 1 for r in out.acceptance_lengths for a in r), kw
    with pytest.raises(ValueError, match="ring_write"):
        generate(ring, drafter, prompts, max_new_tokens=8, tree_budget=31)


def test_engine_with_sliding_ring_caches_equals_generate():
    """The engine's slots hold 128-slot sliding rings beside 256-slot full caches (prompts of 40-60 tokens, 90 new:
    the rings wrap); its tokens equal generate()'s."""
    from dflash_jax.engine import Engine, generate_all
    target = ringed(tiny_gemma4())
    drafter = dj.init_drafter(target, 1, 4, V - 1, seed=0, std=0.1, target_layer_ids=(1, 2))
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, V - 1, size=n).tolist() for n in (60, 40, 52)]
    eng = Engine(target, drafter, slots=2, prompt_len=64, max_new_tokens=90, refill=1)
    eng.reset()
    assert (eng.state.dec.tcache.sliding.size, eng.S) == (128, 256)
    got = generate_all(eng, prompts, max_new_tokens=90, stop_token_ids=[])
    ref = generate(target, None, prompts, max_new_tokens=90, stop_token_ids=[], max_cache_len=eng.S)
    assert [g.tokens for g in got] == ref.tokens
