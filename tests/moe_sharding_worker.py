"""Run in a subprocess with 8 fake CPU devices: MoE targets (Qwen3-MoE with a dense layer, gpt-oss)
decoded with expert parallelism over 'model' must equal the single-device run. Prints one JSON line."""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import dataclasses  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402

import dflash_jax as dj  # noqa: E402
from dflash_jax.sharding import make_mesh  # noqa: E402

tmp = sys.argv[1]
common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=8, num_kv_heads=2, head_dim=16,
              num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32)
configs = {
    "qwen3_moe": dj.TargetConfig(family="qwen3_moe", num_layers=3, qk_norm=True, norm_topk_prob=True,
                                 sparse_layers=(True, False, True), **common),
    "gpt_oss": dj.TargetConfig(family="gpt_oss", num_layers=2, qkv_bias=True, o_bias=True, layer_windows=(4, 0),
                               attention_sinks=True, **common),
}
prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]
kw = dict(max_new_tokens=12, stop_token_ids=[], block_size=None)  # block None: the drafter's chain (not auto)
settings = {"greedy": dict(), "t1": dict(temperature=1.0, seed=3)}
out = {"devices": jax.device_count(), "families": {}}
for fam, cfg in configs.items():
    target = dj.init_target(cfg, seed=0, std=0.25)
    drafter = dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=63, seed=1, std=0.1,
                              target_layer_ids=(0,))
    # (4, 2): 8 experts per device, decode steps take the gathered path; (1, 8): 2 experts per device
    cases = [((4, 2), ("greedy",)), ((1, 8), ("t1",))] if fam == "qwen3_moe" else [((4, 2), ("greedy",))]
    used = {n for _, names in cases for n in names}
    ref = {n: (dj.generate(target, None, prompts, **kw, **s).tokens, dj.generate(target, drafter, prompts, **kw, **s))
           for n, s in settings.items() if n in used}
    res = {}
    for shape, names in cases:
        mesh = make_mesh(*shape)
        for n in names:
            s = settings[n]
            t_only = dj.generate(target, None, prompts, mesh=mesh, **kw, **s).tokens
            spec = dj.generate(target, drafter, prompts, mesh=mesh, **kw, **s)
            res[f"{shape}/{n}"] = {"target_only_equal": t_only == ref[n][0], "spec_equal": spec.tokens == ref[n][1].tokens,
                                   "spec_equals_target_only": spec.tokens == t_only}
            print(fam, shape, n, res[f"{shape}/{n}"], file=sys.stderr, flush=True)
    out["families"][fam] = res
    if fam != "qwen3_moe":
        continue
    # the all-to-all combine (dispatch + return + all-gather) gives the same tokens
    a2a = target.replace(config=dataclasses.replace(cfg, moe_combine="all_to_all"))
    mesh = make_mesh(2, 4)
    spec = dj.generate(a2a, drafter, prompts, mesh=mesh, **kw)
    res["all_to_all (2, 4)/greedy"] = {"spec_equal": spec.tokens == ref["greedy"][1].tokens,
                                       "spec_equals_target_only": spec.tokens == ref["greedy"][0]}
    print(fam, "all_to_all", res["all_to_all (2, 4)/greedy"], file=sys.stderr, flush=True)
    # checkpoint loaded straight onto the mesh: experts split over 'model'
    path = os.path.join(tmp, fam)
    dj.save_target(target, path)
    lt = dj.load_target(path, mesh=make_mesh(2, 4), layout="stacked")
    eg = lt.params["layers"]["e_gate"]
    res["load"] = {"e_gate_spec": [str(a) for a in eg.sharding.spec], "e_gate_shard": list(eg.addressable_shards[0].data.shape),
                   "tokens_equal": dj.generate(lt, None, prompts, **kw).tokens == ref["greedy"][0]}
print("RESULT " + json.dumps(out))
