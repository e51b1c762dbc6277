"""The launchers of a multi-node run: one per node, in a star around node 0's, for the whole run.

    python -m jaxdp.launch --nnodes 2 --node-rank 0 --coordinator node0:29400 --nproc-per-node 4 -- CMD
    python -m jaxdp.launch --nnodes 2 --node-rank 1 --coordinator node0:29400 --nproc-per-node 4 -- CMD

Node 0's launcher (the leader) listens on the --coordinator address; every other launcher connects
to it and stays connected. They talk in jaxdp/cluster/wire.py's messages (a JSON object each, no payload):

    node -> leader   {"hello": 2, "node": R, "nnodes": N, "nproc": P}    answered {"welcome": true} or {"refused": why}
    leader -> nodes  {"start": K, "run": RUN_ID}                         start your processes of attempt K
    any -> any       {"signal": S}                                       a launcher got SIGTERM (...): forward it
    node -> leader   {"ended": K, "kind": ..., "process": I, "code": C}  my processes of attempt K ended (or one failed)
    leader -> nodes  {"stop": K}                                         stop yours: one failed elsewhere
    leader -> nodes  {"decision": "restart" | "exit", "code": C, "line": ...}

The leader decides alone, from every node's outcome, exactly as a single-node launcher decides from
its own. A launcher whose peer launcher disappears (its connection closes, or sends something that
is not one of these messages) stops its processes. No JAX here.
"""

from __future__ import annotations

import selectors
import socket
import time

from jaxdp.cluster import wire
from jaxdp.cluster.detect import parse_address
from jaxdp.cluster.handshake import bind_host

PROTOCOL = 2          # 2: jaxdp/cluster/wire.py's framing (1: lines of JSON)
RETRY_S = 0.2
READ_TIMEOUT_S = 5.0  # a hello, or its answer


FIELDS = {"hello": int, "node": int, "nnodes": int, "nproc": int, "start": int, "run": str, "signal": int,
          "ended": int, "kind": str, "process": (int, type(None)), "code": int, "stop": int, "decision": str,
          "line": (str, type(None))}  # every field's type (a message with another is not one of ours)


class Link:
    """One launcher-to-launcher connection: messages out, and complete messages in without blocking."""

    def __init__(self, conn: socket.socket, node: int | None = None):
        self.conn, self.node, self.closed = conn, node, False
        self.reader = wire.Reader()
        conn.setblocking(False)

    def send(self, message: dict) -> None:
        if self.closed:
            return
        self.conn.setblocking(True)
        try:
            wire.send(self.conn, message)
        except wire.ProtocolError:
            self.closed = True
        finally:
            self.conn.setblocking(False)

    def messages(self) -> list[dict]:
        """Whatever complete messages have arrived (the connection may have closed, or sent
        something that is not one of ours: `closed`)."""
        out = []
        while not self.closed:
            try:
                got = self.reader.read(self.conn)
            except wire.ProtocolError:
                self.closed = True
                break
            if not got:
                break
            for header, _ in got:
                if not all(isinstance(header[k], FIELDS[k]) for k in header if k in FIELDS):
                    self.closed = True  # not one of ours
                    break
                out.append(header)
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
            try:
                hello, _ = wire.receive(conn, timeout=READ_TIMEOUT_S)
            except wire.ProtocolError:
                conn.close()
                continue
            why = self.refusal(hello)
            try:
                wire.send(conn, {"refused": why} if why else {"welcome": True})
            except wire.ProtocolError:
                why = "gone"
            if why:
                conn.close()
            else:
                self.links[hello["node"]] = Link(conn, hello["node"])

    def refusal(self, hello: dict) -> str | None:
        node = hello.get("node")
        if hello.get("hello") != PROTOCOL or not isinstance(node, int) or isinstance(node, bool):
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
            wire.send(conn, hello)
            answer, _ = wire.receive(conn, timeout=READ_TIMEOUT_S)  # (exactly the answer: node 0's orders follow it)
        except wire.ProtocolError:
            conn.close()
            time.sleep(RETRY_S)
            continue
        if answer.get("welcome") is True:
            return Link(conn, 0)
        conn.close()
        return Refused(f"node 0's launcher at {coordinator} refused this one: {answer.get('refused')}")
    return None

