"""hierarchy: `--hierarchy auto` against `flat`, 2 processes x G devices over a shaped link.

    python -m jaxdp.bench hierarchy                                   # 100mbit, 4 devices per process, ring
    python -m jaxdp.bench hierarchy --rate 100mbit --devices 4 --compressions none,int8 --json h.json

Each process of the slow-network testbed (jaxdp/bench/testbed.py) runs G simulated devices on its
own core. `flat` runs one ring over all 2G devices: its two hops between the processes carry about
2 (2G - 1) / 2G of the buffer each way per step, in 2 (2G - 1) sequential hops. `auto` sums inside
each process first (exact, XLA's collective), then every device runs a ring of 2 across the link
on 1/G of the buffer, then gathers locally: the link carries the buffer once each way. For each
`--compressions` entry the two runs are made back to back at the same link (one run each, the
order alternating from entry to entry); the figure is the median steps/s over the log intervals of
a run (compilation left out), and the ratio auto / flat. The held-out accuracy of each run is
reported beside it: the two sum the same numbers in another order.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from jaxdp.bench import testbed
from jaxdp.bench.report import print_table, write_json
from jaxdp.bench.slowlink import add_run_flags, run_training, train_flags


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("hierarchy", help="--hierarchy auto against flat, 2 processes x G devices over a "
                                                "shaped link (needs root and iproute2)")
    p.add_argument("--rate", default="100mbit", help="the link's rate in tc's syntax")
    p.add_argument("--devices", type=int, default=4, help="simulated devices per process")
    p.add_argument("--strategy", default="ring", choices=("ring", "psum"))
    p.add_argument("--compressions", type=lambda t: t.split(","), default=["none"],
                   help="comma-separated --compression values, one pair of runs each (int8, int4: ring only)")
    add_run_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> list[dict]:
    testbed.require("hierarchy")
    if args.devices < 2:
        raise SystemExit("jaxdp.bench: hierarchy: --devices must be at least 2 (one device per process has no "
                         "hierarchy)")
    testbed.parse_rate(args.rate)
    flags = [*train_flags(args), "--strategy", args.strategy]
    results = []
    with testbed.Testbed(num_hosts=2, rate=args.rate) as bed:
        for i, compression in enumerate(args.compressions):
            row: dict[str, Any] = {"compression": compression}
            order = ("flat", "auto") if i % 2 == 0 else ("auto", "flat")
            for mode in order:
                done = run_training(bed, [*flags, "--compression", compression, "--hierarchy", mode],
                                    devices=args.devices, timeout=args.timeout)
                if not done.ok:
                    raise SystemExit(f"jaxdp.bench: hierarchy: the {mode} run ({compression}) failed (exit codes "
                                     f"{done.returncodes}):\n{done.outputs[0][-3000:]}\n{done.outputs[1][-3000:]}")
                rates = done.steps_per_sec()
                final = next((r for r in reversed(done.records) if r.get("event") == "done"), {})
                row[f"{mode}_steps_per_s"] = statistics.median(rates)
                row[f"{mode}_repeats"] = rates
                row[f"{mode}_eval_accuracy"] = final.get("eval_accuracy")
                row[f"{mode}_comm_bytes"] = next((r.get("comm_bytes") for r in reversed(done.steps())
                                                  if r.get("comm_bytes") is not None), None)
            row["auto_vs_flat"] = row["auto_steps_per_s"] / row["flat_steps_per_s"]
            results.append(row)
    print(f"2 processes x {args.devices} devices in 2 network namespaces at {args.rate}, `python -m jaxdp.train "
          f"{' '.join(flags)} --compression C --hierarchy flat|auto`; median steps/s over the "
          f"{args.steps // args.log_every} log intervals of one run per cell")
    print_table(results, [("compression", "compression", "s"), ("flat_steps_per_s", "flat steps/s", ".1f"),
                          ("auto_steps_per_s", "auto steps/s", ".1f"), ("auto_vs_flat", "auto / flat", ".2f"),
                          ("flat_eval_accuracy", "flat accuracy", ".4f"), ("auto_eval_accuracy", "auto accuracy", ".4f")])
    write_json(args.json, results, rate=args.rate, devices=args.devices, train_flags=flags)
    return results
