"""The generic trainer: frozen target outside the optimizer, exact gradient accumulation, LM objective reuse,
bf16 compute with fp32 master weights, data parallelism over a 2-device mesh, schedule, checkpoint round trip."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.xla_env import subprocess_xla_flags
from dflash_jax import TargetConfig, init_drafter, init_target
from dflash_jax.training.blocks import build_batch, stack_batches
from dflash_jax.training.config import OptimizerSection
from dflash_jax.training.data import SequenceData
from dflash_jax.training.loss import DrafterObjective, LMObjective
from dflash_jax.training.optim import make_optimizer, make_schedule
from dflash_jax.training.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TCFG = TargetConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=8, qk_norm=True)


@pytest.fixture(scope="module")
def setup():
    target = init_target(TCFG, seed=0, std=0.1)
    drafter = init_drafter(target, num_layers=1, block_size=4, mask_token_id=1, seed=1, target_layer_ids=[1, 3])
    rng = np.random.default_rng(0)
    seqs = [rng.integers(4, 64, size=int(n)).tolist() for n in rng.integers(16, 32, size=8)]
    data = SequenceData.from_lists(seqs, [4] * 8)
    batch = stack_batches([build_batch(data, list(range(4)), 32, 6, 0, 0), build_batch(data, list(range(4, 8)), 32, 6, 0, 0)])
    return target, drafter, batch


def _leaves(t):
    return jax.tree_util.tree_leaves(t)


@pytest.fixture(scope="module")
def trained(setup):
    """A drafter Trainer (AdamW with weight decay) after two steps, plus the state before them."""
    target, drafter, batch = setup
    obj = DrafterObjective(drafter.config, gamma=2.0, loss_chunk=4)
    tx, sched = make_optimizer(OptimizerSection(lr=1e-2, weight_decay=0.1), 10)
    before = jax.tree_util.tree_map(np.asarray, target.params)
    tr = Trainer(obj, drafter.params, target, tx, schedule=sched)
    state = tr.init_state(0)
    p0 = jax.tree_util.tree_map(np.asarray, state.params)
    for _ in range(2):
        state, aux, stats = tr.train_step(state, batch)
    return tr, state, stats, p0, before


def test_only_drafter_params_are_trained(setup, trained):
    target, drafter, batch = setup
    tr, state, stats, p0, before = trained
    assert int(state.step) == 2 and np.isfinite(float(stats["loss"])) and float(stats["grad_norm"]) > 0
    # every drafter param moved; the target (embedding and lm_head included) did not
    for a, b in zip(_leaves(p0), _leaves(state.params)):
        assert not np.array_equal(a, np.asarray(b))
    for a, b in zip(_leaves(before), _leaves(tr.frozen.params)):
        assert np.array_equal(a, np.asarray(b))
    # the optimizer state holds exactly two moments of the drafter params and nothing target-sized
    n_drafter = sum(x.size for x in _leaves(state.params))
    big = [x for x in _leaves(state.opt_state) if x.size > 1]
    assert sum(x.size for x in big) == 2 * n_drafter
    assert not any(x.shape in ((96, 32), (32, 96)) for x in big)  # no embed / lm_head moments
    # decay mask: norms and q/k norms are not decayed, matrices are
    from dflash_jax.training.optim import decay_mask
    m = decay_mask(drafter.params)
    assert m["fc"] and m["layers"]["q"] and not m["norm"] and not m["layers"]["input_norm"] and not m["layers"]["q_norm"]


def test_gradient_accumulation_is_exact(setup):
    """One step over [accum=2, micro=2] == SGD on the mean of the two micro-batch gradients."""
    target, _, _ = setup
    lm_cfg = TCFG
    obj = LMObjective(lm_cfg)
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 96, size=(2, 2, 12)).astype(np.int32)
    mask = np.ones_like(toks)
    mask[1, 0, 7:] = 0  # unequal token counts: each micro-batch is normalised on its own
    lr = 0.5
    tr = Trainer(obj, target.params, {}, optax.sgd(lr))
    state = tr.init_state(0)
    state, _, stats = tr.train_step(state, {"tokens": toks, "loss_mask": mask})
    grad = jax.jit(jax.grad(lambda p, b: obj.loss(p, {}, b)[0]))
    g = [grad(target.params, {"tokens": jnp.asarray(toks[i]), "loss_mask": jnp.asarray(mask[i])}) for i in range(2)]
    want = jax.tree_util.tree_map(lambda p, a, b: p - lr * (a + b) / 2, target.params, g[0], g[1])
    for a, b in zip(_leaves(want), _leaves(state.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_lm_objective_trains_a_target_from_scratch():
    """The same trainer pretrains a small target on next-token prediction (trainable = the target)."""
    cfg = TCFG
    target = init_target(cfg, seed=3, std=0.02)
    pattern = np.array([5, 9, 13, 17, 21, 25, 29, 33], np.int32)
    toks = np.stack([np.roll(np.tile(pattern, 3), -s) for s in range(4)])[None]  # [1, 4, 24]
    batch = {"tokens": toks, "loss_mask": np.ones_like(toks)}
    tx, sched = make_optimizer(OptimizerSection(lr=1e-2, warmup_ratio=0.0), 40)
    tr = Trainer(LMObjective(cfg), target.params, {}, tx, schedule=sched)
    state = tr.init_state(0)
    losses = []
    for _ in range(40):
        state, aux, _ = tr.train_step(state, batch)
        losses.append(LMObjective.summarize(jax.tree_util.tree_map(np.asarray, aux))["loss"])
    assert losses[0] > 3.5 and losses[-1] < 0.5, losses


def test_bf16_compute_keeps_fp32_master_weights(setup):
    import dataclasses
    target, drafter, batch = setup
    obj = DrafterObjective(dataclasses.replace(drafter.config, dtype="bfloat16"), gamma=2.0, loss_chunk=4)
    tx, sched = make_optimizer(OptimizerSection(lr=1e-3), 4)
    tr = Trainer(obj, drafter.params, target, tx, schedule=sched, param_dtype="float32")
    state = tr.init_state(0)
    state, aux, stats = tr.train_step(state, batch)
    assert all(x.dtype == jnp.float32 for x in _leaves(state.params))
    assert all(x.dtype == jnp.float32 for x in _leaves(state.opt_state) if x.size > 1)
    assert np.isfinite(float(stats["loss"])) and float(stats["grad_norm"]) > 0
    # small updates survive in fp32 (they would vanish in bf16 weights)
    d = np.abs(np.asarray(state.params["layers"]["q"]) - np.asarray(drafter.params["layers"]["q"])).max()
    assert 0 < d < 1e-2


def test_schedule_warmup_and_cosine():
    o = OptimizerSection(lr=1.0, warmup_ratio=0.1, final_lr_ratio=0.0)
    s = make_schedule(o, 100)
    lrs = np.array([float(s(i)) for i in range(101)])
    assert 0 < lrs[0] < 0.2 and np.all(np.diff(lrs[:11]) > 0) and abs(lrs[10] - 1.0) < 1e-6
    assert np.all(np.diff(lrs[10:]) <= 1e-7) and lrs[100] < 1e-6 and abs(lrs[55] - 0.5) < 0.02
    const = make_schedule(OptimizerSection(lr=2.0, warmup_ratio=0.0, schedule="constant"), 10)
    assert float(const(0)) == float(const(9)) == 2.0


def test_checkpoint_round_trip(setup, trained, tmp_path):
    from dflash_jax.training.checkpoint import Checkpointer
    target, drafter, batch = setup
    tr, state, _, _, _ = trained
    ck = Checkpointer(str(tmp_path / "ck"), keep_last=2, async_save=True)
    for step in (1, 2, 3):
        ck.save(step, state.to_tree(), {"step": step, "note": "x"})
    ck.wait()
    assert ck.steps() == [2, 3]  # keep_last
    tree, meta = ck.restore(None, tr.abstract_state(state))
    assert meta == {"step": 3, "note": "x"}
    for a, b in zip(_leaves(state.to_tree()), _leaves(tree)):
        assert np.array_equal(np.asarray(a), np.asarray(b)) and np.asarray(a).dtype == np.asarray(b).dtype
    s1 = tr.place_state(tree)
    s2 = tr.place_state(ck.restore(3, tr.abstract_state(state))[0])
    out1 = tr.train_step(s1, batch)[0]  # (the states are donated: restore twice)
    out2 = tr.train_step(s2, batch)[0]
    for a, b in zip(_leaves(out1.to_tree()), _leaves(out2.to_tree())):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    ck.close()
    with pytest.raises(FileNotFoundError, match="no checkpoint for step 7"):
        Checkpointer(str(tmp_path / "ck")).restore(7, tr.abstract_state(state))


_DP_SCRIPT = textwrap.dedent("""
    import numpy as np, jax
    from dflash_jax import TargetConfig, init_drafter, init_target
    from dflash_jax.sharding import make_mesh
    from dflash_jax.training.blocks import build_batch, stack_batches
    from dflash_jax.training.data import SequenceData
    from dflash_jax.training.loss import DrafterObjective
    import optax
    from dflash_jax.training.trainer import Trainer
    from dflash_jax.training.pipeline import frozen_target_shardings
    assert len(jax.devices()) == 2
    cfg = TargetConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                       num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    target = init_target(cfg, seed=0, std=0.1)
    drafter = init_drafter(target, num_layers=1, block_size=4, mask_token_id=1, seed=1, target_layer_ids=[1, 3])
    rng = np.random.default_rng(0)
    seqs = [rng.integers(4, 64, size=int(n)).tolist() for n in rng.integers(16, 32, size=8)]
    data = SequenceData.from_lists(seqs, [4] * 8)
    batch = stack_batches([build_batch(data, list(range(4)), 32, 6, 0, 0), build_batch(data, list(range(4, 8)), 32, 6, 0, 0)])
    out = []
    for mesh in (make_mesh(1, 1, devices=jax.devices()[:1]), make_mesh(2, 1), make_mesh(1, 2)):
        # plain SGD: Adam's g/sqrt(v) would amplify reduction-order noise in near-zero gradients
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5))
        tr = Trainer(DrafterObjective(drafter.config, 2.0, 4), drafter.params, target, tx, mesh=mesh,
                     frozen_shardings=frozen_target_shardings(target, mesh))
        st = tr.init_state(0)
        for _ in range(3):
            st, aux, stats = tr.train_step(st, batch)
        print("loss", float(stats["loss"]))
        b = tr.put_batch(batch)
        print("shards", mesh.shape["data"], mesh.shape["model"], len(b["tokens"].sharding.device_set),
              tr.frozen.params["layers"]["q"].sharding.spec)
        out.append(jax.tree_util.tree_map(np.asarray, st.params))
    for other in out[1:]:
        for a, b in zip(jax.tree_util.tree_leaves(out[0]), jax.tree_util.tree_leaves(other)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # ZeRO-1: AdamW moments split over 'data', params replicated; matches one device
    res = []
    for mesh in (make_mesh(1, 1, devices=jax.devices()[:1]), make_mesh(2, 1)):
        tr = Trainer(DrafterObjective(drafter.config, 2.0, 4), drafter.params, target, optax.adamw(1e-3), mesh=mesh,
                     frozen_shardings=frozen_target_shardings(target, mesh))
        st = tr.init_state(0)
        st, aux, stats = tr.train_step(st, batch)
        res.append((float(stats["loss"]), jax.tree_util.tree_map(np.asarray, st.params)))
    mu = st.opt_state[0].mu["layers"]["gate"]
    print("zero1", mu.sharding.spec, len(mu.addressable_shards[0].data.reshape(-1)) * 2 == mu.size,
          st.params["layers"]["gate"].sharding.spec)
    np.testing.assert_allclose(res[0][0], res[1][0], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(res[0][1]), jax.tree_util.tree_leaves(res[1][1])):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-5)
    print("DP OK")
""")


def test_data_and_model_parallel_two_devices_match_one():
    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags(2), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _DP_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "shards 2 1 2" in out.stdout and "DP OK" in out.stdout
    assert "zero1 P(None, None, 'data') True P()" in out.stdout, out.stdout
    assert "shards 1 2 2 P(None, 'model', None)" in out.stdout  # target q ([out, in]) split over 'model' (GSPMD)
