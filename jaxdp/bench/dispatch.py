"""dispatch: does a collective program run at the same time as a compute program? From one Python
thread, and from two. The mechanism `--overlap` rests on (jaxdp/step/overlap.py, `Overlapped`).

    python -m jaxdp.bench dispatch                          # 50mbit, a 4 MB ring all-reduce, 400 matmuls
    python -m jaxdp.bench dispatch --workers one            # the CPU backend as a one-core process starts it
    python -m jaxdp.bench dispatch --rate 100mbit --megabytes 8 --matmuls 800 --json d.json

Two processes of the slow-network testbed (jaxdp/bench/testbed.py, one core each unless
--no-pin) join one `jax.distributed` run (gloo). Each times, as the median of 5 repeats:
R, an all-reduce of `--megabytes` over the two processes (`--strategy`: jaxdp's ring, or XLA's
psum); C, `--matmuls` chained 256 x 256 matrix products on its own device (no collective); then
both dispatched from one thread and awaited together; then R dispatched from a second thread
while the first dispatches C. If the two overlap, "both" is near max(R, C); if they run one after
the other, near R + C. `--workers two` (the default) starts the CPU backend as `--overlap` runs
do (jaxdp.cluster.runtime.two_cpu_workers); `one` as a process bound to one core otherwise would. Needs
root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from jaxdp.bench import testbed
from jaxdp.bench.report import print_table, write_json

PORT = 12377


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("dispatch", help="a collective program and a compute program, from one thread and from "
                                               "two: do they overlap? (2 processes on the testbed; root)")
    p.add_argument("--rate", default="50mbit", help="the link's rate in tc's syntax")
    p.add_argument("--megabytes", type=float, default=4.0, help="size of the all-reduced buffer")
    p.add_argument("--matmuls", type=int, default=400, help="256 x 256 products in the compute program")
    p.add_argument("--strategy", default="ring", choices=("ring", "psum"), help="the collective: jaxdp's ring "
                   "(collective-permutes) or XLA's all-reduce")
    p.add_argument("--workers", default="two", choices=("two", "one"), help="two: start the CPU backend with two "
                   "worker threads as --overlap does (jaxdp.cluster.runtime.two_cpu_workers); one: as sized by a one-core process")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not give each process its own core")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> list[dict]:
    testbed.require("dispatch")
    testbed.parse_rate(args.rate)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cores = sorted(os.sched_getaffinity(0))
    with testbed.Testbed(num_hosts=2, rate=args.rate) as bed:
        procs = [bed.run(i, [sys.executable, "-m", "jaxdp.bench.dispatch", str(i), f"{bed.address(0)}:{PORT}",
                             str(args.megabytes), str(args.matmuls), args.strategy, args.workers], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True,
                         preexec_fn=(lambda core={cores[i % len(cores)]}: os.sched_setaffinity(0, core)) if args.pin
                         else None)
                 for i in range(2)]
        outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"jaxdp.bench: dispatch: a process failed (exit codes {[p.returncode for p in procs]})")
    rows = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for row in rows:
        row["one_thread_vs_sum"] = row["one_thread_s"] / (row["collective_s"] + row["compute_s"])
        row["two_threads_vs_max"] = row["two_threads_s"] / max(row["collective_s"], row["compute_s"])
    print(f"2 processes x 1 device in 2 network namespaces at {args.rate}, {'one core each' if args.pin else 'unbound'}, "
          f"CPU backend with {args.workers} worker{'s' if args.workers == 'two' else ''}: a {args.strategy} all-reduce of "
          f"{args.megabytes:g} MB and {args.matmuls} chained 256x256 products; median of 5 repeats, seconds")
    print_table(rows, [("process", "process", "d"), ("collective_s", "collective", ".3f"), ("compute_s", "compute", ".3f"),
                       ("one_thread_s", "both, one thread", ".3f"), ("two_threads_s", "both, two threads", ".3f"),
                       ("one_thread_vs_sum", "one thread / sum", ".2f"), ("two_threads_vs_max", "two threads / max", ".2f")])
    write_json(args.json, rows, rate=args.rate, megabytes=args.megabytes, matmuls=args.matmuls, strategy=args.strategy,
               pinned=args.pin, workers=args.workers)
    return rows


def worker(process: int, coordinator: str, megabytes: float, matmuls: int, strategy: str, workers: str) -> dict:
    """One process's timings (runs inside the testbed; prints them as one JSON line)."""
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxdp.cluster import gloo, runtime

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    gloo.install(gloo.choose(coordinator))
    with runtime.two_cpu_workers(workers == "two"):
        jax.distributed.initialize(coordinator, 2, process)
        mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))  # as jaxdp.make_mesh's
    from jaxdp.sync.collectives import ring_allreduce

    total = (lambda x: ring_allreduce(x, "d")) if strategy == "ring" else (lambda x: jax.lax.psum(x, "d"))
    collective = jax.jit(jax.shard_map(total, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))
    buffer = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")),
                                                    np.ones(int(megabytes * 2**20 // 4), np.float32))

    @jax.jit
    def compute(a: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, matmuls, lambda i, a: jnp.tanh(a @ a) * 0.5, a)

    matrix = jax.device_put(jnp.full((256, 256), 0.01), jax.local_devices()[0])
    jax.block_until_ready((collective(buffer), compute(matrix)))  # compiled

    def timed(fn: Any) -> float:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def two_threads() -> None:
        other = threading.Thread(target=lambda: jax.block_until_ready(collective(buffer)))
        other.start()
        jax.block_until_ready(compute(matrix))
        other.join()

    return {"process": process, "collective_s": timed(lambda: jax.block_until_ready(collective(buffer))),
            "compute_s": timed(lambda: jax.block_until_ready(compute(matrix))),
            "one_thread_s": timed(lambda: jax.block_until_ready((collective(buffer), compute(matrix)))),
            "two_threads_s": timed(two_threads)}


if __name__ == "__main__":  # the testbed's processes: python -m jaxdp.bench.dispatch PROCESS COORDINATOR MB MATMULS
    print(json.dumps(worker(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
                            sys.argv[6])), flush=True)
