"""The seam for who averages across the workers of an elastic run: `Engine`.

The update rules across workers (every_step.py, rounds.py, timed.py, overlap.py) call these
operations and nothing else of the network; the launcher's hub (`hub.HubEngine`) and torchft
(`ft.TorchftEngine`) implement them. On a static mesh the same role is the collective inside one
XLA program (jaxdp/sync/collectives.py), where a quorum and a commit have nothing to decide.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np


class Engine(Protocol):
    """Who takes part, one all-gather of byte pieces, and whether the exchanges went through."""

    members: list                     # the last quorum's members as the engine knows them (torchft: replica ids)
    on_quorum: Callable[[], None] | None  # called after each quorum (the worker's flag agreement)
    on_stop: Callable[[], None] | None    # called when the launcher asks the run to stop (the hub)

    def begin(self, step: int, state_fn: Callable[[], bytes] | None) -> None:
        """Ask for a quorum at `step` (the caller computes meanwhile); `state_fn` gives this worker's
        state's bytes to one that is behind."""

    def settled(self) -> bytes | None:
        """The quorum `begin` asked for: a live peer's state's bytes where this worker was behind (it then
        sits the quorum's first exchange out), else None. Raises hub.QuorumLost."""

    def quorum(self, step: int, state_fn: Callable[[], bytes] | None) -> bytes | None:
        """`begin` then `settled`."""

    def participating(self) -> bool:
        """Whether this worker takes part in the next exchange (not while it heals)."""

    def participants(self) -> int:
        """How many workers the last quorum has."""

    def allgather(self, piece: np.ndarray) -> list[np.ndarray]:
        """Every member's `piece` (uint8, one shape everywhere) in the quorum's order; [] where the
        exchange failed (a member lost or stalled), which `commit` then reports."""

    def commit(self) -> bool:
        """Whether this quorum's exchanges so far all went through; if not, the rule does its step again
        over a new quorum."""

    def set_timeout(self, seconds: float) -> None:
        """How long an exchange waits for a member before leaving it out (--stall-timeout)."""

    def close(self, finished: bool = False) -> None:
        """Leave the run (`finished`: at its end, leaving nothing owed)."""
