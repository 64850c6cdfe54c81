"""Family-specific fields of TargetConfig read from (and written to) Hugging Face config.json: mixture of experts
(Qwen3-MoE, gpt-oss) and the Gated DeltaNet hybrids (Qwen3.5 / Qwen3.6, Qwen3-Next)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

MOE_FAMILIES = ("qwen3_moe", "gpt_oss")
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


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
