"""Quantized targets (dflash_jax.quant): int8 / fp8 weights against their dequantized reference, quantized KV caches
through every attention path, block-scaled FP8 checkpoints in the hub layout, and greedy speculative decoding with
an int8 target equal to the int8 target alone on GSM8K prompts, with tau close to the float32 target's."""
from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dflash_jax as dj
from dflash_jax import quant
from dflash_jax.attention import attention, write_kv
from dflash_jax.cache import KVCache
from dflash_jax.config import TargetConfig
from dflash_jax.sharding import MODEL, param_spec
from dflash_jax.st_io import SafetensorsDir, save_file

# logits of a quantized target equal its dequantized weights' up to float32 rounding of the scaled product
LOGIT_RTOL = 1e-4


def tiny_config(**kw) -> TargetConfig:
    base = dict(family="qwen3", vocab_size=96, hidden_size=160, intermediate_size=288, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=40, qk_norm=True, rope_theta=10000.0)
    return TargetConfig(**{**base, **kw})


def dequantized_params(p: dict) -> dict:
    """The float32 reference of a param tree: every quantized matrix replaced by values * scales."""
    def one(d):
        out = {k: v for k, v in d.items() if not k.endswith(quant.SCALE)}
        for k in d:
            if k + quant.SCALE in d:
                out[k] = quant.dequantize_matrix(d[k], d[k + quant.SCALE], k, jnp.float32)
        return out
    params = one({k: v for k, v in p.items() if k != "layers"})
    params["layers"] = tuple(one(lp) for lp in p["layers"]) if isinstance(p["layers"], tuple) else one(p["layers"])
    return params


def dequantized(target):
    """The target with its dequantized weights and an unquantized KV cache."""
    return target.replace(params=dequantized_params(target.params),
                          config=dataclasses.replace(target.config, quant=None, kv_quant=None))


@pytest.mark.parametrize("mode,layout", [("int8", "stacked"), ("fp8", "unrolled")])
def test_quantized_logits_match_the_dequantized_reference(mode, layout):
    target = dj.init_target(tiny_config(), seed=1, std=0.05, layout=layout)
    q = dj.quantize_target(target, mode)
    lp = q.params["layers"][0] if layout == "unrolled" else q.params["layers"]
    assert lp["gate"].dtype == quant.storage_dtype(mode) and q.params["lm_head"].dtype == quant.storage_dtype(mode)
    assert lp["gate" + quant.SCALE].shape == lp["gate"].shape[:-2] + lp["gate"].shape[-1:]
    assert lp["q" + quant.SCALE].shape == lp["q"].shape[:-1]  # [out, in]: one scale per output row
    assert q.params["embed"].dtype == jnp.float32 and lp["input_norm"].dtype == jnp.float32
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 12))
    got = np.asarray(dj.target_logits(q, ids))
    ref = np.asarray(dj.target_logits(dequantized(q), ids))
    full = np.asarray(dj.target_logits(target, ids))
    scale = np.abs(ref).max()
    err_ref, err_full = np.abs(got - ref).max() / scale, np.abs(got - full).max() / scale
    print(f"{mode}: max |logits - dequantized reference| / max |logits| = {err_ref:.2e}; vs float32 weights {err_full:.2e}")
    assert err_ref <= LOGIT_RTOL
    assert 0 < err_full < (0.05 if mode == "int8" else 0.2)  # quantization changed the weights, by a little


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_quantized_moe_experts_match_the_dequantized_reference(family):
    """Expert matrices [E, in, out] get a scale per expert and output channel; both expert paths (a few tokens:
    the selected experts sliced; many: the grouped matmul) equal the dequantized experts' output."""
    kw = dict(qk_norm=True, norm_topk_prob=True) if family == "qwen3_moe" else dict(qkv_bias=True, o_bias=True,
                                                                                    attention_sinks=True)
    cfg = tiny_config(family=family, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, **kw)
    target = dj.init_target(cfg, seed=3, std=0.1)
    q = dj.quantize_target(target, "int8", "int8")
    lp = q.params["layers"]
    assert lp["e_up"].dtype == jnp.int8 and lp["e_up" + quant.SCALE].shape == (2, 8, 48)  # [L, E, out]
    assert lp["router"].dtype == jnp.float32
    assert param_spec(("layers", "e_down:scale")) == P(None, MODEL, None)  # experts split over the model axis
    ref = dequantized(q)
    for n in (1, 12):  # 1 x 2 slots < 8 experts: sliced; 12 x 2: grouped
        ids = np.random.default_rng(n).integers(0, 96, size=(1, n))
        got, want = (np.asarray(dj.target_logits(t, ids)) for t in (q, ref))
        assert np.abs(got - want).max() <= LOGIT_RTOL * np.abs(want).max(), n


def test_weights_are_one_byte_and_scales_are_laid_out_as_the_output_axis():
    target = dj.init_target(tiny_config(), seed=0)
    q = dj.quantize_target(target, "int8")
    assert quant.tree_bytes(q.params) < 0.4 * quant.tree_bytes(target.params)
    assert param_spec(("layers", "q:scale")) == P(None, MODEL)  # column-parallel: out axis split
    assert param_spec(("layers", "gate:scale")) == P(None, MODEL)
    assert param_spec(("layers", "o:scale")) == P(None, None)  # row-parallel: scales replicated
    assert param_spec(("layers", 3, "up:scale")) == P(MODEL)
    assert param_spec(("lm_head:scale",)) == P(MODEL)


def test_bad_modes_and_unsupported_targets_are_refused():
    target = dj.init_target(tiny_config(), seed=0)
    with pytest.raises(ValueError, match="quant must be one of"):
        dj.quantize_target(target, "int4")
    with pytest.raises(ValueError, match="kv_quant must be one of"):
        dj.quantize_target(target, kv_quant="nf4")
    from dflash_jax.config import GDNConfig
    with pytest.raises(ValueError, match="not hybrid or Gemma 4"):
        tiny_config(family="qwen3_5", layer_types=("linear", "full"), gdn=GDNConfig(2, 4, 8, 6, 4), kv_quant="int8")
    with pytest.raises(ValueError, match="already quantized to int8"):
        dj.quantize_target(dj.quantize_target(target, "int8"), "fp8")
    with pytest.raises(ValueError, match="save the target before quantizing"):
        dj.save_target(dj.quantize_target(target, "int8"), "/nonexistent/never-written")


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_kv_cache_through_every_attention_path(mode):
    """New K / V written through write_kv land quantized with their scales; the reference, blockwise and Pallas
    (interpreted) paths over the quantized cache equal dense attention over the dequantized cache."""
    rng = np.random.default_rng(3)
    L, B, KV, S, D, NH, T = 2, 2, 2, 256, 64, 4, 3
    cache = KVCache.create(L, B, S, KV, D, jnp.float32, quant=mode)
    fill = np.array([150, 77], np.int32)
    k_old = jnp.asarray(rng.normal(size=(B, S, KV, D)), jnp.float32)
    v_old = jnp.asarray(rng.normal(size=(B, S, KV, D)), jnp.float32)
    cache, _, _ = write_kv(cache, 1, jnp.zeros((B,), jnp.int32), k_old, v_old, uniform=True)
    assert cache.k.dtype == quant.storage_dtype(mode) and cache.k_scale.shape == (L, B, KV, S)
    k_new = jnp.asarray(rng.normal(size=(B, T, KV, D)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(B, T, KV, D)), jnp.float32)
    cache, kq, vq = write_kv(cache, 1, jnp.asarray(fill), k_new, v_new)
    # the new rows come back as the cache holds them: within one quantization step of the input
    step = np.abs(np.asarray(k_new)).max(-1, keepdims=True) / quant.qmax(mode)
    assert np.all(np.abs(np.asarray(kq) - np.asarray(k_new)) <= step * (0.51 if mode == "int8" else 32))
    kd = quant.dequantize_kv(cache.k[1], cache.k_scale[1], jnp.float32)
    vd = quant.dequantize_kv(cache.v[1], cache.v_scale[1], jnp.float32)
    np.testing.assert_allclose(np.asarray(kd[0, :, 150:153]), np.swapaxes(np.asarray(kq[0]), 0, 1), atol=1e-6)
    q = jnp.asarray(rng.normal(size=(B, 1, T, NH, D)), jnp.float32)
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
    ctx = jnp.asarray(fill)[:, None]
    want = attention(q, kq[:, None], vq[:, None], mask, kd, vd, ctx, impl="reference")
    for impl in ("reference", "blockwise", "pallas"):
        got = attention(q, kq[:, None], vq[:, None], mask, cache.k, cache.v, ctx, layer=1, impl=impl, block=128,
                        k_scale=cache.k_scale, v_scale=cache.v_scale)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, err_msg=impl)
    plain = attention(q, k_new[:, None], v_new[:, None], mask, kd, vd, ctx, impl="reference")
    assert np.abs(np.asarray(plain) - np.asarray(want)).max() > 0  # the new rows' quantization is seen


def write_fp8_checkpoint(target, path, block=(128, 128)):
    """save_target, then every matrix rewritten in the hub's FP8 layout: float8_e4m3fn weights, weight_scale_inv
    block scales, quantization_config in config.json."""
    dj.save_target(target, path)
    st = SafetensorsDir(path)
    tensors = {}
    for name in st.keys():
        a = np.asarray(st.get(name))
        if name.endswith("proj.weight") or name == "lm_head.weight":
            tensors[name], tensors[name + "_scale_inv"] = quant.quant_blocks(a, block)
        else:
            tensors[name] = a
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "fmt": "e4m3", "weight_block_size": list(block)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return tensors


def test_fp8_block_scaled_checkpoint_loads(tmp_path):
    target = dj.init_target(tiny_config(), seed=2, std=0.05)
    tensors = write_fp8_checkpoint(target, str(tmp_path))
    w = tensors["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == np.dtype("float8_e4m3fn") and tensors["model.layers.0.mlp.up_proj.weight_scale_inv"].shape \
        == (3, 2)  # [288, 160] in 128 x 128 blocks: ceil(288 / 128) x ceil(160 / 128)
    loaded = dj.load_target(str(tmp_path), dtype="float32", layout="unrolled")
    ref = np.asarray(quant.dequant_blocks(w, tensors["model.layers.0.mlp.up_proj.weight_scale_inv"], (128, 128)))
    np.testing.assert_array_equal(np.asarray(loaded.params["layers"][0]["up"]), ref.T)  # dequantized exactly
    ids = np.random.default_rng(1).integers(0, 96, size=(2, 10))
    base = np.asarray(dj.target_logits(loaded, ids))
    full = np.asarray(dj.target_logits(target, ids))
    requant = dj.load_target(str(tmp_path), dtype="float32", quant="fp8", kv_quant="fp8")
    assert requant.config.quant == "fp8" and requant.config.kv_quant == "fp8"
    got = np.asarray(dj.target_logits(requant, ids))
    scale = np.abs(base).max()
    e_block, e_req = np.abs(base - full).max() / scale, np.abs(got - base).max() / scale
    print(f"fp8 checkpoint: block-scaled vs float32 weights {e_block:.2e}; requantized per channel vs block {e_req:.2e}")
    assert 0 < e_block < 0.2 and e_req < 0.2
    ref_q = np.asarray(dj.target_logits(dequantized(requant), ids))
    assert np.abs(got - ref_q).max() / scale <= LOGIT_RTOL
    with open(os.path.join(tmp_path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["quant_method"] = "gptq"
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        dj.load_target(str(tmp_path))


def test_speculative_with_an_int8_target_equals_its_target_only_decoding():
    """Embedded pair, 8 GSM8K test prompts, greedy: chain-16 speculative decoding with the int8 target (int8 KV
    cache) gives the int8 target-only tokens; tau with the int8 target is at least 0.9x the float32 target's."""
    from dflash_jax.prompts import load_dataset_prompts
    try:
        target, drafter, tok = dj.load_reference()
        prompts = [p.turns[0] for p in load_dataset_prompts("gsm8k", None, 8, allow_hub=False)]
    except FileNotFoundError as e:
        pytest.skip(str(e))
    q = dj.quantize_target(target, "int8", "int8")
    assert q.config.kv_quant == "int8"
    kw = dict(max_new_tokens=32, tokenizer=tok)
    spec = dj.generate(q, drafter, prompts, shape="chain:16", **kw)
    alone = dj.generate(q, None, prompts, shape="off", **kw)
    assert [list(a) for a in spec.tokens] == [list(a) for a in alone.tokens]
    base = dj.generate(target, drafter, prompts, shape="chain:16", **kw)
    print(f"tau: float32 target {base.tau:.3f}, int8 target + int8 KV {spec.tau:.3f} ({spec.tau / base.tau:.3f}x)")
    assert spec.tau >= 0.9 * base.tau
    both = dj.generate(q, dj.quantize_drafter(drafter, "int8"), prompts, shape="chain:16", **kw)  # drafts only
    assert [list(a) for a in both.tokens] == [list(a) for a in alone.tokens]
    print(f"tau with the int8 drafter as well: {both.tau:.3f} ({both.tau / base.tau:.3f}x)")
    assert both.tau >= 0.9 * base.tau


def test_int8_drafter_drafts_like_its_dequantized_weights():
    """quantize_drafter: fc, q / k / v / o and the MLP in 1 byte; the draft logits after a context equal those of
    the dequantized drafter within float32 rounding, the drafter's other params are untouched, and saving a
    quantized drafter is refused."""
    from dflash_jax.decode.programs import draft_logits_program
    target = dj.init_target(tiny_config(), seed=0, std=0.25)
    drafter = dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=95, seed=1, std=0.2)
    q = dj.quantize_drafter(drafter, "int8")
    lp = q.params["layers"][0] if isinstance(q.params["layers"], tuple) else q.params["layers"]
    assert q.config.quant == "int8" and q.params["fc"].dtype == jnp.int8 and lp["q"].dtype == jnp.int8
    assert lp["q_norm"].dtype == drafter.params["fc"].dtype  # norms stay
    deq = drafter.replace(params=dequantized_params(q.params))  # the same matrices, float32
    ctx, anchor = jnp.asarray([[3, 14, 15, 92, 65, 35]]), jnp.asarray([8])
    got = np.asarray(draft_logits_program(target, q, ctx, anchor, 4))
    want = np.asarray(draft_logits_program(target, deq, ctx, anchor, 4))
    full = np.asarray(draft_logits_program(target, drafter, ctx, anchor, 4))
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"int8 drafter: max |logits - dequantized| / max |logits| = {err:.2e}; vs float32 weights "
          f"{np.abs(got - full).max() / np.abs(full).max():.2e}")
    assert err <= LOGIT_RTOL
    with pytest.raises(ValueError, match="before quantizing"):
        dj.save_drafter(q, "/nonexistent/never-written")
    with pytest.raises(ValueError, match="drafter quant must be one of"):
        dataclasses.replace(drafter.config, quant="int4")


SHARDED = r'''
import json, sys
import numpy as np
import jax
import dflash_jax as dj
from dflash_jax.sharding import make_mesh, param_spec
cfg = dj.TargetConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8,
                      num_kv_heads=2, head_dim=16, qk_norm=True)
target = dj.init_target(cfg, seed=0, std=0.25)
dj.save_target(target, sys.argv[1])
mesh = make_mesh(1, 4)  # model axis 4 > 2 KV heads: k / v (and their scales) replicated twice
sharded = dj.load_target(sys.argv[1], dtype="float32", mesh=mesh, layout="stacked", quant="int8", kv_quant="int8")
one = dj.load_target(sys.argv[1], dtype="float32", layout="stacked", quant="int8", kv_quant="int8")
drafter = dj.init_drafter(sharded, num_layers=1, block_size=4, mask_token_id=63, seed=1, std=0.1)
lp = sharded.params["layers"]
specs_ok = all(lp[k].sharding.spec == param_spec(("layers", k)) for k in lp if k.endswith(":scale"))
prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
kw = dict(max_new_tokens=8, stop_token_ids=[])
spec = dj.generate(sharded, drafter, prompts, shape="chain:4", **kw).tokens
alone = dj.generate(sharded, None, prompts, shape="off", **kw).tokens
ids = np.asarray([[1, 2, 3, 4, 5, 6]])
diff = float(np.abs(np.asarray(dj.target_logits(sharded, ids)) - np.asarray(dj.target_logits(one, ids))).max())
print("RESULT " + json.dumps({"specs_ok": specs_ok, "scale_dtype": str(lp["k:scale"].dtype),
      "k_dtype": str(lp["k"].dtype), "spec_equals_target_only": spec == alone, "logit_diff": diff}))
'''


def test_quantized_target_on_a_mesh(tmp_path):
    """4 fake CPU devices, model axis 4 over 2 KV heads: the int8 target loads sharded (scales laid out as the
    matrices' output axis), its logits equal the one-device int8 target's, and speculative == target-only there."""
    import subprocess
    import sys
    from tests.xla_env import subprocess_xla_flags
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags(4), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stderr[-3000:]
    r = json.loads(line[0][len("RESULT "):])
    print(r)
    assert r["specs_ok"] and r["k_dtype"] == "int8" and r["scale_dtype"] == "float32"
    assert r["spec_equals_target_only"]
    assert r["logit_diff"] < 1e-4


def test_serving_engine_with_a_quantized_target():
    """The slot engine (serving, training-data generation) keeps a quantized cache's scales through prefill,
    refill and decode: its greedy speculative tokens equal generate()'s target-only tokens of the int8 target."""
    from dflash_jax.engine.core import Engine, generate_all
    target = dj.quantize_target(dj.init_target(tiny_config(num_layers=2), seed=4, std=0.2), "int8", "int8")
    drafter = dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=95, seed=0, target_layer_ids=[0, 1])
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 95, size=n).tolist() for n in (5, 9, 3, 7)]
    eng = Engine(target, drafter, slots=2, prompt_len=16, max_new_tokens=10, refill=1, temperature=0.0)
    state = eng.empty_state()
    assert state.dec.tcache.k.dtype == jnp.int8 and state.dec.tcache.k_scale.shape[-1] == eng.S
    assert state.dec.dcache.k.dtype == jnp.float32 and not state.dec.dcache.quantized  # the drafter's stays float
    got = generate_all(eng, prompts, max_new_tokens=10)
    ref = dj.generate(target, None, prompts, max_new_tokens=10, stop_token_ids=[], max_cache_len=eng.S, shape="off")
    assert [c.tokens for c in got] == ref.tokens
