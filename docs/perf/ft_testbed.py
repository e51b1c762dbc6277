"""Two nodes on the slow-network testbed (jaxdp/bench/testbed.py; root and iproute2): a plain two-node run
(`jaxdp.launch --nnodes 2`, --strategy ring --compression int8) against the same run elastic on torchft (one
launcher per node, int8 between the workers), alternating; steps/s (median of the 50-step windows after the
first) and the bytes host 0 sent per step (the link's counters).

    python docs/perf/ft_testbed.py --rate 100mbit --steps 600 --repeats 2 --json out.json
    python docs/perf/ft_testbed.py --one-node --train-args "--strategy psum" --steps 3000 --repeats 3
    python docs/perf/ft_testbed.py --one-node --train-args "--strategy psum --sync-seconds 0.5" --steps 30000 --repeats 5

`--one-node`: no namespaces (no root needed): one launcher, `--nproc-per-node 2` on 127.0.0.1, each
worker bound to its own core as the launcher does by default, as a user runs two processes on one
machine; its bytes are the loopback interface's (every message, the Lighthouse's too). `--train-args`:
the mode (default `--strategy ring --compression int8`). `--pin`: on the testbed, node i's launcher
and its worker on core i alone (a node's launcher binds its one worker to every core it has: without
it both nodes' workers and their threads share both cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def main() -> None:
    from jaxdp.bench.testbed import Testbed

    parser = argparse.ArgumentParser(prog="docs/perf/ft_testbed.py")
    parser.add_argument("--rate", default="100mbit", help="tc's syntax, or unshaped")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one-node", action="store_true", help="one launcher, 2 processes on 127.0.0.1")
    parser.add_argument("--pin", action="store_true",
                        help="each node's launcher (and so its worker) on a core of its own, as two machines would be")
    parser.add_argument("--train-args", default="--strategy ring --compression int8")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.one_node:
        return one_node(args)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out: dict = {"rate": args.rate, "steps": args.steps, "train_args": args.train_args, "pinned": args.pin, "runs": {}}
    with tempfile.TemporaryDirectory() as scratch, Testbed(2, None if args.rate == "unshaped" else args.rate) as bed:
        port = 29400
        for repeat in range(args.repeats):
            for mode in ("plain", "elastic"):
                port += 10
                where = os.path.join(scratch, f"{mode}-{repeat}")
                os.makedirs(where)
                engine = ["--elastic", "--elastic-engine", "torchft"] if mode == "elastic" else []
                before, started = bed.sent_bytes(), time.time()
                procs = [bed.run(i, [sys.executable, "-m", "jaxdp.launch", *engine, "--nnodes", "2", "--node-rank", str(i),
                                     "--coordinator", f"{bed.address(0)}:{port}", "--nproc-per-node", "1", "--",
                                     sys.executable, "-m", "jaxdp.train", *args.train_args.split(),
                                     "--devices", "1", "--steps", str(args.steps), "--no-progress", "--log-every", "50",
                                     "--metrics-file", os.path.join(where, f"m{i}.jsonl")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root,
                                 preexec_fn=(lambda i=i: os.sched_setaffinity(0, {i})) if args.pin else None)
                     for i in range(2)]
                codes = [p.wait(timeout=900) for p in procs]
                sent = [after - b for after, b in zip(bed.sent_bytes(), before)]
                with open(os.path.join(where, "m0.jsonl")) as f:
                    rows = [json.loads(line) for line in f]
                windows = [r["steps_per_sec"] for r in rows if "steps_per_sec" in r and "event" not in r]
                row = {"exit_codes": codes, "steps_per_s": statistics.median(windows[1:]), "wall_s": time.time() - started,
                       "bytes_per_step_host0": sent[0] / args.steps}
                out["runs"].setdefault(mode, []).append(row)
                print(f"{mode:8s} {repeat}: {row['steps_per_s']:7.1f} steps/s, {row['bytes_per_step_host0']:9.0f} bytes/step "
                      f"sent by host 0, exit codes {codes}", flush=True)
    summarize(out, args.json)


def windows_median(path: str) -> float:
    """The median steps/s of a metrics file's 50-step windows after the first (compilation); for rounds
    (--sync-seconds), the global steps over the seconds from the first round's end to the last's."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    rounds = [r for r in rows if "round" in r and "event" not in r]
    if rounds:
        return (rounds[-1]["step"] - rounds[0]["step"]) / (rounds[-1]["elapsed_s"] - rounds[0]["elapsed_s"])
    return statistics.median([r["steps_per_sec"] for r in rows if "steps_per_sec" in r and "event" not in r][1:])


def one_node(args: argparse.Namespace) -> None:
    """Plain against elastic, alternating, both one launcher of 2 processes on this machine."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out: dict = {"rate": "one node, loopback", "steps": args.steps, "train_args": args.train_args, "runs": {}}
    lo = "/sys/class/net/lo/statistics/tx_bytes"
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for mode in ("plain", "elastic"):
                where = os.path.join(scratch, f"{mode}-{repeat}")
                os.makedirs(where)
                engine = ["--elastic", "--elastic-engine", "torchft"] if mode == "elastic" else []
                with open(lo) as f:
                    before = int(f.read())
                started = time.time()
                code = subprocess.run([sys.executable, "-m", "jaxdp.launch", *engine, "--nproc-per-node", "2", "--",
                                       sys.executable, "-m", "jaxdp.train", *args.train_args.split(), "--devices", "1",
                                       "--steps", str(args.steps), "--no-progress", "--log-every", "50",
                                       "--metrics-file", os.path.join(where, "m.jsonl")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root, timeout=900).returncode
                with open(lo) as f:
                    sent = int(f.read()) - before
                row = {"exit_codes": [code], "steps_per_s": windows_median(os.path.join(where, "m.jsonl")),
                       "wall_s": time.time() - started, "loopback_bytes_per_step": sent / args.steps}
                out["runs"].setdefault(mode, []).append(row)
                print(f"{mode:8s} {repeat}: {row['steps_per_s']:7.1f} steps/s, {row['loopback_bytes_per_step']:9.0f} "
                      f"loopback bytes/step, exit code {code}", flush=True)
    summarize(out, args.json)


def summarize(out: dict, path: str | None) -> None:
    ratios = [e["steps_per_s"] / p["steps_per_s"] for e, p in zip(out["runs"]["elastic"], out["runs"]["plain"])]
    out["elastic_over_plain"] = statistics.median(ratios)
    print(f"elastic / plain steps/s: {', '.join(f'{r:.3f}' for r in ratios)} (median {out['elastic_over_plain']:.3f})")
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
