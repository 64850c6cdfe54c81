"""Helpers that build tiny random Hugging Face target models (PyTorch, CPU, fp32) for tests.

Typical use:

    path, hf = make_hf_model(tmp_path, "qwen3")              # saved to tmp_path/<name>
    target = dflash_jax.load_target(path)
    ref = hf_logits(hf, ids)                                  # numpy float32 [B, T, V]
    assert rel_err(our_logits, ref) <= 1e-4

Every parameter is re-initialised with a large-ish normal std (biases non-zero, norm weights
non-one) so that a wrong transpose, a missing bias or a mis-scaled norm shows up in the logits.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from transformers import (GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3NextConfig,
                          Qwen3NextForCausalLM)
from transformers.models.gemma4 import Gemma4ForCausalLM, Gemma4TextConfig
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

# Tiny defaults per family. Qwen3 uses an explicit head_dim != hidden / heads on purpose.
_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)
FAMILIES: dict[str, tuple[type, type, dict]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(_BASE, head_dim=16, rope_theta=1000.0)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(_BASE, rope_theta=10000.0)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(_BASE, rope_theta=10000.0)),
    # mixture of experts: 8 experts, top-2; Qwen3-MoE with a dense (mlp_only) middle layer
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(_BASE, head_dim=16, rope_theta=1000.0, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1)),
    # gpt-oss: sinks, sliding window 8 on even layers, YaRN (short original context so it matters),
    # biased attention and experts; sizes are multiples of 32 for MXFP4
    "gpt_oss": (GptOssConfig, GptOssForCausalLM,
                dict(_BASE, hidden_size=64, intermediate_size=64, head_dim=16, num_hidden_layers=2, num_local_experts=8,
                     num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                     attention_bias=True, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "original_max_position_embeddings": 16, "truncate": False})),
    # hybrids: Gated DeltaNet layers with a full-attention layer every 3rd (the window of the conv, GQA of value
    # heads, partial rotary all exercised); Qwen3-Next with its fused in_proj_qkvz / in_proj_ba, dense MLPs
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM,
                dict(_BASE, head_dim=16, num_hidden_layers=6, full_attention_interval=3,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                     linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                                "partial_rotary_factor": 0.5})),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM,
                   dict(_BASE, head_dim=16, num_hidden_layers=4, full_attention_interval=2, num_experts=0,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                        linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                                   "partial_rotary_factor": 0.25})),
    # MoE hybrids: 8 routed experts (top-2) + a gated shared expert; Qwen3-Next with a dense (mlp_only) layer
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM,
                    dict(_BASE, head_dim=16, num_hidden_layers=4, full_attention_interval=2, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=6, rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                                   "partial_rotary_factor": 0.25})),
    "qwen3_next_moe": (Qwen3NextConfig, Qwen3NextForCausalLM,
                       dict(_BASE, head_dim=16, num_hidden_layers=4, full_attention_interval=2, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                            norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=6, rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                                      "partial_rotary_factor": 0.25})),
}

# Gemma 4 (tied embeddings, sliding window 8, a soft cap low enough to bend the logits): 5 sliding : 1 full with the
# full layers' own head size; k_eq_v with one global KV head; the MoE block beside the dense MLP; per-layer input
# embeddings with KV-shared last layers (double-wide MLPs there)
_GEMMA4 = dict(_BASE, head_dim=16, global_head_dim=32, num_hidden_layers=6, sliding_window=8, tie_word_embeddings=True,
               hidden_size_per_layer_input=0, final_logit_softcapping=5.0, pad_token_id=0,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 10000.0}})
FAMILIES.update({
    "gemma4": (Gemma4TextConfig, Gemma4ForCausalLM, _GEMMA4),
    "gemma4_kv": (Gemma4TextConfig, Gemma4ForCausalLM,
                  dict(_GEMMA4, num_hidden_layers=7, attention_k_eq_v=True, num_global_key_value_heads=1,
                       layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 3
                       + ["full_attention"])),
    "gemma4_moe": (Gemma4TextConfig, Gemma4ForCausalLM,
                   dict(_GEMMA4, num_hidden_layers=3, enable_moe_block=True, num_experts=8, top_k_experts=2,
                        moe_intermediate_size=24, attention_k_eq_v=True, num_global_key_value_heads=1,
                        layer_types=["sliding_attention", "full_attention", "full_attention"])),
    "gemma4_ple": (Gemma4TextConfig, Gemma4ForCausalLM,
                   dict(_GEMMA4, num_hidden_layers=8, hidden_size_per_layer_input=8, vocab_size_per_layer_input=96,
                        num_kv_shared_layers=3, use_double_wide_mlp=True,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                                     "full_attention", "sliding_attention", "sliding_attention", "full_attention"])),
})

# A LLaMA-3 style rope scaling with a short original context so positions of a few dozen tokens hit
# all three regions of the llama3 frequency rule (kept, smoothed, divided by `factor`).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def hf_config(family: str, **overrides: Any):
    """A transformers config for `family` ("qwen3" | "llama" | "qwen2") with tiny defaults.

    `rope_scaling=` is accepted and folded into the config as transformers expects."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    cfg_cls, _, base = FAMILIES[family]
    kw = dict(base)
    kw.update(overrides)
    return cfg_cls(**kw)


@torch.no_grad()
def randomize_(model: torch.nn.Module, std: float = 0.15, seed: int = 0) -> torch.nn.Module:
    """Re-initialise every parameter in place: normal(0, std) matrices and biases,
    1 + normal(0, std) for norm weights and Gemma 4's scales (router scale, per-expert scale, the layer_scalar
    buffer). Tied weights are drawn once (named_parameters dedups)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
        if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
            p.copy_(1.0 + noise)
        else:
            p.copy_(noise)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(1.0 + torch.randn(b.shape, generator=g, dtype=torch.float32) * std)
    return model


def make_hf_model(tmp_path, family: str = "qwen3", *, std: float = 0.15, seed: int = 0, name: str | None = None,
                  max_shard_size: str | None = None, **overrides: Any):
    """Build a tiny random HF causal LM, save it under `tmp_path/name`, return (path, torch model in eval mode).

    `overrides` go to the transformers config (e.g. num_key_value_heads=4, tie_word_embeddings=True,
    rope_scaling=LLAMA3_ROPE, num_hidden_layers=3)."""
    cfg = hf_config(family, **overrides)
    _, model_cls, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    randomize_(model, std=std, seed=seed)
    path = os.path.join(str(tmp_path), name or f"{family}_{seed}")
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kw)
    return path, model


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids) -> np.ndarray:
    """Float32 logits [B, T, V] of a full causal forward (no padding) as numpy."""
    t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    if t.ndim == 1:
        t = t[None]
    return model(input_ids=t).logits.float().numpy()


@torch.no_grad()
def hf_layer_outputs(model: torch.nn.Module, ids) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(output_hidden_states as numpy list, raw outputs of every decoder layer captured with hooks).

    hidden_states[l + 1] is the output of decoder layer l for l < L - 1; HF replaces the last entry
    with the final-normed output, so the hooks give the raw output of the last layer too."""
    t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    raw: list[np.ndarray] = []

    def hook(_mod, _inp, out):
        raw.append((out[0] if isinstance(out, (tuple, list)) else out).float().numpy().copy())

    handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
    try:
        out = model(input_ids=t, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return [h.float().numpy() for h in out.hidden_states], raw


def rel_err(a, b) -> float:
    """max|a - b| / max|b| (b is the reference)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def edit_config_json(path: str, **changes: Any) -> dict:
    """Update keys of `path/config.json` in place (a value of None deletes the key); returns the new dict."""
    p = os.path.join(path, "config.json")
    with open(p) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(p, "w") as f:
        json.dump(cfg, f, indent=2)
    return cfg
