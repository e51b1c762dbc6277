"""The launchers of a multi-node run: one per node, in a star around node 0's, for the whole run.

    python -m jaxdp.launch --nnodes 2 --node-rank 0 --coordinator node0:29400 --nproc-per-node 4 -- CMD
    python -m jaxdp.launch --nnodes 2 --node-rank 1 --coordinator node0:29400 --nproc-per-node 4 -- CMD

Node 0's launcher (the leader) listens on the --coordinator address; every other launcher connects
to it and stays connected. They talk in lines of JSON:

    node -> leader   {"hello": 1, "node": R, "nnodes": N, "nproc": P}    answered {"welcome": true} or {"refused": why}
    leader -> nodes  {"start": K, "run": RUN_ID}                         start your processes of attempt K
    any -> any       {"signal": S}                                       a launcher got SIGTERM (...): forward it
    node -> leader   {"ended": K, "kind": ..., "process": I, "code": C}  my processes of attempt K ended (or one failed)
    leader -> nodes  {"stop": K}                                         stop yours: one failed elsewhere
    leader -> nodes  {"decision": "restart" | "exit", "code": C, "line": ...}

The leader decides alone, from every node's outcome, exactly as a single-node launcher decides from
its own. A launcher whose peer launcher disappears (its connection closes) stops its processes.
No JAX here.
"""

from __future__ import annotations

import json
import selectors
import socket
import time

from jaxdp.cluster.detect import parse_address
from jaxdp.cluster.handshake import bind_host

PROTOCOL = 1
RETRY_S = 0.2


class Link:
    """One launcher-to-launcher connection: JSON lines out, and complete lines in without blocking."""

    def __init__(self, conn: socket.socket, node: int | None = None, buffer: bytes = b""):
        self.conn, self.node, self.buffer, self.closed = conn, node, buffer, False
        conn.setblocking(False)

    def send(self, message: dict) -> None:
        if self.closed:
            return
        self.conn.setblocking(True)
        try:
            self.conn.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            self.closed = True
        finally:
            self.conn.setblocking(False)

    def messages(self) -> list[dict]:
        """Whatever complete messages have arrived (the connection may have closed: `closed`)."""
        while not self.closed:
            try:
                data = self.conn.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            self.buffer += data
        out = []
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            try:
                out.append(json.loads(line))
            except ValueError:
                self.closed = True  # not one of ours
        return out

    def close(self) -> None:
        self.closed = True
        self.conn.close()


class Leader:
    """Node 0's side: the listening socket and a link to every other node's launcher."""

    def __init__(self, coordinator: str, nnodes: int, nproc: int):
        host, port = parse_address(coordinator, "--coordinator")
        where = bind_host(coordinator)
        if where is None:
            dual = socket.has_dualstack_ipv6()
            self.server = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                               dualstack_ipv6=dual)
        else:
            self.server = socket.create_server((where, port), family=socket.AF_INET6 if ":" in where else socket.AF_INET)
        self.server.setblocking(False)
        self.nnodes, self.nproc = nnodes, nproc
        self.links: dict[int, Link] = {}

    def gather(self, timeout_s: float) -> list[int]:
        """Wait until every node's launcher has joined; the nodes still missing at the deadline."""
        deadline = time.monotonic() + timeout_s
        selector = selectors.DefaultSelector()
        selector.register(self.server, selectors.EVENT_READ)
        while len(self.links) < self.nnodes - 1 and time.monotonic() < deadline:
            if selector.select(timeout=min(0.2, max(0.0, deadline - time.monotonic()))):
                self.admit()
        selector.close()
        return sorted(set(range(1, self.nnodes)) - set(self.links))

    def admit(self) -> None:
        """Answer every launcher waiting to connect: welcome one that fills a free node rank, refuse the rest."""
        while True:
            try:
                conn, _ = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.settimeout(5.0)
            try:
                hello = json.loads(_read_line(conn)[0])
            except (OSError, ValueError):
                conn.close()
                continue
            why = self.refusal(hello)
            try:
                conn.sendall((json.dumps({"refused": why} if why else {"welcome": True}) + "\n").encode())
            except OSError:
                why = "gone"
            if why:
                conn.close()
            else:
                self.links[hello["node"]] = Link(conn, hello["node"])

    def refusal(self, hello: dict) -> str | None:
        node = hello.get("node") if isinstance(hello, dict) else None
        if not isinstance(hello, dict) or hello.get("hello") != PROTOCOL or not isinstance(node, int):
            return "not a jaxdp launcher of this version"
        if (hello.get("nnodes"), hello.get("nproc")) != (self.nnodes, self.nproc):
            return (f"node 0 runs --nnodes {self.nnodes} --nproc-per-node {self.nproc}, this launcher "
                    f"--nnodes {hello.get('nnodes')} --nproc-per-node {hello.get('nproc')}; give every node the same")
        if not 0 < node < self.nnodes:
            return f"--node-rank {node} is not between 1 and --nnodes - 1 = {self.nnodes - 1}"
        if node in self.links:
            return f"node {node} has joined already (two launchers with --node-rank {node}?)"
        return None

    def broadcast(self, message: dict, but: int | None = None) -> None:
        for node, link in self.links.items():
            if node != but:
                link.send(message)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.server.close()


class Refused(str):
    """Node 0's launcher refused this one: the sentence that says why."""


def join(coordinator: str, node: int, nnodes: int, nproc: int, timeout_s: float) -> Link | Refused | None:
    """Connect to node 0's launcher: the link, Refused(why), or None if it did not answer in time."""
    host, port = parse_address(coordinator, "--coordinator")
    hello = {"hello": PROTOCOL, "node": node, "nnodes": nnodes, "nproc": nproc}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection((host, port), timeout=5.0)
        except OSError:
            time.sleep(RETRY_S)  # node 0's launcher is not listening yet
            continue
        try:
            conn.sendall((json.dumps(hello) + "\n").encode())
            line, rest = _read_line(conn)  # node 0 may have sent its first order right after the welcome
            answer = json.loads(line)
        except (OSError, ValueError):
            conn.close()
            time.sleep(RETRY_S)
            continue
        if isinstance(answer, dict) and answer.get("welcome"):
            return Link(conn, 0, rest)
        if not isinstance(answer, dict):
            answer = {"refused": "it is not a jaxdp launcher"}
        conn.close()
        return Refused(f"node 0's launcher at {coordinator} refused this one: {answer.get('refused')}")
    return None


def _read_line(conn: socket.socket) -> tuple[bytes, bytes]:
    """The first line on `conn`, and whatever arrived after it."""
    data = b""
    while b"\n" not in data and len(data) < 65536:
        more = conn.recv(4096)
        if not more:
            break
        data += more
    line, _, rest = data.partition(b"\n")
    return line, rest
