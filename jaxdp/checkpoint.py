"""Orbax checkpoints of a TrainState: save every N steps, resume from the latest.

    ckpt = Checkpointer("/tmp/run", save_every=100, keep=3)
    state = ckpt.restore(state)           # latest checkpoint, or `state` unchanged if none
    ckpt.save(state)                      # every process calls it; orbax writes once
    ckpt.close()
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxdp.state import TrainState


class Checkpointer:
    def __init__(self, directory: str, *, save_every: int = 0, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state",))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, state: TrainState) -> TrainState:
        """The latest checkpoint restored into `state`'s structure and shardings, or `state`."""
        step = self._manager.latest_step()
        if step is None:
            return state
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        return restored["state"]

    def should_save(self, step: int) -> bool:
        return bool(self.save_every) and step % self.save_every == 0

    def save(self, state: TrainState, *, force: bool = False) -> None:
        step = int(jax.device_get(state.step))
        if step in self._manager.all_steps():
            return
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=force)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
