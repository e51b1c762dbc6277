"""Which network address JAX's gloo CPU collectives listen on and advertise to the other processes.

Left alone, JAX's gloo transport advertises the address this machine's host name resolves to. On
many hosts /etc/hosts maps the host name to 127.0.0.1 or 127.0.1.1 (Debian), so peers on other
hosts (or in other network namespaces) are told to connect to their own loopback, and fail with
"Connection refused, remote=[127.0.0.1]:..." although the coordinator is reachable. jaxdp
therefore picks the address itself, in this order:

1. `--gloo-interface NAME`, else `$JAXDP_GLOO_INTERFACE`, else `$GLOO_SOCKET_IFNAME` (PyTorch's
   variable for the same thing): that interface (gloo uses its first address);
   the name `hostname` keeps JAX's own choice (the address the host name resolves to);
2. otherwise, for a coordinator on another machine: the local address the kernel would use to
   reach the coordinator (a UDP socket `connect`ed to it, then `getsockname`: no packet is sent);
3. a coordinator on this machine (127.0.0.1, localhost): JAX's own choice, as before.

`choose(...)` is pure apart from reading this machine's interfaces; `install(endpoint)` hands the
choice to JAX. JAX 0.10 has no setting for it: `jax._src.xla_bridge.make_cpu_client` creates the
gloo collectives with `jaxlib._jax.make_gloo_tcp_collectives(distributed_client=...)` and no
`hostname` or `interface`. It accepts ready-made `collectives`, so `install` registers, through the
public `jax.extend.backend.register_backend_factory`, a "cpu" backend factory that calls that same
`make_cpu_client` with `make_gloo_tcp_collectives(..., hostname=, interface=)`. It must run before
JAX starts its CPU backend.
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from typing import Mapping

from jaxdp.cluster.detect import parse_address
from jaxdp.config import ConfigError

log = logging.getLogger("jaxdp")

ENV_INTERFACE = "JAXDP_GLOO_INTERFACE"
ENV_TORCH_INTERFACE = "GLOO_SOCKET_IFNAME"  # PyTorch's name for the same setting
JAX_DEFAULT = "hostname"                     # the override value that keeps JAX's own choice
_SIOCGIFADDR = 0x8915                        # Linux ioctl: an interface's (primary) IPv4 address


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """What gloo is given: an interface name, or an address (`hostname`), or neither (JAX's default)."""

    interface: str | None
    address: str | None    # the address gloo will advertise, where known
    reason: str
    pass_address: bool = False  # give gloo `address` as its hostname (else `interface`, else nothing)

    @property
    def jax_default(self) -> bool:
        return self.interface is None and not self.pass_address

    def describe(self) -> str:
        if self.jax_default:
            return f"gloo collectives on JAX's default address (the one the host name resolves to): {self.reason}"
        where = " ".join(part for part in (self.interface, f"({self.address})" if self.address else None) if part)
        return f"gloo collectives on {where}: {self.reason}"


def interfaces() -> list[str]:
    """This machine's network interface names (in this network namespace)."""
    return sorted(name for _, name in socket.if_nameindex())


def ipv4_of(interface: str) -> str | None:
    """The interface's primary IPv4 address, or None (no address, or not an interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The interface whose primary IPv4 address is `address`, or None."""
    return next((name for name in interfaces() if ipv4_of(name) == address), None)


def requested(flag_value: str | None, environ: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """(interface name, where it came from) from the flag or the environment, checked; None if unset."""
    for value, source in ((flag_value, "--gloo-interface"), (environ.get(ENV_INTERFACE), ENV_INTERFACE),
                          (environ.get(ENV_TORCH_INTERFACE), ENV_TORCH_INTERFACE)):
        if not value:
            continue
        value = value.strip()
        if "," in value:
            raise ConfigError(f"{source}={value!r} names several interfaces; jaxdp uses one, for example "
                              f"{source}={value.split(',')[0].strip()}")
        if value != JAX_DEFAULT and value not in interfaces():
            raise ConfigError(f"{source}={value!r} is not a network interface of this machine (it has "
                              f"{', '.join(interfaces())}); name one of them, or {JAX_DEFAULT} for JAX's own "
                              f"choice, or leave it unset to use the one that reaches the coordinator")
        return value, source
    return None


def local_address_towards(host: str, port: int) -> str:
    """The local address the kernel picks to reach (host, port): a UDP `connect` sends nothing."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def choose(coordinator_address: str, flag_value: str | None = None,
           environ: Mapping[str, str] = os.environ) -> Endpoint:
    """Where this process's gloo collectives should listen (see the module docstring for the order)."""
    override = requested(flag_value, environ)
    if override is not None:
        name, source = override
        if name == JAX_DEFAULT:
            return Endpoint(None, None, f"{source}={JAX_DEFAULT}")
        return Endpoint(name, ipv4_of(name), f"{source}={name}")
    host, port = parse_address(coordinator_address)
    try:
        coordinator_ip = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as err:
        return Endpoint(None, None, f"the coordinator's host {host!r} did not resolve here ({err.strerror or err})")
    if ipaddress.ip_address(coordinator_ip.split("%")[0]).is_loopback:
        return Endpoint(None, None, f"the coordinator {coordinator_address} is on this machine")
    try:
        local = local_address_towards(coordinator_ip, port)
    except OSError as err:
        return Endpoint(None, None, f"no route to the coordinator {coordinator_ip} ({err.strerror or err})")
    return Endpoint(interface_of(local), local, f"the interface that reaches the coordinator {coordinator_ip} "
                    f"(--gloo-interface or ${ENV_INTERFACE} to choose another)", pass_address=True)


def install(endpoint: Endpoint) -> bool:
    """Make JAX's CPU backend create its gloo collectives on `endpoint`; call it before the backend
    starts. False (and a warning) where this JAX has no such hook or its CPU backend already runs."""
    if endpoint.jax_default:
        return True
    try:
        from jax._src import distributed as jax_distributed, xla_bridge  # the hook: see the module docstring
        from jax._src.lib import _jax
        from jax.extend.backend import register_backend_factory
        make_collectives, make_cpu_client = _jax.make_gloo_tcp_collectives, xla_bridge.make_cpu_client
    except (ImportError, AttributeError) as err:
        log.warning("jaxdp: cannot choose gloo's network interface with this JAX (%s); it uses the address the "
                    "host name resolves to", err)
        return False
    hostname = endpoint.address if endpoint.pass_address else None
    interface = None if endpoint.pass_address else endpoint.interface

    def cpu_backend():
        collectives = make_collectives(distributed_client=jax_distributed.global_state.client,
                                       hostname=hostname, interface=interface)
        return make_cpu_client(collectives=collectives)

    try:
        register_backend_factory("cpu", cpu_backend, priority=0, fail_quietly=False)  # as JAX registers it
    except RuntimeError as err:  # "Backend cpu already initialized": something used JAX first
        log.warning("jaxdp: cannot choose gloo's network interface: %s (call jaxdp.initialize() before anything "
                    "else uses JAX)", err)
        return False
    return True
