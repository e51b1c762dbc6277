"""Start N local processes of a multi-process run, bind them to cores, restart them when one is lost.

    python -m jaxdp.launch --nproc-per-node 2 -- python -m jaxdp.train --devices 4 --steps 50
    python -m jaxdp.launch --nproc-per-node 2 --max-restarts 3 -- python -m jaxdp.train --checkpoint-dir ckpt --save-every 10
    python -m jaxdp.launch --nproc-per-node 4 --no-bind -- python my_script.py   # calls jaxdp.initialize()

Like torchrun's standalone mode:
* a free coordinator port on 127.0.0.1, and `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
  `JAX_PROCESS_ID` in each child's environment (`jaxdp.train` and `jaxdp.initialize()` read them);
* on a CPU host, each process is bound to its own disjoint set of cores (`os.sched_setaffinity`
  in the child before it starts, so XLA sizes its thread pools to them; N processes that each size
  their pools to the whole machine fight over it; README "Launcher" has the figures). `--no-bind`
  leaves them unbound. Hosts with accelerators are not bound (the work is on the devices);
* SIGINT, SIGTERM and SIGUSR1 are forwarded to every child (SIGTERM / SIGUSR1: save and exit 75);
* when a child is lost (exits with EXIT_PEER_LOST, the lost-peer or stall code, or is killed by a
  signal the launcher did not send), the others get a few seconds to exit by themselves, then are
  killed, and all N are started again, up to --max-restarts times. With --checkpoint-dir the run
  resumes from its last checkpoint; no completed step is lost;
* otherwise the launcher exits with the children's code (the first nonzero one, else 0).
Each event is one line on stderr, prefixed "jaxdp.launch:".
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

from jaxdp.cluster import ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from jaxdp.errors import EXIT_BAD_INPUT, EXIT_PEER_LOST

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
GRACE_S = 5.0  # after one child is lost, how long the others get to exit by themselves (their peer watch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxdp.launch", allow_abbrev=False,
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(message: str) -> None:
    print(f"jaxdp.launch: {message}", file=sys.stderr, flush=True)


def describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


class Launcher:
    def __init__(self, command: list[str], nproc: int, bind: bool):
        self.command, self.nproc = command, nproc
        self.cores = bindings(nproc, os.sched_getaffinity(0)) if bind and hasattr(os, "sched_setaffinity") else None
        self.children: list[subprocess.Popen] = []
        self.sent: set[int] = set()  # signals the launcher forwarded: a child they kill is not "lost"

    def start(self, attempt: int) -> None:
        port = free_port()
        address = f"127.0.0.1:{port}"
        self.children = []
        for rank in range(self.nproc):
            env = {**os.environ, ENV_COORDINATOR_ADDRESS: address, ENV_NUM_PROCESSES: str(self.nproc),
                   ENV_PROCESS_ID: str(rank)}
            cores = None if self.cores is None else self.cores[rank]
            preexec = None if cores is None else (lambda cores=cores: os.sched_setaffinity(0, cores))
            # Own session: a Ctrl-C in the terminal reaches the launcher only, which forwards it once.
            self.children.append(subprocess.Popen(self.command, env=env, preexec_fn=preexec, start_new_session=True))
        where = ("not bound to cores (--no-bind)" if self.cores is None else
                 "bound to cores " + ", ".join(f"{rank}: {_cores(c)}" for rank, c in enumerate(self.cores))
                 + " (--no-bind to turn off)")
        again = f" (restart {attempt})" if attempt else ""
        say(f"started {self.nproc} processes{again}, coordinator {address}, {where}")

    def forward(self, signum: int, frame: object) -> None:
        self.sent.add(signum)
        for child in self.children:
            if child.poll() is None:
                try:
                    child.send_signal(signum)
                except ProcessLookupError:
                    pass

    def wait(self) -> tuple[list[int | None], int | None]:
        """Until all children exit or one is lost: (exit codes, rank of the lost child or None)."""
        while True:
            codes = [child.poll() for child in self.children]
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


def _cores(cores: set[int]) -> str:
    ordered = sorted(cores)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        say("error: give the command after --, e.g. python -m jaxdp.launch --nproc-per-node 2 -- python -m jaxdp.train")
        return EXIT_BAD_INPUT
    split = argv.index("--")
    try:
        args = build_parser().parse_args(argv[:split])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    command = argv[split + 1:]
    if not command or args.nproc_per_node <= 0 or args.max_restarts < 0:
        say("error: need a command after --, --nproc-per-node >= 1 and --max-restarts >= 0")
        return EXIT_BAD_INPUT
    launcher = Launcher(command, args.nproc_per_node, args.bind and not has_accelerator())
    for signum in FORWARDED:
        signal.signal(signum, launcher.forward)
    attempt = 0
    while True:
        launcher.start(attempt)
        codes, lost = launcher.wait()
        if lost is None:
            code = next((shell_code(c) for c in codes if c), 0)
            say(f"all {args.nproc_per_node} processes finished; exit code {code}")
            return code
        say(f"process {lost} {describe(codes[lost])}; stopping the others")
        launcher.stop_the_rest()
        if attempt >= args.max_restarts:
            code = shell_code(codes[lost])
            say(f"no restarts left (--max-restarts {args.max_restarts}); exit code {code}")
            return code
        attempt += 1
        say(f"restarting all {args.nproc_per_node} processes ({attempt} of {args.max_restarts})")


if __name__ == "__main__":
    sys.exit(main())
