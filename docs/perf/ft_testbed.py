"""Two nodes on the slow-network testbed (jaxdp/bench/testbed.py; root and iproute2): a plain two-node run
(`jaxdp.launch --nnodes 2`, --strategy ring --compression int8) against the same run elastic on torchft (one
launcher per node, int8 between the workers), alternating; steps/s (median of the 50-step windows after the
first) and the bytes host 0 sent per step (the link's counters).

    python docs/perf/ft_testbed.py --rate 100mbit --steps 600 --repeats 2 --json out.json
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
    parser.add_argument("--json")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out: dict = {"rate": args.rate, "steps": args.steps, "runs": {}}
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
                                     sys.executable, "-m", "jaxdp.train", "--strategy", "ring", "--compression", "int8",
                                     "--devices", "1", "--steps", str(args.steps), "--no-progress", "--log-every", "50",
                                     "--metrics-file", os.path.join(where, f"m{i}.jsonl")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root) for i in range(2)]
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
    ratios = [e["steps_per_s"] / p["steps_per_s"] for e, p in zip(out["runs"]["elastic"], out["runs"]["plain"])]
    out["elastic_over_plain"] = statistics.median(ratios)
    print(f"elastic / plain steps/s: {', '.join(f'{r:.3f}' for r in ratios)} (median {out['elastic_over_plain']:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
