"""A worker of an elastic run as the training loop sees it: who it is, its engine (who averages across
workers, engine.Engine: the launcher's hub, `hub.HubEngine`, or torchft, `ft.TorchftEngine`), and the update rule
`make_step` builds against that engine. The loop (jaxdp/loop/) imports nothing of jaxdp.elastic; it
calls these methods on the worker `from_env` made (jaxdp/elastic/__init__.py lists all it uses).

The two engines differ in how a worker reaches the others and who hosts the quorum, nothing else:
`HubWorker` and `FtWorker` only say how to make their engine and what a lost launcher means.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from jaxdp.elastic import ft, hub
from jaxdp.elastic.engine import Engine


class Worker:
    """One worker of an elastic run (`rank` of `size` shards), its engine made by `make_engine`."""

    def __init__(self, address: str, rank: int, size: int, min_workers: int = 1, quorum_timeout_s: float = 60.0):
        self.address, self.rank, self.size = address, rank, size
        self.min_workers, self.quorum_timeout_s = min_workers, quorum_timeout_s
        self.stall_timeout: float | None = None
        self.shards: list[int] = [rank]
        self.stop = False
        self.stop_asked = False
        self.engine: Engine | None = None
        self.fresh_quorum = False   # the join's quorum is also the first step's
        self.pending_round = False  # (local steps) healed at a peer's round end: that round's exchange first
        self.fresh = False          # at the run's start, no step applied yet: its first steps wait for the others
        self.waiting_since: float | None = None  # (at the run's start) when its first exchange began
        self.said_waiting = False   # the line that names the workers rank 0 waits for was said
        self.live: list[int] = list(range(size))
        self.restarted = False      # started again by the launcher while other workers were live
        self.leader: int | None = 0  # the rank that leads, as the last exchange's rows said (None: not known yet)
        self.alone = False          # restarted, and its first quorum found no live worker
        self.flags = ""             # its flags' prints (jaxdp/cluster/agreement.py; "": not known, not compared)
        self.quorums = 0            # quorums taken so far

    Gone = hub.HubGone    # what a step raises when the quorum is lost (the loop stops with its state)

    def make_engine(self) -> Engine:
        raise NotImplementedError

    @property
    def lead(self) -> bool:
        """Whether this worker writes the metrics, saves the checkpoints and evaluates (jaxdp/loop/lead.py)."""
        return self.leader == self.rank

    def start(self) -> None:
        """Make the engine: from here on the others' first quorum waits for this worker (up to the join timeout)."""
        if self.engine is None:
            self.engine = self.make_engine()
            self.engine.on_quorum, self.engine.on_stop = self.agree, self.ask_stop

    def connect(self) -> None:
        """Join (a restarted worker's engine starts here): every worker starts from its own state (rank 0
        restores the checkpoint), and `settle` then takes the live peers' state if theirs is further on."""
        try:
            self.start()
            if self.stall_timeout:
                self.engine.set_timeout(self.stall_timeout)
        except (RuntimeError, OSError) as err:
            raise hub.Lost(f"cannot reach {self.address}: {err}") from None

    def make_step(self, loss_fn: Callable, tx: Any, mesh: Any, spec: Any, shard_data: Callable, *, stateful: bool,
                  grad_accum: int, rounds: str | None = None, pace: Any = None) -> Any:
        """The update rule `spec` names, across the workers: every step (jaxdp/elastic/every_step.py), H
        local steps (rounds.py), or host-driven `rounds`: "timed" (timed.py, `pace` seconds) or "overlapped"
        (overlap.py, each round's average one round late). Any summing strategy inside a worker, a codec
        of rules.HOST_CODED across workers."""
        from jaxdp.elastic import every_step, overlap, rounds as local, timed

        more: dict[str, Any] = {}
        make: Callable = every_step.make_every_step  # (--shard-params too: every step's layout inside a worker)
        if rounds == "overlapped":
            make = overlap.OverlappedRounds.make
        elif rounds == "timed":
            make, more = timed.TimedRounds.make, {"pace": pace}
        elif spec.sync_every != 1:
            make = local.make_round_step
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

    def agree(self) -> None:
        """After each quorum until this worker has trained (its first, and any while it waits for the
        run's first step: `fresh`): ConfigError (exit 2) where another member has its rank (a
        --node-rank given to two launchers) or trains with other flags (the first that differs named, as
        jaxdp/cluster/agreement.py names it). At the run's start every worker refuses; a joiner refuses
        alone, and the workers that trained before it train on (its leaving is a lost worker's). The
        hub's members show no flags: one launcher starts them all with one command."""
        from jaxdp.cluster import agreement
        from jaxdp.config import ConfigError

        self.quorums += 1
        if self.quorums > 1 and not self.fresh:
            return
        members = self.engine.members if self.engine is not None else []
        twins = [m for m in members if m.rank == self.rank]
        message = None
        if len(twins) > 1:
            message = (f"rank {self.rank} is taken: {len(twins)} live workers of this run have it (at "
                       f"{', '.join(sorted({m.host or '?' for m in twins}))}); give each launcher its own --node-rank "
                       f"(0 .. --nnodes - 1)")
        for other in members:
            flag = agreement.first_differing(self.flags, other.flags) if self.flags and other.flags else None
            if message is None and flag is not None:
                message = (f"{flag} differs between workers (rank {self.rank}'s is not rank {other.rank}'s); start every "
                           f"worker with the same flags (only "
                           f"{', '.join('--' + f.replace('_', '-') for f in agreement.PER_PROCESS)} may differ)")
        if message is not None:
            self.close()
            raise ConfigError(message)

    def say(self, line: str) -> None:
        """One line from the lowest live rank."""
        if self.live and self.rank == min(self.live):
            print(f"jaxdp: {line}", file=sys.stderr, flush=True)

    def ask_stop(self) -> None:
        """Stop every worker after the same step: this worker's next row asks it (every_step.ASKS_STOP)."""
        self.stop_asked = True

    def leaves(self, orphaned: bool) -> bool:
        """Whether a stop signal means this worker alone leaves the run, rather than a stop of every worker."""
        return False

    def close(self, finished: bool = False) -> None:
        if self.engine is not None:
            self.engine.close(finished)
            self.engine = None


class HubWorker(Worker):
    """A process of an elastic run on the launcher's hub (`--elastic-engine hub`): one node. Its launcher
    is its hub, so a worker whose launcher is gone has lost the run: it stops with the state it holds."""

    def make_engine(self) -> hub.HubEngine:
        return hub.HubEngine(self.address, self.rank)

    def gone_line(self, where: str, err: Exception) -> str:
        """The line for a hub that no longer answers (the launcher is gone)."""
        return f"rank {self.rank} lost the launcher at {self.address} {where} ({err})"


class FtWorker(Worker):
    """A worker of an elastic run on torchft (`--elastic-engine torchft`): a Lighthouse, across nodes."""

    def __init__(self, lighthouse: str, rank: int, size: int, min_workers: int = 1, quorum_timeout_s: float = 60.0):
        super().__init__(lighthouse, rank, size, min_workers, quorum_timeout_s)
        self.lighthouse = lighthouse
        self.lighthouse_here = True  # its launcher hosts the Lighthouse: that launcher's end ends the run (`leave`)

    def start(self) -> None:
        """Make the engine, which connects to the Lighthouse (torchft allows it 30 s). A Lighthouse that
        no longer takes a connection by then went away while this worker started (a slow start: the
        others trained on, and their lead saved when it went): this worker ends as they do, exit code 75."""
        try:
            super().start()
        except RuntimeError as err:
            if ft.reachable(self.lighthouse):
                raise
            from jaxdp.errors import EXIT_PREEMPTED

            print(f"jaxdp: {self.gone_line('before this worker joined', err)}; exit code {EXIT_PREEMPTED}",
                  file=sys.stderr, flush=True)
            raise SystemExit(EXIT_PREEMPTED) from None

    def make_engine(self) -> ft.TorchftEngine:
        return ft.TorchftEngine(self.lighthouse, self.rank, self.size, self.min_workers, self.stall_timeout or 20.0,
                                self.quorum_timeout_s, self.flags)

    def gone_line(self, where: str, err: Exception) -> str:
        """The line for a Lighthouse that no longer takes a connection."""
        return f"rank {self.rank}: the Lighthouse at {self.lighthouse.split('://', 1)[-1].rstrip('/')} went away {where}"

    def leaves(self, orphaned: bool) -> bool:
        """Whether a stop signal means this worker alone leaves the run, rather than a stop of every
        worker: its launcher is gone (`orphaned`: the signal was its PR_SET_PDEATHSIG, as when a node's
        launcher is killed or its machine goes down) and did not host the Lighthouse (another node's
        launcher, or --lighthouse, does): the others train on without it, as after a kill. Where the
        launcher hosted the Lighthouse, the run cannot go on without it: every worker stops, the lead saves."""
        return orphaned and not self.lighthouse_here

    def leave(self) -> None:
        """Leave the run at once (`leaves`): no save, exit code 75 (nobody is left to restart it)."""
        from jaxdp.errors import EXIT_PREEMPTED

        print(f"jaxdp: rank {self.rank}: its launcher is gone: this worker leaves the run, the others train on "
              f"without it; exit code {EXIT_PREEMPTED}", file=sys.stderr, flush=True)
        self.close()
        raise SystemExit(EXIT_PREEMPTED)


def from_env(environ: dict | None = None, flags: str = "") -> Worker | None:
    """This process's worker of an elastic run, as `jaxdp.launch --elastic` set it up in the environment
    (torchft's, or the launcher's hub's), or None for a run that is not elastic. `flags`: the prints of
    the run's config (jaxdp/cluster/agreement.py, `prints`), which torchft workers compare at their quorums."""
    environ = os.environ if environ is None else environ
    if environ.get(ft.ENV_LIGHTHOUSE):
        ft.require_torchft()
        worker: Worker = FtWorker(environ[ft.ENV_LIGHTHOUSE], int(environ[ft.ENV_RANK]), int(environ[ft.ENV_SIZE]),
                                  int(environ.get(ft.ENV_MIN, "1")), float(environ.get(ft.ENV_QUORUM_TIMEOUT, "60")))
        worker.lighthouse_here = bool(environ.get(ft.ENV_LIGHTHOUSE_HERE))
        restarted = ft.ENV_RESTART
    elif environ.get(hub.ENV_ADDRESS):
        worker = HubWorker(environ[hub.ENV_ADDRESS], int(environ[hub.ENV_RANK]), int(environ[hub.ENV_SIZE]))
        restarted = hub.ENV_RESTART
    else:
        return None
    worker.flags = flags
    worker.restarted = bool(environ.get(restarted))
    if worker.restarted:  # the live workers' rows say who leads; its engine starts once it has compiled
        worker.leader = None
    else:  # the start: reach the others now, so the first quorum waits for every worker
        worker.start()
    return worker
