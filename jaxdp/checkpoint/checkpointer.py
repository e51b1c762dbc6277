"""Orbax checkpoints of a TrainState: exact resume, on any device count, never over a good one.

    with jaxdp.Checkpointer("/tmp/run", keep=3) as ckpt:
        state = ckpt.restore(state)   # the latest complete checkpoint, in `state`'s structure and
                                      # shardings (any device count); `state` itself if there is none
        ...
        ckpt.save(state)              # every process calls it; returns once the state is on the host,
                                      # orbax writes the files in the background

A checkpoint is one step directory of an orbax `CheckpointManager`:

    DIR/15/state/                     the TrainState: step, params, opt_state, model_state, rng
    DIR/15/meta/                      JSON: the step, the data position, the Config of the run (and
                                      `extra_meta`: the CLI notes whether --sync-every auto chose H
                                      and the data's fingerprint, `data_digest`;
                                      `save_cost`: what --save-every auto measured)
    DIR/15/jaxdp_checksums.json       sha256 of every array of the state (see "Integrity" below)
    DIR/.jaxdp-lock                   held by the run that writes DIR (jaxdp/checkpoint/dirlock.py)
    DIR/20.orbax-checkpoint-tmp/      a save that has not finished (or was killed): never restored
    DIR/20.unreadable/                a checkpoint that failed to restore, moved aside (never deleted)

Resuming is exact: everything a step reads is in the TrainState, and the batch a step trains on is a
pure function of (seed, step) (see jaxdp/data/datasets.py), so the data position to save is the step itself.
It is recorded explicitly anyway (`data_position`), and checked against the state on restore.

Integrity: orbax has no checksums, and a data file with 4 bytes overwritten restores silently wrong
arrays. So every save records the sha256 of each array's bytes. They are computed from the host
copy the save makes anyway, in a background thread (off the training path), and written next to
the step once orbax has committed it (at the next save, `poll` or `close`). A restore checks every
restored array against them; a mismatch is a damaged checkpoint like any other. A step without the
file (saved by an older jaxdp, or killed between commit and checksums) cannot be verified. It is
restored, because refusing it would throw away the work of a run stopped in that window and every
checkpoint made before checksums existed, but not silently: it must hold only finite floats (a
damaged float is often NaN; if not, it is damage like any other), one warning line says it is
unverified, and `restored_unverified` keeps its step, so that a divergence after the restore does
not call it intact (the CLI's message says it may be the cause).

The data: with `extra_meta["data_digest"]` (the CLI records the dataset's fingerprint), a restore
whose checkpoint recorded another one refuses (InputError: documents appended or text edited in
place would move the held-out split over text already trained on; jaxdp/checkpoint/resume.py,
`data_change`). A checkpoint that recorded none (an older jaxdp's, a notebook's) is not checked.

A damaged checkpoint is told apart from one made with other flags by what failed: a description
(`state/_METADATA`, `meta`) that cannot be read or lists no arrays is damage; a complete description
whose arrays or config differ from this run's is "made with other flags" (InputError).

A save that cannot be written (disk full, permissions) raises `CheckpointWriteError` (the CLI exits
with EXIT_CANNOT_SAVE) at the save that failed if it fails at once, else at the next `poll` (the
loop calls it after every step), `save` or `close`: one line naming the step and the reason.

Errors about the caller's input raise `jaxdp.errors.InputError` naming the `directory` (the CLI
says `--checkpoint-dir`); a damaged checkpoint is never an error: it is moved aside with one warning.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import time
from typing import Any, Callable

import jax
import numpy as np

from jaxdp.checkpoint import portable, resume, saveplan
from jaxdp.checkpoint.dirlock import DirectoryLock
from jaxdp.checkpoint.orbax_io import check_writable, handlers, ocp, unused_name, write_error
from jaxdp.cluster import coordination, quiet
from jaxdp.config import Config
from jaxdp.errors import InputError
from jaxdp.metrics import write_text_atomically
from jaxdp.step.state import TrainState

log = logging.getLogger("jaxdp")

UNREADABLE_SUFFIX = ".unreadable"
CHECKSUMS_FILE = "jaxdp_checksums.json"  # DIR/<step>/: sha256 of every array, written after orbax commits
SAVE_COST = "save_cost"  # meta: what --save-every auto measured (jaxdp/checkpoint/saveplan.py), for a restarted run
_BARRIER_IDS = itertools.count()  # every process counts alike, so their barrier names agree


class Checkpointer:
    """Save a TrainState every `save_every` steps into `directory`; restore the latest complete one.

    `save_every` is a step count (0: the caller's final save only) or "auto": an interval chosen from
    the measured cost of the first save (jaxdp/checkpoint/saveplan.py; `due` says when, `decision` what it chose).

    `config` (optional) is recorded in every checkpoint; a later `restore` with a different config
    raises InputError naming the first field that differs. Bad input never changes `directory`.
    """

    def __init__(self, directory: str, *, save_every: int | str = 0, keep: int = 3,
                 config: Config | None = None, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        restarts, mtbf_s = saveplan.failures_from_env()
        self.plan = saveplan.SavePlan(saveplan.parse(save_every), restarts=restarts, mtbf_s=mtbf_s)
        self.decision: dict | None = None  # an auto plan's choice, until `report_decision` says it
        self.config = config
        self.extra_meta: dict[str, Any] = {}  # more JSON for every checkpoint's meta (the CLI: sync_every_auto)
        self.data_state: Callable[[int], dict] | None = None  # step -> more meta: a grain iterator's (jaxdp/data/grain.py)
        self.restored_meta: dict | None = None  # the meta of the checkpoint `restore` restored
        self.restored_unverified: int | None = None  # the step `restore` restored without a checksum record
        check_writable(self.directory)
        self._lock = DirectoryLock(self.directory, *_process_and_client())  # InputError: in use, or not shared
        # Orbax logs a failed background write from its own threads, with tracebacks; jaxdp reports
        # it in one line (CheckpointWriteError). Quiet while this checkpointer lives (--debug: not).
        self._quiet = contextlib.ExitStack()
        self._quiet.enter_context(quiet.quiet())
        quiet.ignore_closed_event_loop_errors()
        self._checksums = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxdp-checksums")
        self._pending: tuple[int, concurrent.futures.Future] | None = None  # saved step, its checksums
        self._failed, self._last_saved = False, None  # a save failed (CheckpointWriteError); the last step saved
        # Old checkpoints (beyond `keep`) are deleted in a background thread, off the training path;
        # close() waits for that as well as for the last save.
        options = ocp().CheckpointManagerOptions(preservation_policy=ocp().checkpoint_managers.LatestN(keep), create=True,
                                                 enable_background_delete=True, enable_async_checkpointing=async_save)
        try:
            self._manager = ocp().CheckpointManager(self.directory, options=options, handler_registry=handlers())
        except BaseException:
            self._lock.release()
            self._quiet.close()
            raise

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
                with quiet.quiet():
                    meta, shapes = self._read_description(step)
            except Exception as err:  # noqa: BLE001 - a damaged checkpoint: try the one before it
                unreadable.append((step, err))
                continue
            saved, owed = portable.without_unsaved_feedback(state, shapes)
            self._check_compatible(step, meta, shapes, saved)  # InputError: stop, change nothing
            try:
                with quiet.quiet():
                    restored = self._restore_step(step, saved, shapes)
                    verified = self._verify(step, restored)
                    restored = portable.with_feedback(portable.from_portable(restored, saved), state, owed)
                break
            except Exception as err:  # noqa: BLE001 - a damaged checkpoint: try the one before it
                unreadable.append((step, err))
        self._move_aside(unreadable, restored_step=None if restored is None else int(restored.step))
        if restored is not None:
            self.restored_meta = meta
            self._recall_save_cost(int(restored.step), meta)
        if restored is not None and not verified:
            self.restored_unverified = int(restored.step)
            _warn(f"checkpoint {os.path.join(self.directory, str(self.restored_unverified))} has no checksum record "
                  f"({CHECKSUMS_FILE}: saved by a jaxdp without checksums, or the run stopped before writing it), "
                  f"so its arrays cannot be verified; restored it unverified")
        return state if restored is None else restored

    def _recall_save_cost(self, step: int, meta: dict) -> None:
        """--save-every auto, resumed: decide at once from the save costs the checkpoint recorded
        (measured on as many devices as this run has), with the launcher's failures until now."""
        recorded = meta.get(SAVE_COST)
        if not self.plan.auto or not isinstance(recorded, dict) or recorded.get("devices") != jax.device_count():
            return
        try:
            costs = {name: float(recorded[name]) for name in saveplan.COSTS}
        except (KeyError, TypeError, ValueError):
            return  # measure again
        self.plan.decide(step, **costs, recalled=True)
        self.extra_meta[SAVE_COST] = recorded
        self.decision = self.plan.decision

    def recorded_meta(self) -> dict | None:
        """The meta JSON (step, config, ...) of the latest checkpoint whose description reads, the one
        `restore` would try first; None when there is none. Reads no arrays and changes nothing: what
        cannot be read is left for `restore` to move aside."""
        for step in reversed(self._manager.all_steps()):
            try:
                with quiet.quiet():
                    return self._read_description(step)[0]
            except Exception:  # noqa: BLE001 - damaged: restore will say so and try the one before
                continue
        return None

    def _read_description(self, step: int) -> tuple[dict, dict]:
        """The meta JSON of checkpoint `step` and the shapes of its state (reads no arrays)."""
        meta = self._manager.restore(step, args=ocp().args.Composite(meta=ocp().args.JsonRestore()))["meta"]
        if not isinstance(meta, dict) or "step" not in meta:
            raise ValueError("its meta/metadata is missing or not jaxdp's")
        description = self._manager.item_metadata(step).get("state")
        shapes = {} if description is None else portable.flat_shapes(description)
        shapes.update(portable.recorded_zero_size(meta))  # zero-size arrays: in meta, not in orbax's files
        if not shapes:  # a checkpoint always holds arrays: their description is gone (state/_METADATA)
            raise ValueError("state/_METADATA, the description of its arrays, is missing or unreadable")
        return meta, shapes

    def _verify(self, step: int, restored: TrainState) -> bool:
        """ValueError if an array of checkpoint `step` differs from what was saved (CHECKSUMS_FILE);
        False if there is no record to check against (then a non-finite float is damage too)."""
        path = os.path.join(self.directory, str(step), CHECKSUMS_FILE)
        host = jax.device_get(restored)
        if not os.path.exists(path):  # saved by an older jaxdp, or stopped between commit and checksums
            for name, leaf in portable.named_leaves(host).items():
                leaf = np.asarray(leaf)
                if np.issubdtype(leaf.dtype, np.inexact) and not np.all(np.isfinite(leaf)):
                    raise ValueError(f"array {name} holds non-finite values, and there is no checksum record "
                                     f"({CHECKSUMS_FILE}) to tell whether it was saved so")
            return False
        with open(path) as f:
            expected = json.load(f)
        actual = portable.checksums(host)
        for name, digest in expected.items():
            if actual.get(name) != digest:
                raise ValueError(f"array {name} does not match the checksum recorded when it was saved")
        return True

    def _check_compatible(self, step: int, meta: dict, stored: dict, state: TrainState) -> None:
        """InputError if checkpoint `step` was made by a different config or holds other shapes."""
        where = f"checkpoint directory {self.directory!r} holds a checkpoint (step {step})"
        saved = meta.get("config") or {}
        if self.config is not None:
            for name, value in resume.resume_fields(self.config).items():
                if name == "dataset" and resume.same_dataset(meta, self.config):
                    continue
                if name in saved and saved[name] != value:
                    raise InputError(f"{where} made with {name}={saved[name]!r}, but this run has {name}={value!r}; "
                                     f"use the same {name} or another checkpoint directory", argument="directory",
                                     setting=name)
            have, want = saved.get("sync_every"), self.config.sync_every
            if isinstance(have, int) and isinstance(want, int) and (have > 1) != (want > 1):
                raise InputError(f"{where} made with sync_every={have}, but this run has sync_every={want}; local "
                                 f"steps (sync_every > 1) and synchronous training keep different states: use "
                                 f"sync_every {'> 1' if have > 1 else '= 1'} or another checkpoint directory",
                                 argument="directory", setting="sync_every")
        wanted = portable.flat_shapes(portable.to_portable(state, abstract=True, stored=stored))
        for path in [*wanted, *(p for p in stored if p not in wanted)]:  # params before opt_state
            if stored.get(path) != wanted.get(path):
                have = "missing" if path not in stored else portable.describe(stored[path])
                want = "nothing" if path not in wanted else portable.describe(wanted[path])
                raise InputError(f"{where} whose {path} is {have}, but this run's model and optimizer "
                                 f"need {want}; use the settings it was made with or another checkpoint directory",
                                 argument="directory")
        change = resume.data_change(meta, self.extra_meta.get(resume.DATA_DIGEST))
        if change is not None:
            dataset = f"dataset {self.config.dataset!r}" if self.config is not None else "the dataset"
            raise InputError(f"{where} trained on other data: {dataset} changed since ({change}), so the held-out "
                             f"split would now hold data already trained on; restore the data it was trained on, or "
                             f"start a new run in another checkpoint directory", argument="directory")

    def _restore_step(self, step: int, state: TrainState, stored: dict) -> TrainState:
        target = jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else ocp().utils.to_shape_dtype_struct(x),
                              portable.to_portable(state, abstract=True, stored=stored))
        args = ocp().args.Composite(state=ocp().args.StandardRestore(portable.without_zero_size(target)),
                                    meta=ocp().args.JsonRestore())
        quiet.ignore_closed_event_loop_errors()
        restored = self._manager.restore(step, args=args)
        position = restored["meta"].get("data_position")
        if int(restored["state"].step) != step or position != step:
            raise ValueError(f"inconsistent checkpoint: directory {step}, state.step {int(restored['state'].step)}, "
                             f"data_position {position}")
        return portable.with_zero_size(restored["state"], target)  # zero-size arrays: not in orbax's files

    def _warn_about_unfinished_saves(self) -> None:
        latest = self._manager.latest_step() or 0
        for name in sorted(os.listdir(self.directory)):
            if ocp().path.step.TMP_DIR_SUFFIX in name:
                step = ocp().path.step.step_from_checkpoint_name(name)
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
            target = unused_name(source + UNREADABLE_SUFFIX)
            resumed = f"resuming from step {restored_step}" if restored_step else "starting from step 0"
            _warn(f"checkpoint {source} could not be read ({quiet.first_line(err)}); moved it to {target}, {resumed}")
            if jax.process_index() == 0:
                os.replace(source, target)
        # Hazard: every process must see the renames before any of them saves again. (Damage is
        # seen alike by all processes, which read the same files.) Barrier names must be unique.
        ocp().multihost.sync_global_processes(f"jaxdp_move_aside_{next(_BARRIER_IDS)}")
        self._manager.reload()

    # -- save -----------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Is a save due after step `step` (training one step at a time)?"""
        return self.plan.due(step - 1, step)

    def due(self, before: int, done: int) -> bool:
        """Is a save due after training from step `before` to `done` (a paced round: several)?"""
        return self.plan.due(before, done)

    def save(self, state: TrainState) -> bool:
        """Save `state` at `state.step` (all processes call it). False if that step is already saved.

        Host sync point: waits for the step that produced `state`, then copies it to host memory
        (the state is replicated, so one copy is all of it; a ZeRO-1 optimizer state is gathered
        from every device, in its tree form: see `_portable`). The files are written in a background
        thread; the next `save` or `close` waits for them.

        An auto plan's measuring save (`--save-every auto`) also waits for its files, times both,
        and sets the interval and `decision` (process 0's, in a multi-process run).
        """
        step = int(jax.device_get(state.step))
        if not self.plan.probing(step):
            return self._save(state, step)
        jax.block_until_ready(state)  # the steps before it are training time, not save time
        ready = time.perf_counter()
        step_s = self.plan.step_s(step, ready)
        saved = self._save(state, step)
        blocked = time.perf_counter() - ready
        self.wait()  # once: how long the background write takes
        written = time.perf_counter() - ready - blocked
        self.plan.decide(step, step_s=step_s, blocked_s=blocked, written_s=written)
        costs = self.plan.costs()
        if jax.process_count() > 1:  # every process saves at the same steps: process 0's measurements
            keys = f"{coordination.namespace('saveplan')}{next(_BARRIER_IDS)}/"  # (unique: every process counts alike)
            chosen = json.loads(coordination.gather_strings(keys, json.dumps(costs))[0])
            if chosen != costs:
                costs = chosen
                self.plan.decide(step, **costs)
        self.extra_meta[SAVE_COST] = {**costs, "devices": jax.device_count()}  # a restart decides from them
        self.decision = self.plan.decision
        return saved

    def report_decision(self, writer: Any, step: int) -> None:
        """The auto plan's decision, once it is taken (at the measuring save, or at a restore that
        recalled the costs): one console line and a `save_every` event through `writer`
        (a jaxdp.metrics.MetricsWriter); then `decision` is None again."""
        if self.decision is not None:
            record, self.decision = self.decision, None
            writer.decision("save_every", step, f"--save-every auto: {record['why']}", **record)

    def _save(self, state: TrainState, step: int) -> bool:
        """The save itself (see `save`), of `state` at `step` (its step, already on the host)."""
        if step in self._manager.all_steps():
            return False
        self._finish_pending()  # orbax waits for the previous save here anyway
        meta = {"step": step, "data_position": step, "config": None if self.config is None else self.config.to_dict(),
                "processes": jax.process_count(), "devices": jax.device_count(), **self.extra_meta,
                **(self.data_state(step) if self.data_state else {})}
        if self.config is not None and resume.dataset_path(self.config):
            meta["dataset_path"] = resume.dataset_path(self.config)  # --dataset as given may be relative
        host_state = jax.device_get(portable.to_portable(state))
        meta.update(portable.zero_size_meta(host_state))  # orbax cannot save zero-size arrays: meta records them
        args = ocp().args.Composite(state=ocp().args.StandardSave(portable.without_zero_size(host_state)),
                                    meta=ocp().args.JsonSave(meta))
        try:
            with quiet.quiet():
                saved = self._manager.save(step, args=args, force=True)
        except Exception as err:  # noqa: BLE001 - could not even start writing: say so now
            raise self._write_error(step, err) from None
        if saved:
            self._pending = (step, self._checksums.submit(portable.checksums, host_state))
            self._last_saved = step
        return saved

    def poll(self) -> None:
        """Cheap; call after every step. Raises CheckpointWriteError once a background save has failed,
        and writes the checksums of a save that has finished."""
        if self._pending is not None and not self._manager.is_saving_in_progress():
            self._finish_pending()

    def _finish_pending(self) -> None:
        """Wait for the save in flight; CheckpointWriteError if it failed; then write its checksums."""
        if self._pending is None:
            return
        step, checksums = self._pending
        self._pending = None
        try:
            with quiet.quiet():
                self._manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - the background write failed
            raise self._write_error(step, err) from None
        step_dir = os.path.join(self.directory, str(step))
        if jax.process_index() == 0 and os.path.isdir(step_dir):
            target = os.path.join(step_dir, CHECKSUMS_FILE)
            try:
                write_text_atomically(target, json.dumps(checksums.result(), indent=0))
            except OSError as err:
                raise self._write_error(step, err) from None

    def wait(self) -> None:
        """Block until every save has been written and committed (CheckpointWriteError if one failed)."""
        self._finish_pending()
        self._manager.wait_until_finished()

    def _write_error(self, step: int, err: BaseException) -> Exception:
        self._failed = True
        return write_error(step, self.directory, err)

    def close(self) -> None:
        try:
            self._finish_pending()
            self._manager.wait_until_finished()
            try:
                self._manager.close()
            except Exception as err:  # noqa: BLE001 - a background write of the last save failed late
                # After a failed save (its unfinished directory removed) this is that save's leftover, which
                # must not mask the CheckpointWriteError already on its way; otherwise it is a failed save.
                if not self._failed:
                    if self._last_saved is None:
                        raise
                    raise self._write_error(self._last_saved, err) from None
        finally:
            self._checksums.shutdown(wait=False)
            self._lock.release()
            self._quiet.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _process_and_client() -> tuple[int, int, Any]:
    """(process index, count, coordination client or None): for the directory lock's shared check."""
    if jax.process_count() == 1:
        return 0, 1, None
    from jaxdp.cluster import coordination

    return jax.process_index(), jax.process_count(), coordination.client()


def _warn(message: str) -> None:
    if jax.process_index() == 0:
        log.warning("jaxdp: warning: %s", message)


