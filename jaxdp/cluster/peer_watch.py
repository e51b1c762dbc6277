"""Lost peers: every process of a multi-process run keeps a TCP connection to process 0.

A connection only closes when its process ends. A connection that closes while the run is going
means that process died: every survivor prints one line naming it and exits with
`EXIT_PEER_LOST` within a second, instead of waiting forever inside a collective. Processes that
never arrive, or stop answering without closing the connection (a dead node), are caught by JAX's
own start-up wait and heartbeat, which `jaxdp.cluster.distributed.initialize` bounds with
--startup-timeout (arriving) and --peer-timeout (running).

Why a watch of our own: a gloo all-reduce whose peer was killed does not fail; the survivor waits
until JAX's heartbeat timeout, and then JAX's client aborts the process (SIGABRT, a C++ stack
trace). Its start-up timeout aborts the same way. A Python `missed_heartbeat_callback` is not
reachable through `jax.distributed`.
"""

from __future__ import annotations

import atexit
import selectors
import socket
import os
import sys
import threading
import time
from typing import Any

from jaxdp.cluster.detect import Cluster, parse_address
from jaxdp.errors import EXIT_PEER_LOST

_WATCH_KEY = "jaxdp/peer_watch"
_running = threading.Event()  # set while this process runs; cleared at exit, when links may close
_links: list[socket.socket] = []  # this process's connections: to every peer (process 0), or to process 0
_failing = threading.Lock()
_VERDICT = b"!"  # a line "!<message>" on a link: the sender found a stalled process (jaxdp/cluster/heartbeat.py)


def start(client: Any, cluster: Cluster, timeout_s: float, bind: str | None = None) -> None:
    """Connect the processes in a star around process 0 and watch the connections.

    A connection only closes when its process ends. Process 0 sees which peer closed and tells
    the others its number before it exits; a peer that sees process 0's connection close without
    a number knows process 0 itself is gone. At interpreter exit each process stops watching
    before JAX's shutdown barrier, so the connections close only after every process is done.
    Process 0 listens for them on `bind` (an address of this machine; None: every interface).
    """
    me, count = cluster.process_id, cluster.num_processes
    if me == 0:
        if bind is None:
            dual = socket.has_dualstack_ipv6()
            server = socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual)
        else:
            server = socket.create_server((bind, 0), family=socket.AF_INET6 if ":" in bind else socket.AF_INET)
        client.key_value_set(_WATCH_KEY, str(server.getsockname()[1]))
        server.settimeout(timeout_s)
        links: dict[int, socket.socket] = {}
        try:
            while len(links) < count - 1:
                conn, _ = server.accept()
                conn.settimeout(timeout_s)
                links[int(conn.recv(16).decode().strip())] = conn
        except (socket.timeout, ValueError):
            missing = sorted(set(range(1, count)) - set(links))
            fail(f"process(es) {missing} joined JAX but not the jaxdp peer watch within {timeout_s} s")
        finally:
            server.close()
        _links.extend(links.values())
        target = lambda: _watch_peers(links, count)  # noqa: E731
    else:
        host, _ = parse_address(cluster.coordinator_address)
        port = int(client.blocking_key_value_get(_WATCH_KEY, int(timeout_s * 1000)))
        link = socket.create_connection((host, port), timeout=timeout_s)
        link.sendall(f"{me}\n".encode())
        _links.append(link)
        target = lambda: _watch_coordinator(link, me, count)  # noqa: E731
    _running.set()
    atexit.register(_running.clear)  # runs before JAX's own exit handler (registered earlier)
    threading.Thread(target=target, name="jaxdp-peer-watch", daemon=True).start()


def wait_for_verdict(seconds: float = 3.0) -> None:
    """Sleep `seconds` if this process watches peers; call it before reporting an unexpected error.

    If a peer just died, the error here is most likely its echo (a gloo connection reset); within
    this grace period the watch exits with EXIT_PEER_LOST naming the process that died. A no-op
    unless this process watches peers."""
    if _running.is_set():
        time.sleep(seconds)


def _watch_peers(links: dict[int, socket.socket], count: int) -> None:
    """Process 0: wait for any peer's connection to close; tell the others which one."""
    selector = selectors.DefaultSelector()
    for process, conn in links.items():
        conn.setblocking(True)
        conn.settimeout(None)
        selector.register(conn, selectors.EVENT_READ, process)
    while True:
        for key, _ in selector.select():
            lost = key.data
            try:
                message = key.fileobj.recv(4096)
            except OSError:
                message = b""
            if message.startswith(_VERDICT) and _running.is_set():
                _stalled_verdict_from(key.fileobj, message, exclude=key.fileobj)
            if message:
                continue
            selector.unregister(key.fileobj)
            if not _running.is_set():
                continue
            for process, conn in links.items():
                if process != lost:
                    try:
                        conn.sendall(f"{lost}\n".encode())
                    except OSError:
                        pass
            _peer_lost(lost, 0, count)


def _watch_coordinator(link: socket.socket, me: int, count: int) -> None:
    """Any other process: process 0 sends the number of a lost peer, or its connection closes."""
    link.settimeout(None)
    try:
        message = link.recv(4096)
    except OSError:
        message = b""
    if message.startswith(_VERDICT) and _running.is_set():
        _stalled_verdict_from(link, message, exclude=link)
    if _running.is_set():
        lost = int(message.split()[0]) if message.strip() else 0
        _peer_lost(lost, me, count)


def _peer_lost(lost: int, me: int, count: int) -> None:
    what = "the coordinator, " if lost == 0 else ""
    fail(f"process {lost} ({what}one of {count}) stopped while process {me} was still running; "
         f"see process {lost}'s own output for why (crashed, killed, out of memory, node failure)")


def stalled(message: str, exclude: socket.socket | None = None) -> None:
    """A stalled process was found: tell every process this one is connected to, then exit.

    A stopped process that is continued later finds the verdict waiting on its connection and
    reports it, instead of blaming the peers that left while it was stopped."""
    for link in list(_links):
        if link is not exclude:
            try:
                link.setblocking(False)
                link.send(_VERDICT + message.encode() + b"\n")
            except OSError:
                pass
    fail(message)


def _stalled_verdict_from(link: socket.socket, first: bytes, exclude: socket.socket) -> None:
    """Read the rest of a "!<message>" line and pass the verdict on (process 0 to the others)."""
    data = first
    link.settimeout(1.0)
    try:
        while not data.endswith(b"\n"):
            more = link.recv(4096)
            if not more:
                break
            data += more
    except OSError:
        pass
    stalled(data[len(_VERDICT):].decode(errors="replace").strip(), exclude=exclude)


def fail(message: str) -> None:
    """Exit at once from any thread: the main thread may be blocked inside a collective."""
    _failing.acquire()  # one line only: a second thread that fails too waits here for the exit
    # One write with its newline (print writes the line and its end separately): the runtime's own
    # threads may log to the same stderr as the process goes down, and must not land mid-line.
    sys.stderr.write(f"jaxdp: error: {message} (exit code {EXIT_PEER_LOST})\n")
    sys.stderr.flush()
    os._exit(EXIT_PEER_LOST)
