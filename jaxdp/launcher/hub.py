"""The hub of an elastic run (`jaxdp.launch --elastic`): the launcher's end of jaxdp/elastic/hub.py's
engine. It forms the quorums (who takes part, whose state goes to a member behind), relays each
exchange's pieces to every member, and fails an exchange for all when a member is lost or stalls in
it. It runs inside the launcher, so it imports no JAX.
"""

from __future__ import annotations

import selectors
import socket
import time
from typing import Any, Sequence

from jaxdp.cluster import wire
from jaxdp.elastic.hub import STALL_TIMEOUT_S, send

JOIN_TIMEOUT_S = 60.0  # an elastic run's first quorum waits this long for every rank (the hub's; the Lighthouse's too)
# What an elastic worker imports beside the zygote's own list: a restart forked from the zygote has them.
RULES = ("jaxdp.elastic.every_step", "jaxdp.elastic.rounds")


class Hub:
    """The launcher's end: members, quorums, exchanges, state hand-overs.

    Single-threaded: the launcher's loop calls `watch(selector)` once, `ready(key.data)` for every
    ready socket it registered and `tick()` every few tens of milliseconds (the timeouts). `events`
    collects lines for the launcher to print; `stalled` the ranks it left out while their processes
    may live on (stalled, or a bad message): the launcher kills those processes.
    """

    def __init__(self, size: int, host: str = "127.0.0.1", join_timeout_s: float = JOIN_TIMEOUT_S):
        self.size, self.join_timeout_s = size, join_timeout_s
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.conns: dict[int, socket.socket] = {}      # rank -> its live member's connection
        self.peers: dict[socket.socket, _Peer] = {}    # every open connection, members and not yet
        self.members: list[int] = []                   # the last quorum's ranks
        self.formed = False                            # a quorum has formed (the run's start is over)
        self.asking: dict[int, int] = {}               # rank -> the step its pending quorum request is at
        self.asked_since: float | None = None          # when the first pending request came
        self.heal: dict | None = None                  # a quorum waiting for its donor's state (`_form`)
        self.broken = False                            # a member of the last quorum was lost: its exchanges fail
        self.gathers: dict[int, dict[int, bytearray]] = {}  # exchange index -> rank -> its piece
        self.since: dict[int, float] = {}              # exchange index -> when its first piece came
        self.stall_timeout = STALL_TIMEOUT_S
        self.stopping = False
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
        """Stop every member after the same step (a preemption signal reached the launcher): each is told,
        and its next row asks every worker to stop (jaxdp/elastic/every_step.py, ASKS_STOP)."""
        self.stopping = True
        for rank in list(self.conns):
            self._send(rank, {"op": "stop"})
        for rank in [r for r in self.asking if not (r in self.members and self.formed)]:
            del self.asking[rank]  # a joiner: the run ends without it
            self._send(rank, {"op": "ended"})

    def owes(self, rank: int) -> bool:
        """Whether the hub waits for `rank` (its quorum request, its piece of an exchange, its state for a
        member behind): a stop that finds it stopped is then the hub's stall timeout's to handle."""
        if self.heal is not None and self.heal["donor"] == rank:
            return True
        if self.asking and rank in self._expected() and rank not in self.asking:
            return True
        return any(rank in self.members and rank not in pieces for pieces in self.gathers.values())

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
        """The timeouts: a connection with no hello, a member that owes its part of a quorum or an exchange."""
        now = time.monotonic() if now is None else now
        for conn, peer in list(self.peers.items()):
            if peer.rank is None and now - peer.opened > self.stall_timeout:
                self._bad(conn, f"no hello within {self.stall_timeout:g} s")
            elif peer.reader.waiting_s(now) > self.stall_timeout:  # stopped in the middle of a message
                self._bad(conn, f"no complete message within {self.stall_timeout:g} s (--stall-timeout)")
        for index, since in list(self.since.items()):
            if now - since > self.stall_timeout and index in self.gathers:
                self._left_out([r for r in self.members if r not in self.gathers[index]], f"exchange {index} of its quorum")
        if self.heal is not None and now - self.heal["since"] > self.stall_timeout:
            self._left_out([self.heal["donor"]], "the state a member behind needs")
        self._try_form(now)

    def _left_out(self, ranks: list[int], what: str) -> None:
        for rank in ranks:
            if rank in self.conns:
                self.events.append(f"rank {rank} stalled: sent nothing for {what} within {self.stall_timeout:g} s "
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
        if rank in self.conns:  # a restarted member of a rank whose old connection has not closed yet
            self.lost(rank)
        peer.rank = rank
        self.conns[rank] = conn
        if self.stopping:
            self._send(rank, {"op": "stop"})

    def _handle(self, rank: int, header: dict, payload: bytearray) -> None:
        op = header.get("op")
        if op == "quorum":
            self._ask(rank, wire.check(header, step=int)["step"])
        elif op == "gather":
            self._piece(rank, wire.check(header, index=int)["index"], payload)
        elif op == "state":
            self._state(rank, payload)
        elif op == "timeout":
            seconds = wire.check(header, seconds=(int, float))["seconds"]
            if seconds > 0:
                self.stall_timeout = float(seconds)  # (every member runs the same command)
                for conn in self.peers:
                    conn.settimeout(self.stall_timeout)
        elif op == "bye":  # finished: gone without leaving work behind
            self.lost(rank)
        else:
            raise wire.ProtocolError(f"unknown op {op!r}")

    # -- quorums --------------------------------------------------------------------------------

    def _expected(self) -> set[int]:
        """Whose quorum request the next quorum waits for: at the start every rank, then the last quorum's live members."""
        return set(range(self.size)) if not self.formed else {r for r in self.members if r in self.conns}

    def _ask(self, rank: int, step: int) -> None:
        if self.stopping and not (self.formed and rank in self.members):
            self._send(rank, {"op": "ended"})  # a joiner while the run stops
            return
        if not self.asking:
            self.asked_since = time.monotonic()
        self.asking[rank] = step
        self._try_form(time.monotonic())

    def _try_form(self, now: float) -> None:
        if not self.asking or self.heal is not None:
            return
        missing = sorted(self._expected() - set(self.asking))
        if missing:
            waited = now - (self.asked_since or now)
            if not self.formed:
                if waited <= self.join_timeout_s:
                    return  # the run's start: every rank, unless one takes longer than this (it joins later)
            elif waited <= self.stall_timeout:
                return
            else:
                self._left_out(missing, "its quorum")  # (lost() calls back here)
                return
        self._form()

    def _form(self) -> None:
        """The quorum of the ranks that asked: every member at the furthest step; the state of the lowest of
        them goes to the others (`heal`), whose replies wait for it."""
        asking, self.asking, self.asked_since = self.asking, {}, None
        ranks = sorted(asking)
        top = max(asking.values())
        behind = [r for r in ranks if asking[r] < top]
        donor = min(r for r in ranks if asking[r] == top)
        self.members, self.formed, self.broken = ranks, True, False
        self.gathers.clear()
        self.since.clear()
        if behind:
            self.heal = {"donor": donor, "behind": behind, "asking": asking, "since": time.monotonic()}
        for rank in ranks:
            if rank not in behind:
                self._send(rank, {"op": "quorum", "members": ranks, "heal": False, "donate": bool(behind) and rank == donor})

    def _state(self, rank: int, payload: bytearray) -> None:
        heal = self.heal
        if heal is None or heal["donor"] != rank:
            return  # (a donor's state after its quorum broke)
        self.heal = None
        for joiner in heal["behind"]:
            self._send(joiner, {"op": "quorum", "members": self.members, "heal": True, "donate": False}, [payload])

    # -- exchanges ------------------------------------------------------------------------------

    def _piece(self, rank: int, index: int, payload: bytearray) -> None:
        if self.broken or rank not in self.members:
            self._send(rank, {"op": "failed"})
            return
        pieces = self.gathers.setdefault(index, {})
        if pieces and len(payload) != len(next(iter(pieces.values()))):
            raise wire.ProtocolError("a piece whose size differs from the other ranks'")
        if not pieces:
            self.since[index] = time.monotonic()
        pieces[rank] = payload
        if len(pieces) == len(self.members):
            del self.gathers[index], self.since[index]
            body = [pieces[r] for r in self.members]  # in rank order
            for member in self.members:
                self._send(member, {"op": "gathered", "count": len(body)}, body)

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

    def lost(self, rank: int) -> None:
        """`rank`'s member is gone: the exchanges of its quorum fail for every member (each does its step
        again over a new quorum), a hand-over it owed goes to the next quorum."""
        conn = self.conns.pop(rank, None)
        if conn is None:
            return
        self._close(conn)
        self.asking.pop(rank, None)
        heal = self.heal
        if heal is not None:
            if heal["donor"] == rank:  # the members behind ask again, in the next quorum
                self.heal = None
                self.asking.update({r: heal["asking"][r] for r in heal["behind"] if r in self.conns})
                self.asked_since = self.asked_since or time.monotonic()
            elif rank in heal["behind"]:
                heal["behind"].remove(rank)
                if not heal["behind"]:
                    self.heal = None
        if rank in self.members and not self.broken:
            self.broken = True
            for pieces in self.gathers.values():
                for sender in pieces:
                    self._send(sender, {"op": "failed"})
            self.gathers.clear()
            self.since.clear()
        self._try_form(time.monotonic())


class _Peer:
    """One connection to the hub: where from, its reader, its rank once its hello came."""

    def __init__(self, where: str, reader: wire.Reader, opened: float):
        self.where, self.reader, self.opened = where, reader, opened
        self.rank: int | None = None
