"""Run in a subprocess with 8 fake CPU devices (XLA_FLAGS set before jax is imported).

Prints one JSON object with the comparisons that tests/test_sharding.py asserts on."""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import dflash_jax as dj  # noqa: E402
from dflash_jax import decode as gen  # noqa: E402
from dflash_jax.sharding import make_mesh  # noqa: E402

out = {"devices": jax.device_count()}
tmp = sys.argv[1]

# GQA with 2 KV heads: model axes 4 and 8 exercise KV-head replication.
cfg = dj.TargetConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                      num_heads=8, num_kv_heads=2, head_dim=16, qk_norm=True)
target = dj.init_target(cfg, seed=0, std=0.25)
drafter = dj.init_drafter(target, num_layers=2, block_size=4, mask_token_id=63, seed=1, std=0.1)
prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]
kw = dict(max_new_tokens=12, stop_token_ids=[], block_size=None)  # block None: the drafter's chain (not auto)
settings = {"greedy": dict(), "t1": dict(temperature=1.0, seed=3), "topk": dict(temperature=0.8, top_k=5, seed=4)}
# every mesh shape once and every sampling setting at least once ((2, 4)/greedy is also what the loading checks below
# run: one program for both); more sampled meshes in the tree worker, (2, 4)/t1, and the pallas worker, (1, 8)/t1
MESH_CASES = {(1, 8): ("t1",), (2, 4): ("greedy",), (4, 2): ("topk",), (8, 1): ("greedy",)}
if len(sys.argv) > 2 and sys.argv[2] == "tree":
    # Tree verification (budget 10 > the 8-token vocab shard at model axis 8: the top-K gathers shards)
    tree_res = {}
    single = dj.generate(target, drafter, prompts, tree_budget=10, **kw)
    for shape, name in [((1, 8), "greedy"), ((2, 4), "t1")]:
        t_only = dj.generate(target, None, prompts, **kw, **settings[name]).tokens
        spec = dj.generate(target, drafter, prompts, mesh=make_mesh(*shape), tree_budget=10, **kw, **settings[name])
        tree_res[f"{shape}/{name}"] = {"spec_equals_target_only": spec.tokens == t_only, "tau": spec.tau,
                                       "acceptance_equal": (spec.acceptance_lengths == single.acceptance_lengths
                                                            if name == "greedy" else None)}
    # a call that changes shape in place (auto's look, then the rest): chain -> tree / target-only / chain
    from dflash_jax.sampling import SamplingParams
    switch = {}
    for shape, name, first, then in [((2, 4), "greedy", (4, None), (4, 10)), ((1, 8), "t1", (3, None), (1, None)),
                                     ((2, 4), "t1", (4, 10), (2, None))]:
        s = settings[name]
        t_only = dj.generate(target, None, prompts, **kw, **s).tokens
        res, more = gen.run_shape(target, drafter, prompts, sp=SamplingParams(s.get("temperature", 0.0)),
                                  max_new_tokens=12, stop_token_ids=[], seed=s.get("seed", 0), max_cache_len=64,
                                  row_ids=None, mesh=make_mesh(*shape), prefill_chunk=gen.PREFILL_CHUNK, Bk=first[0],
                                  tree=first[1], look=5, then=lambda part, then=then: then)
        switch[f"{shape}/{name}/{first}->{then}"] = {"spec_equals_target_only": res.tokens == t_only,
                                                     "switched": more is not None and res.block_size == then[0]}
    tree_res["switch"] = switch
    # a chain's shadow trees (GenerationResult.shadow_lengths) under shard_map: budget 10 > the vocab shard
    one = dj.generate(target, drafter, prompts, shadow_trees=(3, 10), **kw)
    many = dj.generate(target, drafter, prompts, mesh=make_mesh(1, 8), shadow_trees=(3, 10), **kw)
    tree_res["shadow"] = {"equal": many.shadow_lengths == one.shadow_lengths and many.tokens == one.tokens,
                          "known": sum(x > 0 for r in one.shadow_lengths[10] for x in r),
                          "cycles": sum(len(r) for r in one.acceptance_lengths)}
    print("RESULT " + json.dumps({"tree": tree_res}))
    sys.exit(0)
if len(sys.argv) > 2 and sys.argv[2] == "pallas":
    # The TPU default attention path (the Pallas cache kernel, interpreted on CPU) under shard_map: local KV
    # heads (replicated for model axis 4), rows over 'data'; against single-device runs on the blockwise path.
    from dflash_jax import attention as att
    pal = {}
    for shape, name in [((2, 4), "greedy"), ((1, 8), "t1")]:
        s = settings[name]
        t_only = dj.generate(target, None, prompts, **kw, **s).tokens
        single = dj.generate(target, drafter, prompts, **kw, **s)
        with att.use_impl("pallas"):
            spec = dj.generate(target, drafter, prompts, mesh=make_mesh(*shape), **kw, **s)
            t_pal = dj.generate(target, None, prompts, mesh=make_mesh(*shape), **kw, **s).tokens
        pal[f"{shape}/{name}"] = {"spec_equals_target_only": spec.tokens == t_only, "target_only_equal": t_pal == t_only,
                                  "acceptance_equal": spec.acceptance_lengths == single.acceptance_lengths}
    print("RESULT " + json.dumps({"pallas": pal}))
    sys.exit(0)
ref = {name: (dj.generate(target, None, prompts, **kw, **s).tokens, dj.generate(target, drafter, prompts, **kw, **s))
       for name, s in settings.items()}
res = {}
# every mesh shape and every sampling setting at least once (each pair is two compilations on 8 fake
# devices, the bulk of this worker's time): pure tensor parallel, mixed, pure data parallel
for shape, names in MESH_CASES.items():
    mesh = make_mesh(*shape)
    for name in names:
        s = settings[name]
        t_only = dj.generate(target, None, prompts, mesh=mesh, **kw, **s).tokens
        spec = dj.generate(target, drafter, prompts, mesh=mesh, **kw, **s)
        res[f"{shape}/{name}"] = {
            "target_only_equal": t_only == ref[name][0],
            "spec_equal": spec.tokens == ref[name][1].tokens,
            "acceptance_equal": spec.acceptance_lengths == ref[name][1].acceptance_lengths,
            "spec_equals_target_only": spec.tokens == t_only,
        }
out["meshes"] = res


# Sharded loading straight from a checkpoint: every device holds exactly its slice.
dj.save_target(target, os.path.join(tmp, "t"))
dj.save_drafter(drafter, os.path.join(tmp, "d"))
mesh = make_mesh(2, 4)
lt = dj.load_target(os.path.join(tmp, "t"), mesh=mesh, layout="stacked")
ld = dj.load_drafter(os.path.join(tmp, "d"), lt, mesh=mesh, layout="stacked")
lu = dj.load_target(os.path.join(tmp, "t"), mesh=mesh, layout="unrolled")
lud = dj.load_drafter(os.path.join(tmp, "d"), lu, mesh=mesh, layout="unrolled")
q = lt.params["layers"]["q"]
out["load"] = {
    "q_spec": list(q.sharding.spec),
    "q_shard_shape": list(q.addressable_shards[0].data.shape),
    "q_global_shape": list(q.shape),
    "k_global_shape": list(lt.params["layers"]["k"].shape),  # 2 KV heads replicated to 4
    "embed_shard_shape": list(lt.params["embed"].addressable_shards[0].data.shape),
    "tokens_equal": dj.generate(lt, ld, prompts, **kw).tokens == ref["greedy"][1].tokens,
    "unrolled_q_shard_shape": list(lu.params["layers"][0]["q"].addressable_shards[0].data.shape),
    "unrolled_tokens_equal": dj.generate(lu, lud, prompts, **kw).tokens == ref["greedy"][1].tokens,
}
# save from a sharded model un-replicates KV heads
dj.save_target(lt, os.path.join(tmp, "t2"))
back = dj.load_target(os.path.join(tmp, "t2"), layout="stacked")
out["load"]["resave_exact"] = all(
    np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(target.params)))

# KV heads that neither divide nor are divided by the model axis -> clear error
bad = dj.init_target(dj.TargetConfig(family="llama", vocab_size=64, hidden_size=48, intermediate_size=64,
                                     num_layers=1, num_heads=6, num_kv_heads=3, head_dim=8), seed=0)
try:
    dj.generate(bad, None, prompts, mesh=make_mesh(4, 2), **kw)
    out["bad_kv_error"] = None
except ValueError as e:
    out["bad_kv_error"] = str(e)

# Collectives in the compiled fused step (mesh 2 x 4, greedy)
gen.clear_compile_cache()
dj.generate(target, drafter, prompts[:2], mesh=make_mesh(2, 4), **kw)
colls = {}
for key, exe in gen.DEFAULT.programs.items():
    txt = exe.as_text()
    ops = {}
    for op in ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute"):
        shapes = re.findall(r"= ([a-z0-9]+\[[0-9,]*\])\{?[^ ]* %s(?:-start)?\(" % op, txt)
        ops[op] = [int(np.prod([int(x) for x in s[s.index("[") + 1:-1].split(",") if x] or [1])) for s in shapes]
    colls[key[0]] = ops
out["collectives"] = colls
print("RESULT " + json.dumps(out))
