"""Multi-host wiring: `jax.distributed.initialize` from CLI flags or environment variables.

On Cloud TPU pods `jax.distributed.initialize()` discovers everything itself. Elsewhere (CPU/GPU
clusters, local tests) pass the coordinator address, process count and id, by flags or by
DFLASH_COORDINATOR / DFLASH_NUM_PROCESSES / DFLASH_PROCESS_ID. Every process runs the same command
with the same inputs; each feeds only its own shards of the batch (arrays are built with
`jax.make_array_from_callback`) and results are gathered to every process (process 0 prints).
"""
from __future__ import annotations

import argparse
import os

_initialized = False


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-host")
    g.add_argument("--distributed", action="store_true", default=os.environ.get("DFLASH_DISTRIBUTED") == "1",
                   help="call jax.distributed.initialize() (also: DFLASH_DISTRIBUTED=1)")
    g.add_argument("--coordinator", default=os.environ.get("DFLASH_COORDINATOR"),
                   help="host:port of process 0 (not needed on TPU pods)")
    g.add_argument("--num-processes", type=int, default=_env_int("DFLASH_NUM_PROCESSES"))
    g.add_argument("--process-id", type=int, default=_env_int("DFLASH_PROCESS_ID"))


def _env_int(name):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Idempotent jax.distributed.initialize; on CPU selects gloo collectives."""
    global _initialized
    if _initialized:
        return
    import jax
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception:  # older/newer jax without the option
            pass
    kwargs = {}
    if coordinator:
        kwargs["coordinator_address"] = coordinator
    if num_processes is not None:
        kwargs["num_processes"] = num_processes
    if process_id is not None:
        kwargs["process_id"] = process_id
    jax.distributed.initialize(**kwargs)
    _initialized = True


def maybe_initialize(args) -> None:
    if getattr(args, "distributed", False):
        initialize(args.coordinator, args.num_processes, args.process_id)


def is_main_process() -> bool:
    import jax
    return jax.process_index() == 0
