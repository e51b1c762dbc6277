"""Elastic runs on torchft: membership, transport and state transfer behind a small seam.

    python -m jaxdp.launch --elastic --elastic-engine torchft --nproc-per-node 2 --max-restarts 100 -- \\
        python -m jaxdp.train --strategy host --devices 1 --checkpoint-dir ckpt --save-every 100

A worker is one process with its own devices (a one-process JAX program, as in jaxdp/elastic/hub.py).
Across workers everything goes through an `Engine`:

* `quorum(step, state_fn)`: agree on who takes part in this step (torchft's Lighthouse); a worker that is
  behind (a new or restarted one) gets the live state from a peer here (`state_fn` of the peer: never a
  checkpoint). Returns the received state's bytes, or None. `begin` and `settled` are its two halves:
  the quorum runs on torchft's thread in between, while the worker computes.
* `participating()`: whether this worker takes part in this step (the step's rows say so to the others).
* `allgather(piece)`: every worker's `piece` (the step's rows of the shards each computed).
* `commit()`: whether this step's exchanges all went through (else the step is done again, over the new quorum).

`TorchftEngine` is the first (and only) implementation: `torchft.Manager` with `ProcessGroupGloo`, a
Lighthouse in the launcher (jaxdp/launcher/ft.py). JAX's own `live_devices` could take its place once a
process can rejoin on CPU (docs/multihost.md, "Elastic runs on torchft").

Bit-equal sums whatever the membership: gloo's sum order changes with the members, so each worker
sends the gradient sums of the shards it computes as raw bytes, each row tagged with its shard, to
every other (all-gathers), and every worker adds the `size` shards in shard order on the host, as
the hub does (jaxdp/elastic/hub.py). Each worker receives the other workers' rows: N - 1 sums'
bytes, where a ring all-reduce of one sum would cost about 2: fine for a few workers, not for many.

`FtMember` speaks the Member interface the training loop knows (connect, receive_state, close, ...),
and `make_step` builds its step (jaxdp/elastic/every_step.py). This module imports torchft (and torch)
only when a run uses it: without it, one line says `pip install 'jaxdp-trainer[elastic]'`.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from jaxdp.cluster.ft_env import (  # noqa: F401 (the run's variables and the Lighthouse: importable from here too)
    ENV_LIGHTHOUSE, ENV_LIGHTHOUSE_HERE, ENV_MIN, ENV_QUORUM_TIMEOUT, ENV_RANK, ENV_RESTART, ENV_SIZE, INSTALL, assign, require_torchft,
    start_lighthouse,
)
from jaxdp.elastic.hub import HubGone, Lost
from jaxdp.elastic.network import (  # noqa: F401 (what the worker shows the network: importable from here too)
    Member, _Recording, advertised_host, bound_to, listening, member_of, replica_id, same_ip, transport,
)


class QuorumLost(Exception):
    """No quorum of --min-workers workers within the quorum timeout (or the Lighthouse is gone:
    `lighthouse_gone`, where its address no longer takes a connection)."""

    lighthouse_gone = False


def reachable(lighthouse: str, timeout_s: float = 2.0) -> bool:
    """Whether the Lighthouse's address (http://HOST:PORT) takes a TCP connection."""
    hostport = lighthouse.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False


def lost_line(member: Any, err: QuorumLost, where: str) -> str:
    """The line for a lost quorum `where` ("at step 12"): the Lighthouse gone, or too few live workers."""
    if err.lighthouse_gone:
        return f"rank {member.rank}: the Lighthouse at {member.lighthouse.split('://', 1)[-1].rstrip('/')} went away {where}"
    return (f"rank {member.rank}: fewer than --min-workers={member.min_workers} live workers for "
            f"{member.quorum_timeout_s:g} s (--quorum-timeout) {where} ({err})")


def _apply_heal(manager: Any) -> None:
    """A state received from a peer in the quorum, applied (once) through torchft's load_state_dict."""
    if manager._healing:
        manager._apply_pending_state_dict()
        manager._healing = False


class TorchftEngine:
    """The Engine on torchft: a Manager (its own one-process replica group) over ProcessGroupGloo."""

    def __init__(self, lighthouse: str, rank: int, size: int, min_workers: int, timeout_s: float, quorum_timeout_s: float,
                 flags: str = ""):
        require_torchft()
        import torch
        from torch.distributed import TCPStore
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        from jaxdp.cluster import quiet

        quiet.quiet_http_requests()  # (a heal's state transfer: no access line on the console)
        self.torch, self.rank, self.size, self.lighthouse = torch, rank, size, lighthouse
        self._received: bytes | None = None
        self._state_fn: Callable[[], bytes] | None = None
        self.host = host = advertised_host(lighthouse)
        self.members: list[Member] = []  # the last quorum's members, as their replica ids say
        self.refused: set[str] = set()
        self.on_quorum: Callable[[], None] | None = None  # called after each quorum (the member's `agree`)
        timeout = timedelta(seconds=timeout_s)
        # Every listener on the announced address only (127.0.0.1 on one node): torchft's own choices are
        # every interface (docs/multihost.md, "What listens").
        self.store = TCPStore(host or "0.0.0.0", 0, is_master=True, wait_for_workers=False,
                              **({"master_listen_fd": listening(host)} if host else {}))
        with bound_to(host, self.admits):
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._load, state_dict=self._save,
                min_replica_size=min_workers, use_async_quorum=True, timeout=timeout,
                quorum_timeout=timedelta(seconds=quorum_timeout_s), connect_timeout=timedelta(seconds=30),
                rank=0, world_size=1, store_addr=host or "127.0.0.1", store_port=self.store.port,
                lighthouse_addr=lighthouse, replica_id=replica_id(rank, host, flags),
                init_sync=False, checkpoint_transport=transport(host, timeout),
                **({"hostname": host} if host else {}))
        self.manager._client = _Recording(self.manager._client, self)

    def admits(self, address: str) -> bool:
        """Whether a state transfer may go to `address`: a member of the last quorum (its replica id
        names its announced address). A refusal is said once per address."""
        allowed = {m.host for m in self.members if m.host}
        if same_ip(address, allowed):
            return True
        if address not in self.refused:
            self.refused.add(address)
            print(f"jaxdp: rank {self.rank}: refused to send its state to {address}, no member of the quorum "
                  f"(members at {', '.join(sorted(allowed)) or 'unknown addresses'})", file=sys.stderr, flush=True)
        return False

    def _save(self) -> dict:
        data = self._state_fn() if self._state_fn is not None else b""
        return {"state": self.torch.from_numpy(np.frombuffer(data, np.uint8).copy())}

    def _load(self, state: dict) -> None:
        self._received = state["state"].numpy().tobytes()

    def quorum(self, step: int, state_fn: Callable[[], bytes] | None) -> bytes | None:
        """This step's quorum; the state's bytes if this worker was behind and got them from a peer."""
        self.begin(step, state_fn)
        return self.settled()

    def begin(self, step: int, state_fn: Callable[[], bytes] | None) -> None:
        """Start this step's quorum on torchft's thread (the caller computes meanwhile; `settled` waits
        for it). `state_fn` gives this worker's state to a peer that is behind."""
        self._state_fn, self._received = state_fn, None
        if self.manager.current_step() != step:  # (the source after restoring a checkpoint)
            self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        try:
            self.manager.start_quorum(allow_heal=True)
        except Exception as err:  # (the previous quorum's error)
            raise self._lost(err) from None

    def settled(self) -> bytes | None:
        """Wait for the quorum `begin` started; the state's bytes if this worker was behind and got them
        from a peer (it then sits this step out: `participating` is False)."""
        manager = self.manager
        try:
            manager.wait_quorum()
        except Exception as err:  # torchft raises RuntimeError / TimeoutError from its quorum thread
            raise self._lost(err) from None
        if self.on_quorum is not None:
            self.on_quorum()
        _apply_heal(manager)  # the state now, as torchft's synchronous quorum does (not at the commit)
        return self._received

    def _lost(self, err: Exception) -> QuorumLost:
        """QuorumLost for torchft's error (its first line), saying whether the Lighthouse is gone."""
        lost = QuorumLost(str(err).splitlines()[0] if str(err) else type(err).__name__)
        lost.lighthouse_gone = not reachable(self.lighthouse)
        return lost

    def participating(self) -> bool:
        """Whether this worker takes part in this step's collectives (torchft: not while it heals)."""
        return bool(self.manager.is_participating())

    def allgather(self, piece: np.ndarray) -> list[np.ndarray]:
        """Every worker's `piece` (a uint8 array of one shape everywhere), this one's among them, in the
        process group's order (garbage or none if this step fails to commit: a failure is reported to
        the Manager, so `commit` says False)."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        manager = self.manager
        if manager.errored():
            return []
        manager.wait_quorum()
        tensor = self.torch.from_numpy(np.array(piece, copy=True))
        pieces = [self.torch.empty_like(tensor) for _ in range(manager._pg.size())]
        try:
            manager._pg.allgather([pieces], [tensor], AllgatherOptions()).wait()
        except Exception as err:  # a peer died or stalled mid-step: the step is done again
            manager.report_error(err)
            return []
        return [p.numpy() for p in pieces]

    def set_timeout(self, seconds: float) -> None:
        """The collectives' timeout (a stalled worker is left out after it): from the next quorum on."""
        self.manager._timeout = timedelta(seconds=seconds)
        self.manager._pg.set_timeout(timedelta(seconds=seconds))

    def commit(self) -> bool:
        """Whether this step's exchanges all went through; if so the step counts (the step a behind
        worker is healed to). torchft's `should_commit` less its round trip to this worker's own
        manager server, whose vote is of the worker's replica group: here one process, this one (that
        round trip was a visible part of a small model's step: docs/performance.md, "Behind the defaults")."""
        manager = self.manager
        try:
            if err := manager._pg.errored():
                manager.report_error(err)
            _apply_heal(manager)
            ok = manager.num_participants() >= manager._min_replica_size and manager._errored is None
            manager._checkpoint_transport.disallow_checkpoint()
        except Exception:
            return False
        if ok:
            manager._step += 1
            manager._batches_committed += manager.num_participants()
        return ok

    def step(self) -> int:
        return self.manager.current_step()

    def close(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception:
            pass


class FtMember:
    """One worker of an elastic run on torchft, as the training loop sees a member (jaxdp/loop/trainer.py)."""

    def __init__(self, lighthouse: str, rank: int, size: int, min_workers: int = 1, quorum_timeout_s: float = 60.0):
        self.lighthouse, self.rank, self.size = lighthouse, rank, size
        self.address = lighthouse
        self.min_workers, self.quorum_timeout_s = min_workers, quorum_timeout_s
        self.stall_timeout: float | None = None
        self.shards: list[int] = [rank]
        self.stop = False
        self.stop_asked = False
        self.sock = None            # (the loop's test for "had joined" when a join fails)
        self.engine: TorchftEngine | None = None
        self.fresh_quorum = False   # the join's quorum is also the first step's
        self.pending_round = False  # (local steps) healed at a peer's round end: that round's exchange first
        self.fresh = False          # at the run's start, no step applied yet: its first steps wait for rank 0
        self.live: list[int] = list(range(size))
        self.restarted = False      # started again by the launcher while other workers were live
        self.leader: int | None = 0  # the rank that leads, as the last exchange's rows said (None: not known yet)
        self.alone = False          # restarted, and its first quorum found no live worker
        self.lighthouse_here = True  # its launcher hosts the Lighthouse: that launcher's end ends the run (`leave`)
        self.flags = ""             # its flags' prints (jaxdp/cluster/agreement.py; "": not known, not compared)
        self.quorums = 0            # quorums taken so far

    kind = "torchft"      # the engine's name, as --elastic-engine says it (jaxdp/sync/rules.py checks by it)
    lead_moves = True     # the lead is agreed in each exchange's rows (jaxdp/loop/lead.py)
    Gone = HubGone        # what a step raises when the quorum is lost for --quorum-timeout (the loop stops with its state)

    @property
    def lead(self) -> bool:
        """Whether this worker writes the metrics, saves the checkpoints and evaluates (jaxdp/loop/lead.py)."""
        return self.leader == self.rank

    def start(self) -> None:
        """Create the engine: from here on the Lighthouse sees this worker's heartbeats (and a quorum at
        the start waits for it, up to the Lighthouse's join timeout)."""
        if self.engine is None:
            self.engine = TorchftEngine(self.lighthouse, self.rank, self.size, self.min_workers,
                                        self.stall_timeout or 20.0, self.quorum_timeout_s, self.flags)
            self.engine.on_quorum = self.agree

    def connect(self) -> bool:
        """True: every worker starts from its own state (rank 0 restores the checkpoint), and `settle`
        then takes the live peers' state if theirs is further on."""

        try:
            self.start()
            if self.stall_timeout:
                self.engine.set_timeout(self.stall_timeout)
        except RuntimeError as err:
            raise Lost(f"cannot reach the Lighthouse at {self.lighthouse}: {err}") from None
        return True

    def agree(self) -> None:
        """After each quorum until this worker has trained (its first, and any while it waits for the
        run's first step: `fresh`): ConfigError (exit 2) where another member has its rank (a
        --node-rank given to two launchers) or trains with other flags (the first that differs named, as
        jaxdp/cluster/agreement.py names it). At the run's start every worker refuses; a joiner refuses
        alone, and the workers that trained before it train on (its leaving is a lost worker's)."""
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

    def receive_state(self) -> None:
        return None  # (connect says True: never asked)

    def say(self, line: str) -> None:
        """One line from the lowest live rank."""
        if self.live and self.rank == min(self.live):
            print(f"jaxdp: {line}", file=sys.stderr, flush=True)

    def ask_stop(self) -> None:
        self.stop_asked = True

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

    def close(self, finished: bool = False) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def from_env(environ: dict | None = None, kind: type = FtMember, flags: str = "") -> FtMember | None:
    """The worker `jaxdp.launch --elastic --elastic-engine torchft` set up in this environment (a `kind`,
    FtMember or a subclass: jaxdp/elastic/workers.py), or None. `flags`: the prints of the run's config
    (jaxdp/cluster/agreement.py, `prints`), which every quorum compares ("": not compared)."""
    environ = os.environ if environ is None else environ
    lighthouse = environ.get(ENV_LIGHTHOUSE)
    if not lighthouse:
        return None
    require_torchft()
    member = kind(lighthouse, int(environ[ENV_RANK]), int(environ[ENV_SIZE]), int(environ.get(ENV_MIN, "1")),
                  float(environ.get(ENV_QUORUM_TIMEOUT, "60")))
    member.flags = flags
    member.restarted = bool(environ.get(ENV_RESTART))
    member.lighthouse_here = bool(environ.get(ENV_LIGHTHOUSE_HERE))
    if member.restarted:  # the live workers' rows say who leads
        member.leader = None
    else:  # the start: heartbeat now, so the first quorum waits for every worker
        member.start()
    return member
