"""Orbax checkpoints of a TrainState, and stopping cleanly when the job is preempted.

    with jaxdp.Checkpointer("/tmp/run", keep=3) as ckpt:
        state = ckpt.restore(state)   # the latest complete checkpoint, in `state`'s structure and
                                      # shardings (any device count); `state` itself if there is none
        ...
        ckpt.save(state)              # every process calls it; returns once the state is on the host,
                                      # orbax writes the files in the background

A checkpoint is one step directory of an orbax `CheckpointManager`:

    DIR/15/state/                     the TrainState: step, params, opt_state, model_state, rng
    DIR/15/meta/                      JSON: the step, the data position, the Config of the run
    DIR/20.orbax-checkpoint-tmp/      a save that has not finished (or was killed): never restored
    DIR/20.unreadable/                a checkpoint that failed to restore, moved aside (never deleted)

Resuming is exact: everything a step reads is in the TrainState, and the batch a step trains on is a
pure function of (seed, step) (see jaxdp/data.py), so the data position to save is the step itself.
It is recorded explicitly anyway (`data_position`), and checked against the state on restore.

Errors about the caller's input raise `jaxdp.errors.InputError` naming the `directory` (the CLI
says `--checkpoint-dir`); a damaged checkpoint is never an error: it is moved aside with one warning.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxdp.config import Config
from jaxdp.errors import InputError
from jaxdp.state import TrainState

log = logging.getLogger("jaxdp")

# Config groups whose fields decide what a checkpoint contains or which batches come next: a resumed
# run must use the same values. Every other field may change on resume: --steps (the total to train
# to), --strategy (psum, ring and host compute the same mean; only bit-identity is lost), the
# learning rate and its schedule and clipping (to recover from a divergence; the optimizer state's
# shapes are checked separately), the device and process count (the state is replicated),
# checkpointing and logging.
_RESUME_GROUPS = ("data", "model", "optimisation")
_MAY_CHANGE_ON_RESUME = ("steps", "strategy", "lr", "schedule", "warmup_steps", "final_lr_fraction", "clip_norm")

UNREADABLE_SUFFIX = ".unreadable"
_BARRIER_IDS = itertools.count()  # every process counts alike, so their barrier names agree


def resume_fields(config: Config) -> dict[str, Any]:
    """The Config fields a resumed run must share with the run that wrote the checkpoint."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.metadata["group"] in _RESUME_GROUPS and f.name not in _MAY_CHANGE_ON_RESUME}


class Checkpointer:
    """Save a TrainState every `save_every` steps into `directory`; restore the latest complete one.

    `config` (optional) is recorded in every checkpoint; a later `restore` with a different config
    raises InputError naming the first field that differs. Bad input never changes `directory`.
    """

    def __init__(self, directory: str, *, save_every: int = 0, keep: int = 3,
                 config: Config | None = None, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        self.save_every = save_every
        self.config = config
        _check_writable(self.directory)
        # Old checkpoints (beyond `keep`) are deleted in a background thread, off the training path;
        # close() waits for that as well as for the last save.
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_background_delete=True,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=_handlers())

    # -- restore --------------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The step of the latest complete checkpoint (unfinished saves do not count)."""
        return self._manager.latest_step()

    def restore(self, state: TrainState) -> TrainState:
        """The latest readable checkpoint, restored into `state`'s structure and shardings.

        Returns `state` unchanged when `directory` holds no checkpoint. A checkpoint made with a
        different config or state shapes raises InputError. A checkpoint that cannot be read (a
        damaged file) is moved aside to `<step>.unreadable` with one warning, and the one before it
        is tried; an unfinished save (`<step>.orbax-checkpoint-tmp`) is never considered.
        """
        self._warn_about_unfinished_saves()
        unreadable = []
        restored = None
        for step in reversed(self._manager.all_steps()):
            try:
                meta, shapes = self._read_description(step)
            except Exception as err:  # noqa: BLE001 - a damaged checkpoint: try the one before it
                unreadable.append((step, err))
                continue
            self._check_compatible(step, meta, shapes, state)  # InputError: stop, change nothing
            try:
                restored = self._restore_step(step, state)
                break
            except Exception as err:  # noqa: BLE001 - a damaged checkpoint: try the one before it
                unreadable.append((step, err))
        self._move_aside(unreadable, restored_step=None if restored is None else int(restored.step))
        return state if restored is None else restored

    def _read_description(self, step: int) -> tuple[dict, dict]:
        """The meta JSON of checkpoint `step` and the shapes of its state (reads no arrays)."""
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        return meta, _flat_shapes(self._manager.item_metadata(step)["state"])

    def _check_compatible(self, step: int, meta: dict, stored: dict, state: TrainState) -> None:
        """InputError if checkpoint `step` was made by a different config or holds other shapes."""
        where = f"checkpoint directory {self.directory!r} holds a checkpoint (step {step})"
        saved = meta.get("config") or {}
        if self.config is not None:
            for name, value in resume_fields(self.config).items():
                if name in saved and saved[name] != value:
                    raise InputError(f"{where} made with {name}={saved[name]!r}, but this run has {name}={value!r}; "
                                     f"use the same {name} or another checkpoint directory", argument="directory",
                                     setting=name)
        wanted = _flat_shapes(state)
        for path in [*wanted, *(p for p in stored if p not in wanted)]:  # params before opt_state
            if stored.get(path) != wanted.get(path):
                have = "missing" if path not in stored else _describe(stored[path])
                want = "nothing" if path not in wanted else _describe(wanted[path])
                raise InputError(f"{where} whose {path} is {have}, but this run's model and optimizer "
                                 f"need {want}; use the settings it was made with or another checkpoint directory",
                                 argument="directory")

    def _restore_step(self, step: int, state: TrainState) -> TrainState:
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        _ignore_closed_event_loop_errors()
        restored = self._manager.restore(step, args=args)
        position = restored["meta"].get("data_position")
        if int(restored["state"].step) != step or position != step:
            raise ValueError(f"inconsistent checkpoint: directory {step}, state.step {int(restored['state'].step)}, "
                             f"data_position {position}")
        return restored["state"]

    def _warn_about_unfinished_saves(self) -> None:
        latest = self._manager.latest_step() or 0
        for name in sorted(os.listdir(self.directory)):
            if ocp.path.step.TMP_DIR_SUFFIX in name:
                step = ocp.path.step.step_from_checkpoint_name(name)
                if step > latest:
                    _warn(f"{os.path.join(self.directory, name)} is a save that never finished (the process "
                          f"stopped while writing it); it is ignored"
                          + (f", the latest complete checkpoint is step {latest}" if latest else ""))

    def _move_aside(self, unreadable: list[tuple[int, Exception]], restored_step: int | None) -> None:
        """Rename damaged step directories so orbax neither restores nor re-saves over them."""
        if not unreadable:
            return
        for step, err in unreadable:
            source = os.path.join(self.directory, str(step))
            target = _unused_name(source + UNREADABLE_SUFFIX)
            resumed = f"resuming from step {restored_step}" if restored_step else "starting from step 0"
            _warn(f"checkpoint {source} could not be read ({type(err).__name__}: {_first_line(err)}); "
                  f"moved it to {target}, {resumed}")
            if jax.process_index() == 0:
                os.replace(source, target)
        # Hazard: every process must see the renames before any of them saves again. (Damage is
        # seen alike by all processes, which read the same files.) Barrier names must be unique.
        ocp.multihost.sync_global_processes(f"jaxdp_move_aside_{next(_BARRIER_IDS)}")
        self._manager.reload()

    # -- save -----------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return bool(self.save_every) and step % self.save_every == 0

    def save(self, state: TrainState) -> bool:
        """Save `state` at `state.step` (all processes call it). False if that step is already saved.

        Host sync point: waits for the step that produced `state`, then copies it to host memory
        (the state is replicated, so one copy is all of it). The files are written in a background
        thread; the next `save` or `close` waits for them.
        """
        step = int(jax.device_get(state.step))
        if step in self._manager.all_steps():
            return False
        meta = {"step": step, "data_position": step, "config": None if self.config is None else self.config.to_dict(),
                "processes": jax.process_count(), "devices": jax.device_count()}
        host_state = jax.device_get(state)
        args = ocp.args.Composite(state=ocp.args.StandardSave(host_state), meta=ocp.args.JsonSave(meta))
        return self._manager.save(step, args=args, force=True)

    def wait(self) -> None:
        """Block until every save has been written and committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _handlers() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Two items per step: "state" (arrays, orbax's standard handler) and "meta" (JSON)."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
        registry.add("state", args)
    for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add("meta", args)
    return registry


def _check_writable(directory: str) -> None:
    """InputError now, before training, if checkpoints could not be written to `directory`."""
    probe = os.path.join(directory, f".jaxdp-write-test-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise InputError(f"checkpoint directory {directory!r} is not a writable directory ({err.strerror or err}); "
                         f"point it at one you can write to", argument="directory") from None


def _unused_name(path: str) -> str:
    """`path`, or `path.2`, `path.3`, ... : the first that does not exist yet."""
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


def _flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{"params/Dense_0/kernel": (shape, dtype)} for a state, or for orbax's metadata of one."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {"/".join(_key_name(k) for k in path): (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
            for path, leaf in leaves}


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _describe(shape_dtype: tuple[tuple[int, ...], str]) -> str:
    shape, dtype = shape_dtype
    return f"{dtype}{list(shape)}"


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""


def _warn(message: str) -> None:
    if jax.process_index() == 0:
        log.warning("jaxdp: warning: %s", message)


def _ignore_closed_event_loop_errors() -> None:
    """Drop the "Event loop is closed" errors that a *failed* orbax restore reports as unraisable.

    Hazard: when one array of a restore fails, orbax closes its event loop while tensorstore still
    completes the other reads, some of them after `restore` has returned; each prints a RuntimeError
    traceback to stderr. They are noise after the real error, which `restore` reports in one line.
    So from the first restore on, this process ignores exactly those; everything else passes through.
    """
    previous = sys.unraisablehook
    if getattr(previous, "jaxdp_ignores_closed_event_loop", False):
        return

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and "Event loop is closed" in str(error)):
            previous(unraisable)

    hook.jaxdp_ignores_closed_event_loop = True
    sys.unraisablehook = hook
