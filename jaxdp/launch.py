"""Start N local processes of a multi-process run, bind them to cores, restart them when one is lost.

    python -m jaxdp.launch --nproc-per-node 2 -- python -m jaxdp.train --devices 4 --steps 50
    python -m jaxdp.launch --nproc-per-node 2 --max-restarts 3 -- python -m jaxdp.train --checkpoint-dir ckpt --save-every 10
    python -m jaxdp.launch --nproc-per-node 4 --no-bind -- python my_script.py   # calls jaxdp.initialize()

    python -m jaxdp.launch --nnodes 2 --node-rank R --coordinator node0:29400 --nproc-per-node 4 -- CMD   # on each node
    python -m jaxdp.launch --elastic --nproc-per-node 2 --max-restarts 100 -- python -m jaxdp.train --strategy host ...

With --elastic (one node; jaxdp/elastic/hub.py) this launcher is the run's hub: the processes exchange
through it instead of jax.distributed, and a lost process is restarted alone (forked from a zygote
that has JAX imported, jaxdp/launcher/zygote.py) while the others train on. A process that stalls
(owes its part of a quorum or an exchange --stall-timeout seconds after another sent its own, or
stays SIGSTOPped while the run stops) is left out and killed, then restarted as a lost one; a
connection to the hub that sends something else than jaxdp/cluster/wire.py's messages, or nothing,
is dropped with one line.

Like torchrun's standalone mode (the processes themselves: jaxdp/launcher/workers.py):
* a free coordinator port on 127.0.0.1 (the next port free too: the run handshake's), and
  `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` and a fresh `JAXDP_RUN_ID` in each
  child's environment (`jaxdp.train` and `jaxdp.initialize()` read them);
* on a CPU host, each process is bound to its own disjoint set of cores (`os.sched_setaffinity`
  in the child before it starts, so XLA sizes its thread pools to them; N processes that each size
  their pools to the whole machine fight over it; README "Launcher" has the figures). `--no-bind`
  leaves them unbound. Hosts with accelerators are not bound (the work is on the devices);
* SIGINT, SIGTERM and SIGUSR1 are forwarded to every child (save and exit 75, 130 for SIGINT);
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
(jaxdp/launcher/rendezvous.py); the run's coordinator (process 0, on node 0) is HOST:PORT+1, its handshake
PORT+2. Process ids are node-rank * nproc-per-node + local. Node 0's launcher decides for all: a
lost process on any node stops every node's processes and restarts them all (from the last
checkpoint); a stop signal to any launcher reaches every process; a launcher that disappears ends
the run on every node (exit 69).
"""

from __future__ import annotations

import argparse
import math
import selectors
import signal
import sys
import time
from typing import Sequence

from jaxdp.cluster.detect import ENV_RUN_ID, parse_address
from jaxdp.config import ConfigError
from jaxdp.errors import EXIT_BAD_INPUT, EXIT_PEER_LOST, EXIT_PREEMPTED
from jaxdp.launcher import rendezvous
from jaxdp.launcher.workers import (FORWARDED, Launcher, Outcome, decide, describe, free_port, has_accelerator, say,
                                    shell_code, stop_code)


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
    parser.add_argument("--elastic", action="store_true", help="restart a lost process alone while the others train "
                        "on (jaxdp/elastic/); up to --max-restarts times in all")
    parser.add_argument("--elastic-engine", choices=("hub", "torchft"), default="hub", help="an elastic run's engine: "
                        "hub (this launcher relays the exchanges; one node) or torchft (a Lighthouse and gloo; pip install "
                        "'jaxdp-trainer[elastic]'; jaxdp/elastic/ft.py)")
    parser.add_argument("--lighthouse", metavar="HOST:PORT", help="torchft: the Lighthouse to use (default: node 0's "
                        "launcher starts one, on 127.0.0.1, or with --nnodes > 1 on --coordinator)")
    parser.add_argument("--min-workers", type=int, default=1, help="torchft: fewer live workers than this for "
                        "--quorum-timeout seconds: save and exit 75 (default 1)")
    parser.add_argument("--quorum-timeout", type=float, default=60.0, help="torchft: seconds to wait for --min-workers "
                        "(default 60)")
    parser.add_argument("--heartbeat-timeout", type=float, default=None, metavar="SECONDS", help="torchft: the "
                        "Lighthouse this launcher starts leaves out a worker whose heartbeats stop this long (default 0.5 on one node, 1 "
                        "with --nnodes > 1, more on a machine that wakes threads late: measured at the start, one line)")
    parser.add_argument("--no-bind", dest="bind", action="store_false", help="do not bind each process to its own cores")
    parser.add_argument("--nnodes", type=int, default=1, help="machines in the run, each with its own launcher (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's number, 0 .. nnodes - 1; its processes "
                        "are numbered node-rank * nproc-per-node + 0, 1, ...")
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="node 0's address as every node reaches it (needed "
                        "with --nnodes > 1): its launcher listens on PORT, the run's coordinator on PORT + 1 and its "
                        "handshake on PORT + 2 (--elastic-engine torchft: the Lighthouse on PORT)")
    parser.add_argument("--join-timeout", type=float, default=300.0, help="seconds the launchers wait for each other "
                        "at the start (default 300)")
    return parser


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
    torchft = args.elastic and args.elastic_engine == "torchft"
    if args.elastic and args.nnodes > 1 and not torchft:
        say("error: --elastic with the hub runs on one node (its launcher is the hub every process sends its "
            "gradients to); drop --nnodes, or add --elastic-engine torchft")
        return EXIT_BAD_INPUT
    if not torchft and (args.lighthouse or args.min_workers != 1 or args.quorum_timeout != 60.0
                        or args.heartbeat_timeout is not None):
        say("error: --lighthouse, --min-workers, --quorum-timeout and --heartbeat-timeout need --elastic "
            "--elastic-engine torchft")
        return EXIT_BAD_INPUT
    if torchft and not (1 <= args.min_workers <= args.nproc_per_node * args.nnodes and args.quorum_timeout > 0):
        say(f"error: need 1 <= --min-workers <= --nproc-per-node x --nnodes ({args.nproc_per_node * args.nnodes}) "
            f"and --quorum-timeout > 0")
        return EXIT_BAD_INPUT
    if args.heartbeat_timeout is not None and not (math.isfinite(args.heartbeat_timeout) and args.heartbeat_timeout > 0):
        say(f"error: --heartbeat-timeout must be a positive number of seconds, got {args.heartbeat_timeout:g}")
        return EXIT_BAD_INPUT
    if args.heartbeat_timeout is not None and args.lighthouse:
        say("error: --heartbeat-timeout sets the Lighthouse this launcher starts; with --lighthouse, set it where "
            "that one runs")
        return EXIT_BAD_INPUT
    if torchft and args.heartbeat_timeout is None:
        from jaxdp.launcher.ft import heartbeat_timeout

        args.heartbeat_timeout = heartbeat_timeout(args.nnodes)
    launcher = Launcher(command, args.nproc_per_node, args.bind and not has_accelerator())
    for signum in FORWARDED:
        signal.signal(signum, launcher.forward)
    if args.elastic and args.elastic_engine == "torchft":
        from jaxdp.launcher.ft import lead_torchft
        return lead_torchft(launcher, args)
    if args.elastic:
        return lead_elastic(launcher, args)
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
                outcomes[0] = launcher.settled(outcomes.get(0, Outcome("stopped")))
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


def lead_elastic(launcher: Launcher, args: argparse.Namespace) -> int:
    """An elastic run on the hub (jaxdp/elastic/hub.py): this launcher is the hub; a lost process is started
    again alone, up to --max-restarts times in all, while the others train on."""
    from jaxdp.elastic import hub as elastic
    from jaxdp.launcher.hub import RULES, Hub

    size = args.nproc_per_node
    hub = Hub(size)
    selector = selectors.DefaultSelector()
    hub.watch(selector)
    run_id = f"launch-{launcher.launch_id}-elastic"

    def start(rank: int, restart: bool = False) -> bool:
        return launcher.start_one(rank, {elastic.ENV_ADDRESS: hub.address, elastic.ENV_RANK: str(rank),
                                         elastic.ENV_SIZE: str(size), ENV_RUN_ID: run_id,
                                         **({elastic.ENV_RESTART: "1"} if restart else {})})

    try:
        for rank in range(size):
            if not start(rank):
                launcher.kill_all()
                return EXIT_BAD_INPUT if launcher.stop is None else stop_code(launcher.stop)
        where = "" if launcher.cores is None else ", bound to cores " + ", ".join(
            f"{rank}: {sorted(c)}" for rank, c in enumerate(launcher.cores))
        launcher.start_zygote(RULES)  # restarts fork from it, with JAX and the rules imported
        say(f"started {size} processes (elastic: a lost one restarts alone), hub {hub.address}{where}")
        restarts, ended, stalled, frozen = 0, {}, set(), {}
        while True:
            for key, _ in selector.select(timeout=0.05):
                hub.ready(key.data)
            hub.tick()
            for line in _drain(hub.events):
                say(line)
            for rank in _drain(hub.stalled):  # left out by the hub: it is lost, as a dead one is
                child = launcher.children[rank]
                if child.poll() is None:
                    stalled.add(rank)
                    child.kill()  # (SIGKILL reaches a stopped process too)
            if launcher.stop is not None and not hub.stopping:
                hub.request_stop()
            if launcher.stop is not None:  # stopping: a member stopped by SIGSTOP that owes the hub nothing
                for rank, child in enumerate(launcher.children):  # (else the hub's stall timeout applies) holds the end
                    if rank in ended or rank in stalled or child.poll() is not None or not _stopped(child.pid) \
                            or hub.owes(rank):
                        frozen.pop(rank, None)
                    elif time.monotonic() - frozen.setdefault(rank, time.monotonic()) > hub.stall_timeout:
                        say(f"process {rank} has been stopped (SIGSTOP) for {hub.stall_timeout:g} s (--stall-timeout) "
                            f"while the run stops; killed it")
                        stalled.add(rank)
                        child.kill()
            for rank, child in enumerate(launcher.children):
                code = child.poll()
                if rank in ended or code is None:
                    continue
                how, left_out = describe(code), rank in stalled
                if left_out:  # the hub left it out and the launcher killed it: lost, whatever it exited with
                    stalled.discard(rank)
                    how = "was left out by the hub (killed by the launcher)"
                    if launcher.stop is not None or ended.get(0) == 0:  # stopping anyway: its exit is not the run's
                        ended[rank] = 0
                        continue
                elif code in (0, EXIT_PREEMPTED) or launcher.stop is not None or ended.get(0) == 0:
                    ended[rank] = code
                    continue
                elif not launcher.lost(code):  # bad input, divergence, a failed save: not transient
                    say(f"process {rank} {describe(code)}; stopping the others, no restart; exit code "
                        f"{shell_code(code)}")
                    launcher.stop_the_rest()
                    return shell_code(code)
                if restarts >= args.max_restarts:
                    say(f"process {rank} {how}; no restarts left (--max-restarts {args.max_restarts}); "
                        f"stopping the others; exit code {shell_code(code)}")
                    launcher.kill_all()
                    return shell_code(code)
                restarts += 1
                launcher.failures.append(time.time())  # (the restarted process's --save-every auto reads it)
                hub.lost(rank)
                say(f"process {rank} {how}; restarting it alone ({restarts} of {args.max_restarts}), "
                    f"the others train on")
                if not start(rank, restart=True):
                    ended[rank] = code
            if ended.get(0) == 0 and len(ended) < size:  # rank 0 finished (saved the end): the rest have nothing left
                launcher.stop_the_rest()
                for rank, child in enumerate(launcher.children):
                    ended.setdefault(rank, 0 if child.returncode in (0, None) or child.returncode < 0 else child.returncode)
            if len(ended) == size:
                code = next((shell_code(c) for c in ended.values() if c), 0)
                if launcher.stop is not None and code in (0, EXIT_PREEMPTED):
                    code = stop_code(launcher.stop) if code else 0
                say(f"all {size} processes ended ({restarts} restart{'s' if restarts != 1 else ''}); exit code {code}")
                return code
    finally:
        selector.close()
        hub.close()
        launcher.close()


def follow(launcher: Launcher, link: rendezvous.Link, address: str, args: argparse.Namespace) -> int:
    """Any other node: start when node 0's launcher says, report how this node's processes ended."""
    world, first = args.nnodes * args.nproc_per_node, args.node_rank * args.nproc_per_node
    selector = _selector({0: link})
    reported: Outcome | None = Outcome("stopped")  # nothing running between attempts
    attempt = -1
    while True:
        if reported is None and (mine := launcher.check(first)) is not None:
            if mine.kind == "lost":
                say(f"process {mine.process} {describe(mine.code)}; stopping the others")
            if mine.trouble:
                mine = launcher.settled(mine, first)
            reported = mine
            link.send({"ended": attempt, "kind": mine.kind, "process": mine.process, "code": mine.code})
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


def _stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, SIGTSTP: state T in /proc/PID/stat; Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


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
