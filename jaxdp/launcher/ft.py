"""`jaxdp.launch --elastic --elastic-engine torchft`: start the workers and a torchft Lighthouse, restart a
lost worker alone (jaxdp/elastic/ft.py has the run's semantics).

The Lighthouse runs in node 0's launcher: on 127.0.0.1 only for one node, and on `--coordinator
HOST:PORT` (that address only) for several, where every node's workers find it; `--lighthouse
HOST:PORT` names one that runs elsewhere instead (then none starts here, and node 0 is like any
other). With several nodes each launcher starts and restarts its own workers (ranks node-rank x
nproc-per-node + 0, 1, ...) and needs no other launcher: a node whose launcher is killed and started
again brings its workers back, and they heal from a live worker like restarted ones.

A worker that exits 0 or 75 (the run ended, or lost its quorum and saved) is not restarted; a lost
one is, up to --max-restarts times in all (per launcher), and with none left the others go on
without it (they stop themselves, exit 75, when fewer than --min-workers remain for
--quorum-timeout seconds). Once a worker has finished, only a lost rank 0 is restarted. The run's
exit code is 0 once any worker finished: the lead (whichever rank, jaxdp/loop/lead.py) saved the end.
"""

from __future__ import annotations

import argparse
import time

from jaxdp.cluster import ft_env as ft
from jaxdp.cluster.detect import ENV_RUN_ID, parse_address
from jaxdp.config import ConfigError
from jaxdp.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, InputError
from jaxdp.launcher.hub import JOIN_TIMEOUT_S, RULES
from jaxdp.launcher.workers import Launcher, describe, say, shell_code, stop_code

# The Lighthouse leaves out a worker whose heartbeats (every 100 ms, from torchft's own thread) stop this
# long: a dead or stopped one. Each kill costs the survivors about this much: the Lighthouse counts a dead
# worker as alive until then, and torchft's rule against a split brain holds the survivor back meanwhile
# (docs/multihost.md). On one node the heartbeats cross no link, and a worker left out by mistake (a
# heartbeat late on a starved core) heals from a peer over loopback in a fraction of a second: 0.5 s,
# which kept more goodput under kills than 1 s (docs/performance.md, "Behind the defaults"). Across
# nodes a heartbeat can be late by the whole one-node timeout on a home link without the worker being
# gone, and a needless heal sends the whole state over that link: 1 s. --heartbeat-timeout sets it.
HEARTBEAT_TIMEOUT_S = {"one node": 0.5, "several nodes": 1.0}
# On a busy machine a heartbeat (torchft's Manager sends one every 100 ms) is late by about as much as a
# sleeping thread is woken late there. The default adds LATE_BEATS such delays, as this launcher measures
# them at its start (PROBES sleeps of PROBE_S, their 90th percentile), to HEARTBEAT_TIMEOUT_S, in tenths of
# a second, up to MAX_TIMEOUT_S: on a quiet machine it is HEARTBEAT_TIMEOUT_S.
LATE_BEATS, PROBES, PROBE_S, MAX_TIMEOUT_S = 10, 20, 0.01, 5.0


def wake_lateness(probes: int = PROBES, period_s: float = PROBE_S) -> list[float]:
    """How late, in seconds, this machine wakes a thread from each of `probes` sleeps of `period_s`."""
    late = []
    for _ in range(probes):
        started = time.perf_counter()
        time.sleep(period_s)
        late.append(max(0.0, time.perf_counter() - started - period_s))
    return late


def _base(nnodes: int) -> float:
    return HEARTBEAT_TIMEOUT_S["one node" if nnodes == 1 else "several nodes"]


def _typical_late(lateness: list[float]) -> float:
    """The 90th percentile of measured lateness (seconds); 0 for none."""
    return sorted(lateness)[int(0.9 * (len(lateness) - 1))] if lateness else 0.0


def derived_timeout(nnodes: int, lateness: list[float]) -> float:
    """--heartbeat-timeout from the measured wake-up lateness (seconds): HEARTBEAT_TIMEOUT_S plus
    LATE_BEATS times its 90th percentile, in tenths of a second, at most MAX_TIMEOUT_S."""
    base = _base(nnodes)
    return min(MAX_TIMEOUT_S, max(base, round(base + LATE_BEATS * _typical_late(lateness), 1)))


def heartbeat_timeout(nnodes: int, lateness: list[float] | None = None) -> float:
    """The default --heartbeat-timeout for a run of `nnodes` machines: `derived_timeout` from this
    machine's wake-up lateness (measured here unless given); one line where it is above HEARTBEAT_TIMEOUT_S."""
    lateness = wake_lateness() if lateness is None else lateness
    timeout, base = derived_timeout(nnodes, lateness), _base(nnodes)
    if timeout > base:
        late = _typical_late(lateness)
        say(f"this machine wakes a sleeping thread {late * 1000:.0f} ms late (busy): heartbeat timeout "
            f"{timeout:g} s, not {base:g}, so that late heartbeats do not leave a live worker out (--heartbeat-timeout)")
    return timeout


# What a worker on torchft imports beside the zygote's own list: a restart forked from the zygote does
# not pay for them again (torch and torchft: CPU time taken from the survivors' cores; docs/performance.md,
# "Behind the defaults").
PRELOAD = ("torch", "torchft", "jaxdp.elastic.ft", *RULES)


def lead_torchft(launcher: Launcher, args: argparse.Namespace) -> int:
    local, size = args.nproc_per_node, args.nproc_per_node * args.nnodes
    first = args.node_rank * local  # this node's workers are ranks first .. first + local - 1
    lighthouse = None
    try:
        if args.lighthouse:
            address = args.lighthouse if args.lighthouse.startswith("http") else f"http://{args.lighthouse}"
        elif args.nnodes > 1:  # node 0's launcher hosts it on the announced address, every node's workers use it
            host, port = parse_address(args.coordinator, "--coordinator")
            address = f"http://{args.coordinator}"
            if args.node_rank == 0:
                lighthouse = ft.start_lighthouse(host.strip("[]"), port, args.min_workers, args.heartbeat_timeout,
                                                 JOIN_TIMEOUT_S)
        else:
            lighthouse = ft.start_lighthouse("127.0.0.1", 0, args.min_workers, args.heartbeat_timeout, JOIN_TIMEOUT_S)
            address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"  # (address() names the host, not the bind)
    except (InputError, ConfigError) as err:
        say(f"error: {err}")
        return EXIT_BAD_INPUT
    except RuntimeError as err:  # the Lighthouse could not listen there
        say(f"error: cannot start the Lighthouse on --coordinator {args.coordinator}: {str(err).splitlines()[0]}")
        return EXIT_BAD_INPUT
    run_id = f"launch-{launcher.launch_id}-elastic" if args.nnodes == 1 else f"torchft-{args.coordinator}"

    def start(index: int, restart: bool = False) -> bool:
        env = {**({ft.ENV_RESTART: "1"} if restart else {}), **({ft.ENV_LIGHTHOUSE_HERE: "1"} if lighthouse else {}),
               ft.ENV_LIGHTHOUSE: address, ft.ENV_RANK: str(first + index),
               ft.ENV_SIZE: str(size), ft.ENV_MIN: str(args.min_workers), ft.ENV_QUORUM_TIMEOUT: str(args.quorum_timeout),
               ENV_RUN_ID: run_id}
        return launcher.start_one(index, env)

    try:
        for index in range(local):
            if not start(index):
                launcher.kill_all()
                return EXIT_BAD_INPUT if launcher.stop is None else stop_code(launcher.stop)
        launcher.start_zygote(PRELOAD)  # restarts fork from it, with JAX, torch and the rest imported
        say(f"started {local} workers (elastic on torchft: a lost one restarts alone and heals from a live one), "
            f"Lighthouse {address}" + (f" (heartbeat timeout {args.heartbeat_timeout:g} s)" if lighthouse else "")
            + (f"; ranks {first}..{first + local - 1} of {size}" if args.nnodes > 1 else ""))
        restarts, ended = 0, {}
        while True:
            time.sleep(0.05)
            for index, child in enumerate(launcher.children):
                code, rank = child.poll(), first + index
                if index in ended or code is None:
                    continue
                # the run ended: a worker finished (a lost rank 0 still restarts: it restores the last
                # checkpoint and saves the end, in case it was the lead, killed after the others finished)
                if code in (0, EXIT_PREEMPTED) or launcher.stop is not None or (0 in ended.values() and rank):
                    ended[index] = code
                    continue
                if not launcher.lost(code):  # bad input, divergence, a failed save: not transient
                    say(f"worker {rank} {describe(code)}; stopping the others, no restart; exit code {shell_code(code)}")
                    launcher.stop_the_rest()
                    return shell_code(code)
                if restarts >= args.max_restarts:
                    say(f"worker {rank} {describe(code)}; no restarts left (--max-restarts {args.max_restarts}); "
                        f"the others go on while --min-workers={args.min_workers} remain")
                    ended[index] = code
                    continue
                restarts += 1
                launcher.failures.append(time.time())
                say(f"worker {rank} {describe(code)}; restarting it alone ({restarts} of {args.max_restarts}), "
                    f"the others train on")
                # it heals from a live worker; with several nodes another node's may be live (one that finds
                # none exits 75, rank 0 goes on from its checkpoint); alone here, it starts as at the start
                others = args.nnodes > 1 or any(c.poll() is None for i, c in enumerate(launcher.children) if i != index)
                if not start(index, restart=others):
                    ended[index] = code
            if len(ended) == local:
                codes = list(ended.values())
                code = 0 if 0 in codes else EXIT_PREEMPTED if EXIT_PREEMPTED in codes \
                    else next((shell_code(c) for c in codes if c), 0)  # (75: the live ones saved; the lost ones' codes are not the run's)
                if launcher.stop is not None and code in (0, EXIT_PREEMPTED):
                    code = stop_code(launcher.stop) if code else 0
                say(f"all {local} workers ended ({restarts} restart{'s' if restarts != 1 else ''}); exit code {code}")
                return code
    finally:
        launcher.close()
        if lighthouse is not None:
            lighthouse.shutdown()
