"""Run in a subprocess with 8 fake CPU devices: a Gemma 4 target (sliding and full layers with their own head sizes
and KV heads, k_eq_v, the MoE block beside the dense MLP, per-layer inputs, KV-shared last layers) decodes on
('data', 'model') meshes exactly as on one device: a greedy chain and target-only. At model 4 the sliding layers'
2 KV heads and the full layers' 1 are replicated. Prints one JSON object {case: equal}."""
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemma4_tiny import tiny_gemma4  # noqa: E402
import dflash_jax as dj
from dflash_jax.sharding import make_mesh
from dflash_jax.weights import shard_target
V = 32


def same_as_placed(loaded, placed):
    """Every param of `loaded` equals `placed`'s, with the same sharding."""
    import jax
    import numpy as np
    pairs = zip(jax.tree.leaves(loaded.params), jax.tree.leaves(placed.params))
    return all(a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)


target = tiny_gemma4(vocab=V, heads=4, kv_heads=2)
drafter = dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=V - 1, seed=3, std=0.1,
                          target_layer_ids=(1, 2))
prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19]]
kw = dict(max_new_tokens=14, stop_token_ids=[])
ref = dj.generate(target, None, prompts, **kw).tokens
out = {}
for shape in [tuple(int(x) for x in s.split(",")) for s in (sys.argv[1:] or ["2,4", "8,1"])]:
    m = make_mesh(*shape)
    placed = shard_target(target, m)  # the layout generate uses: heads split, KV heads replicated per kind
    out[f"{shape}/layout"] = ([placed.params["layers"][i]["k"].shape[0] for i in (0, 1)] == [2 * 16 * max(1, shape[1] // 2), 32 * shape[1]]
                              and placed.params["layers"][0]["q"].sharding.shard_shape((64, 32))[0] == 64 // shape[1])
    for name, d in [("chain", drafter), ("only", None)]:
        r = dj.generate(target, d, prompts, mesh=m, block_size=4, **kw) if d else dj.generate(target, None, prompts, mesh=m, **kw)
        out[f"{shape}/{name}"] = r.tokens == ref
# a checkpoint loaded onto the (2, 4) mesh tensor by tensor == the in-memory target placed there
import tempfile
with tempfile.TemporaryDirectory() as tmp:
    dj.save_target(target, tmp)
    m = make_mesh(2, 4)
    out["(2, 4)/load onto mesh"] = same_as_placed(dj.load_target(tmp, mesh=m), shard_target(dj.load_target(tmp), m))
print(json.dumps(out))
