"""`jaxdp.launch --elastic --elastic-engine torchft`: start the workers and a torchft Lighthouse, restart a
lost worker alone (jaxdp/cluster/ft.py has the run's semantics).

The Lighthouse runs in this launcher (node 0's) and listens on 127.0.0.1 only, unless `--lighthouse
HOST:PORT` names one elsewhere (then none starts here). A worker that exits 0 or 75 (the run ended,
or lost its quorum and saved) is not restarted; a lost one is, up to --max-restarts times in all, and
with none left the others go on without it (they stop themselves, exit 75, when fewer than
--min-workers remain for --quorum-timeout seconds).
"""

from __future__ import annotations

import argparse
import time

from jaxdp.cluster import ft_env as ft
from jaxdp.cluster.detect import ENV_RUN_ID
from jaxdp.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, InputError
from jaxdp.launcher.workers import Launcher, describe, say, shell_code, stop_code

HEARTBEAT_TIMEOUT_S = 2.0   # the Lighthouse leaves out a worker whose heartbeats stop this long (a dead or stopped one)
JOIN_TIMEOUT_S = 60.0       # a quorum waits this long for heartbeating workers that have not asked yet


def lead_torchft(launcher: Launcher, args: argparse.Namespace) -> int:
    size = args.nproc_per_node
    lighthouse = None
    try:
        if args.lighthouse:
            address = args.lighthouse if args.lighthouse.startswith("http") else f"http://{args.lighthouse}"
        else:
            lighthouse = ft.start_lighthouse("127.0.0.1", 0, args.min_workers, HEARTBEAT_TIMEOUT_S, JOIN_TIMEOUT_S)
            address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"  # (address() names the host, not the bind)
    except InputError as err:
        say(f"error: {err}")
        return EXIT_BAD_INPUT
    run_id = f"launch-{launcher.launch_id}-elastic"

    def start(rank: int, restart: bool = False) -> bool:
        env = {**({ft.ENV_RESTART: "1"} if restart else {}), ft.ENV_LIGHTHOUSE: address, ft.ENV_RANK: str(rank), ft.ENV_SIZE: str(size),
               ft.ENV_MIN: str(args.min_workers), ft.ENV_QUORUM_TIMEOUT: str(args.quorum_timeout), ENV_RUN_ID: run_id}
        return launcher.start_one(rank, env)

    try:
        for rank in range(size):
            if not start(rank):
                launcher.kill_all()
                return EXIT_BAD_INPUT if launcher.stop is None else stop_code(launcher.stop)
        launcher.start_zygote()  # restarts fork from it, with JAX and the rest imported
        say(f"started {size} workers (elastic on torchft: a lost one restarts alone and heals from a live one), "
            f"Lighthouse {address}")
        restarts, ended = 0, {}
        while True:
            time.sleep(0.05)
            for rank, child in enumerate(launcher.children):
                code = child.poll()
                if rank in ended or code is None:
                    continue
                if code in (0, EXIT_PREEMPTED) or launcher.stop is not None or ended.get(0) == 0:  # (rank 0 saves the end)
                    ended[rank] = code
                    continue
                if not launcher.lost(code):  # bad input, divergence, a failed save: not transient
                    say(f"worker {rank} {describe(code)}; stopping the others, no restart; exit code {shell_code(code)}")
                    launcher.stop_the_rest()
                    return shell_code(code)
                if restarts >= args.max_restarts:
                    say(f"worker {rank} {describe(code)}; no restarts left (--max-restarts {args.max_restarts}); "
                        f"the others go on while --min-workers={args.min_workers} remain")
                    ended[rank] = code
                    continue
                restarts += 1
                launcher.failures.append(time.time())
                say(f"worker {rank} {describe(code)}; restarting it alone ({restarts} of {args.max_restarts}), "
                    f"the others train on")
                others = any(c.poll() is None for r, c in enumerate(launcher.children) if r != rank)
                if not start(rank, restart=others):  # (none live: it starts as at the start, rank 0 restoring)
                    ended[rank] = code
            if len(ended) == size:
                codes = list(ended.values())
                code = 0 if ended.get(0) == 0 else EXIT_PREEMPTED if EXIT_PREEMPTED in codes else \
                    next((shell_code(c) for c in codes if c), 0)  # (75: the live ones saved; the lost ones' codes are not the run's)
                if launcher.stop is not None and code in (0, EXIT_PREEMPTED):
                    code = stop_code(launcher.stop) if code else 0
                say(f"all {size} workers ended ({restarts} restart{'s' if restarts != 1 else ''}); exit code {code}")
                return code
    finally:
        launcher.close()
        if lighthouse is not None:
            lighthouse.shutdown()
