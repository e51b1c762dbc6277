"""budget: bytes and held-out loss of `--byte-budget` runs against the synchronous float32 run, over
run lengths x seeds x model configurations (--devices simulated devices in one process, 2 by default:
the bytes a device sends and the losses do not depend on the link, so no testbed is needed).

    python -m jaxdp.bench budget --steps 400,800 --seeds 0,1,2 --configs tuned,other --json docs/perf/budget-400-800.json
    python -m jaxdp.bench budget --budget 0.001 --variants "--sync-every 8 --compression topk:0.006:2:decay=0.98"

Each cell is `python -m jaxdp.train` with the configuration's flags, `--steps S --seed K --devices
D`, once synchronous (`--sync-every 1`, float32 through psum: a bandwidth-optimal all-reduce sends
what the float32 ring does) and once per variant; by default the one variant is the user's path,
`--sync-every auto --compression auto --byte-budget B`, with the budget's own outer step
(jaxdp/sync/budget.py, `outer_lr`). Every run evaluates once, at its end, on the same `--eval-batches` held-out batches.

Bytes are the codec's own count of what a device sends per step (the last logged
`comm_bytes_per_step`, or `comm_bytes` at every step): `fewer_bytes` is the synchronous run's over
the variant's. The logged scalars of a variant that averages them at every step (auto does: see
docs/slow-links.md) add `scalar_bytes_per_step` (their float32 all-reduce), counted in `fewer_bytes`
too. `loss_ratio` is the variant's final held-out loss over the synchronous run's, same seed and
length. `--synchronous-from JSON` takes the synchronous runs from an earlier budget JSON of the same
flags (they do not depend on the variant).
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
import time
from typing import Any

from jaxdp.bench.localsgd import MODEL_FLAGS, default_corpus
from jaxdp.bench.report import print_table, write_json

# "tuned": the local-steps benchmark's GPT (jaxdp/bench/localsgd.py), on which auto's top-k was calibrated;
# "other": a wider GPT at another learning rate and warm-up, not used to choose anything.
CONFIGS = {
    "tuned": MODEL_FLAGS,
    "other": "--model gpt --layers 2 --d-model 96 --heads 4 --seq-len 64 --batch-size 16 --lr 1e-3 "
             "--schedule warmup-cosine --warmup-steps 50",
}
SCALARS = 2  # the logged scalars (loss, grad_norm) a step averages when they cross every step


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("budget", help="--byte-budget against synchronous float32: bytes ratio and held-out "
                                             "loss ratio over run lengths x seeds x model configurations")
    p.add_argument("--budget", default="0.001", help="--byte-budget of the default variant (a fraction, or NNNx)")
    p.add_argument("--steps", type=_ints, default=[400], help="run lengths, comma-separated")
    p.add_argument("--seeds", type=_ints, default=[0], help="seeds, comma-separated")
    p.add_argument("--configs", type=lambda t: t.split(","), default=["tuned"],
                   help=f"model configurations, comma-separated: {', '.join(CONFIGS)}")
    p.add_argument("--train-args", help="model and optimizer flags of one configuration, named custom, in place of "
                                        "--configs")
    p.add_argument("--variants", type=lambda t: [v.strip() for v in t.split(";")],
                   help="';'-separated jaxdp.train flags of the runs compared with synchronous (default: "
                        "--sync-every auto --compression auto --byte-budget BUDGET)")
    p.add_argument("--devices", type=int, default=2, help="simulated devices of every run (the byte ratios are per "
                                                          "device at this count)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--dataset", help="text file (default: README.md and jaxdp/*.py, concatenated)")
    p.add_argument("--synchronous-from", metavar="JSON", help="the synchronous runs of an earlier budget JSON")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--json")
    p.set_defaults(run=run)


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated integers") from None


def train(flags: list[str], timeout: float) -> dict[str, Any]:
    """One `python -m jaxdp.train` run: its final held-out loss, bytes per step, what auto chose."""
    with tempfile.TemporaryDirectory(prefix="jaxdp-budget-") as scratch:
        metrics = os.path.join(scratch, "run.jsonl")
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "jaxdp.train", *flags, "--metrics-file", metrics, "--no-progress"],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise SystemExit(f"jaxdp.bench: budget: the run {shlex.join(flags)} failed (exit {done.returncode}):\n"
                             f"{done.stderr[-3000:]}")
        with open(metrics) as f:
            records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "step" in r and "event" not in r]
    final = next(r for r in reversed(records) if r.get("event") == "done")
    chose = next((r for r in records if r.get("event") == "local_steps"), None)
    per_step = next((r[k] for r in reversed(steps) for k in ("comm_bytes_per_step", "comm_bytes") if k in r), None)
    return {"eval_loss": final["eval_loss"], "comm_bytes_per_step": per_step, "wall_s": time.perf_counter() - started,
            "sync_every": chose["sync_every"] if chose else None,
            "pseudo_gradient": chose.get("pseudo_gradient") if chose else None,
            "why": chose.get("why") if chose else None, "metrics_at_sync": "--metrics-at-sync" in flags}


def run(args: argparse.Namespace) -> list[dict]:
    configs = {"custom": args.train_args} if args.train_args else CONFIGS
    if args.train_args:
        args.configs = ["custom"]
    unknown = [c for c in args.configs if c not in configs]
    if unknown:
        raise SystemExit(f"jaxdp.bench: budget: --configs {','.join(unknown)}: not one of {', '.join(CONFIGS)}")
    variants = args.variants or [f"--sync-every auto --compression auto --byte-budget {args.budget}"]
    earlier = {}
    if args.synchronous_from:
        with open(args.synchronous_from) as f:
            earlier = {(r["config"], r["steps"], r["seed"]): r for r in json.load(f)["results"]
                       if r["variant"] == "synchronous"}
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="jaxdp-budget-") as scratch:
        dataset = args.dataset or default_corpus(scratch)
        for config in args.configs:
            for steps in args.steps:
                for seed in args.seeds:
                    base = [*shlex.split(configs[config]), "--dataset", dataset, "--steps", str(steps), "--seed", str(seed),
                            "--devices", str(args.devices), "--eval-every", "0", "--eval-batches", str(args.eval_batches),
                            "--log-every", "10"]
                    cell = {"config": config, "steps": steps, "seed": seed}
                    sync = earlier.get((config, steps, seed))
                    if sync is None or sync.get("train_flags") != base:
                        sync = {**cell, "variant": "synchronous", "train_flags": base,
                                **train([*base, "--sync-every", "1"], args.timeout)}
                    results.append(sync)
                    for variant in variants:
                        row = {**cell, "variant": variant, "train_flags": base,
                               **train([*base, *shlex.split(variant)], args.timeout)}
                        scalars = 0 if row["metrics_at_sync"] or not row["sync_every"] else SCALARS * 4
                        row["scalar_bytes_per_step"] = scalars
                        row["fewer_bytes"] = sync["comm_bytes_per_step"] / (row["comm_bytes_per_step"] + scalars)
                        row["loss_ratio"] = row["eval_loss"] / sync["eval_loss"]
                        results.append(row)
                        print(f"{config} {steps} steps seed {seed}: {variant}: {row['fewer_bytes']:.0f}x fewer bytes, "
                              f"held-out loss {row['eval_loss']:.4f} / {sync['eval_loss']:.4f} = {row['loss_ratio']:.4f}",
                              flush=True)
    rows = [r for r in results if r["variant"] != "synchronous"]
    print_table(results, [("config", "config", "s"), ("steps", "steps", "d"), ("seed", "seed", "d"),
                          ("variant", "run", "s"), ("sync_every", "H", "d"), ("pseudo_gradient", "codec", "s"),
                          ("eval_loss", "held-out loss", ".4f"), ("loss_ratio", "loss / sync", ".4f"),
                          ("comm_bytes_per_step", "B/step", ".1f"), ("fewer_bytes", "x fewer bytes", ".0f")])
    summary = summarize(rows)
    for s in summary:
        print(f"{s['config']} {s['steps']} steps, {s['variant']}: loss / sync {s['loss_ratio_mean']:.4f} "
              f"(max {s['loss_ratio_max']:.4f}, {s['seeds']} seeds), {s['fewer_bytes_min']:.0f}x fewer bytes (least)")
    write_json(args.json, results, summary=summary, budget=args.budget, configs={c: configs[c] for c in args.configs},
               devices=args.devices)
    return results


def summarize(rows: list[dict]) -> list[dict]:
    """Per (config, steps, variant): the mean and largest loss ratio over seeds, the fewest bytes ratio."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["config"], r["steps"], r["variant"]), []).append(r)
    return [{"config": c, "steps": s, "variant": v, "seeds": len(rs),
             "loss_ratio_mean": statistics.mean(r["loss_ratio"] for r in rs),
             "loss_ratio_max": max(r["loss_ratio"] for r in rs),
             "fewer_bytes_min": min(r["fewer_bytes"] for r in rs)} for (c, s, v), rs in out.items()]
