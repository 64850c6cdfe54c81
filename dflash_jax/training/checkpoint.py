"""Orbax checkpoints of the training state: params, optimizer state, step, PRNG key + JSON metadata.

The directory is handed to orbax unchanged, so `gs://bucket/run` works on TPU VMs. A checkpoint is
published by orbax's atomic rename of its temporary directory; a job killed mid-save leaves only a
temporary directory, which is ignored (and cleaned up) by the next run.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


def _abs(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


class Checkpointer:
    def __init__(self, directory: str, keep_last: int = 3, async_save: bool = True, read_only: bool = False):
        self.directory = _abs(directory)
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last, create=not read_only, cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save, read_only=read_only)
        self.manager = ocp.CheckpointManager(self.directory, options=opts, item_names=("state", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        """Save `state` (a pytree of arrays) and `meta` (JSON) as checkpoint `step`."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int | None, abstract_state):
        """(state, meta) of `step` (None = latest). `abstract_state`: a pytree of ShapeDtypeStruct (with
        shardings) or arrays giving the structure, dtypes and placement to restore into."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoints in {self.directory}")
        if step not in self.steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} (have {self.steps()})")
        abstract = jax.tree_util.tree_map(
            lambda a: a if isinstance(a, jax.ShapeDtypeStruct)
            else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)), abstract_state)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
