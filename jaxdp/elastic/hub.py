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

This module holds no JAX: the launcher imports it. The hub is `jaxdp.launcher.hub.Hub`; the step
that uses `Member` is `jaxdp.elastic.every_step.make_elastic_step`.
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


def partial_layout(value: Any, payload: bytearray) -> list[tuple[str, int]]:
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
        self.alone = False       # (torchft's restarted rank 0 with no live worker: the hub always sends a state)

    kind = "hub"          # the engine's name, as --elastic-engine says it (jaxdp/sync/rules.py checks by it)
    lead_moves = False    # rank 0 leads for the whole run
    Gone = HubGone        # what a step raises when the hub went away (the loop stops with its state)

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

    def leaves(self, orphaned: bool) -> bool:
        """Never alone (jaxdp/elastic/ft.py's `leaves`): the hub is this worker's launcher, so a worker
        whose launcher is gone has lost the run's sum, and stops with the state it holds."""
        return False

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


def from_env(environ: dict | None = None, kind: type = None) -> Any:
    """The Member `jaxdp.launch --elastic` set up in this process's environment (a `kind`, Member or a
    subclass: jaxdp/elastic/workers.py), or None."""
    environ = os.environ if environ is None else environ
    from jaxdp.cluster.ft_env import ENV_LIGHTHOUSE

    if environ.get(ENV_LIGHTHOUSE):  # an elastic run on torchft: jaxdp.elastic.ft.from_env (train.py asks it)
        return None
    address = environ.get(ENV_ADDRESS)
    if not address:
        return None
    return (kind or Member)(address, int(environ[ENV_RANK]), int(environ[ENV_SIZE]))
