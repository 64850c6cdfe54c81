"""DFlash2 drafters: forward and selector walk vs an independent PyTorch reference, the published checkpoint layout
(load / save), the training forward, and decoding with them: greedy speculative == target-only, the ratio test's
sampled distribution == the target's exact one, trees refused."""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from dflash_jax import DrafterConfig, TargetConfig, generate, init_drafter, init_target, load_drafter, load_target, \
    save_drafter
from dflash_jax.drafter import append_context, draft_hidden_cached, draft_hidden_train, init_context_cache
from dflash_jax.drafter2 import candidates, dflash2_from, selector_drafts, selector_tree
from dflash_jax.model import forward, init_cache
from tests.hf_utils import make_hf_model, rel_err
from tests.torch_ref import RefDrafter2, load_hf_target

MASK = 95
BLOCK = 8
DFLASH2 = dict(kind="dflash2", conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=6)


def randomize(drafter, seed: int):
    """Every DFlash2 param away from its start (identity convs, zero kernel projections), norms 1 + noise, so a
    misplaced conv side, group, tap or codebook shows up."""
    rng = np.random.default_rng(seed)

    def f(path, x):
        name = str(path[-1])
        if "norm" in name:
            return jnp.asarray(1.0 + rng.normal(0, 0.25, x.shape), x.dtype)
        if "conv" in name or "sel_" in name:
            return jnp.asarray(x + rng.normal(0, 0.3, x.shape), x.dtype)
        return x

    return drafter.replace(params=jax.tree_util.tree_map_with_path(f, drafter.params))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter2")
    tpath, _ = make_hf_model(root, "qwen3", std=0.2, seed=3, name="t", num_hidden_layers=4)
    target = load_target(tpath)
    drafter = init_drafter(target, num_layers=2, block_size=BLOCK, mask_token_id=MASK, seed=11, std=0.2,
                           output_multiplier=0.7, final_logit_softcapping=6.0, **DFLASH2)
    drafter = randomize(drafter, 12)
    dpath = os.path.join(str(root), "d")
    save_drafter(drafter, dpath)
    return tpath, dpath, target, drafter


@functools.partial(jax.jit, static_argnames=("block",))
def _unary_and_drafts(target, drafter, ctx, anchor, block):
    _, _, feats = forward(target, ctx, None, drafter.config.target_layer_ids)
    dc = append_context(drafter, feats, init_context_cache(drafter, 1, ctx.shape[1]))
    h = draft_hidden_cached(drafter, target, anchor, dc, block)[:, 1:]
    from dflash_jax.drafter import draft_logits_from_hidden
    drafts, _, _ = selector_drafts(drafter, target, h, anchor)
    return draft_logits_from_hidden(drafter, target, h)[0], drafts[0]


def test_forward_and_walk_match_torch_reference(pair):
    tpath, dpath, target, drafter = pair
    loaded = load_drafter(dpath, target)  # the published layout, read back
    ref_t, ref_d = load_hf_target(tpath), RefDrafter2.from_dir(dpath)
    rng = np.random.default_rng(0)
    differs = 0
    for ctx_len in (1, 13, 29):
        prefix = rng.integers(0, MASK, size=ctx_len + 1).tolist()
        u, drafts = _unary_and_drafts(target, loaded, jnp.asarray([prefix[:-1]]), jnp.asarray(prefix[-1:]), BLOCK)
        ref_u, _ = ref_d.unary(ref_t, prefix, BLOCK)
        err = rel_err(np.asarray(u), ref_u.numpy())
        assert err <= 1e-4, f"ctx={ctx_len}: unary scores rel err {err:.2e}"
        ref_drafts = ref_d.greedy_drafts(ref_t, prefix, BLOCK)
        assert np.asarray(drafts).tolist() == ref_drafts
        differs += int(np.sum(np.asarray(drafts) != np.argmax(ref_u.numpy(), -1)))
    assert differs > 0  # the pair term changes some choices: the walk is not the plain argmax


def test_conv_sides_matter_in_the_reference(pair):
    """Sanity of the comparison itself: swapping the sides of one conv changes the reference's scores."""
    tpath, dpath, target, drafter = pair
    ref_t, ref_d = load_hf_target(tpath), RefDrafter2.from_dir(dpath)
    prefix = list(range(1, 15))
    u0, _ = ref_d.unary(ref_t, prefix, BLOCK)
    conv = ref_d.layers[0].mlp_conv
    conv.base_kernel.data = conv.base_kernel.data.flip(0)
    u1, _ = ref_d.unary(ref_t, prefix, BLOCK)
    assert rel_err(u0.numpy(), u1.numpy()) > 1e-2


def test_published_layout_round_trip(pair, tmp_path):
    _, dpath, target, drafter = pair
    cfg = json.load(open(os.path.join(dpath, "config.json")))
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    d = cfg["dflash_config"]
    assert (d["block_size"], d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"], d["selector_top_k"]) \
        == (BLOCK, 2, 8, 8, 6)
    assert d["output_multiplier"] == 0.7 and d["final_logit_softcapping"] == 6.0
    t = load_file(os.path.join(dpath, "model.safetensors"))
    H, V, K, G, R = 32, 96, 2, 4, 8
    assert t["layers.1.attention_conv.base_kernel"].shape == (2, K, H)
    assert t["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * K * G, H)
    assert t["candidate_selector.hidden_projection.weight"].shape == (R, H)
    assert t["candidate_selector.predecessor_codebook"].shape == t["candidate_selector.successor_codebook"].shape \
        == (V, R)
    assert "layers.0.self_attn.q_proj.weight" in t and "fc.weight" in t
    np.testing.assert_array_equal(t["candidate_selector.hidden_projection.weight"],
                                  np.asarray(drafter.params["sel_hidden"]).T)
    loaded = load_drafter(dpath, target, layout="stacked")
    assert loaded.config == drafter.config
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(drafter.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a checkpoint without one DFlash2 tensor is refused by name
    t.pop("layers.1.mlp_conv.base_kernel")
    from safetensors.numpy import save_file
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(t, str(bad / "model.safetensors"))
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layers.1.mlp_conv.base_kernel"):
        load_drafter(str(bad), target)


def test_config_errors():
    base = dict(architectures=["DFlash2DraftModel"], hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                vocab_size=96, num_target_layers=2,
                dflash_config=dict(mask_token_id=1, target_layer_ids=[0], conv_group_size=5))
    with pytest.raises(ValueError, match="conv_group_size 5 must divide hidden_size 32"):
        DrafterConfig.from_hf(base)
    base["dflash_config"].update(conv_group_size=16, selector_top_k=200)
    with pytest.raises(ValueError, match="selector_top_k 200"):
        DrafterConfig.from_hf(base)
    base["dflash_config"].update(selector_top_k=4)
    c = DrafterConfig.from_hf(base)
    assert c.is_dflash2 and (c.conv_group_size, c.selector_top_k, c.selector_rank) == (16, 4, 256)


def test_training_forward_equals_inference_forward(pair):
    """draft_hidden_train (many blocks of one sequence, each its own conv) == the cached inference pass per block."""
    _, _, target, drafter = pair
    seq = np.random.default_rng(5).integers(0, MASK, size=30).astype(np.int32)
    ids = jnp.asarray(seq[None])
    anchors = [3, 11, 20]
    _, _, feats = forward(target, ids, init_cache(target, 1, 30), drafter.config.target_layer_ids)
    ht = draft_hidden_train(drafter, target, feats, ids[:, anchors], jnp.asarray([anchors]), BLOCK)[0]

    @jax.jit
    def cached(a):  # the context = the first a positions (the rest is written past the fill and never seen)
        dc = append_context(drafter, feats, init_context_cache(drafter, 1, 32), count=a[None])
        return draft_hidden_cached(drafter, target, ids[:, a], dc, BLOCK)[0]

    for a_i, a in enumerate(anchors):
        assert rel_err(np.asarray(ht[a_i]), np.asarray(cached(jnp.int32(a)))) < 1e-5
    u, cand, _ = candidates(drafter, target, ht[:, 1:])
    assert cand.shape == (3, BLOCK - 1, 6) and bool(jnp.all(u[..., :-1] >= u[..., 1:]))


# ----------------------------------------------------------------------------------------------
# Decoding with a DFlash2 drafter (the tiny V = 16 target of tests/test_lossless.py)
# ----------------------------------------------------------------------------------------------
V = 16
MAX_NEW = 40
SIZES = dict(conv_group_size=8, selector_rank=8, selector_top_k=8)


@pytest.fixture(scope="module")
def world():
    """(target, a DFlash2 drafter built on a briefly trained DFlash drafter: partial acceptance, with a random
    selector that changes some of its choices; a random-init DFlash2 drafter)."""
    from tests.test_lossless import _train_drafter
    cfg = TargetConfig(family="qwen3", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, max_position_embeddings=512)
    target = init_target(cfg, seed=1, std=0.6)
    trained = dflash2_from(_train_drafter(target), seed=5, std=0.3, **SIZES)
    fresh = init_drafter(target, num_layers=2, block_size=16, mask_token_id=V - 1, seed=2, std=0.3,
                         target_layer_ids=(0, 1), kind="dflash2", **SIZES)
    return target, trained, randomize(fresh, 3)


def _same(a, b, what):
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        assert x == y, f"{what}: row {i} differs\n spec   {x}\n target {y}"


def test_greedy_equals_target_only(world):
    target, trained, fresh = world
    rng = np.random.default_rng(100)
    ragged = [rng.integers(0, V, size=n).tolist() for n in (3, 15, 8)]
    ref = generate(target, None, ragged, max_new_tokens=MAX_NEW)
    for name, drafter in (("trained", trained), ("random", fresh)):
        for bk in (4, 16):
            out = generate(target, drafter, ragged, max_new_tokens=MAX_NEW, block_size=bk)
            _same(out, ref, f"{name} B={bk}")
            accs = [a for row in out.acceptance_lengths for a in row]
            for row, toks in zip(out.acceptance_lengths, out.tokens):
                assert sum(row) + 1 == len(toks) == MAX_NEW
            if name == "trained":
                assert any(1 < a < bk for a in accs) and max(accs) <= bk, (bk, accs)
    out = generate(target, trained, ragged, max_new_tokens=MAX_NEW)  # "auto": the drafter's full block
    _same(out, ref, "auto")
    assert out.block_size == 16


def test_selector_tree_is_the_n_best_paths(world):
    """selector_tree's nodes are the n best selector paths by summed log q (enumerated by brute force)."""
    target, trained, _ = world
    h = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 32))
    u, cand, wh = candidates(trained, target, h)
    root = jnp.asarray([3, 9])
    n = 12
    tree = selector_tree(trained, u, cand, wh, root, n)
    A, Bs = np.asarray(trained.params["sel_pred"]), np.asarray(trained.params["sel_succ"])
    u, cand, wh = np.asarray(u, np.float64), np.asarray(cand), np.asarray(wh, np.float64)
    for b in range(2):
        paths = {}

        def grow(prefix, score, prev, d):
            if d == 3:
                return
            s = u[b, d] + (A[prev] * wh[b, d]) @ Bs[cand[b, d]].T
            logq = s - np.log(np.sum(np.exp(s - s.max()))) - s.max()
            for k, c in enumerate(cand[b, d]):
                paths[prefix + (int(c),)] = score + logq[k]
                grow(prefix + (int(c),), score + logq[k], c, d + 1)

        grow((), 0.0, int(root[b]), 0)
        best = sorted(paths, key=lambda p: -paths[p])[:n]
        par, tok = np.asarray(tree.parent[b]), np.asarray(tree.tokens[b])

        def path(i):
            return () if i == 0 else path(par[i]) + (int(tok[i]),)

        got = {path(i): float(tree.logq[b, i]) for i in range(1, n + 1)}
        assert set(got) == set(best)
        assert max(abs(got[p] - paths[p]) for p in best) < 1e-4


def test_trees_equal_target_only(world):
    """Trees of the N most likely selector paths: greedy and same-seed sampled outputs equal target-only decoding
    token for token (the walk down the tree commits the target's own choices); a bigger tree accepts more."""
    target, trained, _ = world
    rng = np.random.default_rng(500)
    ragged = [rng.integers(0, V, size=n).tolist() for n in (3, 15, 8)]
    taus = {}
    for sp, budgets in ((dict(), (3, 24)), (dict(temperature=1.0, seed=2), (24,))):
        ref = generate(target, None, ragged, max_new_tokens=MAX_NEW, **sp)
        for n in budgets:
            out = generate(target, trained, ragged, max_new_tokens=MAX_NEW, tree_budget=n, **sp)
            _same(out, ref, f"tree {n} {sp}")
            taus[n, bool(sp)] = out.tau
    assert taus[24, False] > taus[3, False] > 1.0 and taus[24, True] > 1.0, taus
    with pytest.raises(ValueError, match="shadow_trees are not supported with a DFlash2 drafter"):
        generate(target, trained, [[1, 2, 3]], max_new_tokens=4, block_size=None, shadow_trees=4)


def test_engine_samples_the_walk_per_row_and_verifies_by_ratio(world):
    """The continuous-batching engine (a sampling setting per row) with a DFlash2 drafter, greedy and T = 1 requests
    in the same slots: each T = 1 row walks the selector sampled and is verified by the ratio test, as generate() does
    at T = 1 (same seed: the same tokens); each greedy row walks the argmax and equals target-only greedy."""
    from dflash_jax.engine import Engine, Request
    from dflash_jax.sampling import SamplingParams
    target, trained, _ = world
    rng = np.random.default_rng(600)
    prompts = [rng.integers(0, V, size=int(rng.integers(3, 12))).tolist() for _ in range(6)]
    hot, cold = SamplingParams(1.0), SamplingParams()
    reqs = [Request(p, i, 24, (), hot if i % 2 else cold) for i, p in enumerate(prompts)]
    eng = Engine(target, trained, slots=2, prompt_len=16, max_new_tokens=24, refill=1, seed=4)
    got = {c.row_id: c for c in eng.run(reqs)}
    odd, even = [r for r in reqs if r.row_id % 2], [r for r in reqs if not r.row_id % 2]
    ref_hot = generate(target, trained, [r.prompt for r in odd], max_new_tokens=24, stop_token_ids=[], temperature=1.0,
                       seed=4, row_ids=[r.row_id for r in odd], max_cache_len=eng.S, block_size=None)
    ref_cold = generate(target, None, [r.prompt for r in even], max_new_tokens=24, stop_token_ids=[],
                        row_ids=[r.row_id for r in even], max_cache_len=eng.S)
    assert [got[r.row_id].tokens for r in odd] == ref_hot.tokens
    assert [got[r.row_id].tokens for r in even] == ref_cold.tokens
    for part in (odd, even):  # drafts were accepted in both kinds of rows
        assert sum(len(got[r.row_id].tokens) for r in part) > sum(got[r.row_id].cycles for r in part)


def test_sampled_distribution_matches_exact_target(world):
    """The ratio test with drafts sampled from the selector: the first 3 tokens of 4096 rows vs the target's exact
    joint (enumerated); same seed twice gives the same tokens; greedy_drafts equals target-only sampling token for
    token (exact-match acceptance of the argmax walk)."""
    from tests.test_lossless import _chi2_pvalue, sampled_first3
    target, trained, _ = world
    sp = dict(temperature=1.3, top_k=8, top_p=0.95)  # the ratio test's p is the processed distribution
    prompt = [7, 7, 15, 3, 7]
    n = 4096
    counts, joint, out = sampled_first3(target, trained, sp, n, prompt)
    pval, cells = _chi2_pvalue(counts, joint)
    tv = 0.5 * np.abs(counts / n - joint).sum()
    assert cells >= 20 and pval > 1e-3 and tv < 0.1, (cells, pval, tv)
    for axis in range(3):
        other = tuple(a for a in range(3) if a != axis)
        assert _chi2_pvalue(counts.sum(axis=other), joint.sum(axis=other))[0] > 1e-3, axis
    accepted = np.mean([row[0] > 1 for row in out.acceptance_lengths])
    assert 0.1 < accepted < 0.95, accepted
    ref = generate(target, None, [prompt] * 256, max_new_tokens=3, seed=7, row_ids=range(256), **sp)
    assert out.tokens[:256] != ref.tokens  # the ratio test commits other draws than target-only sampling ...
    again = generate(target, trained, [prompt] * 256, max_new_tokens=3, seed=7, block_size=4, row_ids=range(256), **sp)
    assert again.tokens == out.tokens[:256]  # ... reproducibly
    one_hot = generate(target, trained, [prompt] * 256, max_new_tokens=3, seed=7, block_size=4, row_ids=range(256),
                       greedy_drafts=True, **sp)
    _same(one_hot, ref, "greedy drafts at T > 0")


# ----------------------------------------------------------------------------------------------
# Training: the DFlash loss + alpha x the selector's cross entropy
# ----------------------------------------------------------------------------------------------
def test_selector_objective_trains_the_selector(world, tmp_path):
    """DrafterObjective on a DFlash2 drafter: the selector's terms are in the loss (its codebooks get gradient), and
    Adam steps lower its cross entropy and raise the selector's teacher-forced tau; the training config's
    drafter.kind dflash2 builds such a drafter."""
    import optax
    from dflash_jax.training.config import config_from_dict
    from dflash_jax.training.loss import DrafterObjective
    from dflash_jax.training.pipeline import drafter_config, initial_drafter_params
    from dflash_jax.training.testing import tiny_config_dict
    target, trained, _ = world
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, V, size=int(rng.integers(3, 12))).tolist() for _ in range(8)]
    outs = generate(target, None, prompts, max_new_tokens=MAX_NEW).tokens
    L = 64
    tokens = np.zeros((8, L), np.int32)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        tokens[i, :len(p) + len(o)] = p + o
    lens = np.array([len(p) + len(o) for p, o in zip(prompts, outs)], np.int32)
    anchors = np.stack([rng.integers(len(p), n - 2, size=8) for p, n in zip(prompts, lens)]).astype(np.int32)
    batch = dict(tokens=jnp.asarray(tokens), lengths=jnp.asarray(lens), anchor_pos=jnp.asarray(anchors),
                 anchor_valid=jnp.ones(anchors.shape, bool))
    obj = DrafterObjective(trained.config, gamma=7.0, loss_chunk=4, selector_weight=1.0)
    grad = jax.jit(jax.value_and_grad(lambda p: obj.loss(p, target, batch), has_aux=True))
    opt = optax.adam(1e-2)
    params, state = trained.params, opt.init(trained.params)
    first = None
    for i in range(30):
        (_, sums), g = grad(params)
        assert i or float(jnp.abs(g["sel_pred"]).max()) > 0
        upd, state = opt.update(g, state, params)
        params = optax.apply_updates(params, upd)
        m = obj.summarize(jax.tree.map(np.asarray, sums))
        first = first or m
    assert m["sel_ce"] < 0.7 * first["sel_ce"] and m["tau"] > first["tau"], (first, m)
    assert 0 < m["sel_in_top_k"] <= 1
    cfg = config_from_dict(tiny_config_dict(str(tmp_path), drafter={"kind": "dflash2", "selector_top_k": 4,
                                                                   "conv_group_size": 8, "target_layer_ids": [0, 1]}))
    dc = drafter_config(cfg, target.config, "float32")
    assert dc.is_dflash2 and dc.selector_top_k == 4
    params0 = initial_drafter_params(cfg, target)
    assert params0["sel_succ"].shape == (V, 256) and params0["layers"]["mlp_conv_base"].shape == (1, 2, 2, 32)


MESH_WORKER = r'''
import json
import dflash_jax as dj
from dflash_jax.drafter2 import dflash2_from
from dflash_jax.sharding import make_mesh
cfg = dj.TargetConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=8,
                      num_kv_heads=2, head_dim=16, qk_norm=True)
target = dj.init_target(cfg, seed=0, std=0.25)
v1 = dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=63, seed=1, std=0.1)
drafter = dflash2_from(v1, seed=2, std=0.3, conv_group_size=8, selector_rank=8, selector_top_k=20)
prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]
kw = dict(max_new_tokens=12, stop_token_ids=[])
alone = dj.generate(target, None, prompts, **kw).tokens
one_t1 = dj.generate(target, drafter, prompts, temperature=1.0, seed=3, **kw)
res = {}
for shape in [(2, 2), (1, 4)]:
    mesh = make_mesh(*shape)
    greedy = dj.generate(target, drafter, prompts, mesh=mesh, **kw)
    t1 = dj.generate(target, drafter, prompts, mesh=mesh, temperature=1.0, seed=3, **kw)
    res[str(shape)] = {"greedy_equals_target_only": greedy.tokens == alone,
                       "t1_equals_one_device": t1.tokens == one_t1.tokens, "tau": greedy.tau}
print("RESULT " + json.dumps(res))
'''


def test_dflash2_on_a_mesh_equals_one_device():
    """4 fake CPU devices, meshes (2, 2) and (1, 4) (a top-K of 20 over vocabulary shards of 16 at model 4): greedy
    DFlash2 speculative decoding == target-only, and at T = 1 (the sampled walk and the ratio test) the same tokens as
    on one device."""
    import subprocess
    import sys
    from tests.xla_env import subprocess_xla_flags
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags(4), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", MESH_WORKER], capture_output=True, text=True, env=env, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads([line for line in p.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    for shape, r in res.items():
        assert r["greedy_equals_target_only"] and r["t1_equals_one_device"], (shape, r)
