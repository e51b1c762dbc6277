"""What the Checkpointer (jaxdp/checkpoint/checkpointer.py) asks of orbax and the file system, in one place:
the items of a step, a directory that can be written, a free name to move a damaged step to, and a failed
save as one line (with orbax's waiting writer threads let go, so the exit comes at once, and the failed
step's unfinished directory removed, so that nothing of it is left for a later run to find).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import threading
import time
from typing import Any

from jaxdp.cluster import quiet
from jaxdp.errors import CheckpointWriteError, InputError


def ocp():
    """orbax.checkpoint, imported on first use: a run that saves nothing never loads it, and starts
    sooner (docs/performance.md, "Behind the defaults")."""
    import orbax.checkpoint

    return orbax.checkpoint


def handlers() -> "Any":
    """Two items per step: "state" (arrays, orbax's standard handler) and "meta" (JSON)."""
    registry = ocp().handlers.DefaultCheckpointHandlerRegistry()
    for args in (ocp().args.StandardSave, ocp().args.StandardRestore):
        registry.add("state", args)
    for args in (ocp().args.JsonSave, ocp().args.JsonRestore):
        registry.add("meta", args)
    return registry


def check_writable(directory: str) -> None:
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


def unused_name(path: str) -> str:
    """`path`, or `path.2`, `path.3`, ... : the first that does not exist yet."""
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


def write_error(step: int, directory: str, err: BaseException) -> CheckpointWriteError:
    """One line: which save failed, why, and what is left.

    Hazard: orbax's other writes of the failed save end later, as asyncio futures that nobody
    awaits; asyncio logs each one ("Future exception was never retrieved", with a traceback) when
    it is garbage-collected, which can be after this checkpointer has closed and the run is
    exiting. So once a save has failed, asyncio's logger stays quiet for the rest of the process
    (--debug keeps it)."""
    quiet.silence_asyncio()
    remove_unfinished(directory, step, after=release_waiting_writers())
    cause = err
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        why = "no space left on the device"
    elif isinstance(cause, OSError):
        why = cause.strerror or quiet.first_line(cause)
    elif "No space left" in str(err):
        why = "no space left on the device"
    else:
        why = quiet.first_line(err)
    return CheckpointWriteError(f"cannot write checkpoint step {step} to {directory}: {why}; the earlier "
                                f"checkpoints are intact (free space or fix the directory, then rerun to resume)")


def remove_unfinished(directory: str, step: int, after: list[threading.Thread] = (), wait_s: float = 10.0) -> None:
    """Delete `<step>.orbax-checkpoint-tmp*` in `directory`, what a failed save of `step` wrote
    (best effort: a directory that cannot be changed keeps it, and a restore ignores it anyway).
    A committed step directory (`<step>`) is never touched.

    Hazard: the failed save's own threads (`after`) may still be creating that directory (orbax
    creates it in a thread of its own, which can finish after the failure is seen); so they are
    waited for first, `wait_s` at most in all."""
    deadline = time.monotonic() + wait_s
    for thread in after:  # (threading's join: orbax's raises the thread's cancellation, after waiting)
        threading.Thread.join(thread, max(deadline - time.monotonic(), 0.0))
    prefix = f"{step}{ocp().path.step.TMP_DIR_SUFFIX}"
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(prefix):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def release_waiting_writers() -> list[threading.Thread]:
    """Let the failed save's remaining orbax threads end now.

    Hazard: each stage of an orbax save runs on a non-daemon thread that first waits (up to orbax's
    300 s coordination timeout) for a key-value signal from the stage before, e.g. "step directory
    created". After a failure that signal never comes, and Python waits for those threads at exit:
    exit code 73 would come 300 s after its message. So every such thread still alive is cancelled
    and its awaited signals are set: it wakes, sees the cancellation and returns without writing.
    Returns those threads (one that was already past its wait runs on to its end)."""
    from orbax.checkpoint._src.futures import future as orbax_future

    released = []
    for thread in threading.enumerate():
        if isinstance(thread, orbax_future._SignalingThread) and thread.is_alive():
            thread.cancel()
            with contextlib.suppress(Exception):  # (a signal already set, or the client gone: nothing waits)
                orbax_future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
            released.append(thread)
    return released
