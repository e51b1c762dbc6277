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
not detected: the others wait for it, like a plain run waits for a stalled peer, until it
resumes or is killed.

Wire: every message is a 4-byte big-endian length, a JSON header of that length, then the header's
"nbytes" bytes of payload (arrays as raw bytes, in an order both sides know). The ops:

    process -> launcher: hello {rank}; partial {step, shard} + arrays; state {step} + the train
                         state; stop {} (a preemption signal arrived here)
    launcher -> process: welcome {source}; also {step, shards}; total {step, shards, donate,
                         stop} + arrays; state {step, shards} + the train state; stop {}

This module holds no JAX: the launcher imports it. The step that uses `Member` is
`jaxdp.step.train_step.make_elastic_step`.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import struct
from typing import Any, Callable, Sequence

import numpy as np

ENV_ADDRESS = "JAXDP_ELASTIC"        # HOST:PORT of the launcher's hub; set: this process is a member
ENV_RANK = "JAXDP_ELASTIC_RANK"
ENV_SIZE = "JAXDP_ELASTIC_SIZE"
READ_TIMEOUT_S = 30.0  # the rest of a message whose header has arrived (a member killed mid-send closes at once)


class Lost(ConnectionError):
    """The other end closed (or never finished a message)."""


# ---------------------------------------------------------------------------------------------
# The wire
# ---------------------------------------------------------------------------------------------


def send(sock: socket.socket, header: dict, payload: Sequence[Any] = ()) -> None:
    """One message: `header` (JSON) and the raw bytes of `payload` (buffers, concatenated)."""
    views = [memoryview(np.ascontiguousarray(p)).cast("B") if isinstance(p, np.ndarray) else memoryview(p)
             for p in payload]
    head = json.dumps({**header, "nbytes": sum(v.nbytes for v in views)}).encode()
    sock.sendall(struct.pack(">I", len(head)) + head)
    for view in views:
        sock.sendall(view)


def _exactly(sock: socket.socket, n: int) -> bytearray:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise Lost("closed")
        got += k
    return out


def receive(sock: socket.socket) -> tuple[dict, bytearray]:
    """(header, payload bytes) of the next message; Lost if the other end is gone."""
    try:
        (size,) = struct.unpack(">I", _exactly(sock, 4))
        header = json.loads(bytes(_exactly(sock, size)))
        return header, _exactly(sock, header.get("nbytes", 0))
    except (OSError, ValueError) as err:
        raise Lost(str(err)) from None


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


# ---------------------------------------------------------------------------------------------
# The hub (in the launcher)
# ---------------------------------------------------------------------------------------------


class Hub:
    """The launcher's end: members, who computes which shard, the per-step sums, state hand-overs.

    Single-threaded: the launcher's loop calls `watch(selector)` once and `ready(key)` for every
    ready socket it registered. `events` collects lines for the launcher to print.
    """

    def __init__(self, size: int, host: str = "127.0.0.1"):
        self.size = size
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.conns: dict[int, socket.socket] = {}      # rank -> its live member's connection
        self.holders: set[int] = set()                 # ranks whose member holds the train state
        self.waiting: list[int] = []                   # joined, waiting for the state (in arrival order)
        self.owner: dict[int, int] = {}                # shard -> the rank that computes it (holders only)
        self.step: int | None = None                   # the step being summed (None: no holder yet)
        self.partials: dict[int, bytearray] = {}       # shard -> its sum for `step`
        self.layout: list[tuple[str, int]] = []        # (dtype, count) of each array of a partial
        self.donor: tuple[int, list[int]] | None = None  # (rank, [joiners]) asked to send the state
        self.stopping = False
        self.finished = False                          # a total with stop was sent, or the run ended
        self.events: list[str] = []
        self._selector: selectors.BaseSelector | None = None

    def watch(self, selector: selectors.BaseSelector) -> None:
        self._selector = selector
        selector.register(self.listener, selectors.EVENT_READ, ("hub", None))

    def close(self) -> None:
        for conn in list(self.conns.values()):
            conn.close()
        self.listener.close()

    def request_stop(self) -> None:
        """Stop every member after the step in flight (a preemption signal reached the launcher)."""
        self.stopping = True
        if not self.holders:  # nobody is stepping: tell those waiting now
            for rank in list(self.waiting):
                self._send(rank, {"op": "stop"})

    # -- events from the sockets ----------------------------------------------------------------

    def ready(self, data: tuple[str, int | None]) -> None:
        kind, rank = data
        if kind == "hub":
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            self._register(conn, None)
            return
        conn = self.conns.get(rank) if rank is not None else None
        if conn is None:
            return
        try:
            conn.settimeout(READ_TIMEOUT_S)
            header, payload = receive(conn)
        except Lost:
            self.lost(rank)
            return
        self._handle(rank, header, payload)

    def _register(self, conn: socket.socket, rank: int | None) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(READ_TIMEOUT_S)
        try:
            header, _ = receive(conn)  # hello, sent at once after connecting
        except Lost:
            conn.close()
            return
        rank = header.get("rank")
        if header.get("op") != "hello" or not isinstance(rank, int) or not 0 <= rank < self.size:
            conn.close()
            return
        if rank in self.conns:  # a restarted member of a rank whose old connection has not closed yet
            self.lost(rank)
        self.conns[rank] = conn
        if self._selector is not None:
            self._selector.register(conn, selectors.EVENT_READ, ("member", rank))
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
        self.step, self.donor = None, None
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
            step, shard = header["step"], header["shard"]
            if self.step is None:
                self.step = step  # the source's first step: its restored position
            if step != self.step or self.owner.get(shard) != rank:
                return  # a stale partial (from before a reassignment): the new owner sends it
            self.partials[shard] = payload
            self.layout = [(str(d), int(c)) for d, c in header["layout"]]
            if len(self.partials) == self.size:
                self._total()
        elif op == "state" and self.donor is not None and self.donor[0] == rank:
            _, joiners = self.donor
            self.donor = None
            for joiner in joiners:
                if joiner in self.conns:
                    self.holders.add(joiner)
                    self._send(joiner, {"op": "state", "step": header["step"], "shards": self._shards(joiner)},
                               [payload])

    def _total(self) -> None:
        layout = self.layout
        total = [np.zeros(count, dtype) for dtype, count in layout]
        for shard in range(self.size):  # in shard order: the same sum whoever computed each
            for acc, part in zip(total, unpack(self.partials[shard], [((count,), dtype) for dtype, count in layout])):
                acc += part
        self.partials.clear()
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
        except OSError:
            self.lost(rank)

    # -- a member gone ---------------------------------------------------------------------------

    def _drop(self, rank: int) -> bool:
        conn = self.conns.pop(rank, None)
        if conn is None:
            return False
        if self._selector is not None:
            try:
                self._selector.unregister(conn)
            except (KeyError, ValueError):
                pass
        conn.close()
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
            self.step, self.owner, self.donor = None, {}, None
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
        self.events.append(f"rank {rank} lost at step {self.step}: its shards {orphans} go to "
                           + ", ".join(f"rank {r}" for r in sorted({self.owner[s] for s in orphans})))
        for heir, shards in asked.items():
            self._send(heir, {"op": "also", "step": self.step, "shards": shards})


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
        send(self.sock, {"op": "hello", "rank": self.rank, "pid": os.getpid()})
        return self._welcome(*receive(self.sock)) is None

    def _welcome(self, header: dict, payload: bytearray) -> tuple[int, bytearray] | None:
        if header["op"] == "stop":
            self.stop = True
            raise Lost("the run is stopping")
        self.shards = header.get("shards", [])
        if header["op"] == "state":
            return header["step"], payload
        return None if header.get("source") else (-1, payload)

    def receive_state(self) -> tuple[int, bytearray] | None:
        """(step, the train state's bytes) from a live member when the hub hands it over; None: no
        live member holds the state, so this process (rank 0) is its source after all."""
        return self._welcome(*receive(self.sock))

    def reduce(self, step: int, partials: dict[int, list[np.ndarray]],
               compute: Callable[[int], list[np.ndarray]]) -> tuple[bytearray, bool]:
        """Send this process's shard sums of `step`, compute more shards when asked (a member was
        lost), return (the total's bytes, donate: send the state after this step)."""
        for shard, arrays in partials.items():
            self._partial(step, shard, arrays)
        while True:
            header, payload = receive(self.sock)
            op = header["op"]
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
            send(self.sock, {"op": "stop"})

    def close(self, finished: bool = False) -> None:
        if self.sock is not None:
            if finished:
                try:
                    send(self.sock, {"op": "bye"})
                except OSError:
                    pass
            self.sock.close()
            self.sock = None


def from_env(environ: dict | None = None) -> Member | None:
    """The Member `jaxdp.launch --elastic` set up in this process's environment, or None."""
    environ = os.environ if environ is None else environ
    address = environ.get(ENV_ADDRESS)
    if not address:
        return None
    return Member(address, int(environ[ENV_RANK]), int(environ[ENV_SIZE]))
