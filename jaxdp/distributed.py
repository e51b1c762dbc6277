"""Process and device set-up: everything that must happen before JAX starts its backend.

    python -m jaxdp.train --coordinator-address 10.0.0.1:12345 --num-processes 2 --process-id 0
    JAX_COORDINATOR_ADDRESS=10.0.0.1:12345 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python -m jaxdp.train
    srun -n 2 python -m jaxdp.train           # SLURM: everything comes from the task's environment

`initialize(config)` is the only caller of `jax.distributed.initialize` in jaxdp. `detect` picks
the first of four sources that applies and returns it as a frozen `Cluster`; `initialize` logs it:

1. explicit: `--coordinator-address HOST:PORT --num-processes P --process-id I` (all three);
2. environment: the same three as `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`;
3. slurm: a task started by `srun` (coordinator = first node of the step, port as JAX picks it);
4. single: one process, no coordinator.

A multi-process run then also gets
* gloo for cross-process collectives on CPU (on GPU, XLA uses NCCL by itself);
* `host_sum`, the `host` strategy's cross-process sum through host memory (the coordination
  service's key-value store), installed with `jaxdp.sync.set_cross_process_sum`;
* a peer watch: every process keeps a TCP connection to process 0. A connection that closes while
  the run is going means that process died; every survivor prints which one and exits with
  `EXIT_PEER_LOST` within a second, instead of waiting forever inside a collective. Processes
  that never arrive, or stop answering without closing the connection (a dead node), are caught
  by `--peer-timeout`, which bounds JAX's start-up wait and heartbeat.

Why a watch of our own: measured with JAX 0.10.2 on CPU, a gloo all-reduce whose peer was killed
does not fail; the survivor waits until JAX's heartbeat timeout (default 100 s), and then JAX's
client aborts the process (SIGABRT, exit 134, C++ stack trace). Its start-up timeout aborts the
same way. A Python `missed_heartbeat_callback` is not reachable through `jax.distributed` and
crashes (std::bad_cast) when passed to the client directly.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import re
import selectors
import socket
import sys
import threading
import time
from typing import Callable, Mapping

import jax
import numpy as np

from jaxdp.config import Config, ConfigError

log = logging.getLogger("jaxdp")

DEFAULT_CPU_DEVICES = 8  # simulate data parallelism on a laptop
EXIT_PEER_LOST = 69  # EX_UNAVAILABLE (sysexits.h): a peer process died or never arrived

# The environment branch: the three flags, spelled as environment variables.
ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"  # overrides the port SLURM detection picks
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"  # read by JAX itself: overrides the SLURM GPU layout

# What `srun` puts in each task's environment (absent in the bare batch script).
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_STEP_NODELIST = "SLURM_STEP_NODELIST"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_PROCID = "SLURM_PROCID"
SLURM_LOCALID = "SLURM_LOCALID"
SLURM_NODEID = "SLURM_NODEID"
SLURM_STEP_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
SLURM_REQUIRED = (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID)
SLURM_PORT_BASE, SLURM_PORT_RANGE = 61440, 4096  # JAX's choice: 61440 + job id % 4096


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Who this process is in the run, and where the coordinator (process 0) listens."""

    source: str                               # "explicit", "environment", "slurm" or "single"
    coordinator_address: str | None = None   # HOST:PORT of process 0
    num_processes: int = 1
    process_id: int = 0
    local_device_ids: tuple[int, ...] | None = None  # GPUs this process owns (None: all visible)

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1

    def describe(self) -> str:
        if not self.multi_process:
            return f"{self.source}: one process"
        devices = "" if self.local_device_ids is None else f", GPUs {list(self.local_device_ids)} of its node"
        return (f"{self.source}: process {self.process_id} of {self.num_processes}, "
                f"coordinator {self.coordinator_address}{devices}")


# ---------------------------------------------------------------------------------------------
# Detection: pure functions of the flags and the environment.
# ---------------------------------------------------------------------------------------------


def detect(config: Config, environ: Mapping[str, str] = os.environ) -> Cluster:
    """The first source that applies: explicit flags, JAX_* variables, SLURM, else one process."""
    return (_from_flags(config) or _from_jax_environment(environ) or _from_slurm(environ)
            or Cluster("single"))


def _from_flags(config: Config) -> Cluster | None:
    given = {"--coordinator-address": config.coordinator_address, "--num-processes": config.num_processes,
             "--process-id": config.process_id}
    if all(value is None for value in given.values()):
        return None
    missing = [flag for flag, value in given.items() if value is None]
    if missing:
        raise ConfigError(f"a multi-process run needs {', '.join(missing)} as well")
    return _checked("explicit", config.coordinator_address, config.num_processes, config.process_id,
                    "--coordinator-address", "--num-processes", "--process-id")


def _from_jax_environment(environ: Mapping[str, str]) -> Cluster | None:
    names = (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    if not all(name in environ for name in names):
        return None  # JAX_COORDINATOR_ADDRESS alone is left to JAX (it may complete a SLURM setup)
    address, count, index = (environ[name] for name in names)
    return _checked("environment", address, _int(count, ENV_NUM_PROCESSES), _int(index, ENV_PROCESS_ID), *names)


def _from_slurm(environ: Mapping[str, str]) -> Cluster | None:
    if not all(name in environ for name in SLURM_REQUIRED):
        return None  # not a task started by srun (a bare batch script has no SLURM_STEP_NODELIST)
    count, index = _int(environ[SLURM_NTASKS], SLURM_NTASKS), _int(environ[SLURM_PROCID], SLURM_PROCID)
    if count == 1:
        return None
    if ENV_COORDINATOR_ADDRESS in environ:
        address = environ[ENV_COORDINATOR_ADDRESS]
    else:
        port = environ.get(ENV_COORDINATOR_PORT) or str(
            SLURM_PORT_BASE + _int(environ[SLURM_JOB_ID], SLURM_JOB_ID) % SLURM_PORT_RANGE)
        address = f"{expand_nodelist(environ[SLURM_STEP_NODELIST])[0]}:{port}"
    cluster = _checked("slurm", address, count, index, ENV_COORDINATOR_ADDRESS, SLURM_NTASKS, SLURM_PROCID)
    return dataclasses.replace(cluster, local_device_ids=slurm_local_device_ids(environ))


def slurm_local_device_ids(environ: Mapping[str, str]) -> tuple[int, ...] | None:
    """Which of the node's GPUs this SLURM task owns; None means every GPU it can see.

    * one task per node (`--ntasks-per-node=1`): the task owns all GPUs of its node;
    * several tasks per node, SLURM already bound GPUs to each task (`--gpus-per-task`, so
      CUDA_VISIBLE_DEVICES lists fewer GPUs than there are tasks on the node): all it sees;
    * several tasks per node sharing the node's GPUs: one GPU each, number SLURM_LOCALID.
    `JAX_LOCAL_DEVICE_IDS=0,1` overrides all of this (JAX reads it itself).
    """
    if ENV_LOCAL_DEVICE_IDS in environ:
        return None
    per_node = expand_tasks_per_node(environ.get(SLURM_STEP_TASKS_PER_NODE, "1"))
    node = _int(environ.get(SLURM_NODEID, "0"), SLURM_NODEID)
    tasks_here = per_node[node] if node < len(per_node) else max(per_node)
    if tasks_here <= 1:
        return None
    visible = [d for d in environ.get(CUDA_VISIBLE_DEVICES, "").split(",") if d.strip()]
    if visible and len(visible) < tasks_here:
        return None
    return (_int(environ[SLURM_LOCALID], SLURM_LOCALID),)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list to host names: `node[01-03,7],gpu5` -> node01 node02 node03 node7 gpu5."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        hosts.extend(_expand_host(item))
    if not hosts:
        raise ConfigError(f"{SLURM_STEP_NODELIST}={nodelist!r} names no host")
    return hosts


def _expand_host(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    names = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ConfigError(f"cannot parse the SLURM host range [{match.group(1)}] in {pattern!r}")
        for number in range(int(low), int(high or low) + 1):
            names.extend(_expand_host(f"{head}{number:0{len(low)}d}{tail}"))
    return names


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE to one count per node: `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ConfigError(f"cannot parse {SLURM_STEP_TASKS_PER_NODE}={spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def parse_address(address: str, what: str = "--coordinator-address") -> tuple[str, int]:
    """`HOST:PORT` (or `[v6]:PORT`) -> (host, port); ConfigError naming `what` otherwise."""
    match = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):(\d+)", address.strip())
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"{what}={address!r} is not HOST:PORT (for example 10.0.0.1:12345, "
                          f"with a port between 1 and 65535)")
    return match.group(1).strip("[]"), int(match.group(2))


def _checked(source: str, address: str, count: int, index: int,
             address_name: str, count_name: str, index_name: str) -> Cluster:
    parse_address(address, address_name)
    if count <= 0:
        raise ConfigError(f"{count_name} must be a positive integer, got {count}")
    if not 0 <= index < count:
        raise ConfigError(f"{index_name}={index} must be between 0 and {count_name} - 1 = {count - 1}")
    return Cluster(source, address.strip(), count, index)


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer") from None


# ---------------------------------------------------------------------------------------------
# Start-up
# ---------------------------------------------------------------------------------------------


def initialize(config: Config) -> Cluster:
    """Start jax.distributed if this is a multi-process run; returns (and logs) what it found."""
    _simulate_cpu_devices(config.devices or DEFAULT_CPU_DEVICES)
    cluster = detect(config)
    if not cluster.multi_process and _in_batch_script_of_several_tasks(os.environ):
        log.warning("jaxdp: running as one process in a SLURM batch script of %s tasks; start it with "
                    "`srun python -m jaxdp.train ...` to use all of them", os.environ[SLURM_NTASKS])
    if cluster.multi_process:
        timeout = config.peer_timeout
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # GPUs use NCCL regardless
        # JAX aborts the process when its own start-up wait ends; ours ends first, with a message.
        alarm = threading.Timer(timeout, _never_arrived, args=(cluster, timeout))
        alarm.daemon = True
        alarm.start()
        try:
            jax.distributed.initialize(
                coordinator_address=cluster.coordinator_address, num_processes=cluster.num_processes,
                process_id=cluster.process_id, local_device_ids=cluster.local_device_ids,
                initialization_timeout=timeout + 30, heartbeat_timeout_seconds=timeout,
                shutdown_timeout_seconds=timeout)
            _start_peer_watch(cluster, timeout)
        finally:
            alarm.cancel()
        from jaxdp import sync  # here, not at the top: sync is also used without distribution

        sync.set_cross_process_sum(host_sum(timeout))
    platform = jax.default_backend()  # starts the backend: everything above must come first
    collectives = {"cpu": "; gloo collectives", "gpu": "; NCCL collectives"}.get(platform, "")
    log.info("jaxdp.distributed: %s; %d %s devices here%s", cluster.describe(), jax.local_device_count(),
             platform, collectives if cluster.multi_process else "")
    return cluster


def _in_batch_script_of_several_tasks(environ: Mapping[str, str]) -> bool:
    """A SLURM job of several tasks, but this is not a task srun started (no step node list)."""
    tasks = environ.get(SLURM_NTASKS, "1")
    return SLURM_JOB_ID in environ and SLURM_STEP_NODELIST not in environ and tasks.isdigit() and int(tasks) > 1


def _never_arrived(cluster: Cluster, timeout: int) -> None:
    """Start-up did not finish in time. JAX does not say who is missing; say what we know."""
    count = cluster.num_processes
    if cluster.process_id == 0:
        others = "process 1" if count == 2 else f"at least one of processes 1..{count - 1}"
        _fail(f"{others} did not join within --peer-timeout={timeout} s (coordinator "
              f"{cluster.coordinator_address}); start every process with the same coordinator and process count")
    others = "" if count == 2 else " (or another process has not joined yet)"
    _fail(f"could not join process 0 (the coordinator) at {cluster.coordinator_address} within "
          f"--peer-timeout={timeout} s{others}; is process 0 running, and is that address reachable from here?")


def _fail(message: str) -> None:
    """Exit at once from any thread: the main thread may be blocked inside a collective."""
    print(f"jaxdp: error: {message} (exit code {EXIT_PEER_LOST})", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


def _simulate_cpu_devices(n: int) -> None:
    """Ask the CPU backend for `n` devices, unless it already started or XLA_FLAGS decides."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backend already running (a notebook, a test): local_devices() picks from what exists


def local_devices(config: Config) -> list[jax.Device]:
    """The devices this process trains on: the first --devices of its local devices (default all)."""
    available = jax.local_devices()
    wanted = config.devices or len(available)
    if wanted > len(available):
        raise ConfigError(f"--devices={wanted} but this process has only {len(available)} "
                          f"{available[0].platform} devices; ask for at most {len(available)}")
    return available[:wanted]


def global_devices(config: Config) -> list[jax.Device]:
    """Every process's chosen devices: the first --devices local devices of each process."""
    n = len(local_devices(config))
    by_process: dict[int, list[jax.Device]] = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(device.process_index, []).append(device)
    return [d for devices in by_process.values() for d in devices[:n]]


def _client():
    """JAX's coordination-service client (private in JAX 0.10; orbax reaches it the same way)."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


# ---------------------------------------------------------------------------------------------
# The host strategy across processes: a sum through host memory.
# ---------------------------------------------------------------------------------------------


def host_sum(timeout_s: float) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    """Sum numpy arrays over processes through the coordination service's key-value store.

    Every call is one round r: each process publishes its arrays as bytes under
    `jaxdp/host_sum/r/<process>`, reads every other process's, and adds all of them in process
    order, so every process computes bit-identical sums (the replicas must stay identical).
    Cleanup: a process deletes its own key of round r - 2 when it publishes round r. That is safe
    because to publish round r - 1, every process must have finished reading round r - 2, and
    this process read all round r - 1 keys before starting round r. The last two rounds' keys
    live until the coordinator exits.
    """
    client, me, count = _client(), jax.process_index(), jax.process_count()
    rounds = iter(range(1 << 62))

    def key(r: int, process: int) -> str:
        return f"jaxdp/host_sum/{r}/{process}"

    def sum_over_processes(arrays: list[np.ndarray]) -> list[np.ndarray]:
        r = next(rounds)
        mine = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        client.key_value_set_bytes(key(r, me), mine)  # host sync point: bytes over the network
        if r >= 2:
            client.key_value_delete(key(r - 2, me))
        totals = None
        for process in range(count):
            try:
                payload = mine if process == me else client.blocking_key_value_get_bytes(
                    key(r, process), int(timeout_s * 1000))
            except Exception as err:  # the peer watch normally ends the process first
                raise RuntimeError(f"host strategy: no gradients from process {process} within {timeout_s} s "
                                   f"({err})") from None
            parts = _unpack(payload, arrays)
            if totals is None:
                totals = [part.copy() for part in parts]
            else:
                for total, part in zip(totals, parts):
                    total += part
        return totals

    return sum_over_processes


def _unpack(payload: bytes, like: list[np.ndarray]) -> list[np.ndarray]:
    out, offset = [], 0
    for a in like:
        out.append(np.frombuffer(payload, a.dtype, a.size, offset).reshape(a.shape))
        offset += a.nbytes
    return out


# ---------------------------------------------------------------------------------------------
# The peer watch: a TCP connection from every process to process 0.
# ---------------------------------------------------------------------------------------------

_WATCH_KEY = "jaxdp/peer_watch"
_running = threading.Event()  # set while this process runs; cleared at exit, when links may close


def _start_peer_watch(cluster: Cluster, timeout_s: float) -> None:
    """Connect the processes in a star around process 0 and watch the connections.

    A connection only closes when its process ends. Process 0 sees which peer closed and tells
    the others its number before it exits; a peer that sees process 0's connection close without
    a number knows process 0 itself is gone. At interpreter exit each process stops watching
    before JAX's shutdown barrier, so the connections close only after every process is done.
    """
    client, me, count = _client(), cluster.process_id, cluster.num_processes
    if me == 0:
        server = socket.create_server(("", 0), family=socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET,
                                      dualstack_ipv6=socket.has_dualstack_ipv6())
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
            _fail(f"process(es) {missing} joined JAX but not the jaxdp peer watch within {timeout_s} s")
        finally:
            server.close()
        target = lambda: _watch_peers(links, count)  # noqa: E731
    else:
        host, _ = parse_address(cluster.coordinator_address)
        port = int(client.blocking_key_value_get(_WATCH_KEY, int(timeout_s * 1000)))
        link = socket.create_connection((host, port), timeout=timeout_s)
        link.sendall(f"{me}\n".encode())
        target = lambda: _watch_coordinator(link, me, count)  # noqa: E731
    _running.set()
    atexit.register(_running.clear)  # runs before JAX's own exit handler (registered earlier)
    threading.Thread(target=target, name="jaxdp-peer-watch", daemon=True).start()


def give_peer_watch_a_moment(seconds: float = 3.0) -> None:
    """Call before reporting an unexpected error: if a peer just died, the error here is most
    likely its echo (a gloo connection reset), and the peer watch exits EXIT_PEER_LOST naming
    the process that died. A no-op unless this process watches peers."""
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
                closed = not key.fileobj.recv(64)
            except OSError:
                closed = True
            if not closed:
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
        message = link.recv(64)
    except OSError:
        message = b""
    if _running.is_set():
        lost = int(message.split()[0]) if message.strip() else 0
        _peer_lost(lost, me, count)


def _peer_lost(lost: int, me: int, count: int) -> None:
    what = "the coordinator, " if lost == 0 else ""
    _fail(f"process {lost} ({what}one of {count}) stopped while process {me} was still running; "
          f"see process {lost}'s own output for why (crashed, killed, out of memory, node failure)")
