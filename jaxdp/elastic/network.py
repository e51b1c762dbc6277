"""What a torchft worker shows the network (jaxdp/elastic/ft.py): the address it announces and binds
its store, its manager server and its checkpoint server to (loopback on one node, the interface that
reaches the Lighthouse across nodes), the replica ids that carry its address, its flags' prints and its
rank to every member of a quorum, and a state transfer that serves only the quorum's members.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any, Callable, Iterator, NamedTuple


def advertised_host(lighthouse: str, environ: dict | None = None) -> str | None:
    """The address this worker's store, checkpoint server and gloo announce to the others: 127.0.0.1
    with a Lighthouse on this machine; else this machine's address on the interface that reaches the
    Lighthouse (or the one --gloo-interface / $JAXDP_GLOO_INTERFACE / $GLOO_SOCKET_IFNAME names), where
    torch's gloo is told to listen too (jaxdp/cluster/gloo.py chooses it as for JAX's gloo); None
    where neither is known (torchft's defaults: the host name)."""
    from jaxdp.cluster import gloo

    environ = os.environ if environ is None else environ
    hostport = lighthouse.split("://", 1)[-1].rstrip("/")
    if any(h in hostport for h in ("127.0.0.1", "localhost")):
        return "127.0.0.1"
    endpoint = gloo.choose(hostport, environ=environ)
    if endpoint.interface and gloo.ENV_TORCH_INTERFACE not in environ:
        environ[gloo.ENV_TORCH_INTERFACE] = endpoint.interface  # torch's gloo reads it when its group is made
    return endpoint.address


class Member(NamedTuple):
    """A member of a quorum as its replica id says (`replica_id`): its rank, its announced address
    (None: not known) and the prints of its flags (jaxdp/cluster/agreement.py, `prints`; "": not known)."""
    rank: int
    host: str | None
    flags: str


def replica_id(rank: int, host: str | None, flags: str) -> str:
    """This worker's torchft replica id: jaxdp_<its announced IP, packed, in hex>_<its flags' prints>_<rank>.
    Every member of a quorum gets every member's id (torchft's QuorumResult.replica_ids): the state
    transfer admits their addresses, and a joiner compares its flags and rank with theirs. (torchft
    appends ":<uuid>" and reads the rank back as the trailing digits before it.)"""
    try:
        packed = ipaddress.ip_address(host).packed.hex() if host else ""
    except ValueError:
        packed = ""
    return f"jaxdp_{packed}_{flags}_{rank}"


def member_of(replica: str) -> Member | None:
    """The Member a replica id (`replica_id`'s, with torchft's ":<uuid>") names; None for another's."""
    parts = replica.split(":", 1)[0].split("_")
    if len(parts) != 4 or parts[0] != "jaxdp" or not parts[3].isdigit():
        return None
    try:
        host = str(ipaddress.ip_address(bytes.fromhex(parts[1]))) if parts[1] else None
    except ValueError:
        host = None
    return Member(int(parts[3]), host, parts[2])


def same_ip(address: str, hosts: set[str]) -> bool:
    """Whether `address` (a client's, as a server sees it: maybe IPv4 mapped into IPv6) is one of `hosts`."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    ip = getattr(ip, "ipv4_mapped", None) or ip
    return any(ip == ipaddress.ip_address(h) for h in hosts)


def listening(host: str) -> int:
    """The file descriptor of a TCP socket listening on HOST, any free port (torch's TCPStore serves on
    it: given a host alone, it listens on every interface)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    return sock.detach()  # (the store owns it now)


def transport(host: str | None, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (a heal's state transfer), serving on HOST only and naming
    HOST in the address it gives the healer (torchft's: every interface, and the machine's host name);
    torchft's own where HOST is not known."""
    from torchft.checkpointing.http_transport import HTTPTransport

    if host is None:
        return HTTPTransport(timeout=timeout, num_chunks=0)

    class Transport(HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{f'[{host}]' if ':' in host else host}:{port}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


@contextlib.contextmanager
def bound_to(host: str | None, admits: Callable[[str], bool]) -> Iterator[None]:
    """While a Manager is made: its gRPC server (torchft.manager binds "[::]:PORT") and its checkpoint
    server (torchft.http's _IPv6HTTPServer on ("", 0)) listen on HOST only, and the checkpoint server
    serves a client only where `admits(its address)`. torchft as it is where HOST is not known."""
    if host is None:
        yield
        return
    import torchft.checkpointing.http_transport as http_transport
    import torchft.manager as manager
    from http.server import ThreadingHTTPServer

    server, http_server = manager.ManagerServer, http_transport._IPv6HTTPServer
    bracketed = f"[{host}]" if ":" in host else host

    def manager_server(**kwargs: Any) -> Any:
        return server(**{**kwargs, "bind": f"{bracketed}:{kwargs['bind'].rsplit(':', 1)[1]}"})

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        request_queue_size = 1024

        def __init__(self, _address: Any, handler: Any):
            super().__init__((host, 0), handler)

        def verify_request(self, request: Any, client_address: Any) -> bool:
            return admits(client_address[0])

    manager.ManagerServer, http_transport._IPv6HTTPServer = manager_server, Server
    try:
        yield
    finally:
        manager.ManagerServer, http_transport._IPv6HTTPServer = server, http_server


class _Recording:
    """The Manager's client of its own manager server, recording each quorum's members on the engine."""

    def __init__(self, client: Any, engine: Any):
        self._client, self._engine = client, engine

    def _quorum(self, **kwargs: Any) -> Any:
        result = self._client._quorum(**kwargs)
        self._engine.members = [m for m in map(member_of, result.replica_ids) if m is not None]
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)
