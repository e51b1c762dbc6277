"""The two engines as the training loop sees them: a member of the run (the transport: the hub's
`hub.Member`, torchft's `ft.FtMember`) with this package's update rules behind `make_step`. The loop
(jaxdp/loop/) imports nothing of jaxdp.elastic; it calls these methods on the member `from_env` made
(jaxdp/elastic/__init__.py lists all it uses).
"""

from __future__ import annotations

from typing import Any, Callable

from jaxdp.elastic import ft, hub


class _Worker:
    """What a worker of either engine does alike."""

    def state_from(self, template: Any, payload: Any) -> Any:
        """A live peer's state (`payload`, its arrays' bytes) placed as `template`'s arrays are."""
        from jaxdp.elastic.every_step import state_from_arrays

        return state_from_arrays(template, payload)


class HubWorker(_Worker, hub.Member):
    """A process of an elastic run on the launcher's hub (`--elastic-engine hub`)."""

    def make_step(self, loss_fn: Callable, tx: Any, mesh: Any, spec: Any, shard_data: Callable, *, stateful: bool,
                  grad_accum: int, rounds: str | None = None, pace: Any = None) -> Any:
        """The hub's one update rule: every step, the host path (jaxdp/sync/rules.py refuses the others)."""
        from jaxdp.elastic.every_step import make_elastic_step

        return make_elastic_step(loss_fn, tx, mesh, self, shard_data, spec=spec, stateful=stateful, grad_accum=grad_accum,
                                 grad_norm=True)

    def settle(self, state: Any) -> tuple[Any, bool]:
        """The state to start from once joined as the source: this process's own (restored or new)."""
        return state, False


class FtWorker(_Worker, ft.FtMember):
    """A worker of an elastic run on torchft (`--elastic-engine torchft`)."""

    def make_step(self, loss_fn: Callable, tx: Any, mesh: Any, spec: Any, shard_data: Callable, *, stateful: bool,
                  grad_accum: int, rounds: str | None = None, pace: Any = None) -> Any:
        """The update rule `spec` names, across torchft workers: every step (jaxdp/elastic/every_step.py), H
        local steps (rounds.py), or host-driven `rounds`: "timed" (timed.py, `pace` seconds) or "overlapped"
        (overlap.py, each round's average one round late). Any summing strategy inside a worker, a codec
        of rules.HOST_CODED across workers."""
        from jaxdp.elastic import every_step, overlap, rounds as local, timed

        more: dict[str, Any] = {}
        make: Callable = every_step.make_ft_step  # (--shard-params too: every step's layout inside a worker)
        if rounds == "overlapped":
            make = overlap.FtOverlapped.make
        elif rounds == "timed":
            make, more = timed.FtRounds.make, {"pace": pace}
        elif spec.sync_every != 1:
            make = local.make_ft_round_step
        return make(loss_fn, tx, mesh, self, shard_data, spec=spec, stateful=stateful, grad_accum=grad_accum,
                    grad_norm=True, **more)

    def round_sync(self, overlapped: bool) -> dict:
        """The entries a state of host-driven rounds keeps in `state.sync.shared` (host arrays): the
        overlapped rounds' round, or the timed rounds' positions of every rank's stream."""
        from jaxdp.elastic import overlap, timed

        return overlap.init_sync() if overlapped else timed.init_sync(self.size)

    def settle(self, state: Any) -> tuple[Any, bool]:
        """The first quorum: the state to start from, and whether it came from a live peer (every_step.settle)."""
        from jaxdp.elastic.every_step import settle

        return settle(self, state)


def from_env(environ: dict | None = None, flags: str = "") -> HubWorker | FtWorker | None:
    """This process's worker of an elastic run, as `jaxdp.launch --elastic` set it up in the environment
    (torchft's, or the launcher's hub's), or None for a run that is not elastic. `flags`: the prints of the
    run's config that torchft workers compare (ft.from_env)."""
    return ft.from_env(environ, FtWorker, flags) or hub.from_env(environ, HubWorker)
