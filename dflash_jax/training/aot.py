"""Ahead-of-time compile of the drafter training step for a TPU topology (no TPU needed, libtpu is).

    python -m train.aot --config configs/qwen3_8b_v5p8.yaml --target-config DIR/config.json \\
        --topology v5p:2x2x1 --per-chip 1,4 [train.remat=chunk train.anchor_chunk=64 ...]

Builds the real jitted step (Trainer.jit_train_step: target forward, drafter forward + backward,
AdamW, ZeRO shardings) over abstract arrays placed on the topology's devices, compiles it with the
TPU compiler and prints its per-chip memory (arguments, temporaries, outputs not aliased) and
cost analysis. `per_chip` sequences per chip = train.batch_size / mesh.data (grad_accum unchanged).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

GIB = 2 ** 30
HBM_GIB = {"v5p": 95.74, "v5e": 15.75, "v4": 31.25, "v6e": 31.25}


def _abstract_target(tcfg, mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..model import Target, param_shapes
    from ..sharding import MODEL, param_spec
    m = mesh.shape[MODEL]
    dt = jnp.dtype(tcfg.dtype)

    def one(path, shape):
        spec = param_spec(path) if m > 1 else P()
        if any(ax is not None and shape[d] % m for d, ax in enumerate(spec)):
            spec = P()
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))

    shapes = param_shapes(tcfg)
    params = {k: one((k,), s) for k, s in shapes.items() if k != "layers"}
    params["layers"] = {k: one(("layers", k), s) for k, s in shapes["layers"].items()}
    return Target(params=params, config=tcfg)


def compile_train_step(cfg, tcfg, devices, per_chip: int, data: int | None = None, model: int = 1):
    """(compiled executable, facts) of cfg's training step at `per_chip` sequences per chip."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..drafter import param_shapes
    from .loss import DrafterObjective
    from .optim import make_optimizer
    from .pipeline import drafter_config
    from .trainer import Trainer, TrainState
    t = cfg.train
    data = data or len(devices) // model
    mesh = Mesh(np.asarray(devices[:data * model]).reshape(data, model), ("data", "model"))
    target = _abstract_target(tcfg, mesh)
    dmaster = drafter_config(cfg, tcfg, t.param_dtype)
    dcfg = dataclasses.replace(dmaster, dtype=t.compute_dtype)
    pdt = jnp.dtype(t.param_dtype)
    repl = NamedSharding(mesh, P())
    shapes = param_shapes(dmaster)
    params = {k: jax.ShapeDtypeStruct(s, pdt) for k, s in shapes.items() if k != "layers"}
    params["layers"] = {k: jax.ShapeDtypeStruct(s, pdt) for k, s in shapes["layers"].items()}
    tx, lr_fn = make_optimizer(cfg.optimizer, 1000)
    trainer = Trainer(DrafterObjective(dcfg, cfg.gamma, t.loss_chunk, t.anchor_chunk, t.remat), params, target, tx,
                      mesh=mesh, schedule=lr_fn, param_dtype=t.param_dtype, zero1=t.zero1)
    sh = trainer.state_shardings()
    opt = jax.eval_shape(tx.init, params)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=repl),
                       params=jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=repl),
                                                     params),
                       opt_state=jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                                        opt, sh.opt_state),
                       rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=repl))
    B, T, A = per_chip * data, cfg.data.max_length, t.num_anchors
    T = -(-T // 16) * 16

    def b(shape, dtype):
        return jax.ShapeDtypeStruct((t.grad_accum, B) + shape, dtype,
                                    sharding=NamedSharding(mesh, P(None, "data", *([None] * len(shape)))))
    batch = {"tokens": b((T,), jnp.int32), "lengths": b((), jnp.int32), "anchor_pos": b((A,), jnp.int32),
             "anchor_valid": b((A,), jnp.bool_)}
    compiled = trainer.jit_train_step().lower(state, target, batch).compile()
    mem = compiled.memory_analysis()
    facts = {"per_chip": per_chip, "data": data, "model": model, "T": T, "anchors": A, "accum": t.grad_accum,
             "args_gib": mem.argument_size_in_bytes / GIB, "temp_gib": mem.temp_size_in_bytes / GIB,
             "out_gib": (mem.output_size_in_bytes - mem.alias_size_in_bytes) / GIB}
    facts["total_gib"] = facts["args_gib"] + facts["temp_gib"] + facts["out_gib"]
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        facts["tflops_per_chip"] = float(cost.get("flops", float("nan"))) / 1e12
    except Exception:  # noqa: BLE001 - cost analysis is optional
        pass
    return compiled, facts


def main(argv=None) -> int:
    import os
    p = argparse.ArgumentParser(prog="python -m train.aot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--target-config", required=True, help="the target's HF config.json (or its directory)")
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--per-chip", default="1,4")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    from ..config import TargetConfig, read_config_json
    from .config import load_config
    cfg = load_config(a.config, a.overrides)
    path = a.target_config if os.path.isdir(a.target_config) else os.path.dirname(os.path.abspath(a.target_config))
    tcfg = TargetConfig.from_hf(read_config_json(path), dtype=cfg.target.dtype)
    devices = topologies.get_topology_desc(topology_name=a.topology, platform="tpu").devices
    hbm = HBM_GIB.get(a.topology.split(":")[0])
    t = cfg.train
    print(f"{a.config} {' '.join(a.overrides)}: {a.topology} ({len(devices)} chips, {hbm} GiB HBM each), "
          f"T={cfg.data.max_length}, anchors={t.num_anchors}, accum={t.grad_accum}, remat={t.remat}, "
          f"anchor_chunk={t.anchor_chunk}, zero1={t.zero1}")
    for pc in (int(x) for x in a.per_chip.split(",")):
        try:
            _, f = compile_train_step(cfg, tcfg, devices, pc, cfg.mesh.data, cfg.mesh.model)
        except Exception as e:  # noqa: BLE001 - RESOURCE_EXHAUSTED is a result
            print(f"  {pc} seq/chip: does not compile: {str(e).splitlines()[0][:300]}")
            continue
        spare = f" = {100 * (1 - f['total_gib'] / hbm):.1f}% spare" if hbm else ""
        print(f"  {pc} seq/chip: args {f['args_gib']:.1f} + temp {f['temp_gib']:.1f} + out {f['out_gib']:.1f} = "
              f"{f['total_gib']:.1f} GiB per chip{spare}; {f.get('tflops_per_chip', float('nan')):.1f} TFLOP/chip/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
