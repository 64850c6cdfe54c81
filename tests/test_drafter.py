"""DFlash drafter: forward vs an independent PyTorch reference, training path vs inference path,
z-lab checkpoint round trip and format, compatibility errors, default tapped layers."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.torch import load_file as st_load, save_file as st_save

import dflash_jax
from dflash_jax import default_target_layer_ids, draft_logits, init_drafter, load_drafter, load_target, save_drafter
from dflash_jax.drafter import draft_hidden_train, draft_logits_from_hidden
from dflash_jax.model import forward, init_cache
from tests.hf_utils import LLAMA3_ROPE, make_hf_model, rel_err
from tests.torch_ref import RefDrafter, load_hf_target, reference_layer_ids

MASK = 95  # last id of the tiny 96-token vocabulary


def perturb_norms(drafter, seed: int, std: float = 0.25):
    """Norm weights 1 + normal(0, std) and biases normal(0, std), so that a missing / misplaced norm
    or bias shows up."""
    rng = np.random.default_rng(seed)

    def f(path, x):
        name = str(path[-1])
        if "norm" in name:
            return jnp.asarray(1.0 + rng.normal(0, std, x.shape).astype(np.float32), x.dtype)
        if name.endswith("_bias']"):
            return jnp.asarray(rng.normal(0, std, x.shape).astype(np.float32), x.dtype)
        return x

    return drafter.replace(params=jax.tree_util.tree_map_with_path(f, drafter.params))


# target kind -> (hf family, overrides, drafter kwargs)
CASES = {
    # GQA 4/2, head_dim 16 != 32 / 4, untied lm_head, default tapped layers for N=5, n=3: [1, 2, 2]
    # (a layer tapped twice)
    "qwen3": ("qwen3", dict(num_hidden_layers=5), dict(num_layers=3)),
    # LLaMA-3 rope scaling (drafter inherits it), tied embeddings, 2 taps (not sorted) for 3 drafter layers
    "llama3": ("llama", dict(num_hidden_layers=4, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
               dict(num_layers=3, target_layer_ids=[2, 0])),
    # sliding-window drafter layers with a window shorter than the contexts
    "sliding": ("qwen3", dict(num_hidden_layers=6),
                dict(num_layers=3, layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                     sliding_window=5)),
    # biased q/k/v/o projections (attention_bias: the published gpt-oss drafters)
    "biased": ("qwen3", dict(num_hidden_layers=4), dict(num_layers=2, attention_bias=True)),
    # a hybrid target (Gated DeltaNet + gated attention, Qwen3.5 layout) with the authors' Qwen3.5 drafter shape:
    # sliding layers but the last, taps given by the config
    "qwen3_5": ("qwen3_5", dict(), dict(num_layers=3, target_layer_ids=[1, 3, 4],
                                        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                                        sliding_window=5)),
}


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    cache = {}

    def get(kind):
        if kind not in cache:
            family, over, dkw = CASES[kind]
            tpath, _ = make_hf_model(root, family, std=0.2, seed=3, name=f"t_{kind}", **over)
            target = load_target(tpath)
            drafter = init_drafter(target, block_size=16, mask_token_id=MASK, seed=11, std=0.2, **dkw)
            drafter = perturb_norms(drafter, seed=12)
            dpath = os.path.join(str(root), f"d_{kind}")
            save_drafter(drafter, dpath)
            ref_t = load_hf_target(tpath)
            ref_d = RefDrafter.from_dir(dpath)
            cache[kind] = (tpath, dpath, target, drafter, ref_t, ref_d)
        return cache[kind]

    return get


# ----------------------------------------------------------------------------------------------
# Forward vs the PyTorch reference
# ----------------------------------------------------------------------------------------------
# (block size, context lengths): few distinct shapes because each one is a compilation; the
# sliding-window case has window 5, so all but the 1-token context are longer than the window.
SHAPES = {4: (1, 23), 16: (6, 37)}


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("block", sorted(SHAPES))
def test_draft_logits_match_torch_reference(setups, kind, block):
    _, _, target, drafter, ref_t, ref_d = setups(kind)
    rng = np.random.default_rng(block * 7 + len(kind))
    for ctx_len in SHAPES[block]:
        prefix = rng.integers(0, MASK, size=ctx_len + 1).tolist()
        ours = np.asarray(draft_logits(target, drafter, prefix, block_size=block))
        ref = ref_d.draft_logits(ref_t, prefix, block).numpy()
        assert ours.shape == ref.shape == (block - 1, 96)
        err = rel_err(ours, ref)
        assert err <= 1e-4, f"{kind} B={block} ctx={ctx_len}: rel err {err:.2e}"
        # the comparison is sensitive: the logits vary across positions and are far from zero
        assert np.std(ref) > 0.1 and np.max(np.abs(ref[0] - ref[-1])) > 1e-2


def test_reference_detects_a_wrong_window(setups):
    """Sanity of the comparison itself: the sliding layers make a measurable difference."""
    _, _, target, drafter, ref_t, ref_d = setups("sliding")
    prefix = np.random.default_rng(0).integers(0, MASK, size=38).tolist()
    ours = np.asarray(draft_logits(target, drafter, prefix, block_size=16))
    saved = list(ref_d.windows)
    try:
        ref_d.windows = [0] * len(saved)  # all layers full non-causal
        ref_full = ref_d.draft_logits(ref_t, prefix, 16).numpy()
    finally:
        ref_d.windows = saved
    assert rel_err(ours, ref_full) > 1e-2


# ----------------------------------------------------------------------------------------------
# Training forward == inference forward; block independence
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("block",))
def _train_logits_dev(target, drafter, ids, anchor_pos, block):
    _, _, feats = forward(target, ids, init_cache(target, 1, ids.shape[1]), drafter.config.target_layer_ids)
    h = draft_hidden_train(drafter, target, feats, ids[:, anchor_pos[0]], anchor_pos, block)
    return draft_logits_from_hidden(drafter, target, h[:, :, 1:])[0]  # [A, block-1, V]


def _train_logits(target, drafter, seq, anchor_pos, block=16):
    ids = jnp.asarray(np.asarray(seq, np.int32)[None])
    return np.asarray(_train_logits_dev(target, drafter, ids, jnp.asarray([anchor_pos], jnp.int32), block))


@pytest.mark.parametrize("kind", ["qwen3", "sliding"])
def test_training_forward_equals_inference(setups, kind):
    _, _, target, drafter, _, _ = setups(kind)
    seq = np.random.default_rng(5).integers(0, MASK, size=40).tolist()
    anchors = [6, 25, 37]  # several blocks of one sequence in one pass
    train = _train_logits(target, drafter, seq, anchors)
    for a, p in enumerate(anchors):
        if p == 25:
            continue  # (covered by the independence test; saves a compilation)
        inf = np.asarray(draft_logits(target, drafter, seq[:p + 1], block_size=16))
        err = rel_err(train[a], inf)
        assert err <= 1e-4, f"anchor {p}: rel err {err:.2e}"


def test_block_ignores_later_context_and_other_blocks(setups):
    _, _, target, drafter, _, _ = setups("sliding")
    rng = np.random.default_rng(6)
    seq = rng.integers(0, MASK, size=40)
    base = _train_logits(target, drafter, seq, [6, 25, 37])
    # change everything after the anchor of the first block (that block's future)
    seq2 = seq.copy()
    seq2[7:] = (seq2[7:] + 17) % MASK
    changed = _train_logits(target, drafter, seq2, [6, 25, 37])
    np.testing.assert_allclose(changed[0], base[0], rtol=1e-6, atol=1e-6)
    assert rel_err(changed[1], base[1]) > 1e-3  # later blocks do see the changed context
    # move the other blocks: the middle block is unaffected
    other = _train_logits(target, drafter, seq, [2, 25, 39])
    np.testing.assert_allclose(other[1], base[1], rtol=1e-6, atol=1e-6)
    assert rel_err(other[0], base[0]) > 1e-3
    # change the middle block's anchor token: only that block changes
    seq3 = seq.copy()
    seq3[25] = (seq3[25] + 1) % MASK
    anch = _train_logits(target, drafter, seq3, [6, 25, 37])
    np.testing.assert_allclose(anch[0], base[0], rtol=1e-6, atol=1e-6)
    assert rel_err(anch[1], base[1]) > 1e-3


# ----------------------------------------------------------------------------------------------
# Checkpoint format
# ----------------------------------------------------------------------------------------------
def _leaves(d):
    return jax.tree_util.tree_leaves_with_path(d.params)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_save_load_round_trip_bit_exact(setups, tmp_path, dtype):
    _, _, target, drafter, _, _ = setups("sliding")
    save_drafter(drafter, str(tmp_path), dtype=dtype)
    back = load_drafter(str(tmp_path), target, dtype=dtype or "float32", layout="stacked")
    assert back.config == dataclasses.replace(drafter.config, dtype=dtype or "float32")
    want = dict(_leaves(drafter))
    got = dict(_leaves(back))
    assert want.keys() == got.keys()
    for k, w in want.items():
        g = got[k]
        w = np.asarray(w.astype(jnp.dtype(dtype)) if dtype else w)
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert np.array_equal(np.asarray(g).view(np.uint8), w.view(np.uint8)), f"{k} differs"
    if dtype:  # a bf16 file read at fp32 gives the exact upcast
        up = load_drafter(str(tmp_path), target, dtype="float32", layout="stacked")
        for k, g in dict(_leaves(up)).items():
            assert np.array_equal(np.asarray(g), np.asarray(want[k].astype(jnp.bfloat16).astype(jnp.float32)))


def test_saved_tensors_and_config_follow_zlab_format(setups):
    _, dpath, target, drafter, _, _ = setups("sliding")
    c = drafter.config
    with open(os.path.join(dpath, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["block_size"] == 16
    assert cfg["dflash_config"]["mask_token_id"] == MASK
    assert cfg["dflash_config"]["target_layer_ids"] == list(c.target_layer_ids) == [1, 2, 3]
    assert cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == 3
    assert cfg["hidden_size"] == 32 and cfg["intermediate_size"] == 64 and cfg["vocab_size"] == 96
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg["sliding_window"] == 5
    assert cfg["attention_bias"] is False and cfg["tie_word_embeddings"] is False
    for k in ("rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings"):
        assert k in cfg, k
    sd = st_load(os.path.join(dpath, "model.safetensors"))
    H, n = 32, 3
    assert sd["fc.weight"].shape == (H, n * H)
    assert sd["hidden_norm.weight"].shape == (H,) and sd["norm.weight"].shape == (H,)
    expect = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(3):
        for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                  "input_layernorm", "post_attention_layernorm"):
            expect.add(f"layers.{i}.{s}.weight")
    assert set(sd) == expect
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (4 * 16, H)  # PyTorch [out, in]
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, H)
    assert sd["layers.0.self_attn.o_proj.weight"].shape == (H, 4 * 16)
    assert sd["layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert sd["layers.2.mlp.down_proj.weight"].shape == (H, 64)
    np.testing.assert_array_equal(sd["layers.1.mlp.gate_proj.weight"].numpy(),
                                  np.asarray(drafter.params["layers"]["gate"][1]).T)


def test_model_prefix_checkpoint_loads(setups, tmp_path):
    _, dpath, target, drafter, _, _ = setups("qwen3")
    sd = st_load(os.path.join(dpath, "model.safetensors"))
    st_save({"model." + k: v for k, v in sd.items()}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(dpath, "config.json"), tmp_path / "config.json")
    back = load_drafter(str(tmp_path), target, layout="stacked")
    for (k, g), (_, w) in zip(_leaves(back), _leaves(drafter)):
        assert np.array_equal(np.asarray(g), np.asarray(w)), k


def _copy_ckpt(src, dst, edit_cfg=None, drop=()):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if edit_cfg:
        edit_cfg(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    sd = st_load(os.path.join(src, "model.safetensors"))
    st_save({k: v for k, v in sd.items() if k not in drop}, os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_mismatched_target_errors_name_the_field(setups, tmp_path):
    _, dpath, target, _, _, _ = setups("qwen3")
    tc = target.config
    for field, change, word in [("hidden_size", dict(hidden_size=48), "hidden_size"),
                                ("vocab", dict(vocab_size=128), "vocab_size"),
                                ("layers", dict(num_layers=7), "num_target_layers")]:
        other = dflash_jax.init_target(dataclasses.replace(tc, **change), seed=0)
        with pytest.raises(ValueError, match=word):
            load_drafter(dpath, other)
    # a tapped layer id beyond the target's depth
    bad = _copy_ckpt(dpath, tmp_path / "bad_ids",
                     edit_cfg=lambda c: c["dflash_config"].update(target_layer_ids=[1, 2, 9]))
    with pytest.raises(ValueError, match=r"target_layer_ids.*9"):
        load_drafter(bad, target)
    # the same check guards generation
    other = dflash_jax.init_target(dataclasses.replace(tc, vocab_size=128), seed=0)
    d = load_drafter(dpath, target)
    with pytest.raises(ValueError, match="vocab_size"):
        dflash_jax.generate(other, d, [[1, 2, 3]], max_new_tokens=2)


def test_missing_tensor_error_names_it(setups, tmp_path):
    _, dpath, target, _, _, _ = setups("qwen3")
    p = _copy_ckpt(dpath, tmp_path / "missing", drop=("layers.1.mlp.up_proj.weight",))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        load_drafter(p, target)


def test_wrong_tensor_shape_error_names_it(setups, tmp_path):
    _, dpath, target, _, _, _ = setups("qwen3")
    p = _copy_ckpt(dpath, tmp_path / "shape", edit_cfg=lambda c: c.update(head_dim=8))
    with pytest.raises(ValueError, match=r"q_proj\.weight"):
        load_drafter(p, target)


# ----------------------------------------------------------------------------------------------
# Default tapped layers
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N,n,want", [
    (36, 5, (1, 9, 17, 25, 33)), (32, 5, (1, 8, 15, 22, 29)), (28, 5, (1, 7, 13, 19, 25)),
    (36, 1, (18,)), (5, 1, (2,)), (6, 3, (1, 2, 3)), (5, 3, (1, 2, 2)),
])
def test_default_target_layer_ids(N, n, want):
    assert tuple(default_target_layer_ids(N, n)) == want
    assert tuple(reference_layer_ids(N, n)) == want


def test_config_without_layer_ids_uses_default(setups, tmp_path):
    _, dpath, target, drafter, _, _ = setups("qwen3")

    def drop(c):
        c["dflash_config"].pop("target_layer_ids")
    p = _copy_ckpt(dpath, tmp_path / "noids", edit_cfg=drop)
    assert load_drafter(p, target).config.target_layer_ids == default_target_layer_ids(5, 3)
