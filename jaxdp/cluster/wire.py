"""jaxdp's one socket framing: the launcher's elastic hub, the multi-node rendezvous and the run handshake.

A message is a 12-byte prefix, a JSON header, then an optional binary payload:

    >I  header length (1 .. MAX_HEADER bytes)
    >Q  payload length (0 .. the receiver's max_payload bytes)
    the header: UTF-8 JSON, always an object
    the payload: raw bytes (an elastic run's arrays; empty for every other message)

Everything a receiver cannot take (a closed connection, a length over its bound, a header that is
not a JSON object or lacks a field of the expected type, a message not complete within the
connection's read timeout) is one exception, `ProtocolError`; every caller handles it by dropping
that connection (a process never dies of what a peer sent). Two ways to read:

* `receive(sock, timeout=...)`: blocking, for the side that waits on one peer (an elastic member, a
  launcher joining node 0's, a process asking process 0 to admit it);
* `Reader`: bytes fed as they arrive on a non-blocking socket, complete messages out, for a side
  that serves many peers from one `selectors` loop (the elastic hub, node 0's launcher). It never
  waits, so a peer that sends half a message, or nothing, stalls no one; `Reader.waiting_s` says
  how long an incomplete message has gone without a byte, for the caller's timeout.

Why not `multiprocessing.connection` (with the run id as the auth key): its `Listener.accept` runs
the HMAC challenge as a blocking exchange (a connection that sends nothing holds the accepting loop
until the peer gives up), `recv_bytes` reads a whole message blocking, with no per-message deadline
and no way to feed it from a selector loop, its `recv` unpickles (code execution for whoever gets
past the key), and its messages carry one blob, not a header and a payload. The key would not keep
out anything our validation does not (every peer of the hub is a local process of the same user),
and the rendezvous's peers have no run id before they join. So: this small framing, standard
library only, no JAX.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any, Sequence

PREFIX = struct.Struct(">IQ")
MAX_HEADER = 64 * 1024        # every header of ours is far shorter
MAX_PAYLOAD = 1 << 40         # the elastic hub's bound (a train state); other users allow none
_CHUNK = 1 << 20


class ProtocolError(ConnectionError):
    """The peer closed, sent something that is not one of our messages, or did not finish one in
    time: drop that connection. `quiet`: it sent nothing wrong (it closed, or said nothing in time)."""

    def __init__(self, why: str, quiet: bool = False):
        super().__init__(why)
        self.quiet = quiet


def encode(header: dict, payload: Sequence[Any] = ()) -> tuple[bytes, list[memoryview]]:
    """(prefix + header bytes, the payload's buffers)."""
    if not isinstance(header, dict):
        raise TypeError(f"a header is a dict, not {type(header).__name__}")
    views = [memoryview(p).cast("B") for p in payload]
    head = json.dumps(header).encode()
    if len(head) > MAX_HEADER:
        raise ValueError(f"a header of {len(head)} bytes is over {MAX_HEADER}")
    return PREFIX.pack(len(head), sum(v.nbytes for v in views)) + head, views


def send(sock: socket.socket, header: dict, payload: Sequence[Any] = ()) -> None:
    """One message (payload: objects with the buffer protocol, contiguous, concatenated);
    ProtocolError if the connection fails."""
    head, views = encode(header, payload)
    try:
        sock.sendall(head)
        for view in views:
            sock.sendall(view)
    except OSError as err:
        raise ProtocolError(f"cannot send: {err}", quiet=True) from None


def _parse_prefix(data: bytes | bytearray | memoryview, max_payload: int) -> tuple[int, int]:
    head, body = PREFIX.unpack_from(data)
    if not 0 < head <= MAX_HEADER:
        raise ProtocolError(f"a header of {head} bytes (1 to {MAX_HEADER})")
    if body > max_payload:
        raise ProtocolError(f"a payload of {body} bytes (at most {max_payload})")
    return head, body


def _parse_header(data: bytes | bytearray | memoryview) -> dict:
    try:
        header = json.loads(bytes(data).decode())
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("the header is not JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"the header is a JSON {type(header).__name__}, not an object")
    return header


def receive(sock: socket.socket, *, timeout: float | None, max_payload: int = 0,
            wait: bool = False) -> tuple[dict, bytearray]:
    """(header, payload) of the next message on a blocking socket, within `timeout` seconds (None:
    no bound). `wait`: wait for the message to begin for as long as it takes; `timeout` then bounds
    the rest (a member waiting for the hub's next total)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    prefix = _exactly(sock, PREFIX.size, None if wait else deadline)
    if wait and timeout is not None:
        deadline = time.monotonic() + timeout
    head, body = _parse_prefix(prefix, max_payload)
    header = _parse_header(_exactly(sock, head, deadline))
    return header, _exactly(sock, body, deadline)


def _exactly(sock: socket.socket, n: int, deadline: float | None) -> bytearray:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise ProtocolError("no complete message within the read timeout", quiet=True)
        try:
            sock.settimeout(left)
            k = sock.recv_into(view[got:], min(n - got, _CHUNK))
        except socket.timeout:
            raise ProtocolError("no complete message within the read timeout", quiet=True) from None
        except OSError as err:
            raise ProtocolError(f"connection failed: {err}", quiet=True) from None
        if k == 0:
            if got == 0 and n == PREFIX.size:
                raise ProtocolError("closed", quiet=True)
            raise ProtocolError("closed in the middle of a message")
        got += k
    return out


class Reader:
    """Complete messages out of the bytes of one non-blocking connection."""

    def __init__(self, max_payload: int = 0):
        self.max_payload = max_payload
        self._buffer = bytearray()
        self._need: tuple[int, int] | None = None  # (header, payload) lengths of the message under way
        self._since: float | None = None           # when its last byte arrived (None: no message under way)

    def read(self, sock: socket.socket) -> list[tuple[dict, bytearray]]:
        """One recv (call it when the selector says readable): the messages it completed."""
        try:
            data = sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return []
        except OSError as err:
            raise ProtocolError(f"connection failed: {err}", quiet=True) from None
        if not data:
            if self._buffer:
                raise ProtocolError("closed in the middle of a message")
            raise ProtocolError("closed", quiet=True)
        return self.feed(data)

    def feed(self, data: bytes) -> list[tuple[dict, bytearray]]:
        self._buffer += data
        out = []
        while True:
            if self._need is None:
                if len(self._buffer) < PREFIX.size:
                    break
                self._need = _parse_prefix(self._buffer, self.max_payload)
            head, body = self._need
            end = PREFIX.size + head + body
            if len(self._buffer) < end:
                break
            header = _parse_header(memoryview(self._buffer)[PREFIX.size:PREFIX.size + head])
            out.append((header, self._buffer[PREFIX.size + head:end]))
            del self._buffer[:end]
            self._need = None
        self._since = time.monotonic() if self._buffer else None
        return out

    def waiting_s(self, now: float | None = None) -> float:
        """How long an incomplete message has gone without a byte (0: none is under way)."""
        return 0.0 if self._since is None else (time.monotonic() if now is None else now) - self._since


INTS = "list of int"  # a field type for `check`: a list of integers


def check(header: dict, **fields: Any) -> dict:
    """`header` if each named field is there with its type (a type, a tuple of types, or INTS);
    else ProtocolError naming the field. (bool is not an int here.)"""
    for name, kind in fields.items():
        value = header.get(name)
        if kind == INTS:
            good = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        else:
            good = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _types(kind))
        if not good:
            raise ProtocolError(f"field {name!r} of a {header.get('op', 'message')!r} message is "
                                f"{type(value).__name__ if name in header else 'missing'}, not {_named(kind)}")
    return header


def _types(kind: Any) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _named(kind: Any) -> str:
    return kind if isinstance(kind, str) else " or ".join(t.__name__ for t in _types(kind))
