"""The 2-process workers of the ddp comparison: their launch, their flags, their cores."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from jaxdp.launcher.workers import free_port


def launch_pair(argv: list[str], timeout: float) -> dict:
    """Start `python -m jaxdp.bench *argv --port P --rank i` for i in 0, 1 (process 0 also gets
    --json); return process 0's JSON."""
    out = f"/tmp/jaxdp-bench-{os.getpid()}-{time.monotonic_ns()}.json"
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "jaxdp.bench", *argv, "--port", port, "--rank", str(i)]
                              + (["--json", out] if i == 0 else []), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"jaxdp.bench: a worker failed ({' '.join(argv)}):\n" + "\n".join(outputs))
    with open(out) as f:
        data = json.load(f)
    os.remove(out)
    return data


def launch_with_launchers(argv: list[str], timeout: float) -> dict:
    """Start the 2 workers `python -m jaxdp.bench *argv` through their own side's launcher, at its
    defaults: `python -m jaxdp.launch` for jaxdp's train-worker, torchrun for ddp-worker. Every
    worker gets --json; process 0 writes it. Returns that JSON."""
    out = f"/tmp/jaxdp-bench-{os.getpid()}-{time.monotonic_ns()}.json"
    worker = ["-m", "jaxdp.bench", *argv, "--json", out]
    if argv[0] == "ddp-worker":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *worker]
    else:
        command = [sys.executable, "-m", "jaxdp.launch", "--nproc-per-node", "2", "--", sys.executable, *worker]
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"jaxdp.bench: a launch failed ({' '.join(command)}):\n{proc.stdout[-5000:]}")
    with open(out) as f:
        data = json.load(f)
    os.remove(out)
    return data


def pin_to_one_core(rank: int) -> None:
    """Give process `rank` its own core (before JAX / torch start their thread pools).

    Two processes that each size their thread pool to every core of the machine fight over the
    cores; with one core each, XLA's CPU client makes a 1-thread pool (it sizes its pool from the
    affinity mask) and torch runs its 1 thread undisturbed. Both sides of the comparison get this.
    """
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def add_pin_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not give each process its own core (both sides)")


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags launch_pair gives each worker (and --no-pin, which the launcher passes on)."""
    add_pin_argument(parser)
    parser.add_argument("--port", type=int, help="absent: started by a launcher, which says who it is")
    parser.add_argument("--rank", type=int, default=0)
