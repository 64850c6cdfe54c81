"""Family-specific fields of TargetConfig read from (and written to) Hugging Face config.json: mixture of experts
(Qwen3-MoE, gpt-oss), the Gated DeltaNet hybrids (Qwen3.5 / Qwen3.6, Qwen3-Next) and Gemma 4."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

MOE_FAMILIES = ("qwen3_moe", "gpt_oss")
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
GEMMA4_ROPE_TYPES = ("default", "proportional")


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """The Gated DeltaNet layers of a hybrid target (dflash_jax/gdn.py)."""
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int = 4

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")

    @property
    def key_size(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_size(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_size + self.value_size

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "GDNConfig":
        return cls(num_k_heads=int(cfg["linear_num_key_heads"]), num_v_heads=int(cfg["linear_num_value_heads"]),
                   k_dim=int(cfg["linear_key_head_dim"]), v_dim=int(cfg["linear_value_head_dim"]),
                   conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)))

    def to_hf(self) -> dict:
        return {"linear_num_key_heads": self.num_k_heads, "linear_num_value_heads": self.num_v_heads,
                "linear_key_head_dim": self.k_dim, "linear_value_head_dim": self.v_dim,
                "linear_conv_kernel_dim": self.conv_kernel}


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """The Gemma 4 text layers (dflash_jax/gemma4.py) beyond TargetConfig's: full-attention layers' head size and KV
    heads (the sliding layers' are TargetConfig.head_dim / num_kv_heads; which layer is which: layer_windows), their
    K = V projection, the RoPE of each kind as (theta, rope_type, partial_rotary_factor, factor), the logit soft cap,
    per-layer input embeddings (ple_dim 0: none) and the KV-shared last layers."""
    global_head_dim: int
    global_kv_heads: int
    k_eq_v: bool = False
    sliding_rope: tuple = (10000.0, "default", 1.0, 1.0)
    full_rope: tuple = (1000000.0, "proportional", 0.25, 1.0)
    final_logit_softcapping: float | None = None
    ple_dim: int = 0  # hidden_size_per_layer_input
    ple_vocab: int = 0  # vocab_size_per_layer_input
    kv_shared_layers: int = 0  # the last this many layers reuse the K/V of the last earlier layer of their kind
    double_wide_mlp: bool = False  # KV-shared layers' MLP is twice intermediate_size wide
    # the most rows one call writes to the sliding layers' ring caches (a prefill chunk, a verified block or tree);
    # the rings hold the window + this many slots, rounded up to 128 (dflash_jax.gemma4.ring_size). Not a checkpoint
    # field: a runtime setting
    ring_write: int = 1024

    def __post_init__(self):
        for rope in (self.sliding_rope, self.full_rope):
            if rope[1] not in GEMMA4_ROPE_TYPES:
                raise ValueError(f"gemma4 rope_type {rope[1]!r} is not supported (supported: {GEMMA4_ROPE_TYPES})")


def _gemma4_rope(rp: Mapping[str, Any], kind: str) -> tuple:
    p = rp.get(kind) or {}
    default = (10000.0, "default", 1.0, 1.0) if kind == "sliding_attention" else (1e6, "proportional", 0.25, 1.0)
    return (float(p.get("rope_theta", default[0])), str(p.get("rope_type", default[1])),
            float(p.get("partial_rotary_factor", default[2])), float(p.get("factor", default[3])))


def gemma4_fields_from_hf(cfg: Mapping[str, Any], family: str) -> dict:
    """TargetConfig fields of Gemma 4 text models from an HF (text) config dict: per-layer windows (0 = a full layer),
    the Gemma4Config, the MoE block's sizes. A setting the layers do not implement is a ValueError naming it."""
    if family != "gemma4":
        return {}
    L = int(cfg["num_hidden_layers"])
    for key, bad, what in (("use_bidirectional_attention", "all", "bidirectional text attention"),
                           ("attention_bias", True, "attention_bias=True")):
        if cfg.get(key) == bad:
            raise ValueError(f"gemma4: {what} is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"gemma4: hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(L)])
    if len(types) != L or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"gemma4 layer_types {types!r} must be {L} of sliding_attention / full_attention")
    types[-1] = "full_attention"  # as transformers: the last layer is always full
    window = int(cfg.get("sliding_window") or 512)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    head_dim, kv = int(cfg.get("global_head_dim") or 512), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
        kv = int(cfg["num_global_key_value_heads"])
    per_layer = cfg.get("per_layer_config") or {}  # transformers 5.x writes the full layers' sizes here
    sizes = {(int(v.get("head_dim", head_dim)), int(v.get("num_key_value_heads", kv)))
             for i, v in per_layer.items() if str(i).isdigit() and int(i) < L and types[int(i)] == "full_attention"}
    if len(sizes) > 1:
        raise ValueError(f"gemma4 per_layer_config gives full layers different sizes {sorted(sizes)}")
    head_dim, kv = sizes.pop() if sizes else (head_dim, kv)
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    first = L - shared
    if shared and not (0 < first and set(types[first:]) <= set(types[:first])):
        raise ValueError(f"gemma4 num_kv_shared_layers={shared}: every shared layer needs an earlier layer of its kind")
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    cap = cfg.get("final_logit_softcapping")
    ple = int(cfg.get("hidden_size_per_layer_input", 256) or 0)  # transformers' defaults where a key is absent
    g = Gemma4Config(global_head_dim=head_dim, global_kv_heads=kv, k_eq_v=k_eq_v,
                     sliding_rope=_gemma4_rope(rp, "sliding_attention"), full_rope=_gemma4_rope(rp, "full_attention"),
                     final_logit_softcapping=float(cap) if cap else None, ple_dim=ple,
                     ple_vocab=int(cfg.get("vocab_size_per_layer_input", 262144)) if ple else 0,
                     kv_shared_layers=shared, double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)))
    out = dict(gemma4=g, layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types))
    if cfg.get("enable_moe_block"):  # routed experts beside every layer's dense MLP
        out.update(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["top_k_experts"]),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=True)
    return out


def gemma4_fields_to_hf(c: Any, out: dict) -> dict:
    """`out` (TargetConfig.to_hf's common keys) turned into a Gemma4TextConfig dict that transformers reads."""
    g = c.gemma4
    for k in ("hidden_act", "rope_theta", "rope_scaling", "attention_bias"):
        out.pop(k, None)
    rope = lambda r: {"rope_theta": r[0], "rope_type": r[1], "partial_rotary_factor": r[2], "factor": r[3]}
    full = [i for i, w in enumerate(c.layer_windows) if not w]
    out.update(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", hidden_activation="gelu_pytorch_tanh",
               layer_types=["sliding_attention" if w else "full_attention" for w in c.layer_windows],
               sliding_window=max(c.layer_windows), attention_k_eq_v=g.k_eq_v, global_head_dim=g.global_head_dim,
               num_global_key_value_heads=g.global_kv_heads,
               per_layer_config={str(i): {"head_dim": g.global_head_dim, "num_key_value_heads": g.global_kv_heads}
                                 for i in full},
               rope_parameters={"sliding_attention": rope(g.sliding_rope), "full_attention": rope(g.full_rope)},
               final_logit_softcapping=g.final_logit_softcapping, hidden_size_per_layer_input=g.ple_dim,
               vocab_size_per_layer_input=g.ple_vocab or c.vocab_size, num_kv_shared_layers=g.kv_shared_layers,
               use_double_wide_mlp=g.double_wide_mlp, enable_moe_block=bool(c.num_experts))
    if c.num_experts:
        out.update(num_experts=c.num_experts, top_k_experts=c.num_experts_per_tok,
                   moe_intermediate_size=c.moe_intermediate_size)
    return out


def moe_fields_from_hf(cfg: Mapping[str, Any], family: str) -> dict:
    """TargetConfig fields of the MoE families (Qwen3-MoE, gpt-oss) from an HF config dict."""
    if family not in MOE_FAMILIES:
        return {}
    L = int(cfg["num_hidden_layers"])
    E = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if E <= 0:
        raise ValueError(f"{family} config has no num_experts / num_local_experts")
    out = dict(num_experts=E, num_experts_per_tok=int(cfg["num_experts_per_tok"]))
    if family == "qwen3_moe":
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = set(int(i) for i in cfg.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(L))
        out.update(moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                   sparse_layers=() if all(sparse) else sparse)
        if cfg.get("use_sliding_window"):
            raise ValueError("qwen3_moe with use_sliding_window=True is not supported")
    else:  # gpt_oss: every layer is MoE; experts are intermediate_size wide
        if float(cfg.get("swiglu_alpha", 1.702)) != 1.702:
            raise ValueError(f"gpt_oss swiglu_alpha={cfg.get('swiglu_alpha')} is not supported (only 1.702)")
        types = list(cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)])
        if len(types) != L or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ValueError(f"gpt_oss layer_types {types!r} must be {L} of sliding_attention / full_attention")
        window = int(cfg.get("sliding_window") or 0)
        if "sliding_attention" in types and window <= 0:
            raise ValueError("gpt_oss sliding_attention layers need a positive sliding_window")
        out.update(moe_intermediate_size=int(cfg["intermediate_size"]), attention_sinks=True,
                   layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                   swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    return out


def moe_fields_to_hf(c: Any) -> dict:
    if c.family == "qwen3_moe":
        dense = [i for i in range(c.num_layers) if not c.is_sparse(i)]
        return {"num_experts": c.num_experts, "num_local_experts": c.num_experts,
                "num_experts_per_tok": c.num_experts_per_tok, "moe_intermediate_size": c.moe_intermediate_size,
                "norm_topk_prob": c.norm_topk_prob, "mlp_only_layers": dense, "decoder_sparse_step": 1}
    if c.family == "gpt_oss":
        w = max(c.layer_windows or (0,))
        return {"num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
                "intermediate_size": c.moe_intermediate_size, "sliding_window": w or None,
                "layer_types": ["sliding_attention" if x else "full_attention" for x in c.layer_windows],
                "swiglu_limit": c.swiglu_limit, "attention_bias": c.qkv_bias}
    return {}



def hybrid_fields_from_hf(cfg: Mapping[str, Any], family: str) -> dict:
    """TargetConfig fields of the hybrid families (Gated DeltaNet + gated attention) from an HF config dict."""
    if family not in HYBRID_FAMILIES:
        return {}
    L = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types:
        every = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(L)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"{family}: unsupported layer kind(s) {unknown} in layer_types (supported: linear_attention, "
                         f"full_attention)")
    if len(types) != L:
        raise ValueError(f"{family} layer_types has {len(types)} entries for {L} layers")
    moe = {}
    E = int(cfg.get("num_experts") or 0)
    if E > 0:  # routed experts (softmax top-k, renormalised in qwen3_5_moe) + a sigmoid-gated shared expert
        if family == "qwen3_5_moe":
            sparse = (True,) * L
        else:
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            dense = set(int(i) for i in cfg.get("mlp_only_layers") or ())
            sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(L))
        moe = dict(num_experts=E, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=True if family == "qwen3_5_moe" else bool(cfg.get("norm_topk_prob", True)),
                   sparse_layers=() if all(sparse) else sparse,
                   shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0))
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    factor = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    return dict(layer_types=tuple(t.split("_")[0] for t in types), gdn=GDNConfig.from_hf(cfg),
                partial_rotary_factor=factor, attn_output_gate=True, zero_centered_norms=True, **moe)
