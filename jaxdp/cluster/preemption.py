"""Stopping cleanly when the job is preempted: the same step on every process.

`Preemption` turns SIGTERM and SIGUSR1 (what SLURM's `--signal` sends) into "finish the current
step, save, stop", and so a first Ctrl-C (SIGINT): the run saves at the next step boundary and
exits 130; a second Ctrl-C interrupts at once (Python's KeyboardInterrupt, the saving included).
The stop agreement is JAX's own `multihost_utils.process_allgather`.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Preemption:
    """Remembers a SIGTERM or SIGUSR1; `should_stop(state)` says when every process has to stop.

    A signal may reach one process only, or reach processes at different steps, but all processes
    must save the same step (orbax's save is collective). So in a multi-process run `should_stop`
    is itself a tiny collective: each process contributes "I got a signal", and all see the
    maximum. Every process calls it after every step, so they all agree on where they stop.
    It is JAX's own `multihost_utils.process_allgather` of one integer per process (a sub-millisecond
    collective over gloo). In a single process it only reads a flag.
    """

    def __init__(self):
        self.signal: int | None = None  # the signal received, if any
        self.orphaned = False  # the process that started this one was gone when the signal came (PR_SET_PDEATHSIG)
        self._parent = os.getppid()
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            for signum in PREEMPTION_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signal is None or signum != signal.SIGINT:
            self.signal = signum  # only set a flag: the loop decides at the end of the step
            self.orphaned = os.getppid() != self._parent
        if signum == signal.SIGINT:  # the next Ctrl-C is Python's own: it interrupts at once
            signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    @property
    def interrupted(self) -> bool:
        """Stopped by Ctrl-C (SIGINT) here: exit code 130 rather than 75."""
        return self.signal == signal.SIGINT

    def should_stop(self, state: Any) -> bool:
        """True on every process once any process has received a preemption signal.

        Multi-process: a collective, and a host sync point: it first waits for `state` (the step
        just dispatched), so only one program is in flight at a time, as in jaxdp/step/train_step.py. Every
        process must call it after the same steps.
        """
        received = self.signal is not None
        if jax.process_count() == 1:
            return received
        jax.block_until_ready(state)
        flags = multihost_utils.process_allgather(np.int32(received))  # host sync point: a collective
        return bool(np.any(flags))

    @property
    def reason(self) -> str:
        """What stopped the run, for the exit message: "SIGTERM", or a signal another process got."""
        return signal.Signals(self.signal).name if self.signal else "SIGTERM or SIGUSR1 on another process"

    def close(self) -> None:
        """Give the signals back to whoever handled them before."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
