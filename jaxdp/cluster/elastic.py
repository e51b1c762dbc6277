"""Elastic runs: a lost process is restarted alone while the others train on (`jaxdp.launch --elastic`).

    python -m jaxdp.launch --elastic --nproc-per-node 2 --max-restarts 100 -- \\
        python -m jaxdp.train --strategy host --devices 1 --checkpoint-dir ckpt --save-every 100

Why not through JAX: `jax.distributed.initialize` fixes the set of processes for the life of every
process (the coordination service, gloo's and NCCL's communicators all assume it), and XLA's
collectives have no way to leave a dead peer out. So a plain multi-process run that loses one
process must stop every process and restart all of them from the last checkpoint (what
`jaxdp.launch --max-restarts` does, like torchrun): every kill costs every process's start-up and
the steps since the last save. An elastic run keeps JAX inside each process (every process is a
one-process JAX program over its own devices) and sums the gradients across processes on the host,
through the launcher, whose membership can change at any step. That is the `host` strategy's
data path with a transport that survives a lost member.

The run is `size` shards (the processes it starts with, their ranks). Shard s of step t is the rows
process s of a `size`-process run would read (`Dataset.train_batch(..., s, size)`: a pure function of
seed, shard and step). Each step every shard's gradient sum over its devices goes to the launcher,
which adds the `size` sums in shard order and sends the total back; every process applies the same
optax update. Which process computed a shard does not change a bit of the result (the same program
on the same inputs), so an elastic run that loses processes ends with exactly the parameters of one
that lost none:

* a process that dies (the launcher sees its socket close at once) leaves its shards to the live
  process with the fewest; a shard of the step in flight that it had not sent yet is computed
  there too, from the same state. No step is lost or recomputed but that one shard.
* the launcher starts the lost rank again; the new process compiles its programs (from the
  persistent compilation cache), then joins: at the end of the next step a live process sends it
  the train state (through the launcher) and the shard goes back to it. No checkpoint is read.
* when no live process holds the state (the start, or all lost at once), rank 0 becomes the source:
  it restores the latest checkpoint (or initialises) and the others join from it.

Rank 0 (whichever process runs it) writes the metrics, the checkpoints and the evaluation, as process
0 does in a plain run; while it restarts, the others train on and it catches up with the state.
A preemption signal (to the launcher, or to any process) stops every process after the same step,
rank 0 saving it (exit 75). Scope: the `host` strategy (the sum is on the host anyway), no
compression, local steps, ZeRO-1 or `--sync-seconds`; one node (the launcher is the hub). Every
process sends its shard's gradients to the launcher and gets the total back (a star over
localhost): twice a ring's bytes, which is what a local star costs. A stopped process (SIGSTOP) is
left out after the stall timeout (below).

Wire: jaxdp/cluster/wire.py's messages (a JSON header, the arrays as raw bytes in an order both sides know
in the payload). The ops:

    process -> launcher: hello {rank, stall_timeout}; partial {step, shard, layout} + arrays; state
                         {step} + the train state; stop {} (a preemption signal arrived here); bye {}
    launcher -> process: welcome {source}; also {step, shards}; total {step, shards, donate,
                         stop} + arrays; state {step, shards} + the train state; stop {}

The hub reads every connection without blocking (`wire.Reader`), so a connection that sends half a
message or nothing stalls no one. A connection that sends something that is not one of these
messages is dropped with one line naming it (a member's counts as lost); one that sends no hello
within the stall timeout is dropped too. A member that owes its part of a step `stall_timeout`
seconds (the members' --stall-timeout) after another member sent its own is left out and named as
stalled (its shards go to the others, as a lost member's do); the launcher kills it, and restarts it
as a lost one. A member whose hub goes away (the launcher was killed) stops after the step it has:
rank 0 saves it (`HubGone`, then exit 75 in every member).

This module holds no JAX: the launcher imports it. The step that uses `Member` is
`jaxdp.step.train_step.make_elastic_step`.
"""

from __future__ import annotations

import os
import selectors
import socket
import time
from typing import Any, Callable, Sequence

import numpy as np

from jaxdp.cluster import wire

ENV_ADDRESS = "JAXDP_ELASTIC"        # HOST:PORT of the launcher's hub; set: this process is a member
ENV_RANK = "JAXDP_ELASTIC_RANK"
ENV_SIZE = "JAXDP_ELASTIC_SIZE"
READ_TIMEOUT_S = 30.0     # a member: the rest of a message whose first bytes have arrived (the hub closing is seen at once)
STALL_TIMEOUT_S = 20.0    # the hub's, until a member's hello says its --stall-timeout

Lost = wire.ProtocolError  # the other end closed, or sent something that is not one of our messages


class HubGone(Exception):
    """This member's hub (the launcher) went away: stop after the step this process holds."""


def send(sock: socket.socket, header: dict, payload: Sequence[Any] = ()) -> None:
    wire.send(sock, header, [np.ascontiguousarray(p) if isinstance(p, np.ndarray) else p for p in payload])


def pack(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.ascontiguousarray(a) for a in arrays]


def unpack(payload: bytes | bytearray, like: Sequence[Any]) -> list[np.ndarray]:
    """`payload` cut into arrays of the shapes and dtypes of `like` (arrays or (shape, dtype) pairs)."""
    out, offset = [], 0
    for item in like:
        shape, dtype = (item.shape, item.dtype) if hasattr(item, "shape") else item
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        out.append(np.frombuffer(payload, dtype, count, offset).reshape(shape))
        offset += count * dtype.itemsize
    if offset != len(payload):
        raise ValueError(f"expected {offset} bytes of arrays, got {len(payload)}")
    return out


def _layout(value: Any, payload: bytearray) -> list[tuple[str, int]]:
    """A partial's layout [(dtype, count), ...], checked against its payload; ProtocolError if bad."""
    try:
        layout = [(str(np.dtype(d)), int(c)) for d, c in value]
        ok = all(c >= 0 for _, c in layout) and sum(np.dtype(d).itemsize * c for d, c in layout) == len(payload)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise Lost("a partial's layout does not describe its payload")
    return layout


# ---------------------------------------------------------------------------------------------
# The hub (in the launcher)
# ---------------------------------------------------------------------------------------------


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
            layout = _layout(header["layout"], payload)
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


# ---------------------------------------------------------------------------------------------
# A member (in each training process)
# ---------------------------------------------------------------------------------------------


class Member:
    """This process's link to the hub: `rank` of `size` shards."""

    def __init__(self, address: str, rank: int, size: int):
        host, port = address.rsplit(":", 1)
        self.rank, self.size, self.address = rank, size, address
        self.sock: socket.socket | None = None
        self.host, self.port = host.strip("[]"), int(port)
        self.shards: list[int] = [rank]
        self.stop = False        # the hub said stop after the last step
        self.stop_asked = False  # this process asked for a stop (a signal here)
        self.stall_timeout: float | None = None  # this run's --stall-timeout, for the hub (None: its default)

    @property
    def lead(self) -> bool:
        """Rank 0 writes metrics, checkpoints and evaluations."""
        return self.rank == 0

    def connect(self) -> bool:
        """Join: True if this process is the source of the state (it restores or initialises it),
        False if it must `receive_state`. Raises Lost if the hub is gone or says stop."""
        self.sock = socket.create_connection((self.host, self.port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        send(self.sock, {"op": "hello", "rank": self.rank, "pid": os.getpid(), "stall_timeout": self.stall_timeout})
        return self._welcome(*self._receive()) is None

    def _receive(self) -> tuple[dict, bytearray]:
        header, payload = wire.receive(self.sock, timeout=READ_TIMEOUT_S, max_payload=wire.MAX_PAYLOAD, wait=True)
        wire.check(header, op=str)
        if "shards" in header:
            wire.check(header, shards=wire.INTS)
        if "step" in header:
            wire.check(header, step=int)
        return header, payload

    def _welcome(self, header: dict, payload: bytearray) -> tuple[int, bytearray] | None:
        if header["op"] == "stop":
            self.stop = True
            raise Lost("the run is stopping")
        self.shards = header.get("shards", [])
        if header["op"] == "state":
            return wire.check(header, step=int)["step"], payload
        if header["op"] != "welcome":
            raise Lost(f"a {header['op']!r} message where a welcome or the state was due")
        return None if header.get("source") else (-1, payload)

    def receive_state(self) -> tuple[int, bytearray] | None:
        """(step, the train state's bytes) from a live member when the hub hands it over; None: no
        live member holds the state, so this process (rank 0) is its source after all."""
        return self._welcome(*self._receive())

    def reduce(self, step: int, partials: dict[int, list[np.ndarray]],
               compute: Callable[[int], list[np.ndarray]]) -> tuple[bytearray, bool]:
        """Send this process's shard sums of `step`, compute more shards when asked (a member was
        lost), return (the total's bytes, donate: send the state after this step)."""
        for shard, arrays in partials.items():
            self._partial(step, shard, arrays)
        while True:
            header, payload = self._receive()
            op = header["op"]
            if op in ("also", "total"):
                wire.check(header, step=int, shards=wire.INTS)
            if op == "also" and header["step"] == step:
                for shard in header["shards"]:
                    self._partial(step, shard, compute(shard))
            elif op == "total" and header["step"] == step:
                self.shards = header["shards"]
                self.stop = bool(header.get("stop"))
                return payload, bool(header.get("donate"))
            elif op == "stop":
                self.stop = True
                raise Lost("the run is stopping")

    def _partial(self, step: int, shard: int, arrays: Sequence[np.ndarray]) -> None:
        layout = [(np.dtype(a.dtype).str, int(np.size(a))) for a in arrays]
        send(self.sock, {"op": "partial", "step": step, "shard": shard, "layout": layout}, pack(arrays))

    def send_state(self, step: int, arrays: Sequence[np.ndarray]) -> None:
        send(self.sock, {"op": "state", "step": step}, pack(arrays))

    def ask_stop(self) -> None:
        if not self.stop_asked and self.sock is not None:
            self.stop_asked = True
            try:
                send(self.sock, {"op": "stop"})
            except Lost:
                pass  # the hub is gone: the next step finds out

    def close(self, finished: bool = False) -> None:
        if self.sock is not None:
            if finished:
                try:
                    send(self.sock, {"op": "bye"})
                except Lost:
                    pass
            self.sock.close()
            self.sock = None


def from_env(environ: dict | None = None) -> Any:
    """The Member `jaxdp.launch --elastic` set up in this process's environment, or None."""
    environ = os.environ if environ is None else environ
    from jaxdp.cluster import ft
    if environ.get(ft.ENV_LIGHTHOUSE):  # an elastic run on torchft (jaxdp/cluster/ft.py)
        return ft.from_env(environ)
    address = environ.get(ENV_ADDRESS)
    if not address:
        return None
    return Member(address, int(environ[ENV_RANK]), int(environ[ENV_SIZE]))
