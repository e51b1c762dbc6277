"""A slow network on one machine: N hosts in their own Linux network namespaces, each joined to a
bridge by a veth pair whose bandwidth `tc` limits.

    with Testbed(num_hosts=2, rate="100mbit") as bed:
        procs = [bed.run(i, [sys.executable, "-m", "jaxdp.train", "--coordinator-address",
                             f"{bed.address(0)}:12355", "--num-processes", "2", "--process-id", str(i)])
                 for i in range(2)]

Layout (built with iproute2 as root: `ip netns`, `ip link`, `tc`; nothing else is touched):

    namespace <tag>-h0: lo, eth0 10.77.0.1/24 ──veth── h0 ┐
    namespace <tag>-h1: lo, eth0 10.77.0.2/24 ──veth── h1 ┼─ bridge br0 in namespace <tag>-br
    ...                                                    ┘

Every interface lives in a namespace the testbed created (the bridge too), so its traffic never
reaches the machine's own interfaces and two testbeds never collide; names carry the pid and a
counter (`jaxdp-tb-<pid>-<n>`). Leaving the `with` block kills the processes `run` started and
deletes every namespace, veth and bridge it made, also after an error; a later testbed deletes
what a killed process left behind.

Bandwidth: a token bucket (`tc qdisc ... tbf`) on both ends of each host's veth, so `rate` bounds
what a host sends and what it receives (a full-duplex link). Measured on a 2-core VM: 100mbit
carried 94-95 Mbit/s of TCP. Added latency needs the `netem` qdisc, which some kernels lack
(this project's CI kernel does: "Specified qdisc kind is unknown"): `latency=` uses netem where it
exists (netem delay on each host's eth0, the token bucket below it) and raises `TestbedError`
saying so where it does not; there is no user-space delaying relay.

CPU: `run(host, argv, cpu=0.5)` holds a process to half of one core, to make one worker slower than
the others for real. Where the cpu controller of cgroups can be written (cgroup v1's
`cpu.cfs_quota_us`, or v2's `cpu.max`) the process goes into a cgroup of its own with that quota,
over a 20 ms period (short, so the quota does not beat with rounds of a tenth of a second);
elsewhere it shares its core with round(1 / cpu) - 1 busy-looping processes pinned to the same core
(so only 1/2, 1/3, ... of a core). `cpu_limit_kind()` says which one this machine gets.

`unavailable_reason()` says in one line why no testbed can be built here (not root, no `ip` or
`tc`, no namespaces or token bucket), or None; tests skip with it.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Mapping, Sequence

from jaxdp.errors import InputError

SUBNET = "10.77.0"            # host i is SUBNET.(i + 1)/24; each testbed is its own isolated network
PREFIX = "jaxdp-tb"           # namespace names: PREFIX-<pid>-<n>-h<i> and PREFIX-<pid>-<n>-br
HOST_IFNAME = "eth0"          # each host's end of its veth, inside its namespace
BRIDGE = "br0"
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_counter = itertools.count()


class TestbedError(InputError):
    """The testbed cannot do what was asked (no root, no netem, a bad rate): one line saying why."""

    __test__ = False  # not a pytest test class


def parse_rate(rate: str) -> int:
    """tc's rate syntax in bits per second: "100mbit" -> 100_000_000 (k, m, g, t are powers of 1000)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*", str(rate).lower())
    if not match or float(match.group(1)) <= 0:
        raise TestbedError(f"rate={rate!r} is not a bandwidth like 10mbit, 100mbit or 1gbit")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode:
        raise TestbedError(f"`{' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


@functools.cache
def unavailable_reason() -> str | None:
    """Why no testbed can be built on this machine, in one line; None when one can."""
    if not os.path.isdir("/proc/self/ns"):
        return "the slow-network testbed needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the slow-network testbed needs root (it runs ip netns add, ip link add and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the slow-network testbed needs {' and '.join(missing)} (Debian: apt-get install iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _ip("ip", "netns", "add", probe)
        _ip("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _ip("tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", *_tbf_args(10**8))
    except TestbedError as err:
        return f"the slow-network testbed cannot be built here: {err}"
    finally:
        _ip("ip", "netns", "del", probe, check=False)
    return None


@functools.cache
def require(command: str) -> None:
    """A benchmark's first act: exit 2 with one line (`jaxdp.bench: COMMAND: why`) where no testbed
    can be built here."""
    reason = unavailable_reason()
    if reason:
        print(f"jaxdp.bench: {command}: {reason}", file=sys.stderr)
        raise SystemExit(2)


def has_netem() -> bool:
    """Whether this kernel has the netem qdisc (added latency); probed once in a scratch namespace."""
    probe = f"{PREFIX}-{os.getpid()}-netem"
    try:
        _ip("ip", "netns", "add", probe)
        return _ip("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                   check=False).returncode == 0
    except TestbedError:
        return False
    finally:
        _ip("ip", "netns", "del", probe, check=False)


CPU_PERIOD_US = 20_000
_CGROUP_V1_CPU = "/sys/fs/cgroup/cpu"
_CGROUP_V2 = "/sys/fs/cgroup"


@functools.cache
def cpu_limit_kind() -> str:
    """How `Testbed.run(..., cpu=f)` holds a process to a fraction of a core here: "cgroup v1",
    "cgroup v2" or "shared core"."""
    if os.access(os.path.join(_CGROUP_V1_CPU, "cpu.cfs_quota_us"), os.R_OK) and os.access(_CGROUP_V1_CPU, os.W_OK):
        return "cgroup v1"
    try:
        with open(os.path.join(_CGROUP_V2, "cgroup.subtree_control")) as f:
            if "cpu" in f.read().split() and os.access(_CGROUP_V2, os.W_OK):
                return "cgroup v2"
    except OSError:
        pass
    return "shared core"


def burst_bytes(bits_per_s: int) -> int:
    """The token bucket's burst at `bits_per_s`: 10 ms of traffic, at least 64 KiB (so one TSO
    segment always fits). Bytes up to it pass at the veth's speed once the bucket has refilled."""
    return max(64 * 1024, bits_per_s // 8 // 100)


def _tbf_args(bits_per_s: int) -> list[str]:
    """A token bucket at `bits_per_s` (`burst_bytes`) and a queue of at most 100 ms (then packets
    drop, as on a real link)."""
    return ["tbf", "rate", f"{bits_per_s}bit", "burst", str(burst_bytes(bits_per_s)), "latency", "100ms"]


def remove_leftovers() -> None:
    """Delete the namespaces of testbeds whose process no longer exists (killed before its teardown)."""
    try:
        names = os.listdir("/var/run/netns")
    except OSError:
        return
    for name in names:
        match = re.fullmatch(rf"{PREFIX}-(\d+)-.*", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _ip("ip", "netns", "del", name, check=False)


class Testbed:
    """`num_hosts` namespaces on one bridge; `rate` (tc syntax, e.g. "100mbit"; None: unshaped)
    bounds each host's link in each direction; `latency` (e.g. "5ms", netem only) delays every
    packet a host sends. Use it as a context manager."""

    __test__ = False  # not a pytest test class

    def __init__(self, num_hosts: int = 2, rate: str | None = None, latency: str | None = None):
        if num_hosts < 2 or num_hosts > 250:
            raise TestbedError(f"num_hosts={num_hosts} must be between 2 and 250")
        self.num_hosts, self.rate, self.latency = num_hosts, rate, latency
        self.bits_per_s = None if rate is None else parse_rate(rate)
        if latency is not None and not re.fullmatch(r"\d+(\.\d+)?(us|ms|s)", latency):
            raise TestbedError(f"latency={latency!r} is not a delay like 500us, 5ms or 0.1s")
        self.tag = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.processes: list[subprocess.Popen] = []
        self._namespaces: list[str] = []
        self._cgroups: list[str] = []
        self._hogs: list[subprocess.Popen] = []

    def namespace(self, host: int) -> str:
        return f"{self.tag}-h{host}"

    def address(self, host: int) -> str:
        """The IPv4 address of `host` (its eth0), e.g. 10.77.0.1 for host 0."""
        if not 0 <= host < self.num_hosts:
            raise TestbedError(f"host {host} is not one of 0..{self.num_hosts - 1}")
        return f"{SUBNET}.{host + 1}"

    def sent_bytes(self) -> list[int]:
        """Bytes each host has sent over the link so far: its bridge port's received-bytes counter
        (the kernel's, after the host's token bucket: what crossed the wire, headers and
        acknowledgements included). One `ip` call for every host."""
        out = _ip("ip", "-j", "-s", "-n", f"{self.tag}-br", "link", "show", "type", "veth").stdout
        ports = {link["ifname"].split("@")[0]: link for link in json.loads(out)}
        return [int(ports[f"h{host}"]["stats64"]["rx"]["bytes"]) for host in range(self.num_hosts)]

    # -- set-up and teardown ---------------------------------------------------------------------

    def __enter__(self) -> "Testbed":
        reason = unavailable_reason()
        if reason:
            raise TestbedError(reason)
        if self.latency is not None and not has_netem():
            raise TestbedError(f"latency={self.latency!r} needs the netem qdisc, which this kernel lacks "
                               f"(tc: \"Specified qdisc kind is unknown\"); leave latency out, or use a kernel with sch_netem")
        remove_leftovers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        bridge_ns = f"{self.tag}-br"
        self._add_namespace(bridge_ns)
        _ip("ip", "-n", bridge_ns, "link", "add", BRIDGE, "type", "bridge")
        _ip("ip", "-n", bridge_ns, "link", "set", BRIDGE, "up")
        for host in range(self.num_hosts):
            ns, port = self.namespace(host), f"h{host}"
            self._add_namespace(ns)
            _ip("ip", "-n", bridge_ns, "link", "add", port, "type", "veth", "peer", "name", HOST_IFNAME, "netns", ns)
            _ip("ip", "-n", bridge_ns, "link", "set", port, "master", BRIDGE)
            _ip("ip", "-n", bridge_ns, "link", "set", port, "up")
            _ip("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", HOST_IFNAME)
            _ip("ip", "-n", ns, "link", "set", HOST_IFNAME, "up")
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            self._shape(ns, HOST_IFNAME, sending=True)   # what the host sends
            self._shape(bridge_ns, port, sending=False)  # what it receives

    def _shape(self, ns: str, dev: str, sending: bool) -> None:
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        if self.latency is not None and sending:
            _ip(*tc, "root", "handle", "1:", "netem", "delay", self.latency)
            if self.bits_per_s is not None:
                _ip(*tc, "parent", "1:1", "handle", "10:", *_tbf_args(self.bits_per_s))
        elif self.bits_per_s is not None:
            _ip(*tc, "root", *_tbf_args(self.bits_per_s))

    def _add_namespace(self, name: str) -> None:
        _ip("ip", "netns", "add", name)
        self._namespaces.append(name)

    def close(self) -> None:
        """Kill what `run` started, then delete every namespace (and with them the veths and the bridge)."""
        for proc in self.processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for hog in self._hogs:
            hog.kill()
            hog.wait()
        self._hogs.clear()
        for group in self._cgroups:
            try:
                os.rmdir(group)
            except OSError:
                pass
        self._cgroups.clear()
        bridge_ns = f"{self.tag}-br"
        if bridge_ns in self._namespaces:  # veths first: a deleted namespace's devices can linger a moment
            for host in range(self.num_hosts):
                _ip("ip", "-n", bridge_ns, "link", "del", f"h{host}", check=False)
        for name in reversed(self._namespaces):
            _ip("ip", "netns", "del", name, check=False)
        self._namespaces.clear()

    # -- running commands ------------------------------------------------------------------------

    def run(self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None, cpu: float | None = None,
            **popen_kwargs) -> subprocess.Popen:
        """Start `argv` inside host `host`'s namespace (`ip netns exec`), in a session of its own;
        killed at teardown if still running. `cpu`: hold it to that fraction of one core (module
        docstring); a `preexec_fn` in `popen_kwargs` (e.g. pinning it to a core) still runs."""
        self.address(host)  # checks the index
        if not self._namespaces:
            raise TestbedError("the testbed is not up: use it inside `with Testbed(...) as bed:`")
        if cpu is not None and not 0 < cpu <= 1:
            raise TestbedError(f"cpu={cpu!r} must be a fraction of one core, above 0 and at most 1")
        limited = cpu is not None and cpu < 1
        kind = cpu_limit_kind() if limited else None
        if kind in ("cgroup v1", "cgroup v2"):
            group = self._cgroup(host, cpu, kind)
            then = popen_kwargs.pop("preexec_fn", None)

            def enter() -> None:
                with open(os.path.join(group, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
                if then is not None:
                    then()

            popen_kwargs["preexec_fn"] = enter
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv],
                                env=None if env is None else dict(env), start_new_session=True, **popen_kwargs)
        self.processes.append(proc)
        if kind == "shared core":
            cores = os.sched_getaffinity(proc.pid)
            for _ in range(max(1, round(1 / cpu) - 1)):
                self._hogs.append(subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"], start_new_session=True,
                    preexec_fn=lambda cores=cores: os.sched_setaffinity(0, cores)))
        return proc

    def _cgroup(self, host: int, cpu: float, kind: str) -> str:
        """A cpu cgroup of this testbed's for `host`, with the quota `cpu` of one core."""
        group = os.path.join(_CGROUP_V1_CPU if kind == "cgroup v1" else _CGROUP_V2, f"{self.tag}-h{host}")
        os.makedirs(group, exist_ok=True)
        if group not in self._cgroups:
            self._cgroups.append(group)
        quota = max(1000, int(cpu * CPU_PERIOD_US))
        if kind == "cgroup v1":
            for name, value in (("cpu.cfs_period_us", CPU_PERIOD_US), ("cpu.cfs_quota_us", quota)):
                with open(os.path.join(group, name), "w") as f:
                    f.write(str(value))
        else:
            with open(os.path.join(group, "cpu.max"), "w") as f:
                f.write(f"{quota} {CPU_PERIOD_US}")
        return group
