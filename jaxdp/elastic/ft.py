"""Elastic runs on torchft: the engine (who averages across workers) over a Lighthouse and gloo.

    python -m jaxdp.launch --elastic --elastic-engine torchft --nproc-per-node 2 --max-restarts 100 -- \\
        python -m jaxdp.train --strategy host --devices 1 --checkpoint-dir ckpt --save-every 100

A worker is one process with its own devices (a one-process JAX program). Across workers everything
goes through the engine's operations (jaxdp/elastic/engine.py), which the update rules call; here
the quorum is torchft's Lighthouse (it runs on torchft's thread between `begin` and `settled`, while
the worker computes), a worker behind is healed from a peer over torchft's checkpoint transport
(never a checkpoint), and the all-gather is gloo's. `TorchftEngine` is torchft's `Manager` with
`ProcessGroupGloo`, a Lighthouse in the launcher (jaxdp/launcher/ft.py). JAX's own `live_devices`
could take its place once a process can rejoin on CPU (docs/multihost.md, "Elastic runs on torchft").

Bit-equal sums whatever the membership: gloo's sum order changes with the members, so each worker
sends the gradient sums of the shards it computes as raw bytes, each row tagged with its shard, to
every other (all-gathers), and every worker adds the `size` shards in shard order on the host. Each
worker receives the other workers' rows: N - 1 sums' bytes, where a ring all-reduce of one sum would
cost about 2: fine for a few workers, not for many.

This module imports torchft (and torch) only when a run uses it: without it, one line says
`pip install 'jaxdp-trainer[elastic]'`.
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from jaxdp.cluster.ft_env import (  # noqa: F401 (the run's variables and the Lighthouse: importable from here too)
    ENV_LIGHTHOUSE, ENV_LIGHTHOUSE_HERE, ENV_MIN, ENV_QUORUM_TIMEOUT, ENV_RANK, ENV_RESTART, ENV_SIZE, INSTALL, assign, require_torchft,
    start_lighthouse,
)
from jaxdp.elastic.hub import QuorumLost  # noqa: F401 (every engine's; importable from here too)
from jaxdp.elastic.network import (  # noqa: F401 (what the worker shows the network: importable from here too)
    Member, _Recording, advertised_host, bound_to, listening, member_of, replica_id, same_ip, transport,
)


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
    """The line for a lost quorum `where` ("at step 12"): the engine's coordinator gone (as the worker names
    it: `gone_line`), or too few live workers."""
    if err.gone:
        return member.gone_line(where, err)
    return (f"rank {member.rank}: fewer than --min-workers={member.min_workers} live workers for "
            f"{member.quorum_timeout_s:g} s (--quorum-timeout) {where} ({err})")


def _apply_heal(manager: Any) -> None:
    """A state received from a peer in the quorum, applied (once) through torchft's load_state_dict."""
    if manager._healing:
        manager._apply_pending_state_dict()
        manager._healing = False


class TorchftEngine:
    """The engine (jaxdp/elastic/engine.py) on torchft: a Manager (its own one-process replica group) over ProcessGroupGloo."""

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
        lost.gone = not reachable(self.lighthouse)
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

    def participants(self) -> int:
        """How many workers the last quorum has."""
        return int(self.manager.num_participants())

    def close(self, finished: bool = False) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception:
            pass
