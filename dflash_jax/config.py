"""Frozen, hashable model configurations built from Hugging Face ``config.json`` files.

Two dataclasses describe everything the compiled functions need to know statically:
``TargetConfig`` (Qwen3 / LLaMA-3.x / Qwen2 decoder-only LMs) and ``DrafterConfig`` (a DFlash
block drafter in the z-lab checkpoint format). Both are frozen so they can be static arguments of
``jax.jit`` and hash keys of compilation caches.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from .families import (HYBRID_FAMILIES, MOE_FAMILIES, GDNConfig, Gemma4Config, gemma4_fields_from_hf,
                       gemma4_fields_to_hf, hybrid_fields_from_hf, moe_fields_from_hf, moe_fields_to_hf)
from .quant import MODES as QUANT_MODES

# HF `architectures` entry -> our family name.
SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3MoeForCausalLM": "qwen3_moe",  # mixture of experts (dflash_jax/moe.py)
    "GptOssForCausalLM": "gpt_oss",  # mixture of experts + sinks + sliding windows (dflash_jax/moe.py)
    # hybrids: Gated DeltaNet + gated full attention (dflash_jax/hybrid.py, dflash_jax/gdn.py)
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # the text model under `text_config`; vision tower skipped
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    # sliding + full attention of their own sizes, sandwich norms, MoE block, per-layer inputs (dflash_jax/gemma4.py)
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",  # the text model under `text_config`; vision / audio towers skipped
}
_MODEL_TYPE_TO_FAMILY = {"qwen3": "qwen3", "llama": "llama", "qwen2": "qwen2", "qwen3_moe": "qwen3_moe",
                         "gpt_oss": "gpt_oss", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5",
                         "qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe",
                         "gemma4": "gemma4", "gemma4_text": "gemma4"}


def _freeze(value: Any) -> Any:
    """Turn dicts/lists into sorted tuples so a config stays hashable."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in value):
        return {k: _thaw(v) for k, v in value}
    return value


def rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, tuple | None]:
    """(theta, frozen scaling dict or None) from either HF v4 (`rope_theta`/`rope_scaling`) or
    v5 (`rope_parameters`) config layouts."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return theta, None
    if kind not in ("llama3", "linear", "yarn"):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn)")
    return theta, _freeze(scaling)


def rope_to_hf(theta: float, scaling: tuple | None) -> dict:
    return {"rope_theta": theta, "rope_scaling": _thaw(scaling) if scaling else None}


def _eos_tuple(v) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    family: str  # "qwen3" | "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # parameter / activation dtype; norms, softmax and logits run in fp32
    # --- mixture of experts (0 experts = dense); see dflash_jax/moe.py ---
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # qwen3_moe: renormalise the top-k softmax probabilities
    sparse_layers: tuple[bool, ...] = ()  # per layer: MoE block (True) or dense MLP (False); () = all MoE
    # --- gpt-oss attention: per-layer sliding window (0 = full) and a learned sink logit per head ---
    layer_windows: tuple[int, ...] = ()
    attention_sinks: bool = False
    swiglu_limit: float = 7.0
    # expert parallelism (runtime choice, not from config.json): how the experts' outputs return to
    # the replicated activations: "psum" of per-device partial outputs (default: chosen by the
    # planner's measurement, see dflash_jax/moe.py) or "all_to_all" dispatch + return + all-gather
    moe_combine: str = "psum"
    # --- hybrids (qwen3_5, qwen3_next): per layer "linear" (Gated DeltaNet) or "full" (gated attention) ---
    layer_types: tuple[str, ...] = ()
    gdn: GDNConfig | None = None
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor dims of q and k
    attn_output_gate: bool = False  # q_proj also yields a sigmoid gate on the attention output
    zero_centered_norms: bool = False  # RMSNorm weights stored as w - 1 (applied as 1 + w)
    shared_expert_size: int = 0  # MoE hybrids: a shared SwiGLU expert of this width beside the routed ones
    # --- gemma4: sliding layers (layer_windows > 0) use head_dim / num_kv_heads, full layers gemma4's ---
    gemma4: Gemma4Config | None = None
    # --- quantized targets (runtime choice, not from config.json; dflash_jax.quant): weight-only "int8" / "fp8"
    # matrices with per-output-channel scales, and an "int8" / "fp8" KV cache with per-token, per-head scales ---
    quant: str | None = None
    kv_quant: str | None = None

    def __post_init__(self):
        for name in ("quant", "kv_quant"):
            mode = getattr(self, name)
            if mode is not None and mode not in QUANT_MODES:
                raise ValueError(f"{name} must be one of {QUANT_MODES} or None, got {mode!r}")
            if mode and (self.layer_types or self.gemma4 is not None):
                raise ValueError(f"{name}={mode!r} is supported for Qwen3, LLaMA, Qwen2, Qwen3-MoE and gpt-oss "
                                 f"targets only (not hybrid or Gemma 4 ones)")
        if self.moe_combine not in ("psum", "all_to_all"):
            raise ValueError(f"moe_combine must be 'psum' or 'all_to_all', got {self.moe_combine!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must lie in [1, {self.num_experts}]")
        if self.layer_types and (self.gdn is None or set(self.layer_types) - {"linear", "full"}):
            raise ValueError(f"layer_types must be 'linear' / 'full' entries with a gdn config, got {self.layer_types}")
        if self.gemma4 is not None and len(self.layer_windows) != self.num_layers:
            raise ValueError("gemma4 needs layer_windows: one entry per layer (the window, 0 for a full layer)")
        if self.gemma4 is not None and self.num_heads % self.gemma4.global_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of the full layers' "
                             f"{self.gemma4.global_kv_heads} KV heads")
        for name in ("sparse_layers", "layer_windows", "layer_types"):
            v = getattr(self, name)
            if v and len(v) != self.num_layers:
                raise ValueError(f"{name} has {len(v)} entries for {self.num_layers} layers")

    def is_sparse(self, i: int) -> bool:
        """Layer i has a MoE block (rather than a dense MLP)."""
        return bool(self.num_experts) and (not self.sparse_layers or self.sparse_layers[i])

    @property
    def has_dense_mlp(self) -> bool:
        """Some layer has a dense MLP (every Gemma 4 layer has one, beside its MoE block)."""
        return self.gemma4 is not None or not all(self.is_sparse(i) for i in range(self.num_layers))

    @property
    def embed_scale(self) -> float:
        """What the token embeddings are multiplied by (Gemma 4: sqrt(hidden_size))."""
        return float(self.hidden_size) ** 0.5 if self.gemma4 is not None else 1.0

    @property
    def logit_softcap(self) -> float | None:
        """The final logits' soft cap, cap * tanh(x / cap) (Gemma 4's final_logit_softcapping), or None."""
        return self.gemma4.final_logit_softcapping if self.gemma4 is not None else None

    @property
    def is_hybrid(self) -> bool:
        """Some layers are Gated DeltaNet (a recurrent state) rather than attention."""
        return bool(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor) // 2 * 2

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], dtype: str = "float32") -> "TargetConfig":
        if isinstance(cfg.get("text_config"), Mapping):  # a multimodal checkpoint: its text model
            cfg = {**cfg["text_config"], "architectures": cfg.get("architectures") or [],
                   **{k: cfg[k] for k in ("tie_word_embeddings", "torch_dtype") if k in cfg}}
        archs = cfg.get("architectures") or []
        family = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                family = SUPPORTED_ARCHITECTURES[a]
                break
        if family is None:
            if archs:
                raise ValueError(
                    f"unsupported architecture {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
            family = _MODEL_TYPE_TO_FAMILY.get(cfg.get("model_type", ""))
            if family is None:
                raise ValueError(
                    f"config has no supported `architectures` and unknown model_type {cfg.get('model_type')!r}; "
                    f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        moe = moe_fields_from_hf(cfg, family)
        moe.update(hybrid_fields_from_hf(cfg, family))
        moe.update(gemma4_fields_from_hf(cfg, family))
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if family != "gemma4" and cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            theta, scaling = rope_from_hf(cfg) if family != "gemma4" else (moe["gemma4"].sliding_rope[0], None)
            attention_bias = bool(cfg.get("attention_bias", False))
            return cls(
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg.get("intermediate_size") or cfg.get("moe_intermediate_size") or 0),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma4")),
                qk_norm=family in ("qwen3", "qwen3_moe") + HYBRID_FAMILIES,
                qkv_bias=True if family == "qwen2" else attention_bias,
                o_bias=attention_bias if family in ("llama", "qwen3") + MOE_FAMILIES else False,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
                dtype=dtype,
                **moe,
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required key {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.family]
        out = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias if self.family != "qwen2" else False,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0])
            if self.eos_token_ids else None,
            "torch_dtype": self.dtype,
        }
        out.update(rope_to_hf(self.rope_theta, self.rope_scaling))
        out.update(moe_fields_to_hf(self))
        if self.is_hybrid:
            out.update(self.gdn.to_hf())
            out.update(layer_types=[t + "_attention" for t in self.layer_types],
                       partial_rotary_factor=self.partial_rotary_factor)
            out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                      "partial_rotary_factor": self.partial_rotary_factor}
            if self.rope_scaling:
                out["rope_parameters"].update(_thaw(self.rope_scaling))
            out.pop("rope_scaling", None)
            if self.family == "qwen3_5":
                out["model_type"] = "qwen3_5_text"
        if self.gemma4 is not None:
            out = gemma4_fields_to_hf(self, out)
        return out


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default tapped target layers: round(1 + i*(N-4)/(n-1)) (Python round, half to even)."""
    n, N = num_draft_layers, num_target_layers
    if n == 1:
        return (N // 2,)
    return tuple(int(round(1 + i * (N - 4) / (n - 1))) for i in range(n))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    max_position_embeddings: int = 32768
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    dtype: str = "float32"
    attention_bias: bool = False  # biased q/k/v/o projections (the gpt-oss drafters)
    # DFlash2 (architectures ["DFlash2DraftModel"]): a dynamic causal conv around each sublayer and a candidate
    # selector over the top `selector_top_k` draft logits (dflash_jax.drafter2)
    kind: str = "dflash"  # "dflash" or "dflash2"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # weight-only "int8" / "fp8" matrices with per-output-channel scales (runtime choice; dflash_jax.quant): drafts
    # only, so speculative decoding stays lossless whatever the drafter's precision
    quant: str | None = None

    def __post_init__(self):
        if self.quant is not None and self.quant not in QUANT_MODES:
            raise ValueError(f"drafter quant must be one of {QUANT_MODES} or None, got {self.quant!r}")
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter kind must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        if self.is_dflash2:
            if self.conv_kernel_size < 1 or self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                raise ValueError(f"DFlash2 conv_kernel_size {self.conv_kernel_size} must be >= 1 and conv_group_size "
                                 f"{self.conv_group_size} must divide hidden_size {self.hidden_size}")
            if self.selector_rank < 1 or not 1 <= self.selector_top_k <= self.vocab_size:
                raise ValueError(f"DFlash2 selector_rank {self.selector_rank} must be >= 1 and selector_top_k "
                                 f"{self.selector_top_k} in [1, vocab_size {self.vocab_size}]")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for t in self.layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise ValueError(f"unknown drafter layer type {t!r}")
        if any(t == "sliding_attention" for t in self.layer_types) and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("drafter num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def is_dflash2(self) -> bool:
        return self.kind == "dflash2"

    @property
    def conv_groups(self) -> int:
        """Channel groups of a DFlash2 dynamic conv (one dynamic kernel tap per group)."""
        return self.hidden_size // self.conv_group_size

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per layer: 0 for full (non-causal) attention, else the sliding window (causal)."""
        types = self.layer_types or ("full_attention",) * self.num_layers
        return tuple(int(self.sliding_window) if t == "sliding_attention" else 0 for t in types)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], dtype: str = "float32") -> "DrafterConfig":
        archs = cfg.get("architectures") or []
        if archs and not any("DFlash" in a for a in archs):
            raise ValueError(f"not a DFlash drafter config: architectures={archs!r} (expected DFlashDraftModel or "
                             f"DFlash2DraftModel)")
        kind = "dflash2" if "DFlash2DraftModel" in archs else "dflash"
        dcfg = dict(cfg.get("dflash_config") or {})

        def get(name, default=None):
            return dcfg.get(name, cfg.get(name, default))

        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            n_layers = int(cfg["num_hidden_layers"])
            n_target = int(cfg["num_target_layers"]) if cfg.get("num_target_layers") is not None else None
            ids = get("target_layer_ids")
            if ids is None:
                if n_target is None:
                    raise ValueError("drafter config has neither dflash_config.target_layer_ids nor num_target_layers")
                ids = default_target_layer_ids(n_target, n_layers)
            mask = get("mask_token_id")
            if mask is None:
                raise ValueError("drafter config has no dflash_config.mask_token_id")
            theta, scaling = rope_from_hf(cfg)
            layer_types = tuple(cfg.get("layer_types") or ())
            softcap = get("final_logit_softcapping")
            return cls(
                hidden_size=hidden,
                intermediate_size=int(cfg.get("intermediate_size") or cfg.get("moe_intermediate_size") or 0),
                num_layers=n_layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                vocab_size=int(cfg["vocab_size"]),
                num_target_layers=n_target if n_target is not None else max(ids) + 1,
                target_layer_ids=tuple(int(i) for i in ids),
                mask_token_id=int(mask),
                block_size=int(get("block_size", 16)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                layer_types=layer_types if any(t == "sliding_attention" for t in layer_types) else (),
                sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                input_embedding_scale=float(get("input_embedding_scale", 1.0)),
                output_multiplier=float(get("output_multiplier", 1.0)),
                final_logit_softcapping=float(softcap) if softcap else None,
                dtype=dtype,
                attention_bias=bool(cfg.get("attention_bias", False)),
                kind=kind,
                **({k: int(get(k)) for k in DFLASH2_FIELDS if get(k) is not None} if kind == "dflash2" else {}),
            )
        except KeyError as e:
            raise ValueError(f"drafter config.json is missing required key {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        out = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "layer_types": list(self.layer_types or ("full_attention",) * self.num_layers),
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }
        if self.input_embedding_scale != 1.0:
            out["dflash_config"]["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            out["dflash_config"]["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            out["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
        if self.is_dflash2:
            out["architectures"] = ["DFlash2DraftModel"]
            out["auto_map"] = {"AutoModel": "dflash.DFlash2DraftModel"}
            out["dflash_config"].update(block_size=self.block_size, **{k: getattr(self, k) for k in DFLASH2_FIELDS})
        out.update(rope_to_hf(self.rope_theta, self.rope_scaling))
        return out


DRAFTER_KINDS = ("dflash", "dflash2")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # dflash_config keys


def read_config_json(path: str | os.PathLike) -> dict:
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(p):
        raise FileNotFoundError(f"no config.json at {p}")
    with open(p) as f:
        return json.load(f)
