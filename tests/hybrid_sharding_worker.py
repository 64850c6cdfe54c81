"""Run in a subprocess with 8 fake CPU devices: a hybrid target (Gated DeltaNet heads and KV heads split over the
model axis, KV heads replicated at model 4) decodes on a (2, 4) mesh exactly as on one device:
chains, trees and target-only; an MoE hybrid (experts over the model axis) on (2, 4). Prints one JSON object {case: equal}."""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import json
import numpy as np
import dflash_jax as dj
from dflash_jax.config import TargetConfig, GDNConfig
from dflash_jax.sharding import make_mesh
from dflash_jax.weights import shard_target


def same_as_placed(loaded, placed):
    """Every param of `loaded` equals `placed`'s, with the same sharding."""
    import jax
    pairs = zip(jax.tree.leaves(loaded.params), jax.tree.leaves(placed.params))
    return all(a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)


cfg = TargetConfig(family="qwen3_5", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=8,
                   num_kv_heads=2, head_dim=16, qk_norm=True, layer_types=("linear", "full", "linear", "full"),
                   gdn=GDNConfig(4, 8, 8, 6, 4), partial_rotary_factor=0.5, attn_output_gate=True,
                   zero_centered_norms=True)
target = dj.init_target(cfg, seed=0, std=0.3)
drafter = dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=63, seed=1, std=0.1, target_layer_ids=(0, 2))
prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]
kw = dict(max_new_tokens=12, stop_token_ids=[])
ref = dj.generate(target, None, prompts, **kw).tokens
out = {}
for shape in [(2, 4)]:
    m = make_mesh(*shape)
    for name, sk in [("chain", dict(block_size=4)), ("tree", dict(tree_budget=6)), ("only", dict())]:
        d = None if name == "only" else drafter
        r = dj.generate(target, d, prompts, mesh=m, **kw, **sk)
        out[f"{shape}/{name}"] = r.tokens == ref
# the MoE hybrid: experts and the shared expert over the model axis
moe_cfg = TargetConfig(family="qwen3_5_moe", vocab_size=64, hidden_size=32, intermediate_size=0, num_layers=4,
                       num_heads=8, num_kv_heads=2, head_dim=16, qk_norm=True, layer_types=("linear", "full") * 2,
                       gdn=GDNConfig(4, 8, 8, 6, 4), partial_rotary_factor=0.5, attn_output_gate=True,
                       zero_centered_norms=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                       norm_topk_prob=True, shared_expert_size=24)
moe_t = dj.init_target(moe_cfg, seed=0, std=0.3)
moe_d = dj.init_drafter(moe_t, num_layers=1, block_size=4, mask_token_id=63, seed=1, std=0.1, target_layer_ids=(0, 2))
moe_ref = dj.generate(moe_t, None, prompts, **kw).tokens
for name, sk in [("chain", dict(block_size=4))]:
    r = dj.generate(moe_t, moe_d, prompts, mesh=make_mesh(2, 4), **kw, **sk)
    out[f"moe/(2, 4)/{name}"] = r.tokens == moe_ref
# a checkpoint loaded onto the (2, 4) mesh tensor by tensor == the in-memory target placed there
import tempfile
with tempfile.TemporaryDirectory() as tmp:
    dj.save_target(target, tmp)
    m = make_mesh(2, 4)
    out["(2, 4)/load onto mesh"] = same_as_placed(dj.load_target(tmp, mesh=m), shard_target(dj.load_target(tmp), m))
print(json.dumps(out))
