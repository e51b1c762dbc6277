"""Process and device set-up: everything that must happen before JAX starts its backend.

`initialize(config)` is the only caller of `jax.distributed.initialize` in jaxdp. It takes the
`Cluster` that `jaxdp.cluster.detect` finds (explicit flags, JAX_* variables, SLURM, or one
process) and logs which it was. A multi-process run then also gets
* a run handshake before JAX's coordinator is contacted (jaxdp/cluster/handshake.py): process 0 admits the
  other processes of its own run only, so a second run started on its address cannot break it;
* the coordinator (and the handshake, the port after it) listening where it is announced: on
  127.0.0.1 for a coordinator at 127.0.0.1 (JAX listens on every interface), on the announced
  address where it is one of this machine's, else on every interface ($JAX_COORDINATOR_BIND_ADDRESS
  decides where set);
* gloo for cross-process collectives on CPU (on GPU, XLA uses NCCL by itself), on the network
  interface that reaches the coordinator, or the one --gloo-interface / $JAXDP_GLOO_INTERFACE /
  $GLOO_SOCKET_IFNAME names (jaxdp/cluster/gloo.py: JAX would use the host name's address, often 127.0.0.1);
* a peer watch (jaxdp/cluster/peer_watch.py): a process that dies is reported by every survivor, by number,
  within a second; one that never arrives is bounded by --startup-timeout, one that stops answering by --peer-timeout.

In a script of your own, `jaxdp.initialize()` does the same from the environment (JAX_* variables,
as `python -m jaxdp.launch` sets them, or SLURM), where `jax.distributed.initialize()` with no
arguments reads only the coordinator address.

`process_devices(n)` and `mesh_devices(n)` choose the first n local devices of this process, and
of every process.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading

import jax

from jaxdp.cluster import gloo, handshake, peer_watch, quiet
from jaxdp.cluster.handshake import ENV_BIND_ADDRESS, bind_host
from jaxdp.cluster.detect import (SLURM_NTASKS, Cluster, detect, handshake_port, in_batch_script_of_several_tasks,
                           parse_address)
from jaxdp.config import Config, ConfigError

log = logging.getLogger("jaxdp")

MAX_DEFAULT_CPU_DEVICES = 8


def default_cpu_devices() -> int:
    """How many devices a CPU-only host simulates when --devices is not given: one per core this
    process may run on, rounded down to a power of two (the default batch sizes divide by it), at
    least 2 (every strategy has a peer to synchronise with) and at most 8. Devices beyond the cores
    only take turns on them, and each turn costs the step time (docs/performance.md, "Behind the
    defaults")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(2, min(MAX_DEFAULT_CPU_DEVICES, 1 << (cores.bit_length() - 1)))


def initialize(config: Config | None = None) -> Cluster:
    """Start jax.distributed if this is a multi-process run; returns (and logs) what it found.

    `config` None (a user's script): the cluster comes from the environment alone, and the CPU
    device count is left to JAX (or XLA_FLAGS). With a config (the CLI), a CPU-only host simulates
    `config.devices` devices (default: `default_cpu_devices()`; the run's last line says how many).
    """
    given = config is not None
    if config is None:
        config = Config(progress=False)
    else:
        _simulate_cpu_devices(config.devices or default_cpu_devices())
    cluster = detect(config)
    gloo.requested(config.gloo_interface, environ={})  # a bad --gloo-interface fails in every kind of run
    if not cluster.multi_process and in_batch_script_of_several_tasks(os.environ):
        log.warning("jaxdp: running as one process in a SLURM batch script of %s tasks; start it with "
                    "`srun python -m jaxdp.train ...` to use all of them", os.environ[SLURM_NTASKS])
    if cluster.multi_process:
        timeout = config.startup_timeout  # arriving: a cold start on a cluster may take minutes
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # GPUs use NCCL regardless
        endpoint = gloo.choose(cluster.coordinator_address, config.gloo_interface)
        if gloo.install(endpoint):
            log.info("jaxdp.cluster.distributed: %s", endpoint.describe())
        # JAX aborts the process when its own start-up wait ends; ours ends first, with a message.
        alarm = threading.Timer(timeout, _never_arrived, args=(cluster, timeout))
        alarm.daemon = True
        alarm.start()
        address, host = cluster.coordinator_address, bind_host(cluster.coordinator_address)
        port = handshake_port(parse_address(address)[1])
        try:
            if cluster.process_id == 0:  # before the coordinator starts: it admits no one unchecked
                _check_port_free(address, host)
                handshake.Admission(host, port, cluster.run_id, cluster.num_processes, address).start()
            else:  # before this process contacts the coordinator: a refused one never does
                handshake.join(address, port, cluster.run_id, cluster.process_id, cluster.num_processes,
                               timeout + 5)  # the alarm fires first, with its message
            jax.distributed.initialize(
                coordinator_address=address, num_processes=cluster.num_processes,
                process_id=cluster.process_id, local_device_ids=cluster.local_device_ids,
                initialization_timeout=timeout + 30, heartbeat_timeout_seconds=config.peer_timeout,
                shutdown_timeout_seconds=config.peer_timeout, coordinator_bind_address=_bind_address(address, host))
            from jaxdp.cluster.coordination import client as coordination_client

            peer_watch.start(coordination_client(), cluster, timeout, bind=host)
        finally:
            alarm.cancel()
    platform = jax.default_backend()  # starts the backend: everything above must come first
    if given and cluster.multi_process and platform == "cpu":  # gloo's "[Gloo] Rank N is connected to ..." lines
        quiet.filter_gloo_lines(enabled=not config.debug)     # (one per device, at the first collective)
    collectives = {"cpu": "; gloo collectives", "gpu": "; NCCL collectives"}.get(platform, "")
    log.info("jaxdp.cluster.distributed: %s; %d %s devices here%s", cluster.describe(), jax.local_device_count(),
             platform, collectives if cluster.multi_process else "")
    if given and cluster.multi_process:  # the same flags everywhere, or exit 2 on every process
        from jaxdp.cluster import agreement
        from jaxdp.cluster.coordination import client as coordination_client

        agreement.check(coordination_client(), config, cluster.process_id, cluster.num_processes,
                        config.startup_timeout, lambda: len(process_devices(config.devices)))
    return cluster


def _bind_address(address: str, host: str | None) -> str | None:
    """JAX's coordinator_bind_address for `host` (None: JAX's default, every interface, or
    $JAX_COORDINATOR_BIND_ADDRESS, which JAX reads itself)."""
    if host is None or os.environ.get(ENV_BIND_ADDRESS):
        return None
    port = parse_address(address)[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_port_free(address: str, host: str | None = None) -> None:
    """ConfigError if the coordinator's port is taken on this machine (JAX says only "Failed to
    start RPC server" and exits 1). Checked by process 0, which hosts the coordinator, on the
    address it will listen on (`host`; None: every interface)."""
    _, port = parse_address(address)
    tries = (((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")) if host is None else
             ((socket.AF_INET6 if ":" in host else socket.AF_INET, host),))
    for family, where in tries:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server would
                probe.bind((where, port))
            return
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ConfigError(f"--coordinator-address={address}: port {port} is already in use on this machine "
                                  f"(another run, or another program); pick a free port") from None
            continue  # no IPv6 here: try IPv4


def _never_arrived(cluster: Cluster, timeout: int) -> None:
    """Start-up did not finish in time. JAX does not say who is missing; say what we know."""
    count = cluster.num_processes
    if cluster.process_id == 0:
        others = "process 1" if count == 2 else f"at least one of processes 1..{count - 1}"
        peer_watch.fail(f"{others} did not join within --startup-timeout={timeout} s (coordinator "
                        f"{cluster.coordinator_address}); start every process with the same coordinator and process count")
    others = "" if count == 2 else " (or another process has not joined yet)"
    peer_watch.fail(f"could not join process 0 (the coordinator) at {cluster.coordinator_address} within "
                    f"--startup-timeout={timeout} s{others}; is process 0 running, and is that address reachable from here?")


def _simulate_cpu_devices(n: int) -> None:
    """Ask the CPU backend for `n` devices, unless it already started or XLA_FLAGS decides."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backend already running (a notebook, a test): process_devices() picks from what exists


# ---------------------------------------------------------------------------------------------
# Device choice
# ---------------------------------------------------------------------------------------------


def process_devices(per_process: int | None = None) -> list[jax.Device]:
    """The devices this process trains on: its first `per_process` local devices (None: all)."""
    available = jax.local_devices()
    wanted = per_process or len(available)
    if wanted > len(available):
        raise ConfigError(f"--devices={wanted} but this process has only {len(available)} "
                          f"{available[0].platform} devices; ask for at most {len(available)}")
    return available[:wanted]


def mesh_devices(per_process: int | None = None) -> list[jax.Device]:
    """Every process's chosen devices: the first `per_process` local devices of each process."""
    n = len(process_devices(per_process))
    by_process: dict[int, list[jax.Device]] = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(device.process_index, []).append(device)
    return [d for devices in by_process.values() for d in devices[:n]]
