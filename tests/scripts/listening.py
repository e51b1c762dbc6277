"""Where a process of a multi-process run listens, and whether its coordinator answers a connection
from this machine's own non-loopback address. Started by `python -m jaxdp.launch`:

    python -m jaxdp.launch --nproc-per-node 2 -- python tests/scripts/listening.py OUT

Each process calls jaxdp.initialize(), runs one collective (so gloo's connections are up), and
writes OUT.<process> as JSON: {"listening": [[family, address, port], ...], "external": ...}, where
"external" is, for process 0, the result of connecting to the coordinator's port on the first
non-loopback IPv4 address of this machine ("refused", "connected", or null without one).
"""

import ipaddress
import json
import os
import socket
import sys

import jax
import numpy as np

import jaxdp
from jaxdp.cluster import gloo

jaxdp.initialize()
from jax.experimental import multihost_utils  # noqa: E402

multihost_utils.process_allgather(np.float32(jax.process_index()))


def my_sockets() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def listening() -> list[list]:
    """This process's listening TCP sockets from /proc/self/net/tcp{,6}: [family, address, port]."""
    mine, out = my_sockets(), []
    for family in ("tcp", "tcp6"):
        for line in open(f"/proc/self/net/{family}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in mine:  # 0A: LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            # /proc writes each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(raw)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped
            out.append([family, str(address), int(hex_port, 16)])
    return out


external = None
if jax.process_index() == 0:
    mine = next((gloo.ipv4_of(name) for name in gloo.interfaces()
                 if gloo.ipv4_of(name) and not ipaddress.ip_address(gloo.ipv4_of(name)).is_loopback), None)
    if mine:
        port = int(os.environ["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
        try:
            socket.create_connection((mine, port), timeout=5).close()
            external = "connected"
        except ConnectionRefusedError:
            external = "refused"
        except OSError as err:
            external = f"error {err}"
found = listening()
multihost_utils.sync_global_devices("looked")  # neither process ends before the other has looked
with open(f"{sys.argv[1]}.{jax.process_index()}", "w") as f:
    json.dump({"listening": found, "external": external}, f)
