"""Checkpoint loading/saving: clear errors for bad checkpoints and bad inputs, sharded checkpoints,
save_target -> load_target round trip, and transformers loading what save_target wrote."""
from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

import dflash_jax
from dflash_jax.config import TargetConfig
from tests.hf_utils import LLAMA3_ROPE, edit_config_json, hf_logits, make_hf_model, rel_err


@pytest.fixture
def ckpt(hf_models, tmp_path):
    """A fresh, editable copy of a tiny LLaMA checkpoint."""
    src, _ = hf_models("llama")
    dst = str(tmp_path / "ckpt")
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, fn):
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------
# 6. Errors
# ----------------------------------------------------------------------------------------------
def test_loads_clean_copy(ckpt):
    t = dflash_jax.load_target(ckpt)
    assert t.config.family == "llama" and t.config.num_layers == 2


def test_unsupported_architecture(ckpt):
    edit_config_json(ckpt, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ValueError, match=r"unsupported architecture.*MistralForCausalLM"):
        dflash_jax.load_target(ckpt)


def test_unknown_model_type_without_architectures(ckpt):
    edit_config_json(ckpt, architectures=None, model_type="gpt2")
    with pytest.raises(ValueError, match=r"unknown model_type 'gpt2'"):
        dflash_jax.load_target(ckpt)


def test_missing_config_key(ckpt):
    edit_config_json(ckpt, hidden_size=None)
    with pytest.raises(ValueError, match=r"missing required key 'hidden_size'"):
        dflash_jax.load_target(ckpt)


def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        dflash_jax.load_target(ckpt)


def test_missing_lm_head_when_untied(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing tensor.*lm_head\.weight"):
        dflash_jax.load_target(ckpt)


def test_unexpected_tensor(ckpt):
    def add(t):
        t["model.layers.0.self_attn.extra_proj.weight"] = np.zeros((4, 4), np.float32)
    _edit_tensors(ckpt, add)
    with pytest.raises(ValueError, match=r"unexpected tensor.*model\.layers\.0\.self_attn\.extra_proj\.weight"):
        dflash_jax.load_target(ckpt)


def test_unexpected_bias_when_config_has_none(ckpt):
    def add(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros((32,), np.float32)
    _edit_tensors(ckpt, add)
    with pytest.raises(ValueError, match=r"unexpected tensor.*q_proj\.bias"):
        dflash_jax.load_target(ckpt)


def test_wrong_tensor_shape(ckpt):
    def bad(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)  # expected (16, 32)
    _edit_tensors(ckpt, bad)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*shape \(8, 32\).*\(16, 32\)"):
        dflash_jax.load_target(ckpt)


def test_config_disagrees_with_tensors(ckpt):
    edit_config_json(ckpt, intermediate_size=48)
    with pytest.raises(ValueError, match=r"gate_proj\.weight.*shape \(64, 32\), expected \(48, 32\)"):
        dflash_jax.load_target(ckpt)


def test_missing_config_json(ckpt):
    os.remove(os.path.join(ckpt, "config.json"))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        dflash_jax.load_target(ckpt)


def test_missing_safetensors(ckpt):
    os.remove(os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        dflash_jax.load_target(ckpt)


def test_nonexistent_path(tmp_path):
    missing = str(tmp_path / "does_not_exist")
    with pytest.raises(FileNotFoundError, match=r"does_not_exist.*does not exist"):
        dflash_jax.load_target(missing)


def test_path_is_a_file(ckpt):
    with pytest.raises(ValueError, match=r"is a file; expected a model directory"):
        dflash_jax.load_target(os.path.join(ckpt, "config.json"))


@pytest.fixture(scope="module")
def small_target(hf_models):
    path, _ = hf_models("llama")
    return dflash_jax.load_target(path)


def test_prompt_longer_than_cache(small_target):
    with pytest.raises(ValueError, match=r"exceeds the cache \(16 slots\)"):
        dflash_jax.generate(small_target, None, [list(range(1, 13))], max_new_tokens=8, max_cache_len=16)
    with pytest.raises(ValueError, match=r"exceeds the cache"):  # the prompt alone is too long
        dflash_jax.generate(small_target, None, [[3] * 40], max_new_tokens=1, max_cache_len=32)


def test_cache_len_boundary(small_target):
    """max_cache_len = prompt + max_new_tokens + 1 is enough (same tokens as the default cache); one less is not."""
    prompt = [5, 9, 11, 3, 7, 8, 1, 4, 6, 2, 10, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 20 tokens: bucket 32 > cache
    ref = dflash_jax.generate(small_target, None, [prompt], max_new_tokens=3, stop_token_ids=[]).tokens
    got = dflash_jax.generate(small_target, None, [prompt], max_new_tokens=3, stop_token_ids=[], max_cache_len=24)
    assert got.tokens == ref and len(ref[0]) == 3
    with pytest.raises(ValueError, match=r"= 24 exceeds the cache \(23 slots\)"):
        dflash_jax.generate(small_target, None, [prompt], max_new_tokens=3, max_cache_len=23)


def test_prompt_longer_than_max_positions(small_target):
    with pytest.raises(ValueError, match=r"exceeds the model's max_position_embeddings \(512\)"):
        dflash_jax.generate(small_target, None, [[3] * 513], max_new_tokens=1)


def test_token_ids_out_of_range(small_target):
    V = small_target.config.vocab_size
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {V}\).*{V}"):
        dflash_jax.generate(small_target, None, [[1, 2, 3], [4, V, 5]], max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {V}\)"):
        dflash_jax.generate(small_target, None, [[1, -1]], max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {V}\)"):
        dflash_jax.target_logits(small_target, [[0, V + 7]])


def test_empty_prompts(small_target):
    with pytest.raises(ValueError, match="prompts is empty"):
        dflash_jax.generate(small_target, None, [], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        dflash_jax.generate(small_target, None, [[1], []], max_new_tokens=2)


# ----------------------------------------------------------------------------------------------
# Sharded checkpoints and dtype
# ----------------------------------------------------------------------------------------------
def test_sharded_checkpoint_equals_single_file(hf_models, tmp_path):
    path, hf = hf_models("qwen3")
    sharded, _ = make_hf_model(tmp_path, "qwen3", name="sharded", max_shard_size="20KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    a, b = dflash_jax.load_target(path), dflash_jax.load_target(sharded)
    assert a.config == b.config
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bf16_load(hf_models):
    path, hf = hf_models("qwen3")
    t = dflash_jax.load_target(path, dtype="bfloat16")
    assert {str(x.dtype) for x in jax.tree_util.tree_leaves(t.params)} == {"bfloat16"}
    ids = np.arange(24, dtype=np.int32)[None] * 5 % t.config.vocab_size
    logits = np.asarray(dflash_jax.target_logits(t, ids))
    assert logits.dtype == np.float32
    assert rel_err(logits, hf_logits(hf, ids)) < 5e-2


# ----------------------------------------------------------------------------------------------
# 8. save_target round trip and transformers compatibility
# ----------------------------------------------------------------------------------------------
ROUND_TRIP = {
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3", dict(tie_word_embeddings=True)),
    "llama3_rope": ("llama", dict(rope_scaling=LLAMA3_ROPE, attention_bias=True)),
    "qwen2": ("qwen2", {}),
}


@pytest.mark.parametrize("variant", list(ROUND_TRIP))
def test_save_load_round_trip_and_transformers(hf_models, tmp_path, variant):
    family, overrides = ROUND_TRIP[variant]
    src, hf = hf_models(family, **overrides)
    t1 = dflash_jax.load_target(src)
    out = str(tmp_path / "saved")
    dflash_jax.save_target(t1, out)
    with open(os.path.join(out, "config.json")) as f:
        saved_cfg = json.load(f)
    assert TargetConfig.from_hf(saved_cfg) == t1.config

    # exact round trip through our loader
    t2 = dflash_jax.load_target(out)
    assert t2.config == t1.config
    assert jax.tree_util.tree_structure(t2.params) == jax.tree_util.tree_structure(t1.params)
    for x, y in zip(jax.tree_util.tree_leaves(t1.params), jax.tree_util.tree_leaves(t2.params)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # transformers loads it and computes the same function as the original HF model
    hf2 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf2) is type(hf)
    ids = np.random.default_rng(0).integers(0, t1.config.vocab_size, size=(2, 40))
    ref = hf_logits(hf, ids)
    got = hf_logits(hf2, ids)
    assert rel_err(got, ref) <= 1e-6
    assert rel_err(np.asarray(dflash_jax.target_logits(t2, ids)), got) <= 1e-4


def test_save_init_target_loads_in_transformers(tmp_path):
    """A target made by init_target (not from HF) is written in a layout transformers accepts."""
    cfg = TargetConfig(family="qwen2", vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, max_position_embeddings=128,
                       qkv_bias=True, eos_token_ids=(5, 6))
    t = dflash_jax.init_target(cfg, seed=1, std=0.15)
    rng = np.random.default_rng(2)
    layers = dict(t.params["layers"])
    for k in ("q_bias", "k_bias", "v_bias", "input_norm", "post_norm"):
        layers[k] = layers[k] + rng.normal(0, 0.2, size=layers[k].shape).astype(np.float32)
    t = t.replace(params=dict(t.params, layers=layers))
    out = str(tmp_path / "from_init")
    dflash_jax.save_target(t, out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.eos_token_id == [5, 6]
    ids = rng.integers(0, 80, size=(1, 30))
    assert rel_err(np.asarray(dflash_jax.target_logits(t, ids)), hf_logits(hf, ids)) <= 1e-4
