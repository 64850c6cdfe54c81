"""Plan a TPU run before paying for it: compile the project's programs for a TPU topology, anywhere.

With libtpu installed (`pip install "dflash-jax[plan]"`), `jax.experimental.topologies` gives the
devices of a TPU slice without the hardware; the planner builds the very programs that
`generate()` and the trainer run (`dflash_jax.decode.programs.decode_programs`: the same shard_map specs,
statics and donation; `Trainer.step_program`) on abstract arguments (`jax.ShapeDtypeStruct` with the runtime's
`NamedSharding`s on that mesh) and runs the real TPU compiler on them. Per program and per chip it
reports the compiler's memory figures (a program that does not fit fails to compile with
RESOURCE_EXHAUSTED, reported as `fits: False` with the compiler's message) and cost figures (flops,
bytes accessed), plus

- `min_bytes`: the physical minimum of HBM traffic: the weights read once (the embedding table
  counts only the rows looked up, unless it is tied to the LM head; a MoE layer only the experts
  its tokens select, expected under uniform routing), the filled KV caches read
  once (filled = prompt + new tokens, at most the cache), the new KV written; a DFlash cycle also
  reads the shared LM head twice (the drafter's logits must exist before the target verifies);
- `roofline_seconds` = max(flops / peak flop rate, bytes_accessed / HBM bandwidth), from the per
  generation figures in `GENERATIONS`;
- `cycle_over_step` per block size: the DFlash cycle's roofline over the target-only step's, which
  is also the break-even tau (a cycle must commit that many tokens on average to match the
  target-only rate);
- the largest batch whose decode cycle fits at the cache length (a search on compiles).

Costing: the compiler counts a while/scan body once, not once per iteration. The decode programs
are compiled twice: with the 'stacked' layer layout the runtime uses on TPU (a scan over layers:
memory and fit come from this one) and with the 'unrolled' layout (every layer its own ops: flops
and bytes are totals over all layers). The cycle is costed by compiling `cycle` (dflash_jax.decode.programs), the
body of the decode loop (one draft + verify), and the target-only step is the Bk=1 cycle without a drafter.

Modules, each importing only those above it: `topology` (TPU generations, slice names, abstract devices,
the mesh; PlanError), `hlo` (compiling one program: memory and cost figures, HLO byte counts, a program's
report record), `abstract` (abstract params on a mesh), `decode` (the decode programs, `plan`, the largest
fitting batch), `train` (`plan_train`), `report` (text, markdown and JSON output).
"""
from __future__ import annotations

from .abstract import abstract_params, bytes_per_chip, local_shape, with_specs
from .decode import (
    COST_METHODS,
    DecodePrograms,
    DecodeSetup,
    expected_expert_fraction,
    expert_bytes_per_chip,
    largest_fitting_batch,
    layer_period,
    load_target_config,
    make_drafter_config,
    plan,
    unrolled_cost,
)
from .hlo import (
    as_on_tpu,
    collective_bytes,
    compile_program,
    hbm_needed,
    prefetch_double_count,
    program_record,
)
from .report import compile_errors, format_report, markdown_table, write_json
from .topology import (
    GENERATIONS,
    INSTALL_HINT,
    Generation,
    GiB,
    PlanError,
    Slice,
    check_layout,
    make_mesh,
    parse_mesh,
    report_header,
    resolve_tpu,
    topology_devices,
    valid_tpu_names,
)
from .train import drafter_config_for_train, plan_train, train_model_flops

__all__ = [
    "COST_METHODS", "GENERATIONS", "INSTALL_HINT", "DecodePrograms", "DecodeSetup",
    "Generation", "GiB", "PlanError", "Slice", "abstract_params", "as_on_tpu",
    "bytes_per_chip", "check_layout", "collective_bytes", "compile_program",
    "drafter_config_for_train", "expected_expert_fraction", "expert_bytes_per_chip",
    "compile_errors", "format_report", "hbm_needed", "largest_fitting_batch", "layer_period",
    "load_target_config", "local_shape", "make_drafter_config", "make_mesh",
    "markdown_table", "parse_mesh", "plan", "plan_train", "prefetch_double_count",
    "program_record", "report_header", "resolve_tpu", "topology_devices",
    "train_model_flops", "unrolled_cost", "valid_tpu_names", "with_specs",
    "write_json",
]
