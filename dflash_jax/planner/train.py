"""The planner's training step: the trainer's optimizer step of a training YAML compiled for a TPU slice, its
cost from loop-free variants, and the model flops behind MFU."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from .abstract import bytes_per_chip
from .decode import load_target_config
from .hlo import as_on_tpu, compile_program, hbm_needed, program_record
from .topology import (
    PlanError,
    check_layout,
    make_mesh,
    parse_mesh,
    report_header,
    resolve_tpu,
    topology_devices,
)


def drafter_config_for_train(cfg, tcfg):
    from ..training.pipeline import drafter_config
    return drafter_config(cfg, tcfg, cfg.train.param_dtype)


def _train_setup(cfg, tcfg, mesh, *, layout: str = "stacked", grad_accum: int | None = None,
                 loss_chunk: int | None = None, anchor_chunk: int | None = None, num_anchors: int | None = None):
    """(jitted step, abstract args, shapes) of the trainer's optimizer step for this YAML, built as
    pipeline.train builds it (objective with the YAML's loss / anchor chunks and remat policy, optimizer,
    frozen-target shardings, ZeRO shardings of the AdamW state, Trainer.step_program)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    from .. import drafter as drafter_mod
    from .. import model as model_mod
    from ..layers import with_layout
    from ..model import Target
    from ..training.blocks import default_buckets
    from ..training.loss import DrafterObjective
    from ..training.optim import make_optimizer
    from ..training.pipeline import drafter_config, frozen_target_shardings
    from ..training.trainer import Trainer, TrainState

    t = cfg.train
    dcfg_master = drafter_config(cfg, tcfg, t.param_dtype)
    dcfg = dataclasses.replace(dcfg_master, dtype=t.compute_dtype)
    repl = NamedSharding(mesh, PS())

    def tree(shapes, dtype, sharding=None):
        dt = jnp.dtype(dtype)
        out = {k: jax.ShapeDtypeStruct(v, dt, sharding=sharding) for k, v in shapes.items() if k != "layers"}
        layers = {k: jax.ShapeDtypeStruct(v, dt, sharding=sharding) for k, v in shapes["layers"].items()}
        if layout == "unrolled":
            n = next(iter(shapes["layers"].values()))[0]
            layers = tuple({k: jax.ShapeDtypeStruct(v.shape[1:], dt, sharding=sharding) for k, v in layers.items()}
                           for _ in range(n))
        out["layers"] = layers if layout == "unrolled" else with_layout(layers, "stacked")
        return out

    target = Target(params=tree(model_mod.param_shapes(tcfg), tcfg.dtype), config=tcfg)
    params0 = tree(drafter_mod.param_shapes(dcfg_master), t.param_dtype, repl)
    steps = t.steps or 1000  # the schedule's length does not change the program
    tx, lr_fn = make_optimizer(cfg.optimizer, steps)
    objective = DrafterObjective(dcfg, cfg.gamma, loss_chunk or t.loss_chunk, anchor_chunk or t.anchor_chunk,
                                 t.remat)
    trainer = Trainer(objective, params0, target, tx, mesh=mesh, schedule=lr_fn, param_dtype=t.param_dtype,
                      frozen_shardings=frozen_target_shardings(target, mesh), zero1=t.zero1)
    opt = jax.tree_util.tree_map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                 jax.eval_shape(tx.init, params0), trainer.opt_shardings)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=repl), params=params0, opt_state=opt,
                       rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=repl))
    buckets = sorted(t.length_buckets) if t.length_buckets else default_buckets(cfg.data.max_length)
    T, A, R = int(max(buckets)), num_anchors or t.num_anchors, t.batch_size
    acc = grad_accum or t.grad_accum
    shapes = {"tokens": ((acc, R, T), jnp.int32), "lengths": ((acc, R), jnp.int32),
              "anchor_pos": ((acc, R, A), jnp.int32), "anchor_valid": ((acc, R, A), jnp.bool_)}
    batch = {k: jax.ShapeDtypeStruct(sh, dt, sharding=trainer.batch_sharding(len(sh), True))
             for k, (sh, dt) in shapes.items()}
    info = {"seq_len": T, "num_anchors": A, "micro_batch": R, "grad_accum": t.grad_accum,
            "block_size": dcfg.block_size, "drafter_layers": dcfg.num_layers}
    return trainer.step_program(state), (state, trainer.frozen, batch), info, (target, params0, opt)


def train_model_flops(tcfg, dcfg, seq_len: int, num_anchors: int) -> float:
    """Useful flops of one training sequence (no recomputation), the numerator of MFU.

    Target forward up to its last tapped layer (2 x active weights x tokens, causal attention);
    drafter forward + backward (6 x weights x block tokens, the context projection and K/V over the
    sequence, block attention over half the sequence on average); the frozen lm_head forward and its
    input gradient (4 x H x V per predicted position)."""
    def attn_w(c):
        return c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)

    def mlp_w(c, moe=False):
        if moe and getattr(c, "num_experts", 0):
            return 3 * c.hidden_size * c.moe_intermediate_size * c.num_experts_per_tok
        return 3 * c.hidden_size * c.intermediate_size

    T, A, B = seq_len, num_anchors, dcfg.block_size
    Lt = max(dcfg.target_layer_ids) + 1
    target = Lt * (2 * T * (attn_w(tcfg) + mlp_w(tcfg, True)) + 2 * T * T * tcfg.num_heads * tcfg.head_dim)
    H, kv = dcfg.hidden_size, dcfg.num_kv_heads * dcfg.head_dim
    blocks = A * B
    per_layer = (2 * blocks * (attn_w(dcfg) + mlp_w(dcfg))  # block tokens through the layer
                 + 2 * T * 2 * H * kv  # context K/V projections
                 + 4 * blocks * (T / 2 + B) * dcfg.num_heads * dcfg.head_dim)  # scores + values
    drafter = 3 * (dcfg.num_layers * per_layer + 2 * T * len(dcfg.target_layer_ids) * H * H)  # + fc
    head = 4 * H * tcfg.vocab_size * A * (B - 1)
    return float(target + drafter + head)


def _random_target_config(spec, dtype: str):
    from ..config import TargetConfig
    arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[spec.family]
    return TargetConfig.from_hf({"architectures": [arch], "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
                                 "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
                                 "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
                                 "head_dim": spec.head_dim}, dtype=dtype)


@as_on_tpu
def plan_train(config: str, tpu: str = "v5p-8", *, target: str | None = None, mesh: str | None = None,
               overrides: Sequence[str] = (), cost: bool = True, log=None) -> dict:
    """Compile the trainer's optimizer step of a training YAML for a TPU slice.

    target: the target's config.json (or directory), overriding `target.path` (needed when that is
    a hub id). mesh: "data=D,model=M" (default: the YAML's mesh section). overrides: YAML overrides
    ("train.batch_size=32"). Memory and fit come from the step the trainer runs (stacked layers,
    grad_accum micro-batches scanned, anchors and loss in chunks, remat, ZeRO shardings).

    cost: flops / bytes per step. A loop body is costed once, so they come from loop-free variants of
    the same step (unrolled layers, one micro-batch, all anchors in one attention and one loss chunk)
    compiled at two anchor counts a1 < a2 (64 and 128 by default): the target's forward does not
    depend on the anchors and the drafter's work is linear in them, so cost(A) = cost(a1) +
    (A - a1) / (a2 - a1) * (cost(a2) - cost(a1)), times grad_accum. From them: the roofline step
    time max(flops / peak, HBM bytes / bandwidth), sequences per second, the ratio of the compiled flops
    to the model flops (train_model_flops; recomputation shows here) and the implied MFU at the
    roofline (model flops / (peak x roofline time))."""
    log = log or (lambda *_: None)
    from ..training.config import load_config
    sl = resolve_tpu(tpu)
    if not os.path.exists(config):
        raise PlanError(f"training config {config} does not exist")
    cfg = load_config(config, list(overrides))
    tpath = target or cfg.target.path
    if os.path.exists(tpath):
        tcfg = load_target_config(tpath, cfg.target.dtype)
    elif cfg.target.random_init is not None:  # the random target the pipeline would create there
        tcfg = _random_target_config(cfg.target.random_init, cfg.target.dtype)
    else:
        raise PlanError(f"target.path {tpath!r} is not a local config; pass --target <config.json or its directory>")
    if mesh is None and (cfg.mesh.data is not None or cfg.mesh.model != 1):
        mesh = f"model={cfg.mesh.model}" + (f",data={cfg.mesh.data}" if cfg.mesh.data is not None else "")
    data, model = parse_mesh(mesh, sl.chips)
    check_layout(tcfg, None, data, model)
    if cfg.train.batch_size % data:
        raise PlanError(f"train.batch_size {cfg.train.batch_size} is not divisible by the mesh data axis ({data})")
    m = make_mesh(topology_devices(sl), data, model)
    gen = sl.generation
    report = report_header(sl, data, model)
    log(f"compiling the training step of {config} ...")
    jitted, args, info, (_, params0, opt) = _train_setup(cfg, tcfg, m)
    mem = compile_program(jitted, args)
    acc = info["grad_accum"]
    A = info["num_anchors"]
    c = None
    if cost and mem["fits"]:
        a1 = min(64, max(1, A // 2))
        a2 = min(2 * a1, A)
        pts = {}
        for a in sorted({a1, a2}):
            log(f"compiling its loop-free single-micro-batch variant at {a} anchors for flops / bytes ...")
            j2, args2, _, _ = _train_setup(cfg, tcfg, m, layout="unrolled", grad_accum=1, loss_chunk=a,
                                           anchor_chunk=a, num_anchors=a)
            pts[a] = compile_program(j2, args2)
        if all(p["fits"] for p in pts.values()):
            keys = ("flops", "bytes_accessed", "hbm_bytes", "collective_bytes")
            if a2 > a1:
                c = {k: pts[a1][k] + (A - a1) / (a2 - a1) * (pts[a2][k] - pts[a1][k]) for k in keys}
            else:
                c = {k: pts[a1][k] for k in keys}
            c = {k: v * acc for k, v in c.items()}
            c.update(fits=True, method=f"loop-free variants at {a1} and {a2} anchors, extended to {A}, x grad_accum "
                                      f"{acc}")
            points = {a: pts[a]["flops"] for a in sorted(pts)}  # one micro-batch's flops per anchor count compiled
    # physical minimum per step: the frozen target read once per micro-batch, the drafter's master
    # weights and AdamW moments read and written once
    min_bytes = acc * bytes_per_chip(args[1].params) + 2 * (
        bytes_per_chip(params0) + bytes_per_chip(opt))
    rec = program_record("train_step", info["block_size"], cfg.train.batch_size, None, None, mem, c, min_bytes, gen)
    rec["prompt_len"] = None
    rec["seq_len"] = info["seq_len"]
    rec["grad_accum"] = acc
    if c is not None:
        rec["flops_at_anchors"] = points
    per_chip = cfg.train.batch_size // data
    need = hbm_needed(mem)
    train = dict(info, config=config, per_chip=per_chip, sequences_per_step=cfg.train.batch_size * acc)
    if need is not None:
        train["hbm_needed_bytes"] = need
        train["hbm_spare_fraction"] = 1.0 - need / gen.hbm_bytes
    rl = rec.get("roofline_seconds")
    dcfg = drafter_config_for_train(cfg, tcfg)
    train["model_flops_per_sequence"] = train_model_flops(tcfg, dcfg, info["seq_len"], A)
    if rl:
        seqs_chip = per_chip * acc  # sequences one chip trains per step
        train["sequences_per_second"] = cfg.train.batch_size * acc / rl
        train["mfu_at_roofline"] = train["model_flops_per_sequence"] * seqs_chip / (gen.peak_flops * rl)
        train["compiled_over_model_flops"] = rec["flops"] / (train["model_flops_per_sequence"] * seqs_chip)
        train["bound"] = "compute" if rec["flops"] / gen.peak_flops >= rec["hbm_bytes"] / gen.hbm_bandwidth else "HBM"
    report["programs"] = [rec]
    report["cycle_over_step"] = {}
    report["train"] = train
    report["target"] = os.path.abspath(tpath)
    return report

