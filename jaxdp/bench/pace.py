"""pace: one process slowed for real; lockstep local steps against rounds of time (`--sync-seconds`).

    python -m jaxdp.bench pace                                  # process 1 at 50 % of a core
    python -m jaxdp.bench pace --slow-cpu 0.5 --sync-every 16 --sync-seconds 0.1 --steps 800 --json p.json

Two processes of the testbed (jaxdp/bench/testbed.py), one device and one core each; process 1 is
held to `--slow-cpu` of its core (a cgroup CPU quota where one can be set, else a shared core:
testbed.cpu_limit_kind()). The same command runs twice, back to back, for the same `--steps`
global batches (equal examples): once with `--sync-every H` (lockstep: both processes take H
steps per round, so the fast one waits for the slow one) and once with `--sync-seconds S` (each
takes as many steps as it manages in S seconds; the average is weighted by examples).

Figures: the summed examples/s of both processes (the median over the run's log intervals, the
first one, with compilation, left out; a log interval of the `--sync-seconds` run is one round),
each process's examples/s (lockstep: what its own time per step, the heartbeat's
`step_time_by_process`, would allow; paced: what it trained), and the held-out accuracy at the end.
The ideal ratio with one process at half speed is (1 + 1/2) / (2 x 1/2) = 1.5.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from jaxdp.bench import testbed
from jaxdp.bench.report import print_table, write_json
from jaxdp.bench.slowlink import run_training

UNSHAPED = "unshaped"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("pace", help="one process slowed by a CPU quota: --sync-every H (lockstep) against "
                                           "--sync-seconds S (needs root and iproute2)")
    p.add_argument("--slow-cpu", type=lambda t: [float(v) for v in t.split(",")], default=[0.5, 1.0],
                   help="comma-separated fractions of its core process 1 gets, one row each (1: the control, "
                        "neither slowed)")
    p.add_argument("--sync-every", type=int, default=16, help="H of the lockstep run")
    p.add_argument("--sync-seconds", type=float, default=0.1, help="S of the paced run")
    p.add_argument("--rate", default=UNSHAPED, help=f"the link's rate in tc's syntax, or {UNSHAPED}")
    p.add_argument("--steps", type=int, default=800, help="global batches per run (the same examples for both)")
    p.add_argument("--train-args", default="", help="more jaxdp.train flags, as one string")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--json")
    p.set_defaults(run=run)


def _median(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def run(args: argparse.Namespace) -> list[dict]:
    import shlex

    testbed.require("pace")
    if not all(0 < v <= 1 for v in args.slow_cpu):
        raise SystemExit(f"jaxdp.bench: pace: --slow-cpu must be fractions of a core in (0, 1], got {args.slow_cpu}")
    rate = None if args.rate == UNSHAPED else args.rate
    if rate:
        testbed.parse_rate(rate)
    base = ["--steps", str(args.steps), "--strategy", "ring", *shlex.split(args.train_args)]
    modes = {"lockstep": ["--sync-every", str(args.sync_every), "--log-every", str(args.sync_every)],
             "paced": ["--sync-seconds", str(args.sync_seconds)]}
    rows = []
    with testbed.Testbed(num_hosts=2, rate=rate) as bed:
        for slow in args.slow_cpu:
            rows.append(_pair(bed, base, modes, slow, args))
    print(f"2 processes x 1 device at {args.rate}, process 1 held to a fraction of its core "
          f"({testbed.cpu_limit_kind()}); `python -m jaxdp.train {' '.join(base)}` with --sync-every {args.sync_every} "
          f"(lockstep) and --sync-seconds {args.sync_seconds:g} (paced); median summed examples/s over the log "
          f"intervals of one run each; per process: paced, what it trained; lockstep, what its own time per step "
          f"(without waiting) would allow")
    print_table(rows, [("slow_cpu", "process 1 cpu", "g"),
                       ("lockstep_examples_per_s", "lockstep ex/s", ".0f"), ("paced_examples_per_s", "paced ex/s", ".0f"),
                       ("paced_vs_lockstep", "paced / lockstep", ".2f"),
                       ("paced_by_process_s", "paced ex/s by process", "s"),
                       ("lockstep_own_by_process_s", "lockstep own ex/s by process", "s"),
                       ("lockstep_eval_accuracy", "lockstep accuracy", ".4f"),
                       ("paced_eval_accuracy", "paced accuracy", ".4f")])
    write_json(args.json, rows, train_flags=base)
    return rows


def _pair(bed: testbed.Testbed, base: list[str], modes: dict, slow: float, args: argparse.Namespace) -> dict:
    """The lockstep and the paced run with process 1 at `slow` of its core."""
    row: dict[str, Any] = {"slow_cpu": slow, "cpu_limit": testbed.cpu_limit_kind(), "rate": args.rate}
    rows_per_process = None
    for mode, flags in modes.items():
        done = run_training(bed, [*base, *flags], timeout=args.timeout, process_cpu=[None, slow])
        if not done.ok:
            raise SystemExit(f"jaxdp.bench: pace: the {mode} run failed (exit codes {done.returncodes}):\n"
                             f"{done.outputs[0][-3000:]}\n{done.outputs[1][-3000:]}")
        steps = done.steps()[1:]  # the first interval includes compilation
        final = next((r for r in reversed(done.records) if r.get("event") == "done"), {})
        start = next((r for r in done.records if r.get("event") == "start"), {})
        rows_per_process = (start.get("config") or {}).get("batch_size", 0) // 2
        row[f"{mode}_examples_per_s"] = _median([r.get("examples_per_sec") for r in steps])
        row[f"{mode}_repeats"] = [r.get("examples_per_sec") for r in steps]
        row[f"{mode}_eval_accuracy"] = final.get("eval_accuracy")
        row[f"{mode}_final_step"] = final.get("step")
        row[f"{mode}_wall_s"] = done.wall_s
        if mode == "paced":
            per = [r["examples_per_sec_by_process"] for r in steps if r.get("examples_per_sec_by_process")]
            row["paced_by_process"] = [_median([p[i] for p in per]) for i in range(2)]
            row["paced_steps_by_process"] = [_median([r["round_steps_by_process"][i] for r in steps]) for i in range(2)]
        else:
            times = [r["step_time_by_process"] for r in steps if r.get("step_time_by_process")]
            own = [_median([t[i] for t in times]) for i in range(2)] if times else None
            row["lockstep_own_by_process"] = [rows_per_process / t for t in own] if own and rows_per_process else None
    for key in ("paced_by_process", "lockstep_own_by_process"):
        row[f"{key}_s"] = " / ".join(f"{v:.0f}" for v in row[key]) if row.get(key) else None
    row["paced_vs_lockstep"] = (row["paced_examples_per_s"] / row["lockstep_examples_per_s"]
                                if row["paced_examples_per_s"] and row["lockstep_examples_per_s"] else None)
    return row
