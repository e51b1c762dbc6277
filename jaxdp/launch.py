"""Start N local processes of a multi-process run, bind them to cores, restart them when one is lost.

    python -m jaxdp.launch --nproc-per-node 2 -- python -m jaxdp.train --devices 4 --steps 50
    python -m jaxdp.launch --nproc-per-node 2 --max-restarts 3 -- python -m jaxdp.train --checkpoint-dir ckpt --save-every 10
    python -m jaxdp.launch --nproc-per-node 4 --no-bind -- python my_script.py   # calls jaxdp.initialize()

    python -m jaxdp.launch --nnodes 2 --node-rank R --coordinator node0:29400 --nproc-per-node 4 -- CMD   # on each node

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

Several nodes (like torchrun's --nnodes / --node-rank): one launcher per node, all given node 0's
address as --coordinator HOST:PORT. Node 0's launcher listens on PORT and the others connect to it
(jaxdp/rendezvous.py); the run's coordinator (process 0, on node 0) is HOST:PORT+1, its handshake
PORT+2. Process ids are node-rank * nproc-per-node + local. Node 0's launcher decides for all: a
lost process on any node stops every node's processes and restarts them all (from the last
checkpoint); a stop signal to any launcher reaches every process; a launcher that disappears ends
the run on every node (exit 69).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Sequence

from jaxdp import rendezvous
from jaxdp.cluster import (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_RUN_ID, handshake_port,
                           parse_address)
from jaxdp.config import ConfigError
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
                     usage="python -m jaxdp.launch --nproc-per-node N [--max-restarts R] [--no-bind] "
                           "[--nnodes M --node-rank R --coordinator HOST:PORT] -- COMMAND ...")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="processes to start on this machine")
    parser.add_argument("--max-restarts", type=int, default=0, help="restart all processes up to R times when one is lost")
    parser.add_argument("--no-bind", dest="bind", action="store_false", help="do not bind each process to its own cores")
    parser.add_argument("--nnodes", type=int, default=1, help="machines in the run, each with its own launcher (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's number, 0 .. nnodes - 1; its processes "
                        "are numbered node-rank * nproc-per-node + 0, 1, ...")
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="node 0's address as every node reaches it (needed "
                        "with --nnodes > 1): its launcher listens on PORT, the run's coordinator on PORT + 1 and its "
                        "handshake on PORT + 2")
    parser.add_argument("--join-timeout", type=float, default=300.0, help="seconds the launchers wait for each other "
                        "at the start (default 300)")
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
            for rank in range(self.nproc):
                env = {**os.environ, ENV_COORDINATOR_ADDRESS: address, ENV_NUM_PROCESSES: str(world),
                       ENV_PROCESS_ID: str(first + rank), ENV_RUN_ID: run_id}
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
                 "bound to cores " + ", ".join(f"{first + rank}: {_cores(c)}" for rank, c in enumerate(self.cores))
                 + " (--no-bind to turn off)")
        again = f" (restart {attempt})" if attempt else ""
        which = (f"{self.nproc} processes" if world == self.nproc else f"process {first} of {world}" if self.nproc == 1
                 else f"processes {first}..{first + self.nproc - 1} of {world}")
        say(f"started {which}{again}, coordinator {address}, {where}")
        return True

    def begin(self, attempt: int, address: str, run_id: str, first: int, world: int) -> Outcome | None:
        """Start the children: None, or the outcome that stands instead (a stop signal came first,
        or the command cannot be started: one line said)."""
        try:
            if self.start(attempt, address, run_id, first, world):
                return None
        except (OSError, subprocess.SubprocessError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            say(f"error: cannot start {self.command[0]!r}: {reason}")
            return Outcome("bad_input", code=EXIT_BAD_INPUT)
        return Outcome("stopped")

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
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes or (args.nnodes > 1 and not args.coordinator):
        say("error: need --nnodes >= 1, --node-rank between 0 and --nnodes - 1, and --coordinator HOST:PORT "
            "with --nnodes > 1")
        return EXIT_BAD_INPUT
    try:
        address = None if args.coordinator is None else _attempt_address(args.coordinator)
    except ValueError as err:
        say(f"error: {err}")
        return EXIT_BAD_INPUT
    launcher = Launcher(command, args.nproc_per_node, args.bind and not has_accelerator())
    for signum in FORWARDED:
        signal.signal(signum, launcher.forward)
    if args.node_rank > 0:
        link = rendezvous.join(args.coordinator, args.node_rank, args.nnodes, args.nproc_per_node, args.join_timeout)
        if isinstance(link, rendezvous.Refused):
            say(f"error: {link}")
            return EXIT_BAD_INPUT
        if link is None:
            say(f"error: node 0's launcher at {args.coordinator} did not answer within --join-timeout="
                f"{args.join_timeout:g} s; exit code {EXIT_PEER_LOST}")
            return EXIT_PEER_LOST
        try:
            return follow(launcher, link, address, args)
        finally:
            link.close()
    leader = None
    if args.coordinator is not None:
        try:
            leader = rendezvous.Leader(args.coordinator, args.nnodes, args.nproc_per_node)
        except OSError as err:
            say(f"error: cannot listen on --coordinator {args.coordinator}: {err.strerror or err}")
            return EXIT_BAD_INPUT
        missing = leader.gather(args.join_timeout)
        if missing:
            say(f"error: the launchers of node(s) {missing} did not join within --join-timeout={args.join_timeout:g} s; "
                f"exit code {EXIT_PEER_LOST}")
            leader.close()
            return EXIT_PEER_LOST
    try:
        return lead(launcher, leader, address, args)
    finally:
        if leader is not None:
            leader.close()


def _attempt_address(coordinator: str) -> str:
    """The run's coordinator for --coordinator HOST:PORT: HOST:PORT+1 (PORT is the launchers')."""
    try:
        host, port = parse_address(coordinator, "--coordinator")
    except ConfigError as err:
        raise ValueError(str(err)) from None
    if port > 65533:
        raise ValueError(f"--coordinator={coordinator}: PORT must be at most 65533 (the run also uses PORT + 1 and PORT + 2)")
    return f"[{host}]:{port + 1}" if ":" in host else f"{host}:{port + 1}"


def lead(launcher: Launcher, leader: rendezvous.Leader | None, address: str | None, args: argparse.Namespace) -> int:
    """Node 0 (or the only node): run attempts, collect every node's outcome, decide, tell the others."""
    world, nodes = args.nnodes * args.nproc_per_node, args.nnodes
    links = {} if leader is None else leader.links
    attempt = 0
    while True:
        run_id = f"launch-{launcher.launch_id}-{attempt}"
        if leader is not None:
            leader.broadcast({"start": attempt, "run": run_id})
        begun = launcher.begin(attempt, address or f"127.0.0.1:{free_port()}", run_id, 0, world)
        outcomes: dict[int, Outcome] = {} if begun is None else {0: begun}
        stopping = False
        selector = _selector(links)
        while len(outcomes) < nodes:
            if 0 not in outcomes and (mine := launcher.check()) is not None:
                outcomes[0] = mine
                if mine.kind == "lost":
                    say(f"process {mine.process} {describe(mine.code)}; stopping the others")
            for signum in _drain(launcher.relay):
                if leader is not None:
                    leader.broadcast({"signal": signum})
            for node, link in links.items():
                for message in link.messages():
                    if "signal" in message:
                        launcher.deliver(message["signal"])
                        leader.broadcast(message, but=node)
                    elif message.get("ended") == attempt:
                        outcomes[node] = Outcome(message["kind"], message.get("process"), message.get("code", 0), node)
                if link.closed and node not in outcomes:
                    outcomes[node] = Outcome("gone", node=node)
            if leader is not None:
                leader.admit()  # a late or second launcher is refused: the run is formed
            if not stopping and any(o.trouble for o in outcomes.values()):
                stopping = True
                if leader is not None:
                    leader.broadcast({"stop": attempt})
                launcher.stop_the_rest()
                outcomes.setdefault(0, Outcome("stopped"))
            elif len(outcomes) < nodes:
                selector.select(timeout=0.05)
        selector.close()
        action, code, line = decide([outcomes[n] for n in sorted(outcomes)], attempt, args.max_restarts,
                                    launcher.stop, world)
        if line is not None:
            say(line)
        if leader is not None:
            leader.broadcast({"decision": action, "code": code, "line": line})
        if action == "exit":
            return code
        attempt += 1


def follow(launcher: Launcher, link: rendezvous.Link, address: str, args: argparse.Namespace) -> int:
    """Any other node: start when node 0's launcher says, report how this node's processes ended."""
    world, first = args.nnodes * args.nproc_per_node, args.node_rank * args.nproc_per_node
    selector = _selector({0: link})
    reported: Outcome | None = Outcome("stopped")  # nothing running between attempts
    attempt = -1
    while True:
        if reported is None and (mine := launcher.check(first)) is not None:
            reported = mine
            if mine.kind == "lost":
                say(f"process {mine.process} {describe(mine.code)}; stopping the others")
            link.send({"ended": attempt, "kind": mine.kind, "process": mine.process, "code": mine.code})
            if mine.trouble:
                launcher.stop_the_rest()
        for signum in _drain(launcher.relay):
            link.send({"signal": signum})
        for message in link.messages():
            if "signal" in message:
                launcher.deliver(message["signal"])
            elif "start" in message:
                attempt = message["start"]
                reported = launcher.begin(attempt, address, message["run"], first, world)
                if reported is not None:
                    link.send({"ended": attempt, "kind": reported.kind, "process": reported.process, "code": reported.code})
            elif message.get("stop") == attempt and reported is None:
                launcher.stop_the_rest()
                reported = Outcome("stopped")
                link.send({"ended": attempt, "kind": "stopped", "process": None, "code": 0})
            elif "decision" in message:
                if message.get("line"):
                    say(message["line"])
                if message["decision"] == "exit":
                    return message["code"]
        if link.closed:
            if reported is None:
                launcher.stop_the_rest()
            say(f"error: node 0's launcher is gone; stopped this node's processes; exit code {EXIT_PEER_LOST}")
            return EXIT_PEER_LOST
        selector.select(timeout=0.05)


def _selector(links: dict) -> selectors.BaseSelector:
    selector = selectors.DefaultSelector()
    for link in links.values():
        if not link.closed:
            selector.register(link.conn, selectors.EVENT_READ)
    return selector


def _drain(items: list) -> list:
    out = items[:]
    del items[:len(out)]
    return out


if __name__ == "__main__":
    sys.exit(main())
