"""Hybrid targets (Qwen3.5 / Qwen3-Next: Gated DeltaNet + gated attention): parity with transformers in the released
checkpoint layouts, cached decoding == one full forward, commit of a verified block == prefilling the kept rows, and
lossless speculative decoding (chains and trees, greedy and sampled) over the recurrent state."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dflash_jax as dj
from dflash_jax import generate, init_target, target_logits
from dflash_jax.config import GDNConfig, TargetConfig
from dflash_jax.model import forward, init_cache

from .hf_utils import hf_logits, make_hf_model, randomize_, rel_err
from .test_lossless import _train_drafter


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {fam: make_hf_model(root, fam) for fam in ("qwen3_5", "qwen3_next", "qwen3_5_moe", "qwen3_next_moe")}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5_moe", "qwen3_next_moe"])
def test_logits_match_transformers(hf_models, family):
    """Full forward over 150 tokens (several sub-blocks of the chunked delta rule), ragged content, fp32; the MoE
    variants with routed experts, the gated shared expert and (Qwen3-Next) a dense layer between MoE ones."""
    path, hf = hf_models[family]
    target = dj.load_target(path)
    assert target.config.is_hybrid and target.config.layer_types.count("full") >= 1
    if "moe" in family:
        assert target.config.num_experts == 8 and target.config.shared_expert_size == 40
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 150))
    assert rel_err(np.asarray(target_logits(target, ids)), hf_logits(hf, ids)) <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_cached_step_by_step_logits_match_transformers(hf_models, family):
    """A 150-token prompt into the cache (one prefill pass over three sub-blocks), then 10 one-token steps on the
    recurrent state and the KV cache: every step's logits match transformers' full forward at that position."""
    from dflash_jax.model import lm_head
    path, hf = hf_models[family]
    target = dj.load_target(path)
    ids = np.random.default_rng(3).integers(0, 96, size=(1, 160))
    ref = hf_logits(hf, ids)
    step = jax.jit(forward)
    h, cache, _ = step(target, jnp.asarray(ids[:, :150], jnp.int32), init_cache(target, 1, 256))
    got = [np.asarray(lm_head(target, h[:, -1]))]
    for t in range(150, 159):
        h, cache, _ = step(target, jnp.asarray(ids[:, t:t + 1], jnp.int32), cache)
        got.append(np.asarray(lm_head(target, h[:, -1])))
    assert rel_err(np.stack(got, axis=1), ref[:, 149:159]) <= 1e-4


def test_fused_expert_tensors_load(hf_models, tmp_path):
    """Expert weights stored fused (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) load as the
    per-expert ones do."""
    import shutil
    from safetensors.numpy import load_file, save_file
    src, hf = hf_models["qwen3_5_moe"]
    path = str(tmp_path / "fused")
    shutil.copytree(src, path)
    st = load_file(os.path.join(path, "model.safetensors"))
    cfg = json.load(open(os.path.join(path, "config.json")))
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}.mlp.experts."
        per = lambda k: [st.pop(f"{b}{e}.{k}_proj.weight") for e in range(cfg["num_experts"])]
        g, u, d = per("gate"), per("up"), per("down")
        st[b + "gate_up_proj"] = np.stack([np.concatenate([a, c]) for a, c in zip(g, u)])
        st[b + "down_proj"] = np.stack(d)
    save_file(st, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    target = dj.load_target(path)
    ids = np.random.default_rng(9).integers(0, 96, size=(1, 30))
    assert rel_err(np.asarray(target_logits(target, ids)), hf_logits(hf, ids)) <= 1e-4


def test_multimodal_checkpoint_layout_loads_the_text_model(tmp_path):
    """Qwen3_5ForConditionalGeneration: text weights under model.language_model., the vision tower and mtp.* tensors
    present and skipped, the text config nested under text_config."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from .hf_utils import FAMILIES
    text = dict(FAMILIES["qwen3_5"][2])
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).float().eval()
    randomize_(model)
    path = str(tmp_path / "mm")
    model.save_pretrained(path)
    from safetensors.numpy import load_file, save_file
    st = load_file(os.path.join(path, "model.safetensors"))
    assert any(k.startswith("model.language_model.") for k in st) and any("visual" in k for k in st)
    st["mtp.fc.weight"] = np.zeros((4, 4), np.float32)  # a multi-token-prediction head: not part of the target
    save_file(st, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    target = dj.load_target(path)
    ids = np.random.default_rng(1).integers(0, 96, size=(1, 40))
    with torch.no_grad():
        ref = model(input_ids=torch.as_tensor(ids)).logits.float().numpy()
    assert rel_err(np.asarray(target_logits(target, ids)), ref) <= 1e-4


def test_save_load_roundtrip_is_read_by_transformers(hf_models, tmp_path):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM
    target = dj.load_target(hf_models["qwen3_5"][0])
    dj.save_target(target, str(tmp_path / "out"))
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert cfg["layer_types"].count("full_attention") == target.config.layer_types.count("full")
    hf = Qwen3_5ForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
    ids = np.random.default_rng(2).integers(0, 96, size=(1, 30))
    assert rel_err(np.asarray(target_logits(target, ids)), hf_logits(hf, ids)) <= 1e-4


def test_bfloat16_load_decodes_like_float32(hf_models):
    """bf16 params and activations (the recurrent state stays fp32): our bf16 logits are no further from fp32 than
    transformers' own bf16 run of the same model (this tiny random hybrid amplifies rounding: both ~0.4). (Decoding
    in bf16 on XLA:CPU stops at a bf16 x bf16 -> f32 dot it does not implement, for every family.)"""
    import copy
    path, hf = hf_models["qwen3_5"]
    t16 = dj.load_target(path, dtype="bfloat16")
    assert t16.params["embed"].dtype == jnp.bfloat16
    ids = np.random.default_rng(4).integers(0, 96, size=(1, 40))
    ref = hf_logits(hf, ids)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    with torch.no_grad():
        ref16 = hf16(input_ids=torch.as_tensor(ids)).logits.float().numpy()
    ours = rel_err(np.asarray(target_logits(t16, ids)), ref)
    assert ours <= 1.25 * rel_err(ref16, ref), (ours, rel_err(ref16, ref))


def test_bad_layer_types_are_a_clear_error(hf_models, tmp_path):
    from .hf_utils import edit_config_json
    import shutil
    path = str(tmp_path / "bad")
    shutil.copytree(hf_models["qwen3_5"][0], path)
    edit_config_json(path, layer_types=["linear_attention", "mamba2_attention"] * 3)
    with pytest.raises(ValueError, match=r"unsupported layer kind\(s\) \['mamba2_attention'\]"):
        dj.load_target(path)


# ----------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------
V = 16


def tiny_hybrid(seed=1, std=0.6):
    cfg = TargetConfig(family="qwen3_5", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=4,
                       num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, max_position_embeddings=512,
                       layer_types=("linear", "linear", "full", "linear"), gdn=GDNConfig(2, 4, 8, 6, 4),
                       partial_rotary_factor=0.5, attn_output_gate=True, zero_centered_norms=True)
    return init_target(cfg, seed=seed, std=std)


@pytest.fixture(scope="module")
def world():
    target = tiny_hybrid()
    return target, _train_drafter(target)


def test_cached_decoding_equals_full_forward(world):
    """generate (chunked prefill of a ragged batch, then one-token steps on the recurrent state) == an argmax loop
    of full forwards (checked teacher-forced: the output is each position's argmax of one forward over it)."""
    target, _ = world
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, V, size=n).tolist() for n in (3, 40, 17)]
    out = generate(target, None, prompts, max_new_tokens=12)
    for p, toks in zip(prompts, out.tokens):  # teacher-forced: one full forward over prompt + output
        logits = np.asarray(target_logits(target, [p + toks]))[0]
        assert toks == [int(x) for x in logits[len(p) - 1:len(p) + len(toks) - 1].argmax(-1)]


def test_prefill_chunks_equal_one_pass(world):
    """A 64-token bucket prefilled in chunks of 16 (the recurrent state carried across chunks, padding rows masked)
    leaves the same state and first token as one pass."""
    from dflash_jax.decode.programs import prefill
    from dflash_jax.sampling import SamplingParams
    target, _ = world
    rng = np.random.default_rng(4)
    lens = np.array([5, 64, 33])
    toks = np.zeros((3, 64), np.int32)
    for b, n in enumerate(lens):
        toks[b, :n] = rng.integers(0, V, size=n)
    args = (target, None, jnp.asarray(toks), jnp.asarray(lens, jnp.int32), jnp.arange(3), jax.random.PRNGKey(0),
            jnp.full((3, 4), -1, jnp.int32), jnp.full((3,), 8, jnp.int32))
    kw = dict(S=128, Bk=1, sp=SamplingParams())
    one = prefill(*args, **kw, chunk=None)
    many = prefill(*args, **kw, chunk=16)
    np.testing.assert_array_equal(one.anchor, many.anchor)
    np.testing.assert_allclose(one.tcache.lin.rec, many.tcache.lin.rec, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(one.tcache.lin.conv, many.tcache.lin.conv, rtol=1e-4, atol=1e-3)  # values ~5
    with pytest.raises(ValueError, match="multiple of the prefill chunk"):
        prefill(*args, **kw, chunk=24)


def test_commit_equals_prefilling_the_kept_rows(world):
    """Verify a block of 6 rows, commit n = 0 / 1 / 4 / 6 rows: the recurrent state and the next logits equal those of a
    cache that was fed only the kept rows."""
    target, _ = world
    rng = np.random.default_rng(5)
    B, P, W = 4, 9, 6
    ctx = jnp.asarray(rng.integers(0, V, size=(B, P)), jnp.int32)
    blk = jnp.asarray(rng.integers(0, V, size=(B, W)), jnp.int32)
    n = jnp.asarray([0, 1, 4, 6], jnp.int32)  # row b keeps n[b] rows: none, one, a prefix, all
    f = jax.jit(forward, static_argnames=("verify",))
    _, c0, _ = f(target, ctx, init_cache(target, B, 32))
    _, cv, _ = f(target, blk, c0, verify=True)
    assert cv.pending is not None
    np.testing.assert_array_equal(cv.lin.rec, c0.lin.rec)  # verification leaves the committed state alone
    got = cv.commit(c0.lengths + n, n)
    probe = jnp.asarray(rng.integers(0, V, size=(B, 1)), jnp.int32)
    h_got, _, _ = f(target, probe, got)
    for b in range(B):
        k = int(n[b])
        seq = jnp.concatenate([ctx[b:b + 1], blk[b:b + 1, :k], probe[b:b + 1]], axis=1)
        h_ref, c_ref, _ = f(target, seq, init_cache(target, 1, 32))
        assert rel_err(h_got[b, -1], h_ref[0, -1]) <= 1e-4
        _, c_kept, _ = f(target, seq[:, :-1], init_cache(target, 1, 32))
        assert rel_err(got.lin.rec[:, b], c_kept.lin.rec[:, 0]) <= 1e-4
        assert rel_err(got.lin.conv[:, b], c_kept.lin.conv[:, 0]) <= 1e-4


def _same(a, b, what):
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        assert x == y, f"{what}: row {i} differs\n spec   {x}\n target {y}"


def test_greedy_chains_and_trees_equal_target_only(world):
    target, drafter = world
    rng = np.random.default_rng(100)
    ragged = [rng.integers(0, V, size=n).tolist() for n in (3, 15, 8)]
    ref = generate(target, None, ragged, max_new_tokens=40)
    accs = {}
    for bk in (8, 16):
        out = generate(target, drafter, ragged, max_new_tokens=40, block_size=bk)
        _same(out, ref, f"chain {bk}")
        accs[bk] = [a for r in out.acceptance_lengths for a in r]
    for n in (16, 64):
        out = generate(target, drafter, ragged, max_new_tokens=40, tree_budget=n)
        _same(out, ref, f"tree {n}")
        accs[f"tree{n}"] = [a for r in out.acceptance_lengths for a in r]
    # partial acceptance (a rollback of the recurrent state to a mid-block row) happens in every shape
    for k, a in accs.items():
        assert any(x > 1 for x in a) and any(x == 1 for x in a), (k, a)
    assert any(1 < x < 16 for x in accs[16])


def test_sampled_equals_target_only_same_seed(world):
    target, drafter = world
    rng = np.random.default_rng(7)
    ragged = [rng.integers(0, V, size=n).tolist() for n in (4, 11)]
    kw = dict(max_new_tokens=30, temperature=1.0, seed=3)
    ref = generate(target, None, ragged, **kw)
    _same(generate(target, drafter, ragged, block_size=8, **kw), ref, "sampled chain")
    _same(generate(target, drafter, ragged, tree_budget=16, **kw), ref, "sampled tree")


def test_steady_state_does_not_recompile(world):
    target, drafter = world
    rng = np.random.default_rng(8)
    generate(target, drafter, [rng.integers(0, V, size=5).tolist()], max_new_tokens=20, block_size=8)
    before = dict(dj.COMPILE_COUNTS)
    out = generate(target, drafter, [rng.integers(0, V, size=9).tolist()], max_new_tokens=20, block_size=8)
    assert out.compile_time == 0.0 and dict(dj.COMPILE_COUNTS) == before


def test_moe_hybrid_speculative_equals_target_only(hf_models):
    """Routed + shared experts under verification: a drafter's chains and trees commit target-only's greedy tokens."""
    target = dj.load_target(hf_models["qwen3_5_moe"][0])
    drafter = dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=95, seed=3, std=0.1,
                              target_layer_ids=(0, 2))
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (5, 12)]
    ref = generate(target, None, prompts, max_new_tokens=16)
    _same(generate(target, drafter, prompts, max_new_tokens=16, block_size=4), ref, "moe chain")
    _same(generate(target, drafter, prompts, max_new_tokens=16, tree_budget=8), ref, "moe tree")


def test_sharded_equals_single_device():
    """8 fake CPU devices in a subprocess (tests/hybrid_sharding_worker.py): tensor-parallel GDN and attention heads,
    rows over 'data'; a checkpoint loaded onto (2, 4) tensor by tensor holds the same params as the in-memory target
    placed there."""
    import subprocess
    import sys
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    worker = os.path.join(os.path.dirname(__file__), "hybrid_sharding_worker.py")
    p = subprocess.run([sys.executable, worker], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(res) == 5 and all(res.values()), res


@pytest.mark.slow
def test_training_pipeline_trains_a_drafter_for_a_hybrid_target(tmp_path):
    """Data generation (the continuous-batching engine over the recurrent state), training and export on a tiny
    Qwen3.5 target: block acceptance rises, and the exported drafter decodes losslessly with it."""
    from dflash_jax.training.config import config_from_dict
    from dflash_jax.training.data import generate_data
    from dflash_jax.training.pipeline import export, train
    from dflash_jax.training.testing import tiny_config_dict, write_id_prompts
    root = str(tmp_path)
    write_id_prompts(f"{root}/prompts.jsonl", 192, seed=0)
    cfg = TargetConfig(family="qwen3_5", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=4,
                       num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, layer_types=("linear",) * 3 + ("full",),
                       gdn=GDNConfig(2, 4, 16, 16, 4), partial_rotary_factor=0.25, attn_output_gate=True,
                       zero_centered_norms=True)
    dj.save_target(init_target(cfg, seed=0, std=0.02), f"{root}/target")
    d = tiny_config_dict(root, train={"steps": 80})
    d["target"].pop("random_init")
    c = config_from_dict(d)
    quiet = dict(log=lambda *_: None)
    generate_data(c, progress=False, **quiet)
    out = train(c, resume=False, progress=False, **quiet)
    before, after = out["eval_before"], out["eval_after"]
    assert before["tau"] < 1.2 and after["tau"] > before["tau"] + 1.0, (before, after)
    target = dj.load_target(f"{root}/target")
    drafter = dj.load_drafter(export(c, **quiet), target)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(4, 300, size=n).tolist() for n in (6, 20, 11)]
    ref = generate(target, None, prompts, max_new_tokens=32)
    spec = generate(target, drafter, prompts, max_new_tokens=32, block_size=8)
    _same(spec, ref, "trained drafter")
    assert spec.tau > 1.5, spec.tau


def test_engine_continuous_batching_equals_generate(world):
    """The continuous-batching engine (slots refilled while others decode, rows of the recurrent state written into
    free slots) on a hybrid target: target-only, a chain and a tree give generate()'s tokens."""
    from dflash_jax.decode.shape import TargetOnly, Tree
    from dflash_jax.engine import Engine, generate_all
    target, drafter = world
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, V, size=n).tolist() for n in (3, 15, 8, 5, 12)]
    ref = generate(target, None, prompts, max_new_tokens=20).tokens
    eng = Engine(target, drafter, slots=2, prompt_len=16, max_new_tokens=20, block_size=8)
    assert [c.tokens for c in generate_all(eng, prompts, max_new_tokens=20)] == ref
    eng = Engine(target, drafter, slots=3, prompt_len=16, max_new_tokens=20, shapes=[Tree(6), TargetOnly()])
    assert [c.tokens for c in generate_all(eng, prompts, max_new_tokens=20)] == ref
