"""slowlink: `python -m jaxdp.train` in 2 processes on 2 hosts of a slow-network testbed
(jaxdp/bench/testbed.py: network namespaces joined by veth links that `tc` shapes), for each link
rate and strategy; steps/s in a table. Needs root and iproute2.

    python -m jaxdp.bench slowlink                                   # unshaped, 1gbit, 100mbit, 10mbit; psum, ring
    python -m jaxdp.bench slowlink --rates 100mbit --strategies ring --train-args "--model gpt --dataset corpus.txt"

Each (rate, strategy) is one run of `--steps` steps of the default model (the MLP on digits,
unless --train-args says otherwise), logged every `--log-every` steps; the first step (compilation)
is left out, and each log interval after it is one repeat: the table gives the median steps/s
over those repeats, as the CLI's own `steps_per_sec` measures them. Each process has one device
and, by default, its own core (--no-pin: not).

`run_training(bed, flags)` is the reusable part: any `jaxdp.train` flags, one process per testbed
host, returning process 0's metrics records, the wall time and each process's output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from jaxdp.bench import testbed
from jaxdp.bench.report import print_table, write_json

UNSHAPED = "unshaped"
COORDINATOR_PORT = 12355  # any port: each testbed is a network of its own


@dataclasses.dataclass
class Training:
    """What one multi-process `jaxdp.train` run on a testbed left behind."""

    records: list[dict]        # process 0's metrics file, one dict per JSON line
    wall_s: float              # from starting the processes to the last one's exit
    returncodes: list[int]
    outputs: list[str]         # each process's stdout and stderr, interleaved
    wire: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)  # (last logged step, sent per host)

    def wire_bytes_per_step(self) -> float | None:
        """What each host sent over the link per step, as the kernel counted it (testbed.sent_bytes),
        between the first logged step and the last (compilation, start-up and the final evaluation
        left out), averaged over the hosts; None if the run logged fewer than two steps in time."""
        logged = [(step, sent) for step, sent in self.wire if step > 0]
        if not logged or logged[-1][0] <= logged[0][0]:
            return None
        # each step's first sample: the counters just after its record appeared
        (first, before), (last, after) = logged[0], next(s for s in logged if s[0] == logged[-1][0])
        return statistics.fmean((b - a) / (last - first) for a, b in zip(before, after))

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)

    def steps(self) -> list[dict]:
        return [r for r in self.records if "event" not in r]

    def steps_per_sec(self) -> list[float]:
        """The CLI's steps/s of each log interval after the first step (compilation is not in any)."""
        return [r["steps_per_sec"] for r in self.steps() if isinstance(r.get("steps_per_sec"), (int, float))]


def run_training(bed: testbed.Testbed, flags: Sequence[str], *, devices: int = 1, pin: bool = True,
                 timeout: float = 600, env: Mapping[str, str] | None = None,
                 process_flags: Sequence[Sequence[str]] | None = None,
                 process_env: Sequence[Mapping[str, str]] | None = None,
                 process_cpu: Sequence[float | None] | None = None) -> Training:
    """`python -m jaxdp.train --devices DEVICES *flags` on every host of `bed`, host 0 the
    coordinator, process 0 writing the metrics file. `process_flags[i]` / `process_env[i]` add to
    process i's flags / environment; `process_cpu[i]` holds process i to that fraction of its core
    (testbed.Testbed.run). `pin`: process i runs on core i (mod the cores there are).
    Processes still running after `timeout` seconds are killed (their return code is then negative)."""
    base_env = {k: v for k, v in (os.environ if env is None else env).items() if k != "XLA_FLAGS"}  # --devices decides
    cores = sorted(os.sched_getaffinity(0)) if pin and hasattr(os, "sched_setaffinity") else None
    with tempfile.TemporaryDirectory(prefix="jaxdp-slowlink-") as scratch:
        metrics = Path(scratch) / "metrics.jsonl"
        procs, logs = [], []
        start = time.perf_counter()
        for i in range(bed.num_hosts):
            argv = [sys.executable, "-m", "jaxdp.train", "--devices", str(devices), "--no-progress", *flags,
                    *(process_flags[i] if process_flags else ()),
                    "--coordinator-address", f"{bed.address(0)}:{COORDINATOR_PORT}",
                    "--num-processes", str(bed.num_hosts), "--process-id", str(i)]
            if i == 0:
                argv += ["--metrics-file", str(metrics)]
            log = open(Path(scratch) / f"p{i}.log", "w+")
            logs.append(log)
            core = None if cores is None else {cores[i % len(cores)]}
            procs.append(bed.run(i, argv, env={**base_env, **(process_env[i] if process_env else {})},
                                 stdout=log, stderr=log, cpu=process_cpu[i] if process_cpu else None,
                                 preexec_fn=None if core is None else (lambda core=core: os.sched_setaffinity(0, core))))
        deadline = start + timeout
        wire: list[tuple[int, list[int]]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_wire, args=(bed, metrics, wire, stop), daemon=True)
        sampler.start()
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                pass
        stop.set()
        sampler.join()
        wall_s = time.perf_counter() - start
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return Training(records, wall_s, [p.returncode for p in procs], outputs, wire)


WIRE_SAMPLE_S = 0.05  # how often run_training reads the link's counters (and the last logged step)


def _sample_wire(bed: testbed.Testbed, metrics: Path, wire: list, stop: threading.Event) -> None:
    """Until `stop`: append (the last logged step in `metrics`, the bytes each host has sent) to `wire`."""
    step, seen = 0, 0
    while not stop.wait(WIRE_SAMPLE_S):
        try:
            with open(metrics, "rb") as f:
                f.seek(seen)
                chunk = f.read()
        except OSError:
            chunk = b""
        lines = chunk.split(b"\n")
        seen += len(chunk) - len(lines[-1])  # a line still being written is read again next time
        for line in lines[:-1]:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "event" not in record and isinstance(record.get("step"), int):
                step = max(step, record["step"])
        try:
            wire.append((step, bed.sent_bytes()))
        except (testbed.TestbedError, ValueError, KeyError):
            return


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("slowlink", help="2 processes over a shaped network link (needs root and iproute2)")
    p.add_argument("--rates", type=lambda t: t.split(","), default=[UNSHAPED, "1gbit", "100mbit", "10mbit"],
                   help=f"link rates in tc's syntax, or {UNSHAPED}")
    p.add_argument("--strategies", type=lambda t: t.split(","), default=["psum", "ring"])
    add_run_flags(p)
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not give each process its own core")
    p.set_defaults(run=run)


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a benchmark made of one `run_training` per cell, its log intervals the repeats:
    --steps, --log-every, --train-args, --timeout, --json; `train_flags(args)` turns them into flags."""
    p.add_argument("--steps", type=int, default=200, help="steps per run")
    p.add_argument("--log-every", type=int, default=20, help="steps per repeat (a log interval of the run)")
    p.add_argument("--train-args", default="", help="more jaxdp.train flags, as one string")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--json")


def train_flags(args: argparse.Namespace) -> list[str]:
    """The jaxdp.train flags `add_run_flags` asked for."""
    return ["--steps", str(args.steps), "--log-every", str(args.log_every), *shlex.split(args.train_args)]


def run(args: argparse.Namespace) -> list[dict]:
    testbed.require("slowlink")
    for rate in args.rates:
        if rate != UNSHAPED:
            testbed.parse_rate(rate)  # a bad rate fails before the first run, not after it
    flags = train_flags(args)
    results = []
    for rate in args.rates:
        row: dict[str, Any] = {"rate": rate}
        with testbed.Testbed(num_hosts=2, rate=None if rate == UNSHAPED else rate) as bed:
            for strategy in args.strategies:
                run = run_training(bed, [*flags, "--strategy", strategy], pin=args.pin, timeout=args.timeout)
                if not run.ok:
                    raise SystemExit(f"jaxdp.bench: slowlink: the {strategy} run at {rate} failed "
                                     f"(exit codes {run.returncodes}):\n{run.outputs[0][-3000:]}\n{run.outputs[1][-3000:]}")
                rates = run.steps_per_sec()
                row[f"{strategy}_steps_per_s"] = statistics.median(rates)
                row[f"{strategy}_repeats"] = rates
                row[f"{strategy}_wall_s"] = run.wall_s
        if "psum" in args.strategies:
            for strategy in args.strategies:
                row[f"{strategy}_vs_psum"] = row[f"{strategy}_steps_per_s"] / row["psum_steps_per_s"]
        results.append(row)
    print(f"2 processes x 1 device in 2 network namespaces, `python -m jaxdp.train {' '.join(flags)}`; "
          f"median steps/s over the {args.steps // args.log_every} log intervals of one run per cell")
    columns = [("rate", "link", "s")]
    for strategy in args.strategies:
        columns.append((f"{strategy}_steps_per_s", f"{strategy} steps/s", ".1f"))
        if strategy != "psum" and "psum" in args.strategies:
            columns.append((f"{strategy}_vs_psum", f"{strategy} / psum", ".3f"))
    print_table(results, columns)
    write_json(args.json, results, pinned=args.pin, train_flags=flags)
    return results
