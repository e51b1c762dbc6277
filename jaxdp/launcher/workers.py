"""The local processes of a launch: started bound to their cores, watched, signalled, restarted.

    launcher = Launcher(command, nproc=2, bind=True)
    launcher.start(attempt, address, run_id, first=0, world=2)     # JAX_* variables in each child
    outcome = launcher.check()                                      # None while all run
    decide(outcomes, attempt, max_restarts, stop, ...)               # restart, stop, or end with a code

`python -m jaxdp.launch` (jaxdp/launch.py) drives it, for one node or several (jaxdp/launcher/rendezvous.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Sequence

from jaxdp.checkpoint import saveplan
from jaxdp.cluster.detect import ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_RUN_ID, handshake_port
from jaxdp.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_PEER_LOST, EXIT_PREEMPTED

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
GRACE_S = 5.0  # after one child is lost, how long the others get to exit by themselves (their peer watch)
PR_SET_PDEATHSIG = 1  # Linux prctl: a signal for this process when the thread that started it ends


def bindings(count: int, cores: Sequence[int]) -> list[set[int]]:
    """Disjoint, contiguous, near-equal sets of `cores`, one per process; with fewer cores than
    processes, each process gets one core and some share (round robin)."""
    cores = sorted(cores)
    if count > len(cores):
        return [{cores[i % len(cores)]} for i in range(count)]
    size, extra = divmod(len(cores), count)
    out, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        out.append(set(cores[start:end]))
        start = end
    return out


def has_accelerator() -> bool:
    """True on a host with an NVIDIA GPU or a TPU (by their device files; no JAX import), unless
    JAX_PLATFORMS asks for the CPU only."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    return any(os.path.exists(path) for path in ("/dev/nvidiactl", "/dev/accel0", "/dev/vfio/0"))


def free_port() -> int:
    """A free TCP port on 127.0.0.1 whose handshake port (the next one) is free as well."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                with socket.socket() as after:
                    after.bind(("127.0.0.1", handshake_port(port)))
            except OSError:
                continue
            return port
    raise OSError("found no free pair of ports on 127.0.0.1")


def _libc() -> ctypes.CDLL | None:
    """The C library, for prctl (Linux only); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def say(message: str) -> None:
    """One line of the launcher's on stderr; on a terminal it first clears the line, where rank 0's
    progress bar may stand (the bar draws itself again at its next update)."""
    clear = "\r\x1b[K" if sys.stderr.isatty() else ""
    print(f"{clear}jaxdp.launch: {message}", file=sys.stderr, flush=True)


def describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def stop_code(signum: int) -> int:
    """The launcher's exit code when a stop signal ends it between attempts."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


def shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one node's processes of one attempt ended."""

    kind: str                   # finished, lost, bad_input, stopped (told to, or a signal came first), gone (a launcher vanished)
    process: int | None = None  # lost / bad_input: which process (None: the command could not start)
    code: int = 0               # finished: the first nonzero exit code; lost / bad_input: that process's
    node: int = 0

    @property
    def trouble(self) -> bool:
        return self.kind in ("lost", "bad_input", "gone")


def decide(outcomes: Sequence[Outcome], attempt: int, max_restarts: int, stop: int | None,
           world: int) -> tuple[str, int, str | None]:
    """("restart" or "exit", exit code, the line that says so) from every node's outcome."""
    bad = next((o for o in outcomes if o.kind == "bad_input"), None)
    if bad is not None:  # not transient: never restarted
        return "exit", EXIT_BAD_INPUT, None if bad.process is None else (
            f"process {bad.process} exited with code {EXIT_BAD_INPUT} (bad input: its message above says what to "
            f"change); stopped the others, no restart; exit code {EXIT_BAD_INPUT}")
    gone = next((o for o in outcomes if o.kind == "gone"), None)
    if gone is not None:
        return "exit", EXIT_PEER_LOST, (f"the launcher of node {gone.node} is gone; stopped the others, no restart; "
                                        f"exit code {EXIT_PEER_LOST}")
    if all(o.kind == "finished" for o in outcomes):
        code = next((o.code for o in outcomes if o.code), 0)
        return "exit", code, f"all {world} processes finished; exit code {code}"
    if stop is not None:  # told to stop: a restart would undo it
        return "exit", stop_code(stop), f"received {signal.Signals(stop).name}: no restart; exit code {stop_code(stop)}"
    lost = [o for o in outcomes if o.kind == "lost"]
    cause = next((o for o in lost if o.code < 0), lost[0] if lost else None)
    if cause is None or attempt >= max_restarts:
        code = EXIT_PEER_LOST if cause is None else shell_code(cause.code)
        return "exit", code, f"no restarts left (--max-restarts {max_restarts}); exit code {code}"
    return "restart", 0, f"restarting all {world} processes ({attempt + 1} of {max_restarts})"


class Launcher:
    def __init__(self, command: list[str], nproc: int, bind: bool):
        self.command, self.nproc = command, nproc
        self.cores = bindings(nproc, os.sched_getaffinity(0)) if bind and hasattr(os, "sched_setaffinity") else None
        self.children: list[subprocess.Popen] = []
        self.sent: set[int] = set()  # signals the launcher forwarded: a child they kill is not "lost"
        self.stop: int | None = None  # the first SIGINT / SIGTERM / SIGUSR1 received: start nothing more
        self.relay: list[int] = []  # signals received here, not yet passed to the other nodes' launchers
        self.launch_id = uuid.uuid4().hex[:12]
        self.libc = _libc()  # loaded here: the children only call it, between fork and exec
        self.zygote = None  # an elastic run's warm start for restarts (jaxdp/launcher/zygote.py)
        # The run's failure record, in every child's environment (--save-every auto sets its
        # interval from it, jaxdp/checkpoint/saveplan.py): when the launcher started, when a process was lost.
        self.launched_at, self.failures = time.time(), []

    def start_zygote(self, preload: Sequence[str] = ()) -> None:
        """Start the zygote that later restarts fork from (command `PYTHON -m MODULE ...` only),
        with `preload` imported too (jaxdp/launcher/zygote.py)."""
        from jaxdp.launcher import zygote

        if zygote.module_of(self.command) is not None:
            prepare = lambda me=os.getpid(): _child(None, self.libc, me)  # noqa: E731
            self.zygote = zygote.Zygote(self.command, dict(os.environ), prepare, preload)

    def start(self, attempt: int, address: str, run_id: str, first: int, world: int) -> bool:
        """Start this node's children, processes first .. first + nproc - 1 of `world`; False (nothing
        started) if a stop signal came first. OSError if the command cannot be started (the children
        already started are killed)."""
        # No stop signal may fall between "is there one?" and the last child's start: the handler
        # runs after the unblock below and reaches every child.
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        try:
            if self.stop is not None:
                return False
            self.children = []
            self.failures += [time.time()] * (attempt - len(self.failures))  # attempt k follows k losses
            for rank in range(self.nproc):
                self.children.append(self._spawn(rank, {ENV_COORDINATOR_ADDRESS: address, ENV_NUM_PROCESSES: str(world),
                                                        ENV_PROCESS_ID: str(first + rank), ENV_RUN_ID: run_id}))
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        where = ("not bound to cores (--no-bind)" if self.cores is None else
                 "bound to cores " + ", ".join(f"{first + rank}: {_cores(c)}" for rank, c in enumerate(self.cores))
                 + " (--no-bind to turn off)")
        again = f" (restart {attempt})" if attempt else ""
        which = (f"{self.nproc} processes" if world == self.nproc else f"process {first} of {world}" if self.nproc == 1
                 else f"processes {first}..{first + self.nproc - 1} of {world}")
        say(f"started {which}{again}, coordinator {address}, {where}")
        return True

    def _spawn(self, rank: int, env: dict[str, str]) -> subprocess.Popen:
        """Start the command as local process `rank` with `env` added (stop signals blocked by the caller)."""
        cores = None if self.cores is None else self.cores[rank]
        mtbf_s = saveplan.mtbf(self.launched_at, self.failures)
        env = {**env, saveplan.ENV_RESTARTS: str(len(self.failures)),
               **({saveplan.ENV_MTBF: f"{mtbf_s:.3f}"} if mtbf_s is not None else {})}
        if self.zygote is not None and self.zygote.usable():
            try:
                return self.zygote.fork(self.command[3:], env, cores)
            except OSError:
                pass  # the ordinary way
        # Own session: a Ctrl-C in the terminal reaches the launcher only, which forwards it once.
        # Spawned from the main thread: PR_SET_PDEATHSIG fires when the spawning thread ends.
        try:
            prepare = lambda c=cores, me=os.getpid(): _child(c, self.libc, me)  # noqa: E731
            return subprocess.Popen(self.command, env={**os.environ, **env}, preexec_fn=prepare, start_new_session=True)
        except (OSError, subprocess.SubprocessError):
            self.kill_all()
            raise

    def start_one(self, rank: int, env: dict[str, str]) -> bool:
        """(Re)start local process `rank` alone (an elastic run); False if a stop signal came first,
        or the command cannot be started (one line said)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        try:
            if self.stop is not None:
                return False
            try:
                child = self._spawn(rank, env)
            except (OSError, subprocess.SubprocessError) as err:
                self._cannot_start(err)
                return False
            if rank < len(self.children):
                self.children[rank] = child
            else:
                self.children.append(child)
            return True
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)

    def begin(self, attempt: int, address: str, run_id: str, first: int, world: int) -> Outcome | None:
        """Start the children: None, or the outcome that stands instead (a stop signal came first,
        or the command cannot be started: one line said)."""
        try:
            if self.start(attempt, address, run_id, first, world):
                return None
        except (OSError, subprocess.SubprocessError) as err:
            self._cannot_start(err)
            return Outcome("bad_input", code=EXIT_BAD_INPUT)
        return Outcome("stopped")

    def _cannot_start(self, err: OSError | subprocess.SubprocessError) -> None:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        say(f"error: cannot start {self.command[0]!r}: {reason}")

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()

    def kill_all(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait()

    def forward(self, signum: int, frame: object) -> None:
        """The signal handler: forward to this node's children, and to the other nodes (`relay`)."""
        self.relay.append(signum)
        self.deliver(signum)

    def deliver(self, signum: int) -> None:
        if self.stop is None:
            self.stop = signum
        self.sent.add(signum)
        for child in self.children:
            if child.poll() is None:
                try:
                    child.send_signal(signum)
                except ProcessLookupError:
                    pass

    def check(self, first: int = 0) -> Outcome | None:
        """None while the children run; their outcome once all exited, one was lost or one exited
        with bad input (numbered from `first`)."""
        codes = [child.poll() for child in self.children]
        bad = [rank for rank, code in enumerate(codes) if code == EXIT_BAD_INPUT]
        if bad:  # not transient: never a restart, whatever the others did
            return Outcome("bad_input", first + bad[0], EXIT_BAD_INPUT)
        lost = [rank for rank, code in enumerate(codes) if code is not None and self.lost(code)]
        if lost:  # a process killed by a signal is the cause; the others' lost-peer exits its effect
            rank = next((rank for rank in lost if codes[rank] < 0), lost[0])
            return Outcome("lost", first + rank, codes[rank])
        if all(code is not None for code in codes):
            return Outcome("finished", code=next((shell_code(c) for c in codes if c), 0))
        return None

    def settled(self, outcome: Outcome, first: int = 0) -> Outcome:
        """`outcome` once the others have stopped: a lost peer can exit before the process whose bad
        input set it off has finished exiting, and bad input is never restarted."""
        self.stop_the_rest()
        after = self.check(first) if outcome.kind == "lost" else None  # (every child has exited now)
        return after if after is not None and after.kind == "bad_input" else outcome

    def lost(self, code: int) -> bool:
        return code == EXIT_PEER_LOST or (code < 0 and -code not in self.sent and -code != signal.SIGINT)

    def stop_the_rest(self) -> None:
        deadline = time.monotonic() + GRACE_S
        for child in self.children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _child(cores: set[int] | None, libc: ctypes.CDLL | None, launcher: int) -> None:
    """Runs in each child between fork and exec (the launcher has no other threads)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # blocked in the launcher while it starts them
    if libc is not None:  # SIGTERM when the launcher's main thread ends, by kill -9 too
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != launcher:  # it ended before prctl: nothing would send the signal
            os._exit(128 + signal.SIGTERM)
    if cores is not None:
        os.sched_setaffinity(0, cores)


def _cores(cores: set[int]) -> str:
    ordered = sorted(cores)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))
