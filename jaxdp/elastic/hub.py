"""Elastic runs on the launcher's hub: a lost process is restarted alone while the others train on
(`jaxdp.launch --elastic`, one node, no torch).

    python -m jaxdp.launch --elastic --nproc-per-node 2 --max-restarts 100 -- \\
        python -m jaxdp.train --strategy host --devices 1 --checkpoint-dir ckpt --save-every 100

Why not through JAX: `jax.distributed.initialize` fixes the set of processes for the life of every
process (the coordination service, gloo's and NCCL's communicators all assume it), and XLA's
collectives have no way to leave a dead peer out. So a plain multi-process run that loses one
process must stop every process and restart all of them from the last checkpoint (what
`jaxdp.launch --max-restarts` does, like torchrun): every kill costs every process's start-up and
the steps since the last save. An elastic run keeps JAX inside each process (every process is a
one-process JAX program over its own devices) and exchanges across processes on the host, through a
transport whose membership can change at any step.

Who averages across workers is one seam, the engine (`HubEngine` here, `ft.TorchftEngine` on
torchft): a quorum (who takes part; a worker that is behind gets a live peer's state there), an
all-gather of one byte piece per member, and a commit (whether this quorum's exchanges all went
through). The update rules are written once against it (jaxdp/elastic/every_step.py, rounds.py,
timed.py, overlap.py), so every rule runs on either engine.

The hub (`jaxdp.launcher.hub.Hub`, inside the launcher) is that seam over localhost sockets:

* quorum: every member of the last quorum asks (the rules take one at the same step, from what
  every worker's rows said); joiners that asked meanwhile are let in. The furthest member's state
  goes to the members behind (a new or restarted process: no checkpoint is read). At the start the
  hub waits for every rank up to JOIN_TIMEOUT_S.
* all-gather: every member's piece, in rank order, to every member; a member lost or stalled before
  its piece fails this exchange and every later one of its quorum (`commit` says False, and the rule
  does the step again over a new quorum).

Wire: jaxdp/cluster/wire.py's messages (a JSON header, raw bytes after it).

    member -> hub: hello {rank, pid}; timeout {seconds}; quorum {step}; state {} + its state's bytes;
                   gather {index} + a piece; bye {}
    hub -> member: quorum {members, heal, donate} (+ the state, healing); gathered {count} + the
                   pieces; failed {}; stop {}; ended {}

The hub reads every connection without blocking (`wire.Reader`), so a connection that sends half a
message or nothing stalls no one. A connection that sends something that is not one of these
messages is dropped with one line naming it (a member's counts as lost); one that sends no hello
within the stall timeout is dropped too. A member that owes its quorum or its piece `stall_timeout`
seconds (the members' --stall-timeout) after another member sent its own is left out and named as
stalled; the launcher kills it, and restarts it as a lost one. A preemption signal to the launcher
reaches every member as `stop` (its next row asks every worker to stop after the same step); a
member whose hub goes away stops with the state it holds (the lead saves it; exit 75).

This module holds no JAX: the launcher imports it.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Sequence

import numpy as np

from jaxdp.cluster import wire

ENV_ADDRESS = "JAXDP_ELASTIC"        # HOST:PORT of the launcher's hub; set: this process is a member
ENV_RANK = "JAXDP_ELASTIC_RANK"
ENV_SIZE = "JAXDP_ELASTIC_SIZE"
ENV_RESTART = "JAXDP_ELASTIC_RESTART"  # set: a restarted member (it says hello once it has compiled)
READ_TIMEOUT_S = 30.0     # a member: the rest of a message whose first bytes have arrived (the hub closing is seen at once)
STALL_TIMEOUT_S = 20.0    # the hub's, until a member's hello says its --stall-timeout

Lost = wire.ProtocolError  # the other end closed, or sent something that is not one of our messages


class QuorumLost(Exception):
    """No quorum: the engine's coordinator (the hub, or torchft's Lighthouse) is gone (`gone`), or too few
    live workers for --quorum-timeout, or the run is stopping (`ended`)."""

    gone = False
    ended = False


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


# ---------------------------------------------------------------------------------------------
# A member's engine (in each training process)
# ---------------------------------------------------------------------------------------------


class HubEngine:
    """The engine (jaxdp/elastic/engine.py) on the launcher's hub."""

    def __init__(self, address: str, rank: int):
        host, port = address.rsplit(":", 1)
        self.rank, self.address = rank, address
        self.members: list = []         # (torchft's: the members' replica ids; none here, no flags compared)
        self.on_quorum: Callable[[], None] | None = None  # called after each quorum (the member's `agree`)
        self.on_stop: Callable[[], None] | None = None    # called when the launcher asks the run to stop
        self._ranks: list[int] = []     # the last quorum's ranks
        self._healing = False           # healed in the last quorum: it sits this quorum's first exchange out
        self._errored = False           # an exchange of this quorum failed
        self._gathers = 0               # exchanges so far in this quorum
        self._state_fn: Callable[[], bytes] | None = None
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        send(self.sock, {"op": "hello", "rank": rank, "pid": os.getpid()})

    def _receive(self) -> tuple[dict, bytearray]:
        """The next message for this member; a `stop` on the way is passed on (`on_stop`)."""
        while True:
            header, payload = wire.receive(self.sock, timeout=READ_TIMEOUT_S, max_payload=wire.MAX_PAYLOAD, wait=True)
            if wire.check(header, op=str)["op"] != "stop":
                return header, payload
            if self.on_stop is not None:
                self.on_stop()

    def _lost(self, err: Exception) -> QuorumLost:
        lost = QuorumLost(str(err))
        lost.gone = True
        return lost

    def set_timeout(self, seconds: float) -> None:
        """The members' --stall-timeout, for the hub (a member that owes its part this long is left out)."""
        try:
            send(self.sock, {"op": "timeout", "seconds": float(seconds)})
        except Lost:
            pass  # the hub is gone: the first quorum finds out

    def quorum(self, step: int, state_fn: Callable[[], bytes] | None) -> bytes | None:
        self.begin(step, state_fn)
        return self.settled()

    def begin(self, step: int, state_fn: Callable[[], bytes] | None) -> None:
        """Ask for a quorum at `step` (`settled` waits for it); `state_fn` gives this member's state to one behind."""
        self._state_fn = state_fn
        try:
            send(self.sock, {"op": "quorum", "step": step})
        except Lost as err:
            raise self._lost(err) from None

    def settled(self) -> bytes | None:
        """The quorum `begin` asked for: the state's bytes if this member was behind and got them from a
        peer (it then sits this quorum's first exchange out: `participating` is False)."""
        try:
            header, payload = self._receive()
            if header["op"] == "ended":
                lost = QuorumLost("the run is stopping")
                lost.ended = True
                raise lost
            if header["op"] != "quorum":
                raise Lost(f"a {header['op']!r} message where a quorum was due")
            self._ranks = wire.check(header, members=wire.INTS)["members"]
            if header.get("donate"):
                send(self.sock, {"op": "state"}, [self._state_fn() if self._state_fn is not None else b""])
        except Lost as err:
            raise self._lost(err) from None
        self._healing, self._errored, self._gathers = bool(header.get("heal")), False, 0
        if self.on_quorum is not None:
            self.on_quorum()
        return bytes(payload) if self._healing else None

    def participating(self) -> bool:
        return not self._healing

    def participants(self) -> int:
        """How many members the last quorum has."""
        return len(self._ranks)

    def allgather(self, piece: np.ndarray) -> list[np.ndarray]:
        """Every member's `piece` (a uint8 array of one shape everywhere), in rank order; [] if this
        quorum's exchanges failed (a member lost or stalled: `commit` then says False)."""
        if self._errored:
            return []
        self._gathers += 1
        try:
            send(self.sock, {"op": "gather", "index": self._gathers}, [np.ascontiguousarray(piece)])
            header, payload = self._receive()
        except Lost:  # the hub is gone: the next quorum says so
            self._errored = True
            return []
        if header["op"] != "gathered":
            self._errored = True
            return []
        count = wire.check(header, count=int)["count"]
        pieces = np.frombuffer(payload, np.uint8)
        if count < 1 or pieces.size != count * piece.size:
            raise Lost(f"the hub's pieces are {pieces.size} bytes, not {count} of {piece.size}")
        return list(pieces.reshape((count, *piece.shape)))

    def commit(self) -> bool:
        """Whether this quorum's exchanges so far all went through (the hub sends every member's pieces to
        every member, or fails the exchange for all: no round trip needed to agree)."""
        self._healing = False
        return not self._errored and bool(self._ranks)

    def close(self, finished: bool = False) -> None:
        if self.sock is not None:
            if finished:
                try:
                    send(self.sock, {"op": "bye"})
                except Lost:
                    pass
            self.sock.close()
            self.sock = None
