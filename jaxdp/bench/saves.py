"""saves: what checkpoints cost a run that never fails, per `--save-every` (a number, or auto).

    python -m jaxdp.bench saves                                       # 0, 1, 10, 100 and auto
    python -m jaxdp.bench saves --intervals 0,auto --steps 4000 --repeats 3 --json s.json

Each interval is `python -m jaxdp.train --steps N --checkpoint-dir D --save-every K` (the default
MLP; `--train-args` for more flags) in a fresh directory, `--repeats` times, the intervals
interleaved so that drift in the machine's speed spreads over all of them. The figure is the
median of the run's training time (the metrics file's last `elapsed_s`: from the start of the
loop, the first step's compilation included, which a warm cache makes short and alike in every run,
to the last logged step, before the final save), and the overhead is its ratio to the first interval's (0: only the final
save, by default). For auto, the interval it chose is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from jaxdp.bench.report import print_table, write_json


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("saves", help="what checkpoints cost an undisturbed run, per --save-every (auto included)")
    p.add_argument("--intervals", type=lambda t: t.split(","), default=["0", "1", "10", "100", "auto"],
                   help="comma-separated --save-every values; overheads are against the first")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--train-args", default="", help="more jaxdp.train flags, as one string")
    p.add_argument("--json")
    p.set_defaults(run=run)


def _once(directory: str, steps: int, every: str, extra: list[str]) -> tuple[float, list[int]]:
    metrics = os.path.join(directory, "metrics.jsonl")
    done = subprocess.run([sys.executable, "-m", "jaxdp.train", "--steps", str(steps), "--no-progress",
                           "--checkpoint-dir", os.path.join(directory, "ckpt"), "--save-every", every,
                           "--log-every", "50", "--metrics-file", metrics, *extra], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"jaxdp.bench: saves: --save-every {every} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    elapsed = [r["elapsed_s"] for r in records if "elapsed_s" in r and "event" not in r][-1]
    return elapsed, [r["save_every"] for r in records if r.get("event") == "save_every"]


def run(args: argparse.Namespace) -> list[dict]:
    extra = shlex.split(args.train_args)
    times: dict[str, list[float]] = {every: [] for every in args.intervals}
    chosen: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="jaxdp-saves-") as scratch:
        _once(os.path.join(scratch, "warm"), 2, "0", extra)  # the compile cache: every run finds it warm
        for repeat in range(args.repeats):
            for every in args.intervals:
                seconds, picked = _once(os.path.join(scratch, f"{every}-{repeat}"), args.steps, every, extra)
                times[every].append(seconds)
                chosen.setdefault(every, picked)
    base = statistics.median(times[args.intervals[0]])
    rows = [{"save_every": every, "train_s": statistics.median(times[every]), "repeats_s": times[every],
             "overhead": statistics.median(times[every]) / base - 1, "chosen": chosen.get(every) or None}
            for every in args.intervals]
    print(f"`python -m jaxdp.train --steps {args.steps} --save-every K {args.train_args}`, median training time of "
          f"{args.repeats} runs (to the last logged step: the final save left out); overhead against --save-every "
          f"{args.intervals[0]}")
    print_table(rows, [("save_every", "--save-every", "s"), ("train_s", "training s", ".2f"),
                       ("overhead", "overhead", "+.1%"), ("chosen", "auto chose", "")])
    write_json(args.json, rows, steps=args.steps, train_args=extra)
    return rows
