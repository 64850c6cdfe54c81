"""TPU slices for the planner: the generations' per-chip figures, gcloud accelerator names -> topologies,
the abstract devices of a topology (libtpu, no TPU needed), and the data x model mesh on them."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

INSTALL_HINT = ('libtpu is not installed: the planner needs the TPU compiler. Install it with '
                '`pip install "dflash-jax[plan]"` (or `pip install "jax[tpu]==<your jax version>"`); '
                'no TPU is needed.')

GiB = 2 ** 30


class PlanError(ValueError):
    """A bad planner input (TPU name, mesh, model config) or a missing libtpu."""


# ----------------------------------------------------------------------------------------------
# TPU generations and slice names
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Generation:
    name: str  # prefix of topology names ("v5p", "v5e", "v6e")
    peak_flops: float  # bf16 FLOP/s per chip (Google Cloud TPU spec pages)
    hbm_bandwidth: float  # HBM bytes/s per chip (same source)
    hbm_bytes: int  # HBM per chip as the TPU compiler counts it ("exceeds available HBM (95.74G)")
    gcloud: str  # accelerator-type prefix in gcloud names ("v5p-8", "v5litepod-8", "v6e-8")
    per_core_names: bool  # gcloud's number counts TensorCores (2 per chip) rather than chips


GENERATIONS = {
    "v5p": Generation("v5p", 459e12, 2.765e12, int(95.74 * GiB), "v5p", True),
    "v6e": Generation("v6e", 918e12, 1.640e12, int(31.25 * GiB), "v6e", False),
    "v5e": Generation("v5e", 197e12, 0.819e12, int(15.75 * GiB), "v5litepod", False),
}
# chips -> topology (v5p: a 3-D torus, hosts of 2x2x1 chips; v5e / v6e: 2-D, one host up to 8 chips)
_V5P_SHAPES = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
               512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_2D_SHAPES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


@dataclasses.dataclass(frozen=True)
class Slice:
    accelerator: str  # the gcloud name, e.g. "v5p-8"
    generation: Generation
    topology: str  # e.g. "v5p:2x2x1"
    chips: int
    chips_per_host: tuple[int, int, int]

    @property
    def hosts(self) -> int:
        return self.chips // math.prod(self.chips_per_host)


def valid_tpu_names() -> list[str]:
    out = [f"v5p-{2 * n}" for n in _V5P_SHAPES]
    out += [f"{GENERATIONS[g].gcloud}-{n}" for g in ("v5e", "v6e") for n in _2D_SHAPES]
    return out


def resolve_tpu(name: str) -> Slice:
    """A gcloud accelerator type ("v5p-8", "v5litepod-16", "v6e-8", ...) -> its slice."""
    name = str(name).strip().lower()
    for gen in GENERATIONS.values():
        prefix = gen.gcloud + "-"
        if not name.startswith(prefix) or not name[len(prefix):].isdigit():
            continue
        n = int(name[len(prefix):])
        chips = n // 2 if gen.per_core_names else n
        shapes = _V5P_SHAPES if gen.name == "v5p" else _2D_SHAPES
        if (gen.per_core_names and n % 2) or chips not in shapes:
            break
        dims = tuple(int(x) for x in shapes[chips].split("x"))
        if gen.name == "v5p":
            per_host = (2, 2, 1)
        else:
            per_host = (dims[0], dims[1], 1) if chips <= 8 else (2, 2, 1)
        return Slice(name, gen, f"{gen.name}:{shapes[chips]}", chips, per_host)
    raise PlanError(f"unknown TPU accelerator type {name!r}; valid: {', '.join(valid_tpu_names())}")


def _require_libtpu():
    if importlib.util.find_spec("libtpu") is None:
        raise PlanError(INSTALL_HINT)


def topology_devices(sl: Slice):
    """The slice's TPU devices (abstract: compile-only) from libtpu's topology description."""
    _require_libtpu()
    # libtpu takes a lock file per process; planning only compiles, so several processes may share it
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from ..cli import tpu_present
    if not tpu_present():  # off a TPU VM libtpu looks for the VM's workers and logs errors; compiling needs none
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", sl.accelerator)
    from jax.experimental import topologies
    td = topologies.get_topology_desc(topology_name=sl.topology, platform="tpu",
                                      chips_per_host_bounds=sl.chips_per_host)
    devs = list(td.devices)
    if len(devs) != sl.chips:
        raise PlanError(f"topology {sl.topology} gave {len(devs)} devices, expected {sl.chips} chips")
    return devs


def parse_mesh(text: str | None, chips: int) -> tuple[int, int]:
    """"data=D,model=M" (either may be left out) -> (data, model); default: the runtime's rule
    (model 1, data = every chip), as `--model-parallel 1` in the CLIs and mesh.model: 1 in training."""
    data, model = None, 1
    if text:
        for part in str(text).split(","):
            k, sep, v = part.partition("=")
            k = k.strip()
            if not sep or k not in ("data", "model") or not v.strip().isdigit() or int(v) < 1:
                raise PlanError(f"bad --mesh {text!r}: expected data=D,model=M with positive integers")
            if k == "data":
                data = int(v)
            else:
                model = int(v)
    if chips % model:
        raise PlanError(f"mesh model={model} does not divide the slice's {chips} chips")
    data = chips // model if data is None else data
    if data * model != chips:
        raise PlanError(f"mesh data={data} x model={model} = {data * model} != the slice's {chips} chips")
    return data, model


def check_layout(tcfg, dcfg, data: int, model: int) -> None:
    """The runtime's divisibility rules (sharding.target_layout / drafter_layout) for this mesh."""
    import types

    from ..sharding import drafter_layout, target_layout
    shape = types.SimpleNamespace(shape={"data": data, "model": model})
    try:
        target_layout(tcfg, shape)
        if dcfg is not None:
            drafter_layout(dcfg, shape)
    except ValueError as e:
        raise PlanError(f"mesh data={data},model={model}: {e}") from None


def make_mesh(devices, data: int, model: int):
    from ..sharding import make_mesh as mk
    return mk(data, model, devices=devices)


def report_header(sl: Slice, data: int, model: int) -> dict:
    """The head of a plan's report: the slice, its mesh and its per-chip figures."""
    return {"tpu": sl.accelerator, "topology": sl.topology, "chips": sl.chips, "hosts": sl.hosts,
            "mesh": {"data": data, "model": model}, "hbm_bytes_per_chip": sl.generation.hbm_bytes,
            "peak_flops_per_chip": sl.generation.peak_flops, "hbm_bandwidth_per_chip": sl.generation.hbm_bandwidth}
