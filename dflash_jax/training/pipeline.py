"""The end-to-end drafter recipe: target setup -> data generation -> training -> export.

`run(cfg, stages)` is what `python -m train` calls; each stage is also usable alone
(`generate_data`, `train`, `export`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

from ..config import DrafterConfig, TargetConfig, read_config_json
from ..drafter import Drafter, check_compatible, drafter_config_for, init_drafter, param_shapes
from ..model import Target, init_target, relayout
from ..weights import load_drafter, load_target, resolve_model_path, save_target
from .blocks import BatchSchedule, default_buckets, eval_batches
from .checkpoint import Checkpointer
from .config import TrainConfig
from .interrupt import Interrupted, graceful_stop
from .data import data_is_complete, generate_data, load_sequences, split_train_eval
from .loss import DrafterObjective, cast_tree
from .metrics_log import MetricsLogger, progress_bar
from .optim import make_optimizer
from .records import DataError, check_prompt_source
from .schema import ConfigError
from .trainer import Trainer, add_sums, fetch_tree

STAGES = ("generate", "train", "export")


# ----------------------------------------------------------------------------------------------
# Target and drafter setup
# ----------------------------------------------------------------------------------------------
def make_random_target(path: str, spec, corpus=None) -> Target:
    """A random target + small byte-level BPE tokenizer (ChatML template, eos <|im_end|>) at `path`."""
    from ..text import build_demo_tokenizer, demo_corpus
    if spec.tokenizer_vocab_size > spec.vocab_size:
        raise ConfigError(f"target.random_init.tokenizer_vocab_size {spec.tokenizer_vocab_size} exceeds "
                          f"vocab_size {spec.vocab_size}")
    os.makedirs(path, exist_ok=True)
    tok = build_demo_tokenizer(path, texts=list(corpus or []) + demo_corpus(None), vocab_size=spec.tokenizer_vocab_size)
    arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[spec.family]
    hf = {"architectures": [arch], "model_type": spec.family, "vocab_size": spec.vocab_size,
          "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
          "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
          "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
          "eos_token_id": int(tok.eos_token_id), "bos_token_id": None}
    target = init_target(TargetConfig.from_hf(hf), seed=spec.seed, std=spec.std)
    save_target(target, path)
    return target


def ensure_target(cfg: TrainConfig, log=print) -> None:
    path = cfg.target.path
    if cfg.target.random_init is not None and not os.path.exists(os.path.join(path, "config.json")):
        corpus = []
        if cfg.data.prompt_format != "ids" and os.path.exists(cfg.data.prompts):
            from .records import load_prompt_records, record_to_messages, resolve_field
            recs = load_prompt_records(dataclasses.replace(cfg.data, max_prompts=400))
            field = resolve_field(cfg.data, recs[0])
            corpus = [m["content"] for r in recs for m in record_to_messages(r, field)]
        log(f"creating a random target (target.random_init) at {path}")
        make_random_target(path, cfg.target.random_init, corpus)


def target_config(cfg: TrainConfig) -> TargetConfig:
    return TargetConfig.from_hf(read_config_json(resolve_model_path(cfg.target.path)), dtype=cfg.target.dtype)


def drafter_config(cfg: TrainConfig, tcfg: TargetConfig, dtype: str) -> DrafterConfig:
    """The drafter's config from the YAML (or from drafter.init_from), checked against the target."""
    d = cfg.drafter
    shell = Target(params={}, config=tcfg)
    if d.init_from:
        dc = DrafterConfig.from_hf(read_config_json(resolve_model_path(d.init_from)), dtype=dtype)
        want = {"num_layers": d.num_layers, "block_size": d.block_size, "mask_token_id": d.mask_token_id,
                "kind": d.kind}
        if d.target_layer_ids is not None:
            want["target_layer_ids"] = tuple(d.target_layer_ids)
        bad = [f"drafter.{k}={v!r} but {d.init_from} has {getattr(dc, k)!r}" for k, v in want.items()
               if getattr(dc, k) != v]
        if bad:
            raise ConfigError("drafter.init_from does not match the drafter section: " + "; ".join(bad))
    else:
        dc = drafter_config_for(shell, d.num_layers, d.block_size, d.mask_token_id, d.target_layer_ids, dtype,
                                layer_types=tuple(d.layer_types or ()), sliding_window=d.sliding_window,
                                **dflash2_fields(d))
    check_compatible(dc, shell)
    return dc


def initial_drafter_params(cfg: TrainConfig, target: Target) -> dict:
    d = cfg.drafter
    dtype = cfg.train.param_dtype
    if d.init_from:
        drafter_config(cfg, target.config, dtype)  # validates
        return load_drafter(d.init_from, target, dtype=dtype, layout="stacked").params
    return init_drafter(target, d.num_layers, d.block_size, d.mask_token_id, seed=d.seed,
                        target_layer_ids=d.target_layer_ids, dtype=dtype, std=d.init_std,
                        layer_types=tuple(d.layer_types or ()), sliding_window=d.sliding_window,
                        **dflash2_fields(d)).params


def dflash2_fields(d) -> dict:
    """The DrafterConfig fields of a drafter section's kind (the DFlash2 sizes for kind dflash2)."""
    if d.kind != "dflash2":
        return {}
    return dict(kind="dflash2", conv_kernel_size=d.conv_kernel_size, conv_group_size=d.conv_group_size,
                selector_rank=d.selector_rank, selector_top_k=d.selector_top_k)


def make_training_mesh(cfg: TrainConfig):
    from ..sharding import make_mesh
    return make_mesh(cfg.mesh.data, cfg.mesh.model)


def frozen_target_shardings(target: Target, mesh):
    """Replicated, except target matrices split over 'model' (GSPMD) when the model axis is > 1."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..sharding import MODEL, param_spec
    m = mesh.shape[MODEL]

    def one(path, a):
        keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
        keys = tuple(k for k in keys if k not in (None, "params"))
        spec = param_spec(keys) if m > 1 else P()
        for dim, ax in enumerate(spec):
            if ax is not None and a.shape[dim] % m:
                spec = P()
                break
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, target)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
_TRAJECTORY_SECTIONS = ("target", "drafter", "data", "train", "optimizer")


def _trajectory_config(cfg: TrainConfig) -> dict:
    d = cfg.to_dict()
    out = {k: d[k] for k in _TRAJECTORY_SECTIONS}
    out["data"] = dict(out["data"])
    out["data"]["generation"] = dict(out["data"]["generation"])
    out["data"]["generation"].pop("batch_size", None)
    out["eval"] = {"num_sequences": cfg.eval.num_sequences}  # changes the training split
    return out


def _flat(d: dict, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def total_steps(cfg: TrainConfig, schedule: BatchSchedule) -> int:
    return cfg.train.steps if cfg.train.steps is not None else cfg.train.epochs * schedule.steps_per_epoch


def evaluate(trainer: Trainer, params, batches) -> dict:
    sums = None
    for b in batches:
        sums = add_sums(sums, trainer.eval_step(params, b))
    return trainer.objective.summarize(fetch_tree(sums)) if sums is not None else {}


def generation_eval(cfg: TrainConfig, target: Target, params, dcfg: DrafterConfig, eval_data) -> dict:
    """Real speculative decoding (greedy) on held-out prompts: tau = mean acceptance length."""
    from ..decode.api import generate
    n = min(cfg.eval.generate_prompts, len(eval_data))
    if n == 0:
        return {}
    drafter = Drafter(params=cast_tree(params, target.config.dtype), config=dataclasses.replace(dcfg, dtype=target.config.dtype))
    prompts = [eval_data.seq(i)[:int(eval_data.prompt_lens[i])].tolist() for i in range(n)]
    res = generate(target, drafter, prompts, max_new_tokens=cfg.eval.generate_max_new_tokens, temperature=0.0,
                   stop_token_ids=[], block_size=None)  # the full-block chain: its tau is the drafter's
    return {"gen_tau": res.tau}


def train(cfg: TrainConfig, *, resume: bool = True, allow_config_change: bool = False, target: Target | None = None,
          progress: bool | None = None, log=print) -> dict:
    """Train the drafter of `cfg` (resuming from checkpoint.dir when it holds checkpoints)."""
    t = cfg.train
    is_main = jax.process_index() == 0
    progress = cfg.log.progress_bar if progress is None else progress
    if target is None:
        ensure_target(cfg, log)
        target = load_target(cfg.target.path, dtype=cfg.target.dtype, layout="stacked")
    # Training scans over stacked layers (drafter params, checkpoints and the frozen target alike): one
    # compiled layer body instead of an unrolled loop, and the layout GSPMD's 'model' specs expect.
    target = relayout(target, "stacked")
    dcfg_master = drafter_config(cfg, target.config, t.param_dtype)
    dcfg = dataclasses.replace(dcfg_master, dtype=t.compute_dtype)
    data = load_sequences(cfg.data.output_dir, target.config.vocab_size)
    train_data, eval_data = split_train_eval(data, cfg.eval.num_sequences)
    buckets = sorted(t.length_buckets) if t.length_buckets else default_buckets(max(cfg.data.max_length,
                                                                                    int(data.lengths.max())))
    mesh = make_training_mesh(cfg)
    dp = mesh.shape["data"]
    if t.batch_size % dp:
        raise ConfigError(f"train.batch_size {t.batch_size} is not divisible by the mesh data axis ({dp} devices)")
    sched = BatchSchedule(train_data, t.batch_size, t.grad_accum, t.num_anchors, t.seed, buckets, t.length_grouping)
    n_steps = total_steps(cfg, sched)
    tx, lr_fn = make_optimizer(cfg.optimizer, n_steps)
    objective = DrafterObjective(dcfg, cfg.gamma, t.loss_chunk, t.anchor_chunk, t.remat, t.selector_weight)
    params0 = initial_drafter_params(cfg, target)
    trainer = Trainer(objective, params0, target, tx, mesh=mesh, schedule=lr_fn, param_dtype=t.param_dtype,
                      frozen_shardings=frozen_target_shardings(target, mesh), zero1=t.zero1)
    state = trainer.init_state(t.seed)
    ckpt = Checkpointer(cfg.checkpoint.dir, cfg.checkpoint.keep_last, cfg.checkpoint.async_save)
    traj = _trajectory_config(cfg)
    start = 0
    latest = ckpt.latest_step()
    if latest is not None:
        if not resume:
            raise ConfigError(f"checkpoint.dir {cfg.checkpoint.dir} already holds checkpoints (latest step {latest}); "
                              f"resume (default) or use a new checkpoint.dir")
        tree, meta = ckpt.restore(latest, trainer.abstract_state(state))
        old = _flat(meta.get("trajectory", {}))
        new = _flat(json.loads(json.dumps(traj)))
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if diff and not allow_config_change:
            raise ConfigError(f"checkpoint.dir {cfg.checkpoint.dir} was trained with different settings "
                              f"(differs in: {', '.join(diff)}); resuming would not reproduce the run. Use a new "
                              f"checkpoint.dir, or pass --allow-config-change")
        if meta.get("train_sequences") != len(train_data) and not allow_config_change:
            raise ConfigError(f"the training set changed since the checkpoint ({meta.get('train_sequences')} -> "
                              f"{len(train_data)} sequences); use a new checkpoint.dir or --allow-config-change")
        state = trainer.place_state(tree)
        start = int(jax.device_get(state.step))
        log(f"resumed from {ckpt.directory} step {start} (epoch {meta.get('epoch')}, batch {meta.get('batch_in_epoch')})")
    if is_main and "://" not in cfg.checkpoint.dir:
        os.makedirs(cfg.checkpoint.dir, exist_ok=True)
        with open(os.path.join(cfg.checkpoint.dir, "train_config.yaml"), "w") as f:
            f.write(cfg.to_yaml())
    logger = MetricsLogger(cfg.metrics_path, cfg.log.tensorboard_dir, enabled=is_main,
                           resume_step=start if latest is not None else None, log=log)
    ev_bs = cfg.eval.batch_size or t.batch_size
    ev_batches = eval_batches(eval_data, ev_bs, cfg.eval.num_anchors or t.num_anchors, t.seed, buckets, dp) \
        if eval_data is not None else []
    log(f"training: {len(train_data)} sequences ({0 if eval_data is None else len(eval_data)} held out), "
        f"{sched.steps_per_epoch} steps/epoch, {n_steps} steps, batch {t.batch_size} x accum {t.grad_accum}, "
        f"mesh data={dp} model={mesh.shape['model']}, B={dcfg.block_size}, gamma={cfg.gamma:g}")

    def run_eval(step, params):
        m = evaluate(trainer, params, ev_batches) if ev_batches else {}
        if eval_data is not None and cfg.eval.generate_prompts:
            m.update(generation_eval(cfg, trainer.frozen, params, dcfg, eval_data))
        if m:
            logger.write(step, "eval", m)
        return m

    summary = {"start_step": start, "total_steps": n_steps, "train_sequences": len(train_data)}
    if start == 0:
        summary["eval_before"] = run_eval(0, state.params)
    delay = float(os.environ.get("DFLASH_TRAIN_STEP_DELAY", "0") or 0)  # test hook: slow steps down
    bar = progress_bar(n_steps, start, progress and is_main)
    sums, stat_acc, n_acc, t_log = None, None, 0, time.time()
    last_train = {}
    step = start
    with graceful_stop() as stop:  # first Ctrl-C: finish and save this step, then stop
        for step in range(start, n_steps):
            state, aux, stats = trainer.train_step(state, sched.batch(step))
            sums = add_sums(sums, aux)
            stat_acc = add_sums(stat_acc, stats)
            n_acc += 1
            done = step + 1
            last = done == n_steps
            if done % cfg.log.every_steps == 0 or last or stop.requested:
                m = objective.summarize(fetch_tree(sums))
                st = fetch_tree(stat_acc)
                m.update(step_loss=float(st["loss"]) / n_acc, grad_norm=float(st["grad_norm"]) / n_acc,
                         lr=float(st["lr"]) / n_acc, steps_per_s=n_acc / max(time.time() - t_log, 1e-9))
                epoch, _ = sched.position(step)
                m["epoch"] = epoch
                logger.write(done, "train", m)
                last_train = m
                if bar is not None:
                    bar.set_postfix(loss=f"{m['loss']:.3f}", tau=f"{m['tau']:.2f}", lr=f"{m['lr']:.2e}")
                elif is_main:  # no progress bar: a line per logging interval instead of silence
                    log(f"step {done}/{n_steps}: loss {m['loss']:.4f}, tau {m['tau']:.3f}, lr {m['lr']:.3e}, "
                        f"{m['steps_per_s']:.2f} steps/s")
                sums, stat_acc, n_acc, t_log = None, None, 0, time.time()
            if cfg.eval.every_steps and done % cfg.eval.every_steps == 0 and not last:
                run_eval(done, state.params)
            if done % cfg.checkpoint.every_steps == 0 or last or stop.requested:
                epoch, j = sched.position(done)
                ckpt.save(done, state.to_tree(), {"step": done, "epoch": epoch, "batch_in_epoch": j,
                                                  "train_sequences": len(train_data), "total_steps": n_steps,
                                                  "trajectory": traj})
            if bar is not None:
                bar.update(1)
            if stop.requested and not last:  # Ctrl-C: this step is saved above; nothing is lost
                if bar is not None:
                    bar.close()
                ckpt.close()
                logger.close()
                raise Interrupted(f"interrupted at step {done} of {n_steps}; last checkpoint: step {done} in "
                                  f"{ckpt.directory}; run the same command to resume")
            if delay:
                time.sleep(delay)
    if bar is not None:
        bar.close()
    ckpt.wait()
    summary["final_step"] = int(jax.device_get(state.step))
    summary["train_last"] = last_train
    summary["eval_after"] = run_eval(summary["final_step"], state.params) if summary["final_step"] > start or \
        start == n_steps else {}
    ckpt.close()
    logger.close()
    summary["params"] = state.params
    summary["drafter_config"] = dcfg_master
    return summary


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------
def restore_params(cfg: TrainConfig, step: int | None = None, tcfg: TargetConfig | None = None):
    """(step, drafter params in param_dtype, master DrafterConfig) from checkpoint.dir."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..sharding import make_mesh
    tcfg = tcfg or target_config(cfg)
    dcfg = drafter_config(cfg, tcfg, cfg.train.param_dtype)
    ckpt = Checkpointer(cfg.checkpoint.dir, cfg.checkpoint.keep_last, async_save=False, read_only=True)
    if ckpt.latest_step() is None:
        raise FileNotFoundError(f"no checkpoints in {cfg.checkpoint.dir}")
    repl = NamedSharding(make_mesh(1, 1, devices=jax.devices()[:1]), P())
    shapes = param_shapes(dcfg)
    dt = jnp.dtype(cfg.train.param_dtype)

    def sds(s):
        return jax.ShapeDtypeStruct(s, dt, sharding=repl)
    params = {k: sds(v) for k, v in shapes.items() if k != "layers"}
    params["layers"] = {k: sds(v) for k, v in shapes["layers"].items()}
    tx, _ = make_optimizer(cfg.optimizer, 1)
    opt = jax.eval_shape(tx.init, params)
    opt = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=repl), opt)
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=repl), "params": params, "opt_state": opt,
                "rng": jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=repl)}
    tree, meta = ckpt.restore(step, abstract)
    ckpt.close()
    return int(meta["step"]), tree["params"], dcfg


def export(cfg: TrainConfig, step: int | None = None, out: str | None = None, log=print) -> str:
    """Write checkpoint `step` (None = latest) as a z-lab DFlash drafter directory."""
    from ..weights import save_drafter
    out = out or cfg.export_dir
    if "://" in out:
        raise ConfigError(f"export directory {out} must be local (set export.dir or --out); checkpoint.dir may be remote")
    step, params, dcfg = restore_params(cfg, step)
    dt = cfg.export.dtype
    drafter = Drafter(params=cast_tree(params, dt), config=dataclasses.replace(dcfg, dtype=dt))
    if jax.process_index() == 0:
        save_drafter(drafter, out, dtype=dt)
        with open(os.path.join(out, "dflash_training.json"), "w") as f:
            json.dump({"step": step, "checkpoint_dir": cfg.checkpoint.dir, "target": cfg.target.path,
                       "gamma": cfg.gamma, "num_anchors": cfg.train.num_anchors}, f, indent=2)
    log(f"exported step {step} to {out}")
    return out


# ----------------------------------------------------------------------------------------------
# Everything
# ----------------------------------------------------------------------------------------------
def run(cfg: TrainConfig, stages=STAGES, *, resume: bool = True, allow_config_change: bool = False,
        progress: bool | None = None, log=print) -> dict:
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ConfigError(f"unknown stage(s) {bad}; stages: {list(STAGES)}")
    out: dict = {}
    progress = cfg.log.progress_bar if progress is None else progress
    if "generate" in stages and not data_is_complete(cfg):
        check_prompt_source(cfg.data)  # before ensure_target writes anything
    ensure_target(cfg, log)
    target = None
    if "generate" in stages:
        if data_is_complete(cfg):
            log(f"data in {cfg.data.output_dir} is complete")
        else:
            target = load_target(cfg.target.path, dtype=cfg.target.dtype)
            out["data"] = generate_data(cfg, target=target, progress=progress, log=log)
            log(f"data: {out['data']['sequences']} sequences, {out['data']['tokens']} tokens in {cfg.data.output_dir}")
    if "train" in stages:
        if target is None:
            target = load_target(cfg.target.path, dtype=cfg.target.dtype, layout="stacked")
        out["train"] = train(cfg, resume=resume, allow_config_change=allow_config_change, target=target,
                             progress=progress, log=log)
    if "export" in stages:
        out["export"] = export(cfg, log=log)
    return out


__all__ = ["run", "train", "export", "generate_data", "ensure_target", "make_random_target", "drafter_config",
           "restore_params", "DataError"]
