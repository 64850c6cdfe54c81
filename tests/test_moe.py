"""Mixture-of-experts targets (Qwen3-MoE, gpt-oss): parity with transformers, the two expert-compute
paths, MXFP4 checkpoints, save/load round trip, cached decoding, and lossless speculative decoding on
MoE targets. All fp32 on CPU, tiny random models (8 experts, top-2)."""
from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dflash_jax
from dflash_jax import generate, init_target, moe
from dflash_jax.config import TargetConfig
from dflash_jax.model import forward, init_cache, lm_head
from dflash_jax.st_io import SafetensorsDir, save_file
from tests.hf_utils import hf_logits, rel_err
from tests.xla_env import subprocess_xla_flags

PARITY_TOL = 1e-4


def _ids(B, T, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=(B, T)).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# Parity with transformers
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_logits_match_transformers(hf_models, family):
    path, hf = hf_models(family)
    ids = _ids(2, 40, 96, seed=1)  # 40 > the gpt-oss window (8): sliding layers really slide
    ref = hf_logits(hf, ids)
    for layout in ("unrolled", "stacked"):  # stacked: the dense/MoE choice of a mixed model is a lax.cond
        target = dflash_jax.load_target(path, layout=layout)
        c = target.config
        assert c.family == family and c.num_experts == 8 and c.num_experts_per_tok == 2
        if family == "qwen3_moe":
            assert c.sparse_layers == (True, False, True) and c.norm_topk_prob and c.qk_norm
        else:
            assert c.layer_windows == (8, 0) and c.attention_sinks and c.qkv_bias and c.o_bias
            assert dict(c.rope_scaling)["rope_type"] == "yarn"
        ours = np.asarray(dflash_jax.target_logits(target, ids))
        err = rel_err(ours, ref)
        assert err <= PARITY_TOL, f"{family}/{layout}: relative logit error {err:.3e}"


def test_gpt_oss_features_are_exercised(hf_models):
    """Each gpt-oss feature changes the logits far beyond the parity tolerance, so the parity test
    checks all of them: the sliding window, the sinks, YaRN and the qwen3-moe renormalisation."""
    path, hf = hf_models("gpt_oss")
    target = dflash_jax.load_target(path)
    ids = _ids(1, 40, 96, seed=2)
    ref = hf_logits(hf, ids)
    c = target.config
    no_sinks = target.replace(params=dict(target.params, layers=tuple(
        dict(lp, sinks=jnp.full_like(lp["sinks"], -1e9)) for lp in target.params["layers"])))
    variants = {"no window": target.replace(config=dataclasses.replace(c, layer_windows=(0, 0))),
                "no sinks": no_sinks,
                "no yarn": target.replace(config=dataclasses.replace(c, rope_scaling=None))}
    for name, t in variants.items():
        err = rel_err(np.asarray(dflash_jax.target_logits(t, ids)), ref)
        assert err > 100 * PARITY_TOL, (name, err)
    qpath, qhf = hf_models("qwen3_moe")
    qt = dflash_jax.load_target(qpath)
    unnorm = qt.replace(config=dataclasses.replace(qt.config, norm_topk_prob=False))
    assert rel_err(np.asarray(dflash_jax.target_logits(unnorm, ids)), hf_logits(qhf, ids)) > 100 * PARITY_TOL


def test_unsupported_moe_config_errors(hf_models, tmp_path):
    path, _ = hf_models("gpt_oss")
    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    from tests.hf_utils import edit_config_json
    edit_config_json(bad, layer_types=["sliding_attention", "chunked_attention"])
    with pytest.raises(ValueError, match="layer_types"):
        dflash_jax.load_target(bad)


# ----------------------------------------------------------------------------------------------
# Expert compute: gathered (few tokens) == grouped (ragged_dot) == dense reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_gathered_equals_grouped_equals_dense(family):
    E, H, I, k, N = 8, 16, 24, 2, 11
    c = TargetConfig(family=family, vocab_size=32, hidden_size=H, intermediate_size=I, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=8, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I,
                     norm_topk_prob=True, swiglu_limit=0.5)  # a low limit: the clamps bite
    rng = np.random.default_rng(0)
    lp = {"router": rng.normal(size=(H, E)), "e_gate": rng.normal(size=(E, H, I)), "e_up": rng.normal(size=(E, H, I)),
          "e_down": rng.normal(size=(E, I, H)) * 0.3}
    if family == "gpt_oss":
        lp.update(router_bias=rng.normal(size=(E,)), e_gate_bias=rng.normal(size=(E, I)),
                  e_up_bias=rng.normal(size=(E, I)), e_down_bias=rng.normal(size=(E, H)))
    lp = {k_: jnp.asarray(v, jnp.float32) for k_, v in lp.items()}
    x = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
    w, idx = moe.route(c, lp, x)
    a = np.asarray(moe.experts_gathered(c, lp, x, w, idx))
    b = np.asarray(moe.experts_grouped(c, lp, x, w, idx))
    # dense numpy reference: every expert on every token, combined with the routing weights
    wd = np.zeros((N, E))
    np.put_along_axis(wd, np.asarray(idx), np.asarray(w), axis=1)
    ref = np.zeros((N, H))
    for e in range(E):
        g = np.asarray(x) @ np.asarray(lp["e_gate"][e]) + (np.asarray(lp["e_gate_bias"][e]) if "e_gate_bias" in lp else 0)
        u = np.asarray(x) @ np.asarray(lp["e_up"][e]) + (np.asarray(lp["e_up_bias"][e]) if "e_up_bias" in lp else 0)
        act = np.asarray(moe.activation(c, jnp.asarray(g), jnp.asarray(u)))
        y = act @ np.asarray(lp["e_down"][e]) + (np.asarray(lp["e_down_bias"][e]) if "e_down_bias" in lp else 0)
        ref += wd[:, e:e + 1] * y
    assert rel_err(a, ref) < 1e-5 and rel_err(b, ref) < 1e-5
    if family == "gpt_oss":  # the clamp is active on this data
        assert np.any(np.abs(np.asarray(x @ lp["e_up"][0])) > c.swiglu_limit)
    # weights: softmax of the top-k logits (gpt-oss) or renormalised top-k probabilities (qwen3-moe)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)


def test_activation_matches_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    ex = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2))
    gu = torch.linspace(-12, 12, 2 * 6 * 5).reshape(5, 12)
    ref = ex._apply_gate(gu).numpy()
    c = TargetConfig(family="gpt_oss", vocab_size=8, hidden_size=8, intermediate_size=6, num_layers=1, num_heads=1,
                     num_kv_heads=1, head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=6)
    g, u = jnp.asarray(gu.numpy()[:, 0::2]), jnp.asarray(gu.numpy()[:, 1::2])
    np.testing.assert_allclose(np.asarray(moe.activation(c, g, u)), ref, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# MXFP4 checkpoints
# ----------------------------------------------------------------------------------------------
def test_mxfp4_dequant_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 5, 2, 16), dtype=np.uint8)  # every nibble code
    scales = rng.integers(120, 134, size=(3, 5, 2), dtype=np.uint8)
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    ours = moe.mxfp4_dequant(blocks, scales)  # [3, 5, 64]; transformers also transposes the last two axes
    np.testing.assert_array_equal(np.swapaxes(ours, 1, 2), ref.numpy())
    # our test quantiser round-trips values that are exactly representable
    q_blocks, q_scales = moe.mxfp4_quantize(ours)
    np.testing.assert_array_equal(moe.mxfp4_dequant(q_blocks, q_scales), ours)


def test_gpt_oss_mxfp4_checkpoint(hf_models, tmp_path):
    """A checkpoint whose experts ship as *_blocks + *_scales: we dequantise on load and match the
    transformers model carrying the same (dequantised) weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    path, hf = hf_models("gpt_oss")
    q = str(tmp_path / "mxfp4")
    shutil.copytree(path, q)
    hf_q = type(hf)(hf.config).eval()
    hf_q.load_state_dict(hf.state_dict())
    st = SafetensorsDir(path)
    tensors = {n: np.array(st.get(n)) for n in st.keys()}
    with torch.no_grad():
        for i, layer in enumerate(hf_q.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{i}.mlp.experts.{proj}"
                w = tensors.pop(name)  # [E, in, out]
                blocks, scales = moe.mxfp4_quantize(np.swapaxes(w, 1, 2))  # packed along `in`
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
                deq = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                 dtype=torch.float32)
                assert 0 < float((deq - torch.from_numpy(w)).abs().max()) < 0.5  # really quantised
                getattr(layer.mlp.experts, proj).copy_(deq)
    os.remove(os.path.join(q, "model.safetensors"))
    save_file(tensors, os.path.join(q, "model.safetensors"), metadata={"format": "pt"})
    target = dflash_jax.load_target(q)
    ids = _ids(2, 24, 96, seed=3)
    ref = hf_logits(hf_q, ids)
    assert rel_err(np.asarray(dflash_jax.target_logits(target, ids)), ref) <= PARITY_TOL
    assert rel_err(hf_logits(hf, ids), ref) > 10 * PARITY_TOL  # the quantisation is visible in the logits


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_save_load_round_trip(hf_models, tmp_path, family):
    """save_target writes an HF checkpoint transformers loads (same logits), and we load it back exactly."""
    path, hf = hf_models(family)
    target = dflash_jax.load_target(path, layout="stacked")
    out = str(tmp_path / "resaved")
    dflash_jax.save_target(target, out)
    back = dflash_jax.load_target(out, layout="stacked")
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(target.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back.config == target.config
    hf2 = type(hf).from_pretrained(out, dtype=torch.float32).eval()
    ids = _ids(1, 20, 96, seed=4)
    assert rel_err(hf_logits(hf2, ids), hf_logits(hf, ids)) <= 1e-6


# ----------------------------------------------------------------------------------------------
# Cached decoding (decode steps take the gathered path) == full forward (grouped path)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_cached_decoding_equals_full_forward(hf_models, family):
    target = dflash_jax.load_target(hf_models(family)[0])
    B, P, N = 2, 6, 14  # decode runs past the gpt-oss window (8)
    seq = _ids(B, P + N, 96, seed=5)
    full = np.asarray(dflash_jax.target_logits(target, seq))
    fwd = jax.jit(forward)
    head = jax.jit(lm_head)
    h, cache, _ = fwd(target, jnp.asarray(seq[:, :P]), init_cache(target, B, 32))
    got = [np.asarray(head(target, h))]
    for t in range(P, P + N):
        h, cache, _ = fwd(target, jnp.asarray(seq[:, t:t + 1]), cache)  # B * top-2 = 4 < 8 experts: gathered
        got.append(np.asarray(head(target, h)))
    assert rel_err(np.concatenate(got, axis=1), full) <= 1e-5


# ----------------------------------------------------------------------------------------------
# Lossless speculative decoding on MoE targets
# ----------------------------------------------------------------------------------------------
def _moe_target(family):
    from tests.test_lossless import V
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
              head_dim=16, max_position_embeddings=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if family == "qwen3_moe":
        cfg = TargetConfig(family=family, qk_norm=True, norm_topk_prob=True, **kw)
    else:
        cfg = TargetConfig(family=family, qkv_bias=True, o_bias=True, layer_windows=(6, 0), attention_sinks=True,
                           rope_scaling=(("factor", 4.0), ("original_max_position_embeddings", 16),
                                         ("rope_type", "yarn")), **kw)
    return init_target(cfg, seed=1, std=0.6)


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def moe_world(request):
    from tests.test_lossless import TAPS, _train_drafter
    target = _moe_target(request.param)
    assert all(target.config.is_sparse(i) for i in TAPS)  # the drafter taps MoE layers
    return target, _train_drafter(target, steps=60)


def test_moe_greedy_and_sampled_speculative_equal_target_only(moe_world):
    """Greedy and same-seed sampled speculative decoding == target-only decoding, with a drafter
    that agrees often enough for acceptance and rollback. (The sampled distribution itself is
    family-independent and checked in tests/test_lossless.py.)"""
    from tests.test_lossless import MAX_NEW, V, _same
    target, drafter = moe_world
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, V, size=n).tolist() for n in (3, 14, 8)]
    # one row, block 2: the verify pass routes 1 x 2 tokens x top-2 < 8 experts (gathered path)
    single = generate(target, drafter, prompts[:1], max_new_tokens=MAX_NEW, block_size=2)
    _same(single, generate(target, None, prompts[:1], max_new_tokens=MAX_NEW), "single, block 2")
    # a ragged batch, block 16: grouped (ragged_dot) verify
    ref = generate(target, None, prompts, max_new_tokens=MAX_NEW)
    out = generate(target, drafter, prompts, max_new_tokens=MAX_NEW, block_size=None)
    _same(out, ref, "ragged, block 16")
    accs = [a for row in out.acceptance_lengths + single.acceptance_lengths for a in row]
    assert any(a > 1 for a in accs) and min(accs) == 1, accs  # acceptance and rollback both happen
    sp = dict(temperature=0.8, top_k=6, seed=3)
    sref = generate(target, None, prompts, max_new_tokens=MAX_NEW, **sp)
    _same(generate(target, drafter, prompts, max_new_tokens=MAX_NEW, block_size=None, **sp), sref, "sampled")
    assert sref.tokens != ref.tokens


# ----------------------------------------------------------------------------------------------
# Expert parallelism: 8 fake CPU devices == one device
# ----------------------------------------------------------------------------------------------
def test_expert_parallel_equals_single_device(tmp_path):
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = subprocess_xla_flags()  # the worker adds its device count
    p = subprocess.run([sys.executable, os.path.join(root, "tests", "moe_sharding_worker.py"), str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=900, cwd=root)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
    assert r["devices"] == 8
    for fam, res in r["families"].items():
        for case, v in res.items():
            if case == "load":
                continue
            if case.startswith("all_to_all"):
                assert v == {"spec_equal": True, "spec_equals_target_only": True}, (fam, case, v)
                continue
            assert v == {"target_only_equal": True, "spec_equal": True, "spec_equals_target_only": True}, (fam, case, v)
    assert set(r["families"]) == {"qwen3_moe", "gpt_oss"}
    assert "all_to_all (2, 4)/greedy" in r["families"]["qwen3_moe"]  # the other combine of expert parallelism
    ld = r["families"]["qwen3_moe"]["load"]  # [L, E/4, H, I] per device on mesh (2, 4)
    assert ld["e_gate_spec"] == ["None", "model"] and ld["e_gate_shard"] == [3, 16 // 4, 32, 32], ld
    assert ld["tokens_equal"]


# ----------------------------------------------------------------------------------------------
# Drafter training on a MoE target, end to end (data generation, training, export, decoding)
# ----------------------------------------------------------------------------------------------
def test_moe_training_end_to_end(tmp_path):
    from dflash_jax import load_drafter, load_target, save_target
    from dflash_jax.training.config import config_from_dict
    from dflash_jax.training.data import generate_data
    from dflash_jax.training.pipeline import ensure_target, export, train
    from dflash_jax.training.testing import tiny_config_dict, write_id_prompts
    quiet = dict(log=lambda *_: None)
    root = str(tmp_path)
    write_id_prompts(f"{root}/prompts.jsonl", 48, seed=0)
    cfg = config_from_dict(tiny_config_dict(root, train={"steps": 30, "batch_size": 8},
                                            data={"generation": {"max_new_tokens": 24, "batch_size": 48}},
                                            checkpoint={"every_steps": 30}, log={"every_steps": 10}))
    ensure_target(cfg, **quiet)  # random dense target + tokenizer; then swap in a MoE target of the same vocab
    dense = load_target(cfg.target.path).config
    mcfg = TargetConfig(family="qwen3_moe", vocab_size=dense.vocab_size, hidden_size=64, intermediate_size=128,
                        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, num_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                        eos_token_ids=dense.eos_token_ids, sparse_layers=(True, True, False, True))
    save_target(init_target(mcfg, seed=0, std=0.1), cfg.target.path)
    generate_data(cfg, progress=False, **quiet)
    out = train(cfg, resume=False, progress=False, **quiet)
    assert out["final_step"] == 30
    assert np.isfinite(out["train_last"]["loss"]) and out["train_last"]["loss"] < out["eval_before"]["loss"]
    target = load_target(cfg.target.path)
    assert target.config.family == "qwen3_moe"
    drafter = load_drafter(export(cfg, **quiet), target)  # taps layers 1 (MoE) and 3 (MoE)
    assert drafter.config.target_layer_ids == (1, 3)
    prompts = [[5, 9, 11, 40], [7, 8, 9, 10, 11, 12]]
    assert (generate(target, drafter, prompts, max_new_tokens=16, stop_token_ids=[], block_size=None).tokens
            == generate(target, None, prompts, max_new_tokens=16, stop_token_ids=[]).tokens)


@pytest.mark.parametrize("target_dir, drafter_dir, block, taps", [
    ("gpt-oss-20b", "gpt-oss-20b-dflash", 8, (1, 6, 11, 16, 21)),
    ("qwen3-30b-a3b", "qwen3-coder-30b-a3b-dflash", 16, (1, 12, 23, 34, 45)),
])
def test_published_moe_drafter_configs_load_against_their_targets(target_dir, drafter_dir, block, taps):
    """The authors' drafter configs for MoE targets (configs/models, see its README) parse, match their
    target (widths, vocabulary, depth, taps in range) and tap MoE layers; the gpt-oss drafter's biased
    projections are read (its checkpoint carries q/k/v/o biases, which load_drafter then expects)."""
    from types import SimpleNamespace

    from dflash_jax.config import DrafterConfig, read_config_json
    from dflash_jax.drafter import check_compatible
    from dflash_jax.weights import drafter_hf_expected as _hf_expected
    root = os.path.join(os.path.dirname(__file__), "..", "configs", "models")
    tc = TargetConfig.from_hf(read_config_json(os.path.join(root, target_dir)))
    dc = DrafterConfig.from_hf(read_config_json(os.path.join(root, drafter_dir)))
    check_compatible(dc, SimpleNamespace(config=tc))
    assert dc.block_size == block and dc.target_layer_ids == taps and dc.num_layers == 8
    assert all(tc.is_sparse(i) for i in dc.target_layer_ids)  # every tap is a MoE layer's output
    biases = [n for n in _hf_expected(dc) if n.endswith("_proj.bias")]
    assert dc.attention_bias == (target_dir == "gpt-oss-20b")
    assert len(biases) == (4 * dc.num_layers if dc.attention_bias else 0)
