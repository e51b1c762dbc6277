"""Where an overlapped round's time goes (`--sync-every H --overlap`, jaxdp/step/overlap.py): 2 processes
on the slow-network testbed (jaxdp/bench/testbed.py; root and iproute2), each timestamping its rounds
from inside: the inner steps, the average on its thread, the training thread's wait for it to land, and
what comes after (the apply, the round's record, the hooks) until the next average starts.

    python docs/perf/overlap_trace.py --rate 50mbit --json trace.json
    python docs/perf/overlap_trace.py --rate 50mbit --train-args "--strategy ring --sync-every 16 --overlap"

Per process, the medians over the rounds (the first 5 and the last left out) in milliseconds:
`round` (one round to the next), `train` (its H inner steps), `average` (the collective on the thread),
`wait` (the training thread waiting for it after its steps), `after` (from the landing to the next
round). With `average` > `train` the link is the bound: a round lasts `average` + `after`, and the
gain over `--sync-every H` without overlap is at most (`train` + `average`) / (`average` + `after`).
The tracing wraps the programs in a `sitecustomize` of its own; the run is otherwise the CLI's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import statistics
import sys
import tempfile

SITE = r'''
import atexit, json, os, threading, time
import jax
import jaxdp.step.overlap as ov

T0, EVENTS = time.perf_counter(), []


def ev(name):
    EVENTS.append((time.perf_counter() - T0, name))


original_in_flight, original_landed = ov.Overlapped._in_flight, ov.Overlapped._landed


def in_flight(self, state):
    ev("round")
    if not getattr(self, "_traced", False):
        reduce, self._traced = self.layout.reduce, True

        def traced(*args):
            ev("average_begin")
            out = jax.block_until_ready(reduce(*args))
            ev("average_end")
            return out

        self.layout.reduce = traced
    return original_in_flight(self, state)


def landed(self, state, pending):
    ev("wait_begin")
    try:
        return original_landed(self, state, pending)
    finally:
        ev("wait_end")


ov.Overlapped._in_flight, ov.Overlapped._landed = in_flight, landed
atexit.register(lambda: json.dump(EVENTS, open(os.path.join(os.environ["OVERLAP_TRACE"], f"{os.getpid()}.json"), "w")))
'''


def summarise(events: list) -> dict:
    """The medians (ms) of a process's rounds, from its (seconds, name) events."""
    rounds, current = [], None
    for at, name in events:
        if name == "round":
            current = {"round": at}
            rounds.append(current)
        elif current is not None:
            current[name] = at
    rows = [{"round": b["round"] - a["round"], "train": a["wait_begin"] - a["round"],
             "average": a["average_end"] - a["average_begin"], "wait": a["wait_end"] - a["wait_begin"],
             "after": b["round"] - a["wait_end"]}
            for a, b in zip(rounds[5:-2], rounds[6:-1]) if "average_begin" in a and "wait_end" in a]
    return {k: round(1000 * statistics.median(r[k] for r in rows), 2) for k in rows[0]} if rows else {}


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from jaxdp.bench import testbed
    from jaxdp.bench.slowlink import run_training

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="50mbit")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--train-args", default="--strategy psum --outer-optimizer sgd --outer-lr 1 --outer-momentum 0 "
                                            "--sync-every 8 --overlap")
    p.add_argument("--json")
    args = p.parse_args()
    testbed.require("overlap_trace")
    root = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    with tempfile.TemporaryDirectory(prefix="overlap-trace-") as scratch:
        with open(os.path.join(scratch, "sitecustomize.py"), "w") as f:
            f.write(SITE)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([scratch, root]), "OVERLAP_TRACE": scratch}
        with testbed.Testbed(num_hosts=2, rate=args.rate) as bed:
            done = run_training(bed, ["--steps", str(args.steps), "--log-every", "40", *shlex.split(args.train_args)],
                                env=env)
        if not done.ok:
            raise SystemExit(f"overlap_trace: the run failed:\n{done.outputs[0][-3000:]}")
        by_process = [summarise(json.load(open(f))) for f in sorted(glob.glob(os.path.join(scratch, "*.json")))]
    rates = done.steps_per_sec()
    result = {"rate": args.rate, "train_args": args.train_args, "steps_per_s": statistics.median(rates),
              "by_process_ms": by_process, "loadavg": os.getloadavg()}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
