"""Admission to a run: process 0 lets in exactly the other processes of its own run.

JAX's coordinator admits any process that names a free task number, so a process of a second run
started on a running run's coordinator address (a copied command, a SLURM port collision) used to
register with the running run, and JAX aborted both of that run's processes. So before any process
reaches JAX's coordinator it asks process 0, on the port after the coordinator's
(`jaxdp.cluster.detect.handshake_port`), with one jaxdp/cluster/wire.py message (a JSON object, no payload):

    {"jaxdp": 2, "run": RUN_ID, "process": I, "processes": N}

and process 0 answers `{"ok": true}` or `{"ok": false, "why": SENTENCE}`. Process 0 admits each
process number 1..N-1 once, of its own run id and count; once all N-1 are in, the run is formed and
it refuses everyone else for as long as it runs. A refused process exits 2 with the sentence; the
running run never hears of it. The run id comes from `jaxdp.cluster.detect.run_id` ($JAXDP_RUN_ID, SLURM's
job and step ids); without one, only the process numbers and the count are checked, which still
keeps every newcomer out of a formed run.

No JAX here: `Admission` (process 0) and `join` (the others) are plain sockets and threads.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import threading
import time

from jaxdp.cluster import wire
from jaxdp.cluster.detect import parse_address
from jaxdp.config import ConfigError

PROTOCOL = 2           # 2: jaxdp/cluster/wire.py's framing (1: a line of JSON)
READ_TIMEOUT_S = 5.0   # how long process 0 waits for a connection's hello
RETRY_S = 0.1          # how often a process retries while process 0 is not listening yet
ENV_BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"  # JAX's own variable: where the coordinator listens


class Admission:
    """Process 0's side: listens on (host, port) from construction on, answers in a thread."""

    def __init__(self, host: str | None, port: int, run_id: str, num_processes: int, coordinator: str):
        self.run_id, self.num_processes, self.coordinator = run_id, num_processes, coordinator
        self.admitted: set[int] = set()
        self.refused = 0
        self._lock = threading.Lock()
        try:
            if host is None:  # every interface, as JAX's coordinator listens by default
                dual = socket.has_dualstack_ipv6()
                self.server = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                                   dualstack_ipv6=dual)
            else:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                self.server = socket.create_server((host, port), family=family)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} is already in use on this machine: jaxdp's run handshake uses the port "
                                  f"after the coordinator's ({coordinator}), so another run (or program) has it; "
                                  f"pick a coordinator port whose next port is free too") from None
            raise

    @property
    def formed(self) -> bool:
        with self._lock:
            return len(self.admitted) == self.num_processes - 1

    def start(self) -> "Admission":
        threading.Thread(target=self._serve, name="jaxdp-handshake", daemon=True).start()
        return self

    def close(self) -> None:
        self.server.close()

    def decide(self, hello: dict | None) -> str | None:
        """None to admit the process `hello` describes (None: not a handshake), else the sentence
        that refuses it."""
        mine = _named(self.run_id)
        if not isinstance(hello, dict) or hello.get("jaxdp") != PROTOCOL:
            return "it speaks another handshake version (a different jaxdp?)"
        run, process, count = hello.get("run"), hello.get("process"), hello.get("processes")
        try:
            wire.check(hello, run=str, process=int, processes=int)
        except wire.ProtocolError:
            return "the handshake was malformed"
        if run != self.run_id:
            return (f"it belongs to another run ({mine}; this process is of {_named(run)}); two runs cannot "
                    f"share a coordinator address: give this run another port")
        if count != self.num_processes:
            return (f"it runs {self.num_processes} processes but this one was started as one of {count}; "
                    f"start every process with the same process count")
        with self._lock:
            if len(self.admitted) == self.num_processes - 1:
                return (f"its run ({mine}) is running with all of its {self.num_processes} processes, and this "
                        f"process {process} is not one of them (another run on the same coordinator address?): "
                        f"give this run another port")
            if not 0 < process < self.num_processes:
                return f"it runs processes 0..{self.num_processes - 1}; this is process {process}"
            if process in self.admitted:
                return f"its process {process} has joined already ({mine}); was process {process} started twice?"
            self.admitted.add(process)
        return None

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    hello, _ = wire.receive(conn, timeout=READ_TIMEOUT_S)
                except wire.ProtocolError as err:
                    if err.quiet:
                        continue  # a visitor that left, or never spoke: nothing to answer
                    hello = None  # something else (a port scanner, a browser): refused
                why = self.decide(hello)
                if why is not None:
                    self.refused += 1
                try:
                    wire.send(conn, {"ok": True} if why is None else {"ok": False, "why": why})
                except wire.ProtocolError:
                    pass  # it left


def join(coordinator: str, port: int, run_id: str, process_id: int, num_processes: int, timeout_s: float) -> None:
    """Ask process 0 (of the run whose coordinator is `coordinator`, HOST:PORT) on `port` of its host
    to admit this process; retried while nothing listens there.

    ConfigError with process 0's sentence if it refuses (or something else answers on that port);
    TimeoutError if process 0 does not answer within `timeout_s`."""
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    hello = {"jaxdp": PROTOCOL, "run": run_id, "process": process_id, "processes": num_processes}
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"process 0 did not answer on {host}:{port} within {timeout_s} s")
        try:
            with socket.create_connection((host, port), timeout=min(left, READ_TIMEOUT_S * 2)) as link:
                wire.send(link, hello)
                answer, _ = wire.receive(link, timeout=min(left, READ_TIMEOUT_S * 2))
                ok, why = wire.check(answer, ok=bool)["ok"], answer.get("why", "")
        except wire.ProtocolError as err:
            if err.quiet:  # process 0 went away, or did not answer in time: try again until the deadline
                time.sleep(RETRY_S)
                continue
            raise ConfigError(f"port {port} on {host} answered, but not as jaxdp's run handshake (which uses the "
                              f"port after the coordinator's); another program has it: pick another port") from None
        except OSError:
            time.sleep(RETRY_S)  # process 0 is not listening yet: nothing to wait on but time
            continue
        if not ok:
            raise ConfigError(f"process 0 at {coordinator} refused this process: {why}")
        return


def _named(run_id: str) -> str:
    return f"run id {run_id!r}" if run_id else "no run id"


def bind_host(address: str, environ=os.environ) -> str | None:
    """Where process 0's coordinator (and handshake) should listen for `address` (HOST:PORT); None
    for every interface.

    The host of $JAX_COORDINATOR_BIND_ADDRESS where set (JAX's own variable); an announced loopback
    address (127.0.0.1, ::1, localhost) itself, for every process of such a run is on this machine;
    the address `HOST` resolves to here if it is one of this machine's and not a loopback one (a
    host name that resolves to 127.0.1.1 here, as Debian's /etc/hosts has it, is reached by other
    machines on another address); else None.
    """
    if environ.get(ENV_BIND_ADDRESS):
        host, _ = parse_address(environ[ENV_BIND_ADDRESS], ENV_BIND_ADDRESS)
        return None if host in ("::", "0.0.0.0", "") else host
    host, port = parse_address(address)
    try:
        resolved = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0].split("%")[0]
    except OSError:
        return None
    if ipaddress.ip_address(resolved).is_loopback:
        literal = host == "localhost" or _is_ip(host)
        return resolved if literal else None
    try:
        with socket.socket(socket.AF_INET6 if ":" in resolved else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((resolved, 0))
    except OSError:
        return None  # not an address of this machine (a NAT, a container's port mapping)
    return resolved


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
