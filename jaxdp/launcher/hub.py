"""The hub of an elastic run (`jaxdp.launch --elastic`): the launcher's end of jaxdp/elastic/hub.py.

It knows the members, who computes which shard, the per-step sums in shard order, and the state a
joining member receives from a live one. It runs inside the launcher, so it imports no JAX.
"""

from __future__ import annotations

import selectors
import socket
import time
from typing import Any, Sequence

import numpy as np

from jaxdp.cluster import wire
from jaxdp.elastic.hub import STALL_TIMEOUT_S, partial_layout, send, unpack


class Hub:
    """The launcher's end: members, who computes which shard, the per-step sums, state hand-overs.

    Single-threaded: the launcher's loop calls `watch(selector)` once, `ready(key.data)` for every
    ready socket it registered and `tick()` every few tens of milliseconds (the timeouts). `events`
    collects lines for the launcher to print; `stalled` the ranks it left out while their processes
    may live on (stalled, or a bad message): the launcher kills those processes.
    """

    def __init__(self, size: int, host: str = "127.0.0.1"):
        self.size = size
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.conns: dict[int, socket.socket] = {}      # rank -> its live member's connection
        self.peers: dict[socket.socket, _Peer] = {}    # every open connection, members and not yet
        self.holders: set[int] = set()                 # ranks whose member holds the train state
        self.waiting: list[int] = []                   # joined, waiting for the state (in arrival order)
        self.owner: dict[int, int] = {}                # shard -> the rank that computes it (holders only)
        self.step: int | None = None                   # the step being summed (None: no holder yet)
        self.partials: dict[int, bytearray] = {}       # shard -> its sum for `step`
        self.layout: list[tuple[str, int]] = []        # (dtype, count) of each array of a partial
        self.since: float | None = None                # when the first partial of `step` arrived
        self.donor: tuple[int, list[int]] | None = None  # (rank, [joiners]) asked to send the state
        self.stall_timeout = STALL_TIMEOUT_S
        self.stopping = False
        self.finished = False                          # a total with stop was sent, or the run ended
        self.events: list[str] = []
        self.stalled: list[int] = []
        self._selector: selectors.BaseSelector | None = None

    def watch(self, selector: selectors.BaseSelector) -> None:
        self._selector = selector
        selector.register(self.listener, selectors.EVENT_READ, ("hub", None))

    def close(self) -> None:
        for conn in list(self.peers):
            conn.close()
        self.listener.close()

    def request_stop(self) -> None:
        """Stop every member after the step in flight (a preemption signal reached the launcher)."""
        self.stopping = True
        if not self.holders:  # nobody is stepping: tell those waiting now
            for rank in list(self.waiting):
                self._send(rank, {"op": "stop"})

    # -- events from the sockets ----------------------------------------------------------------

    def ready(self, data: tuple[str, Any]) -> None:
        kind, conn = data
        if kind == "hub":
            try:
                conn, where = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.stall_timeout)  # sends to a member that reads nothing fail after this
            self.peers[conn] = _Peer(f"{where[0]}:{where[1]}", wire.Reader(wire.MAX_PAYLOAD), time.monotonic())
            if self._selector is not None:
                self._selector.register(conn, selectors.EVENT_READ, ("conn", conn))
            return
        peer = self.peers.get(conn)
        if peer is None:
            return
        try:
            for header, payload in peer.reader.read(conn):
                if self.peers.get(conn) is not peer:
                    return  # dropped while handling an earlier message
                if peer.rank is None:
                    self._hello(conn, peer, header)
                else:
                    self._handle(peer.rank, header, payload)
        except wire.ProtocolError as err:
            self._bad(conn, str(err), err.quiet)

    def tick(self, now: float | None = None) -> None:
        """The timeouts: a connection with no hello, a member that owes its part of the step."""
        now = time.monotonic() if now is None else now
        for conn, peer in list(self.peers.items()):
            if peer.rank is None and now - peer.opened > self.stall_timeout:
                self._bad(conn, f"no hello within {self.stall_timeout:g} s")
            elif peer.reader.waiting_s(now) > self.stall_timeout:  # stopped in the middle of a message
                self._bad(conn, f"no complete message within {self.stall_timeout:g} s (--stall-timeout)")
        if self.since is None or now - self.since <= self.stall_timeout:
            return
        late = sorted({self.owner[s] for s in range(self.size) if s not in self.partials and s in self.owner})
        for rank in late:
            self.events.append(f"rank {rank} stalled: sent nothing for step {self.step} within {self.stall_timeout:g} s "
                               f"(--stall-timeout) of another rank's part; left out")
            self.stalled.append(rank)
            self.lost(rank)

    def _bad(self, conn: socket.socket, why: str, quiet: bool = False) -> None:
        """Drop `conn`: one line unless it simply closed (a member's end is the launcher's to report)."""
        peer = self.peers.get(conn)
        if peer is None:
            return
        member = peer.rank is not None and self.conns.get(peer.rank) is conn
        if member and not quiet:  # its process may live on: the launcher kills it (and restarts it)
            self.events.append(f"rank {peer.rank} stalled: {why}; left out" if "within" in why else
                               f"rank {peer.rank} sent a bad message ({why}); left out")
            self.stalled.append(peer.rank)
        elif not quiet:
            self.events.append(f"dropped the connection from {peer.where}: {why}")
        if member:
            self.lost(peer.rank)
        else:
            self._close(conn)

    def _hello(self, conn: socket.socket, peer: _Peer, header: dict) -> None:
        if header.get("op") != "hello":
            raise wire.ProtocolError(f"a {header.get('op')!r} message before its hello")
        rank = wire.check(header, rank=int)["rank"]
        if not 0 <= rank < self.size:
            raise wire.ProtocolError(f"rank {rank} is not one of 0..{self.size - 1}")
        stall = header.get("stall_timeout")
        if isinstance(stall, (int, float)) and not isinstance(stall, bool) and stall > 0:
            self.stall_timeout = float(stall)  # (every member runs the same command)
            conn.settimeout(self.stall_timeout)
        if rank in self.conns:  # a restarted member of a rank whose old connection has not closed yet
            self.lost(rank)
        peer.rank = rank
        self.conns[rank] = conn
        if self.stopping:
            self._send(rank, {"op": "stop"})
            return
        if not self.holders and rank == 0:  # no state anywhere: rank 0 restores or initialises it
            self._make_source()
            return
        self._send(rank, {"op": "welcome", "source": False})
        self.waiting.append(rank)

    def _make_source(self) -> None:
        self.holders.add(0)
        self.owner = {s: 0 for s in range(self.size)}
        self.step, self.donor, self.since = None, None, None
        self.partials.clear()
        self._send(0, {"op": "welcome", "source": True, "shards": list(range(self.size))})

    def _handle(self, rank: int, header: dict, payload: bytearray) -> None:
        op = header.get("op")
        if op == "stop":
            self.request_stop()
        elif op == "bye":  # finished: gone without leaving work behind
            self._drop(rank)
            self.holders.discard(rank)
        elif op == "partial":
            wire.check(header, step=int, shard=int, layout=list)
            step, shard = header["step"], header["shard"]
            layout = partial_layout(header["layout"], payload)
            if self.step is None:
                self.step = step  # the source's first step: its restored position
            if step != self.step or self.owner.get(shard) != rank:
                return  # a stale partial (from before a reassignment): the new owner sends it
            if self.partials and layout != self.layout:
                raise wire.ProtocolError("a partial whose arrays differ from the other ranks'")
            if not self.partials:
                self.since = time.monotonic()
            self.partials[shard] = payload
            self.layout = layout
            if len(self.partials) == self.size:
                self._total()
        elif op == "state":
            wire.check(header, step=int)
            if self.donor is None or self.donor[0] != rank:
                return
            _, joiners = self.donor
            self.donor = None
            for joiner in joiners:
                if joiner in self.conns:
                    self.holders.add(joiner)
                    self._send(joiner, {"op": "state", "step": header["step"], "shards": self._shards(joiner)},
                               [payload])
        else:
            raise wire.ProtocolError(f"unknown op {op!r}")

    def _total(self) -> None:
        layout = self.layout
        total = [np.zeros(count, dtype) for dtype, count in layout]
        for shard in range(self.size):  # in shard order: the same sum whoever computed each
            for acc, part in zip(total, unpack(self.partials[shard], [((count,), dtype) for dtype, count in layout])):
                acc += part
        self.partials.clear()
        self.since = None
        step = self.step
        self.step = step + 1
        stop = self.stopping
        joiners, donor = [], None
        if self.waiting and not stop and self.donor is None:
            joiners, self.waiting = self.waiting, []
            donor = min(self.holders)
            self.donor = (donor, joiners)
            for joiner in joiners:  # from the next step on, a joiner computes its own shard again
                self.owner[joiner] = joiner
            self.events.append(f"rank{'s' if len(joiners) > 1 else ''} {', '.join(map(str, joiners))} joined at "
                               f"step {step + 1}: the state comes from rank {donor}")
        for rank in sorted(self.holders):
            self._send(rank, {"op": "total", "step": step, "shards": self._shards(rank), "donate": rank == donor,
                              "stop": stop}, total)
        if stop:
            self.finished = True
            for rank in list(self.waiting):
                self._send(rank, {"op": "stop"})

    def _shards(self, rank: int) -> list[int]:
        return sorted(s for s, r in self.owner.items() if r == rank)

    def _send(self, rank: int, header: dict, payload: Sequence[Any] = ()) -> None:
        conn = self.conns.get(rank)
        if conn is None:
            return
        try:
            send(conn, header, payload)
        except wire.ProtocolError:
            self.lost(rank)

    # -- a member gone ---------------------------------------------------------------------------

    def _close(self, conn: socket.socket) -> None:
        self.peers.pop(conn, None)
        if self._selector is not None:
            try:
                self._selector.unregister(conn)
            except (KeyError, ValueError):
                pass
        conn.close()

    def _drop(self, rank: int) -> bool:
        conn = self.conns.pop(rank, None)
        if conn is None:
            return False
        self._close(conn)
        return True

    def _alive(self, rank: int | None) -> bool:
        """Holds the state, or is about to (its hand-over is under way)."""
        return rank in self.holders or (self.donor is not None and rank in self.donor[1])

    def lost(self, rank: int) -> None:
        """`rank`'s member is gone: its shards go to the live holders, a hand-over it owed to another."""
        if not self._drop(rank):
            return
        if rank in self.waiting:
            self.waiting.remove(rank)
        was_holder = rank in self.holders
        self.holders.discard(rank)
        if self.donor is not None:
            donor, joiners = self.donor
            if donor == rank:  # it died before handing the state over: the joiners wait for the next step
                self.donor = None
                for joiner in joiners:
                    self.owner.pop(joiner, None)
                self.waiting = [j for j in joiners if j in self.conns] + self.waiting
            elif rank in joiners:
                joiners.remove(rank)
        if not was_holder and rank not in self.owner.values():
            return
        if not self.holders:  # nobody holds the state: rank 0 (when it is back) restores it
            self.step, self.owner, self.donor, self.since = None, {}, None, None
            self.partials.clear()
            self.waiting = [r for r in self.waiting if r in self.conns]
            self.events.append(f"rank {rank} lost and no process holds the state: rank 0 restores the last "
                               f"checkpoint when it joins")
            if 0 in self.waiting:  # rank 0 waits for a state that no one has: it becomes the source
                self.waiting.remove(0)
                self._make_source()
            return
        orphans = [s for s in range(self.size) if not self._alive(self.owner.get(s))]
        asked: dict[int, list[int]] = {}  # heir -> shards of the step in flight it must compute too
        for shard in orphans:
            heir = min(self.holders, key=lambda r: (len(self._shards(r)), r))
            self.owner[shard] = heir
            if self.step is not None and shard not in self.partials:
                asked.setdefault(heir, []).append(shard)
        if self.since is not None:  # the heirs get the whole timeout for their extra shards
            self.since = time.monotonic()
        self.events.append(f"rank {rank} lost at step {self.step}: its shards {orphans} go to "
                           + ", ".join(f"rank {r}" for r in sorted({self.owner[s] for s in orphans})))
        for heir, shards in asked.items():
            self._send(heir, {"op": "also", "step": self.step, "shards": shards})


class _Peer:
    """One connection to the hub: where from, its reader, its rank once its hello came."""

    def __init__(self, where: str, reader: wire.Reader, opened: float):
        self.where, self.reader, self.opened = where, reader, opened
        self.rank: int | None = None
