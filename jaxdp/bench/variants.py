"""variants: any `jaxdp.train` variants side by side, 2 processes over one shaped link: steps/s,
the ratio to the first variant, held-out accuracy and bytes sent.

    python -m jaxdp.bench variants --rate 100mbit \\
        --variants "--strategy ring;--strategy ring --compression int8;--strategy ring --compression int4"
    python -m jaxdp.bench variants --rate 50mbit --variants "--sync-every 8;--sync-every 8 --overlap" \\
        --train-args "--strategy ring --outer-optimizer sgd --outer-lr 1 --outer-momentum 0"

Every variant is one `run_training` (jaxdp/bench/slowlink.py) on the same testbed (jaxdp/bench/
testbed.py, one core per process unless --no-pin), with `--train-args` and then the variant's own flags. The
figure is the median steps/s over the run's log intervals (compilation left out), as the CLI's
`steps_per_sec` measures them; the ratio is against the first variant's, measured in the same
invocation. The held-out accuracy is the run's final evaluation; the bytes are the last logged
`comm_bytes` (the codec's own count of what a device sends per average) and, beside them, what each
host sent over the link per step as the kernel counted it (`Training.wire_bytes_per_step`: headers
and acknowledgements included, start-up and the final evaluation not). One run per variant; run
it again to see the spread. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
from typing import Any

from jaxdp.bench import testbed
from jaxdp.bench.report import print_table, write_json
from jaxdp.bench.slowlink import UNSHAPED, add_run_flags, run_training, train_flags


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("variants", help="jaxdp.train variants side by side, 2 processes over a shaped link: "
                                               "steps/s, ratio to the first, held-out accuracy (needs root and iproute2)")
    p.add_argument("--rate", default="100mbit", help="the link's rate in tc's syntax, or unshaped")
    p.add_argument("--variants", type=lambda t: [v.strip() for v in t.split(";")], required=True,
                   help="';'-separated jaxdp.train flags, one run each; ratios are against the first")
    p.add_argument("--devices", type=int, default=1, help="simulated devices per process")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not give each process its own core")
    add_run_flags(p)
    p.set_defaults(run=run)


def measure(bed: testbed.Testbed, flags: list[str], variant: str, *, devices: int = 1, pin: bool = True,
            timeout: float = 600, what: str = "variants") -> dict:
    """One `run_training` of `flags` then `variant`'s own on `bed`: the median steps/s over its
    log intervals (and each), the final held-out figures, the last logged `comm_bytes` (what each
    device sent per average) and the wall time. A failed run stops the benchmark (`what` names it)."""
    done = run_training(bed, [*flags, *shlex.split(variant)], devices=devices, pin=pin, timeout=timeout)
    if not done.ok:
        raise SystemExit(f"jaxdp.bench: {what}: the run {variant!r} failed (exit codes {done.returncodes}):"
                         f"\n{done.outputs[0][-3000:]}\n{done.outputs[1][-3000:]}")
    rates = done.steps_per_sec()
    final = next((r for r in reversed(done.records) if r.get("event") == "done"), {})
    return {"variant": variant or "(none)", "steps_per_s": statistics.median(rates), "repeats": rates,
            "eval_accuracy": final.get("eval_accuracy"), "eval_loss": final.get("eval_loss"),
            "comm_bytes": next((r.get("comm_bytes") for r in reversed(done.steps()) if r.get("comm_bytes") is not None),
                               None),
            "wire_bytes": done.wire_bytes_per_step(), "wall_s": done.wall_s, "auto_chose": chosen(done.records)}


def chosen(records: list[dict]) -> str | None:
    """What `--compression auto` and `--sync-every auto` chose in a run's metrics records, in order
    ("topk:0.001:gather", "--sync-every 16, int4"; a compression choice that local steps replaced is
    left out), or None where nothing was automatic."""
    said = []
    for r in records:
        if r.get("event") == "compression" and r.get("applied", True):
            said.append(str(r.get("choice")))
        elif r.get("event") == "local_steps":
            said.append(f"--sync-every {r.get('sync_every')}" + (f", {r['pseudo_gradient']}" if r.get("pseudo_gradient") else ""))
    return "; ".join(dict.fromkeys(said)) or None


def run(args: argparse.Namespace) -> list[dict]:
    testbed.require("variants")
    if args.rate != UNSHAPED:
        testbed.parse_rate(args.rate)
    flags = train_flags(args)
    results: list[dict] = []
    with testbed.Testbed(num_hosts=2, rate=None if args.rate == UNSHAPED else args.rate) as bed:
        for variant in args.variants:
            results.append(measure(bed, flags, variant, devices=args.devices, pin=args.pin, timeout=args.timeout,
                                   what="variants"))
    for row in results:
        row["vs_first"] = row["steps_per_s"] / results[0]["steps_per_s"]
    print(f"2 processes x {args.devices} device{'s' if args.devices > 1 else ''} in 2 network namespaces at {args.rate}, "
          f"`python -m jaxdp.train {' '.join(flags)} VARIANT`; median steps/s over the "
          f"{args.steps // args.log_every} log intervals of one run per variant")
    print_table(results, [("variant", "variant", "s"), ("steps_per_s", "steps/s", ".1f"), ("vs_first", "vs first", ".2f"),
                          ("eval_accuracy", "held-out accuracy", ".4f"), ("eval_loss", "held-out loss", ".4f"),
                          ("comm_bytes", "bytes sent per step", ".0f"), ("wire_bytes", "on the wire", ".0f")]
                + ([("auto_chose", "auto chose", "s")] if any(r["auto_chose"] for r in results) else []))
    write_json(args.json, results, rate=args.rate, devices=args.devices, pinned=args.pin, train_flags=flags)
    return results
