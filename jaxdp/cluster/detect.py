"""Who this process is in a run: pure detection from flags, JAX_* variables, SLURM, Kubernetes, SkyPilot or dstack.

    python -m jaxdp.train --coordinator-address 10.0.0.1:12345 --num-processes 2 --process-id 0
    JAX_COORDINATOR_ADDRESS=10.0.0.1:12345 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python -m jaxdp.train
    srun -n 2 python -m jaxdp.train           # SLURM: everything comes from the task's environment

`detect(config, environ)` picks the first source that applies and returns a frozen `Cluster`;
nothing here starts anything or imports JAX, so every branch is tested without a cluster:

1. explicit: `--coordinator-address HOST:PORT --num-processes P --process-id I` (all three);
2. environment: the same three as `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`
   (what `python -m jaxdp.launch` sets, and what `jaxdp.initialize()` reads in a user's script);
3. slurm: a task started by `srun` (coordinator = first node of the step, port from the job and
   step ids: `slurm_port`);
4. kubernetes: a pod of an Indexed Job or a JobSet (`JOB_COMPLETION_INDEX`; the count from
   `JAX_NUM_PROCESSES`; the coordinator `JAX_COORDINATOR_ADDRESS`, else the first pod's DNS name,
   `<job>-0.<subdomain>`, from this pod's own: examples/kubernetes/);
5. skypilot: a node of a SkyPilot task (`SKYPILOT_NODE_IPS`, `SKYPILOT_NODE_RANK`: examples/skypilot.yaml);
6. dstack: a node of a dstack task (`DSTACK_MASTER_NODE_IP`, `DSTACK_NODE_RANK`, `DSTACK_NODES_NUM`:
   examples/dstack.yml);
7. single: one process, no coordinator.

Kubernetes, SkyPilot and dstack start one process per node (pod), which owns all of its node's
devices; the coordinator port is `$JAX_COORDINATOR_PORT`, else `CLOUD_PORT` (the handshake uses the
next one: open both between the nodes). A node that carries both SkyPilot's and dstack's variables
runs only where they agree (`_from_cloud` says why it refuses rather than picks one).

Every multi-process run also has a run id, which the processes present to process 0 before they
reach JAX's coordinator (jaxdp/cluster/handshake.py): `$JAXDP_RUN_ID` (the launcher sets one per start), else
under SLURM `slurm-JOB.STEP`, else none (process 0 then admits the first process of each number).

Why not JAX's own cluster detection (`jax._src.clusters`): it is private, it cannot be called
without starting JAX, and it gives one GPU per task whenever SLURM_LOCALID is set; the rules
below also cover one task owning all of its node's GPUs, and every bad value gets a sentence.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping

from jaxdp.config import Config, ConfigError

# The environment branch: the three flags, spelled as environment variables.
ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"  # overrides the port SLURM detection picks
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"  # read by JAX itself: overrides the SLURM GPU layout
ENV_RUN_ID = "JAXDP_RUN_ID"  # the same on every process of one run, different between runs

# What `srun` puts in each task's environment (absent in the bare batch script).
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_STEP_ID = "SLURM_STEP_ID"  # optional: 0 where absent
SLURM_STEP_NODELIST = "SLURM_STEP_NODELIST"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_PROCID = "SLURM_PROCID"
SLURM_LOCALID = "SLURM_LOCALID"
SLURM_NODEID = "SLURM_NODEID"
SLURM_STEP_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
SLURM_GPUS_ON_NODE = "SLURM_GPUS_ON_NODE"  # set by SLURM when it allocated GPUs
SLURM_REQUIRED = (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID)
# The SLURM coordinator port. JAX's own rule, 61440 + job id % 4096, gives every step of a job the
# same port, and jobs 4096 ids apart too. Ours: an even port in 20480..32766 (below Linux's
# ephemeral range 32768-60999, so no outgoing connection holds it), the handshake on the odd one after.
SLURM_PORT_BASE, SLURM_PORT_PAIRS = 20480, 6144
SLURM_STEP_STRIDE = 3071  # coprime to 6144: the steps of one job never share a port

# Kubernetes: an Indexed Job sets JOB_COMPLETION_INDEX and names its pods <job>-<index> (a JobSet's:
# <jobset>-<replicated job>-<job index>-<index>); with a headless Service as the pod's subdomain the
# first pod is reachable as <job>-0.<subdomain>.
K8S_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
K8S_POD_HOSTNAME = "HOSTNAME"  # the pod's name, which Kubernetes sets as its host name
# SkyPilot: the nodes' IPs, one per line (the head node first), and this node's rank.
SKYPILOT_NODE_IPS = "SKYPILOT_NODE_IPS"
SKYPILOT_NODE_RANK = "SKYPILOT_NODE_RANK"
SKYPILOT_TASK_ID = "SKYPILOT_TASK_ID"  # the same on every node of one task: the run id
# dstack: the master node's IP, this node's rank, the node count.
DSTACK_MASTER_NODE_IP = "DSTACK_MASTER_NODE_IP"
DSTACK_NODE_RANK = "DSTACK_NODE_RANK"
DSTACK_NODES_NUM = "DSTACK_NODES_NUM"
DSTACK_RUN_NAME = "DSTACK_RUN_NAME"  # the run id
CLOUD_PORT = 23456  # the coordinator port where a platform names only hosts ($JAX_COORDINATOR_PORT overrides)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Who this process is in the run, and where the coordinator (process 0) listens."""

    source: str                               # "explicit", "environment", "slurm", "kubernetes", "skypilot", "dstack" or "single"
    coordinator_address: str | None = None   # HOST:PORT of process 0
    num_processes: int = 1
    process_id: int = 0
    local_device_ids: tuple[int, ...] | None = None  # GPUs this process owns (None: all visible)
    run_id: str = ""                          # the same on every process of this run ("": none given)

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1

    def describe(self) -> str:
        if not self.multi_process:
            return f"{self.source}: one process"
        devices = "" if self.local_device_ids is None else f", GPUs {list(self.local_device_ids)} of its node"
        run = f", run {self.run_id}" if self.run_id else ""
        return (f"{self.source}: process {self.process_id} of {self.num_processes}, "
                f"coordinator {self.coordinator_address}{devices}{run}")


# ---------------------------------------------------------------------------------------------
# Detection: pure functions of the flags and the environment.
# ---------------------------------------------------------------------------------------------


def detect(config: Config, environ: Mapping[str, str] = os.environ, fqdn: str | None = None) -> Cluster:
    """The first source that applies: explicit flags, JAX_* variables, SLURM, Kubernetes, SkyPilot,
    dstack, else one process. `fqdn`: this host's fully qualified name (Kubernetes only; default
    `socket.getfqdn()`, asked only there)."""
    cluster = (_from_flags(config) or _from_jax_environment(environ) or _from_slurm(environ)
               or _from_kubernetes(environ, fqdn) or _from_cloud(environ))
    if cluster is None:
        return Cluster("single")
    return dataclasses.replace(cluster, run_id=run_id(environ))


def run_id(environ: Mapping[str, str] = os.environ) -> str:
    """$JAXDP_RUN_ID, else SLURM's `slurm-JOB.STEP` (in a task srun started), SkyPilot's task id or
    dstack's run name, else "" (none; on Kubernetes the examples set $JAXDP_RUN_ID to the Job's uid)."""
    if environ.get(ENV_RUN_ID, "").strip():
        return environ[ENV_RUN_ID].strip()
    if SLURM_JOB_ID in environ and SLURM_STEP_NODELIST in environ:
        return f"slurm-{environ[SLURM_JOB_ID]}.{environ.get(SLURM_STEP_ID, '0')}"
    for name, prefix in ((SKYPILOT_TASK_ID, "skypilot"), (DSTACK_RUN_NAME, "dstack")):
        if environ.get(name, "").strip():
            return f"{prefix}-{environ[name].strip()}"
    return ""


def handshake_port(coordinator_port: int) -> int:
    """The port of process 0's run handshake: the one after the coordinator's (before it at 65535)."""
    return coordinator_port + 1 if coordinator_port < 65535 else coordinator_port - 1


def slurm_port(job_id: int, step_id: int) -> int:
    """The coordinator port of a SLURM job step (the handshake uses the next one).

    Job ids less than 6144 apart never share a port at the same step, nor do two steps of one job;
    a rarer collision makes the second run's process 0 exit 2 saying the port is taken, and keeps
    its other processes out of the first run (the handshake). $JAX_COORDINATOR_PORT overrides it."""
    return SLURM_PORT_BASE + 2 * ((job_id + SLURM_STEP_STRIDE * step_id) % SLURM_PORT_PAIRS)


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
        step = environ.get(SLURM_STEP_ID, "0")
        port = coordinator_port(environ) or slurm_port(
            _int(environ[SLURM_JOB_ID], SLURM_JOB_ID), _int(step, SLURM_STEP_ID) if step.isdigit() else 0)
        address = f"{expand_nodelist(environ[SLURM_STEP_NODELIST])[0]}:{port}"
    cluster = _checked("slurm", address, count, index, ENV_COORDINATOR_ADDRESS, SLURM_NTASKS, SLURM_PROCID)
    return dataclasses.replace(cluster, local_device_ids=slurm_local_device_ids(environ))


def _from_kubernetes(environ: Mapping[str, str], fqdn: str | None) -> Cluster | None:
    if K8S_COMPLETION_INDEX not in environ:
        return None
    index = _int(environ.get(ENV_PROCESS_ID, environ[K8S_COMPLETION_INDEX]), K8S_COMPLETION_INDEX)
    if ENV_NUM_PROCESSES not in environ:
        raise ConfigError(f"a Kubernetes Indexed Job pod ({K8S_COMPLETION_INDEX}={index}) needs {ENV_NUM_PROCESSES} "
                          f"set to the Job's completions (examples/kubernetes/)")
    count = _int(environ[ENV_NUM_PROCESSES], ENV_NUM_PROCESSES)
    if count == 1:
        return None
    address = environ.get(ENV_COORDINATOR_ADDRESS)
    if address is None:
        if fqdn is None:
            import socket

            fqdn = socket.getfqdn()
        address = f"{kubernetes_first_pod(fqdn, environ.get(K8S_POD_HOSTNAME, ''), index)}:{_cloud_port(environ)}"
    return _checked("kubernetes", address, count, index, ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES,
                    K8S_COMPLETION_INDEX)


def kubernetes_first_pod(fqdn: str, hostname: str, index: int) -> str:
    """The DNS name of pod 0 of this pod's Indexed Job: `trainer-3.workers.ns.svc.cluster.local` ->
    `trainer-0.workers.ns.svc.cluster.local` (a JobSet's `js-w-0-3.js` -> `js-w-0-0.js`). Without a
    subdomain (no headless Service) a pod's name does not resolve: set JAX_COORDINATOR_ADDRESS."""
    name, _, domain = fqdn.partition(".")
    name = name or hostname
    if not name.endswith(f"-{index}") or not domain:
        raise ConfigError(f"cannot tell the first pod's DNS name from this pod's ({fqdn or hostname!r}, index {index}): "
                          f"give the Job's pods a headless Service as their subdomain, or set {ENV_COORDINATOR_ADDRESS} "
                          f"(examples/kubernetes/)")
    return f"{name[:-len(str(index))]}0.{domain}"


def _from_cloud(environ: Mapping[str, str]) -> Cluster | None:
    """SkyPilot's node, else dstack's. Where a node carries both platforms' variables they must agree
    on the node count, this node's rank and the head node (the head only without
    $JAX_COORDINATOR_ADDRESS): then SkyPilot's are taken (the same numbers). Where they disagree,
    ConfigError (exit 2) naming both variables of each disagreement, not SkyPilot's silently:
    neither platform's set is the more likely to be right (one is stale: exported by an image, a
    shell profile or an outer launch), and a guess that is wrong does not fail, it waits for a
    coordinator that never comes, or gives two nodes one rank, until --startup-timeout."""
    if all(name in environ for name in (SKYPILOT_NODE_IPS, SKYPILOT_NODE_RANK, DSTACK_MASTER_NODE_IP,
                                          DSTACK_NODE_RANK, DSTACK_NODES_NUM)):
        ips = _skypilot_ips(environ)
        sky_rank = _int(environ[SKYPILOT_NODE_RANK], SKYPILOT_NODE_RANK)
        count = _int(environ[DSTACK_NODES_NUM], DSTACK_NODES_NUM)
        rank = _int(environ[DSTACK_NODE_RANK], DSTACK_NODE_RANK)
        master = environ[DSTACK_MASTER_NODE_IP].strip()
        differ = [f"{SKYPILOT_NODE_IPS} lists {len(ips)} nodes, {DSTACK_NODES_NUM}={count}"] if len(ips) != count else []
        if sky_rank != rank:
            differ.append(f"{SKYPILOT_NODE_RANK}={sky_rank}, {DSTACK_NODE_RANK}={rank}")
        if ENV_COORDINATOR_ADDRESS not in environ and ips and ips[0].lower() != master.lower():
            differ.append(f"{SKYPILOT_NODE_IPS} starts with {ips[0]}, {DSTACK_MASTER_NODE_IP}={master}")
        if differ:
            raise ConfigError(f"SkyPilot's and dstack's variables disagree ({'; '.join(differ)}): unset the stale "
                              f"platform's, or set {ENV_COORDINATOR_ADDRESS}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}")
    return _from_skypilot(environ) or _from_dstack(environ)


def _skypilot_ips(environ: Mapping[str, str]) -> list[str]:
    return [line.strip() for line in environ[SKYPILOT_NODE_IPS].splitlines() if line.strip()]


def _from_skypilot(environ: Mapping[str, str]) -> Cluster | None:
    if SKYPILOT_NODE_IPS not in environ or SKYPILOT_NODE_RANK not in environ:
        return None
    ips = _skypilot_ips(environ)
    if len(ips) <= 1:
        return None
    return _checked("skypilot", environ.get(ENV_COORDINATOR_ADDRESS) or _host_port(ips[0], _cloud_port(environ)),
                    len(ips), _int(environ[SKYPILOT_NODE_RANK], SKYPILOT_NODE_RANK), ENV_COORDINATOR_ADDRESS,
                    SKYPILOT_NODE_IPS, SKYPILOT_NODE_RANK)


def _from_dstack(environ: Mapping[str, str]) -> Cluster | None:
    names = (DSTACK_MASTER_NODE_IP, DSTACK_NODE_RANK, DSTACK_NODES_NUM)
    if not all(name in environ for name in names):
        return None
    count = _int(environ[DSTACK_NODES_NUM], DSTACK_NODES_NUM)
    if count == 1:
        return None
    address = environ.get(ENV_COORDINATOR_ADDRESS) or _host_port(environ[DSTACK_MASTER_NODE_IP].strip(),
                                                                  _cloud_port(environ))
    return _checked("dstack", address, count, _int(environ[DSTACK_NODE_RANK], DSTACK_NODE_RANK),
                    ENV_COORDINATOR_ADDRESS, DSTACK_NODES_NUM, DSTACK_NODE_RANK)


def _cloud_port(environ: Mapping[str, str]) -> int:
    return coordinator_port(environ) or CLOUD_PORT


def coordinator_port(environ: Mapping[str, str]) -> int | None:
    """$JAX_COORDINATOR_PORT (None where unset or empty); a bad one is ConfigError naming
    JAX_COORDINATOR_PORT, not the coordinator address made from it."""
    text = environ.get(ENV_COORDINATOR_PORT, "").strip()
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"{ENV_COORDINATOR_PORT}={environ[ENV_COORDINATOR_PORT]!r} is not a port between 1 and 65535")
    return int(text)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def slurm_local_device_ids(environ: Mapping[str, str]) -> tuple[int, ...] | None:
    """Which of the node's GPUs this SLURM task owns.

    * one task per node (`--ntasks-per-node=1`): the task owns all GPUs of its node;
    * several tasks per node, SLURM already bound GPUs to each task (`--gpus-per-task`, so
      CUDA_VISIBLE_DEVICES lists fewer GPUs than there are tasks on the node): all it sees;
    * several tasks per node sharing the node's GPUs: one GPU each, number SLURM_LOCALID.
    "All" is said explicitly, `(0, .., n - 1)` for the n GPUs of CUDA_VISIBLE_DEVICES (else
    SLURM_GPUS_ON_NODE): given None, `jax.distributed.initialize` runs its own SLURM detection and
    keeps GPU number SLURM_LOCALID alone, so a task that owns its node's 8 GPUs would train on one.
    None where the count is unknown (no GPUs allocated: a CPU job) or `JAX_LOCAL_DEVICE_IDS=0,1`
    decides (JAX reads it itself).
    """
    if ENV_LOCAL_DEVICE_IDS in environ:
        return None
    per_node = expand_tasks_per_node(environ.get(SLURM_STEP_TASKS_PER_NODE, "1"))
    node = _int(environ.get(SLURM_NODEID, "0"), SLURM_NODEID)
    tasks_here = per_node[node] if node < len(per_node) else max(per_node)
    visible = [d for d in environ.get(CUDA_VISIBLE_DEVICES, "").split(",") if d.strip()]
    if tasks_here <= 1 or (visible and len(visible) < tasks_here):
        count = len(visible) or _int(environ.get(SLURM_GPUS_ON_NODE, "0"), SLURM_GPUS_ON_NODE)
        return tuple(range(count)) if count else None
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


def in_batch_script_of_several_tasks(environ: Mapping[str, str]) -> bool:
    """A SLURM job of several tasks, but this is not a task srun started (no step node list)."""
    tasks = environ.get(SLURM_NTASKS, "1")
    return SLURM_JOB_ID in environ and SLURM_STEP_NODELIST not in environ and tasks.isdigit() and int(tasks) > 1
