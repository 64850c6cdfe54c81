"""End to end on a tiny random target: training raises acceptance (blocks and real speculative decoding),
the z-lab export loads and decodes, and a SIGKILLed run resumes to bit-identical parameters."""
from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml

from dflash_jax import generate, init_drafter, load_drafter, load_target
from dflash_jax.training.config import config_from_dict
from dflash_jax.training.schema import ConfigError
from dflash_jax.training.data import generate_data, load_sequences, split_train_eval
from dflash_jax.training.pipeline import ensure_target, restore_params, train
from dflash_jax.training.testing import signal_when, tiny_config_dict, write_id_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("e2e"))
    write_id_prompts(f"{root}/prompts.jsonl", 192, seed=0)
    cfg = config_from_dict(tiny_config_dict(root))
    ensure_target(cfg, **QUIET)
    generate_data(cfg, progress=False, **QUIET)
    return root


def _cfg(root, name, **sections):
    d = tiny_config_dict(root, **sections)
    d["checkpoint"]["dir"] = f"{root}/{name}/ckpt"
    d["export"]["dir"] = f"{root}/{name}/export"
    return d, config_from_dict(d)


def _leaves(t):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(t)]


@pytest.mark.slow
def test_training_raises_acceptance_and_export_decodes(data_root):
    d, cfg = _cfg(data_root, "long", train={"steps": 300})
    out = train(cfg, resume=False, progress=False, **QUIET)
    before, after = out["eval_before"], out["eval_after"]
    assert before["tau"] < 1.2
    assert after["tau"] > 2.2 and after["tau"] > before["tau"] + 1.0, (before, after)
    assert after["loss"] < before["loss"] - 0.3 and after["acc_1"] > before["acc_1"] + 0.1, (before, after)
    from dflash_jax.training.pipeline import export
    path = export(cfg, **QUIET)
    target = load_target(cfg.target.path)
    trained = load_drafter(path, target, layout="stacked")
    step, params, _ = restore_params(cfg)
    assert step == 300
    for a, b in zip(_leaves(params), _leaves(trained.params)):
        assert np.array_equal(a, b)
    # drafter.init_from starts a new run from the exported drafter
    from dflash_jax.training.pipeline import initial_drafter_params
    again = initial_drafter_params(config_from_dict(d, [f"drafter.init_from={path}"]), target)
    for a, b in zip(_leaves(params), _leaves(again)):
        assert np.array_equal(a, b)
    untrained = init_drafter(target, 1, 8, 3, seed=0, target_layer_ids=[1, 3])
    data = load_sequences(cfg.data.output_dir)
    _, held = split_train_eval(data, cfg.eval.num_sequences)
    prompts = [held.seq(i)[:held.prompt_lens[i]].tolist() for i in range(len(held))]
    r0 = generate(target, untrained, prompts, max_new_tokens=40, stop_token_ids=[], block_size=None)
    r1 = generate(target, trained, prompts, max_new_tokens=40, stop_token_ids=[], block_size=None)
    assert r1.tokens == r0.tokens  # lossless either way
    assert r0.tau < 1.1 and r1.tau > r0.tau + 0.3, (r0.tau, r1.tau)
    print(f"\nblock tau {before['tau']:.2f} -> {after['tau']:.2f}; generate tau {r0.tau:.2f} -> {r1.tau:.2f}")


@pytest.mark.slow
def test_killed_training_resumes_bit_for_bit(data_root, tmp_path):
    sections = dict(train={"steps": 60}, checkpoint={"every_steps": 20, "keep_last": 5})
    # uninterrupted reference, in this process
    _, ref_cfg = _cfg(data_root, "ref", **sections)
    train(ref_cfg, resume=False, progress=False, **QUIET)
    # the same run in a subprocess, SIGKILLed right after its first checkpoint is published
    d, cfg = _cfg(data_root, "killed", **sections)
    d["checkpoint"]["async_save"] = True
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(d))
    ck = f"{data_root}/killed/ckpt"
    cmd = [sys.executable, "-m", "train", "--config", str(cfg_path), "--no-progress"]
    env = dict(os.environ, DFLASH_TRAIN_STEP_DELAY="0.15", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd + ["--stages", "train"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    # settle: a few more steps run (and are lost) before the kill
    signal_when(proc, lambda: os.path.isdir(f"{ck}/20"), "checkpoint", 300, poll=0.05, settle=0.5)
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.isdir(f"{ck}/60")
    done = subprocess.run(cmd + ["--stages", "train,export"], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "resumed from" in done.stdout
    s_ref, p_ref, _ = restore_params(ref_cfg)
    s_res, p_res, _ = restore_params(cfg)
    assert s_ref == s_res == 60
    for a, b in zip(_leaves(p_ref), _leaves(p_res)):
        assert np.array_equal(a, b)
    # metrics: each train step logged once even though steps after 20 ran twice
    recs = [json.loads(line) for line in open(f"{ck}/metrics.jsonl")]
    steps = [r["step"] for r in recs if r["split"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 60
    # export of an earlier step through the CLI equals that checkpoint
    out_dir = tmp_path / "step40"
    ex = subprocess.run([sys.executable, "-m", "train.export", "--config", str(cfg_path), "--step", "40",
                         "--out", str(out_dir)], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=300)
    assert ex.returncode == 0, ex.stderr[-3000:]
    _, p40, _ = restore_params(cfg, 40)
    d40 = load_drafter(str(out_dir), load_target(cfg.target.path), layout="stacked")
    for a, b in zip(_leaves(p40), _leaves(d40.params)):
        assert np.array_equal(a, b)
    assert not np.array_equal(_leaves(p40)[0], _leaves(p_res)[0])
    # a changed trajectory setting is refused on resume
    changed = config_from_dict(d, ["optimizer.lr=1e-3", "train.steps=80"])
    with pytest.raises(ConfigError, match=r"differs in: optimizer\.lr, train\.steps"):
        train(changed, progress=False, **QUIET)


@pytest.mark.slow
def test_ctrl_c_saves_the_step_in_flight_and_says_how_to_resume(data_root, tmp_path):
    """SIGINT (Ctrl-C) during `python -m train`: the step in flight finishes and is checkpointed, one line
    (no traceback) says where it stopped, and the same command resumes to the uninterrupted result."""
    sections = dict(train={"steps": 40}, checkpoint={"every_steps": 20, "keep_last": 5},
                    log={"every_steps": 5, "progress_bar": False})
    _, ref_cfg = _cfg(data_root, "ref_int", **sections)
    train(ref_cfg, resume=False, progress=False, **QUIET)
    d, cfg = _cfg(data_root, "interrupted", **sections)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(d))
    ck = f"{data_root}/interrupted/ckpt"
    cmd = [sys.executable, "-m", "train", "--config", str(cfg_path), "--stages", "train"]
    env = dict(os.environ, DFLASH_TRAIN_STEP_DELAY="0.2", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = f"{ck}/metrics.jsonl"
    signal_when(proc, lambda: os.path.exists(metrics) and '"train"' in open(metrics).read(), "metrics line", 300,
                poll=0.05, sig=signal.SIGINT)
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    m = re.search(r"^interrupted at step (\d+) of 40; last checkpoint: step (\d+) in (\S+); "
                  r"run the same command to resume$", err, re.M)
    assert m, err[-3000:]
    step = int(m.group(1))
    assert 5 <= step < 40 and int(m.group(2)) == step and m.group(3) == os.path.abspath(ck)
    assert os.path.isdir(f"{ck}/{step}")  # the step in flight was saved: nothing is lost
    assert re.search(r"^step 5/40: loss [\d.]+, tau [\d.]+, lr [\d.e+-]+, [\d.]+ steps/s$", out, re.M), out[-2000:]
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"step {step} " in done.stdout and "resumed from" in done.stdout
    s_ref, p_ref, _ = restore_params(ref_cfg)
    s_res, p_res, _ = restore_params(cfg)
    assert s_ref == s_res == 40
    for a, b in zip(_leaves(p_ref), _leaves(p_res)):
        assert np.array_equal(a, b)
