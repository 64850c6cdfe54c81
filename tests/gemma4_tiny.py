"""A tiny Gemma 4 target with every feature in 4 layers, shared by tests/test_gemma4.py and the 8-device worker
(tests/gemma4_sharding_worker.py, which runs as a script and must not import the test module's torch stack)."""
from dflash_jax import init_target
from dflash_jax.config import TargetConfig
from dflash_jax.families import Gemma4Config


def tiny_gemma4(seed=1, std=0.6, vocab=16, heads=2, kv_heads=1):
    """Sliding (window 8) / full layers, k_eq_v with a global head size, the MoE block, per-layer inputs, the last two
    layers KV-shared (double-wide MLPs), an untied lm_head with a soft cap."""
    g = Gemma4Config(global_head_dim=32, global_kv_heads=1, k_eq_v=True, sliding_rope=(100.0, "default", 1.0, 1.0),
                     full_rope=(10000.0, "proportional", 0.25, 1.0), final_logit_softcapping=8.0, ple_dim=4,
                     ple_vocab=vocab, kv_shared_layers=2, double_wide_mlp=True)
    cfg = TargetConfig(family="gemma4", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=4,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=16, max_position_embeddings=512,
                       layer_windows=(8, 0, 8, 0), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       norm_topk_prob=True, gemma4=g)
    return init_target(cfg, seed=seed, std=std)
