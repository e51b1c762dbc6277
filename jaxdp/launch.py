"""Start N local processes of a multi-process run, bind them to cores, restart them when one is lost.

    python -m jaxdp.launch --nproc-per-node 2 -- python -m jaxdp.train --devices 4 --steps 50
    python -m jaxdp.launch --nproc-per-node 2 --max-restarts 3 -- python -m jaxdp.train --checkpoint-dir ckpt --save-every 10
    python -m jaxdp.launch --nproc-per-node 4 --no-bind -- python my_script.py   # calls jaxdp.initialize()

Like torchrun's standalone mode:
* a free coordinator port on 127.0.0.1 (the next port free too: the run handshake's), and
  `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` and a fresh `JAXDP_RUN_ID` in each
  child's environment (`jaxdp.train` and `jaxdp.initialize()` read them);
* on a CPU host, each process is bound to its own disjoint set of cores (`os.sched_setaffinity`
  in the child before it starts, so XLA sizes its thread pools to them; N processes that each size
  their pools to the whole machine fight over it; README "Launcher" has the figures). `--no-bind`
  leaves them unbound. Hosts with accelerators are not bound (the work is on the devices);
* SIGINT, SIGTERM and SIGUSR1 are forwarded to every child (SIGTERM / SIGUSR1: save and exit 75);
  one that arrives while the children are being restarted stops the launcher instead (exit 75, or
  130 for SIGINT): no new attempt starts;
* the children die with the launcher: each gets SIGTERM (save and exit 75) when the launcher ends,
  even by kill -9 (Linux: PR_SET_PDEATHSIG), so none trains on as an orphan holding the checkpoint
  directory;
* when a child is lost (exits with EXIT_PEER_LOST, the lost-peer or stall code, or is killed by a
  signal the launcher did not send), the others get a few seconds to exit by themselves, then are
  killed, and all N are started again, up to --max-restarts times. With --checkpoint-dir the run
  resumes from its last checkpoint; no completed step is lost;
* a child that exits with EXIT_BAD_INPUT (2) is never restarted (bad input is not transient): the
  others are stopped and the launcher exits 2;
* otherwise the launcher exits with the children's code (the first nonzero one, else 0).
Each event is one line on stderr, prefixed "jaxdp.launch:". Bad usage (or a command that cannot be
started) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Sequence

from jaxdp.cluster import ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_RUN_ID, handshake_port
from jaxdp.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_PEER_LOST, EXIT_PREEMPTED

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
GRACE_S = 5.0  # after one child is lost, how long the others get to exit by themselves (their peer watch)
PR_SET_PDEATHSIG = 1  # Linux prctl: a signal for this process when the thread that started it ends


class UsageError(Exception):
    """Bad launcher flags: one line, exit 2 (argparse would print the usage as well)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m jaxdp.launch", allow_abbrev=False,
                     description=__doc__.split("\n\n")[0],
                     usage="python -m jaxdp.launch --nproc-per-node N [--max-restarts R] [--no-bind] -- COMMAND ...")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="processes to start on this machine")
    parser.add_argument("--max-restarts", type=int, default=0, help="restart all processes up to R times when one is lost")
    parser.add_argument("--no-bind", dest="bind", action="store_false", help="do not bind each process to its own cores")
    return parser


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
    print(f"jaxdp.launch: {message}", file=sys.stderr, flush=True)


def describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def stop_code(signum: int) -> int:
    """The launcher's exit code when a stop signal ends it between attempts."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


def shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


class Launcher:
    def __init__(self, command: list[str], nproc: int, bind: bool):
        self.command, self.nproc = command, nproc
        self.cores = bindings(nproc, os.sched_getaffinity(0)) if bind and hasattr(os, "sched_setaffinity") else None
        self.children: list[subprocess.Popen] = []
        self.sent: set[int] = set()  # signals the launcher forwarded: a child they kill is not "lost"
        self.stop: int | None = None  # the first SIGINT / SIGTERM / SIGUSR1 received: start nothing more
        self.launch_id = uuid.uuid4().hex[:12]
        self.libc = _libc()  # loaded here: the children only call it, between fork and exec

    def start(self, attempt: int) -> bool:
        """Start all children; False (nothing started) if a stop signal came first. OSError if the
        command cannot be started (the children already started are killed)."""
        port = free_port()
        address = f"127.0.0.1:{port}"
        # No stop signal may fall between "is there one?" and the last child's start: the handler
        # runs after the unblock below and reaches every child.
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        try:
            if self.stop is not None:
                return False
            self.children = []
            for rank in range(self.nproc):
                env = {**os.environ, ENV_COORDINATOR_ADDRESS: address, ENV_NUM_PROCESSES: str(self.nproc),
                       ENV_PROCESS_ID: str(rank), ENV_RUN_ID: f"launch-{self.launch_id}-{attempt}"}
                cores = None if self.cores is None else self.cores[rank]
                # Own session: a Ctrl-C in the terminal reaches the launcher only, which forwards it once.
                # Spawned from the main thread: PR_SET_PDEATHSIG fires when the spawning thread ends.
                try:
                    prepare = lambda c=cores, me=os.getpid(): _child(c, self.libc, me)  # noqa: E731
                    self.children.append(subprocess.Popen(self.command, env=env, preexec_fn=prepare,
                                                          start_new_session=True))
                except (OSError, subprocess.SubprocessError):
                    self.kill_all()
                    raise
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        where = ("not bound to cores (--no-bind)" if self.cores is None else
                 "bound to cores " + ", ".join(f"{rank}: {_cores(c)}" for rank, c in enumerate(self.cores))
                 + " (--no-bind to turn off)")
        again = f" (restart {attempt})" if attempt else ""
        say(f"started {self.nproc} processes{again}, coordinator {address}, {where}")
        return True

    def kill_all(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait()

    def forward(self, signum: int, frame: object) -> None:
        if self.stop is None:
            self.stop = signum
        self.sent.add(signum)
        for child in self.children:
            if child.poll() is None:
                try:
                    child.send_signal(signum)
                except ProcessLookupError:
                    pass

    def wait(self) -> tuple[list[int | None], int | None]:
        """Until all children exit, one is lost or one exits with bad input: (exit codes, rank of the
        lost or bad-input child, or None)."""
        while True:
            codes = [child.poll() for child in self.children]
            bad = [rank for rank, code in enumerate(codes) if code == EXIT_BAD_INPUT]
            if bad:  # not transient: never a restart, whatever the others did
                return codes, bad[0]
            lost = [rank for rank, code in enumerate(codes) if code is not None and self.lost(code)]
            if lost:  # a process killed by a signal is the cause; the others' lost-peer exits its effect
                return codes, next((rank for rank in lost if codes[rank] < 0), lost[0])
            if all(code is not None for code in codes):
                return codes, None
            time.sleep(0.05)

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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    no_command = "error: give the command after --, e.g. python -m jaxdp.launch --nproc-per-node 2 -- python -m jaxdp.train"
    try:
        args = build_parser().parse_args(argv[:split])  # --help / -h: the help, exit 0
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except UsageError as err:
        say(no_command if split == len(argv) else f"error: {err} (python -m jaxdp.launch --help)")
        return EXIT_BAD_INPUT
    command = argv[split + 1:]
    if split == len(argv):
        say(no_command)
        return EXIT_BAD_INPUT
    if not command or args.nproc_per_node <= 0 or args.max_restarts < 0:
        say("error: need a command after --, --nproc-per-node >= 1 and --max-restarts >= 0")
        return EXIT_BAD_INPUT
    launcher = Launcher(command, args.nproc_per_node, args.bind and not has_accelerator())
    for signum in FORWARDED:
        signal.signal(signum, launcher.forward)
    attempt = 0
    while True:
        try:
            started = launcher.start(attempt)
        except (OSError, subprocess.SubprocessError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            say(f"error: cannot start {command[0]!r}: {reason}")
            return EXIT_BAD_INPUT
        if not started:
            code = stop_code(launcher.stop)
            say(f"received {signal.Signals(launcher.stop).name} while restarting: not starting restart {attempt}; "
                f"exit code {code}")
            return code
        codes, lost = launcher.wait()
        if lost is None:
            code = next((shell_code(c) for c in codes if c), 0)
            say(f"all {args.nproc_per_node} processes finished; exit code {code}")
            return code
        if codes[lost] == EXIT_BAD_INPUT:
            launcher.stop_the_rest()
            say(f"process {lost} exited with code {EXIT_BAD_INPUT} (bad input: its message above says what to "
                f"change); stopped the others, no restart; exit code {EXIT_BAD_INPUT}")
            return EXIT_BAD_INPUT
        say(f"process {lost} {describe(codes[lost])}; stopping the others")
        launcher.stop_the_rest()
        if launcher.stop is not None:  # told to stop: a restart would undo it
            code = stop_code(launcher.stop)
            say(f"received {signal.Signals(launcher.stop).name}: no restart; exit code {code}")
            return code
        if attempt >= args.max_restarts:
            code = shell_code(codes[lost])
            say(f"no restarts left (--max-restarts {args.max_restarts}); exit code {code}")
            return code
        attempt += 1
        say(f"restarting all {args.nproc_per_node} processes ({attempt} of {args.max_restarts})")


if __name__ == "__main__":
    sys.exit(main())
