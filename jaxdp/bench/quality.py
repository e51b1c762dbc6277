"""`python -m jaxdp.bench quality`: time to quality on the laptop GPT. Each optimizer variant trains
the same GPT on the same batches through `python -m jaxdp.train` at each seed; held-out nats/byte
every `--eval-every` steps give the steps and seconds each run took to reach a target held-out loss.

    python -m jaxdp.bench quality --steps 400 --seeds 0,1,2 --json docs/perf/quality-gpt.json

The shape and recipe are `bench nanogpt`'s (4 layers, width 128, 4 heads, 128 tokens, batch 32;
warm-up then cosine to a tenth, clip 1.0, weight decay 0.1), on one device. The variants:

* `adamw`: AdamW at --lr (nanoGPT's recipe);
* `muon`: `--optimizer muon`: Muon for the hidden matrices at --muon-lr (0.02), Adam at --lr for the rest;
* `nesterov`: AdamW inside, and every --sync-every H steps DiLoCo's outer Nesterov (lr 0.7, momentum
  0.9, the command line's defaults) on the one worker's pseudo-gradient.

The target (`--target auto`) is the worst final held-out loss of the first variant's seeds: every run
of that variant reaches it by its last step. `steps_to_target` is the first evaluated step at or below
it (None: not reached); `seconds_to_target` is the run's elapsed seconds at that evaluation
(evaluations included, the same schedule for every variant).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxdp.bench.report import print_table

VARIANTS = {
    "adamw": ["--optimizer", "adamw"],
    "muon": ["--optimizer", "muon"],
    "nesterov": ["--optimizer", "adamw", "--sync-every", "{sync_every}"],  # --outer-optimizer nesterov is the default
}


def register(subparsers) -> None:
    from jaxdp.bench.nanogpt import RECIPE, SHAPE

    p = subparsers.add_parser("quality", help="time to quality on the laptop GPT: steps and seconds to a target "
                                              "held-out loss for AdamW, Muon and DiLoCo's outer Nesterov, per seed")
    p.add_argument("--dataset", help="a text file (default: the Python standard library's sources, --corpus-mb MB)")
    p.add_argument("--corpus-mb", type=float, default=12.0)
    p.add_argument("--variants", default="adamw,muon,nesterov", help="comma-separated: " + ", ".join(VARIANTS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=20, help="held-out batches per evaluation")
    p.add_argument("--target", default="auto", help="held-out nats/byte to reach; auto: the first variant's worst final")
    p.add_argument("--sync-every", type=int, default=8, help="H of the nesterov variant")
    p.add_argument("--lr", type=float, default=RECIPE["lr"])
    p.add_argument("--warmup-steps", type=int, help="default: the recipe's 100, at most a fifth of --steps")
    for flag in ("layers", "heads", "d_model", "seq_len", "batch_size"):
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=SHAPE[flag])
    p.add_argument("--train-args", default="", help="extra flags for every run")
    p.add_argument("--json", help="write the results here")
    p.set_defaults(run=run)


def run(args) -> list[dict]:
    from jaxdp.bench.nanogpt import stdlib_corpus

    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"jaxdp.bench quality: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    work = Path(tempfile.mkdtemp(prefix="jaxdp-quality-"))
    text = Path(args.dataset) if args.dataset else stdlib_corpus(work / "stdlib.txt", args.corpus_mb)
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in names:
            runs.append({"variant": name, "seed": seed, **train(text, name, seed, args, work)})
            print(json.dumps(runs[-1]), flush=True)
    target = auto_target(runs, names[0]) if args.target == "auto" else float(args.target)
    for r in runs:
        r.update(reached(r, target))
    summary = summarise(runs, names)
    print(f"target: held-out {target:.4f} nats/byte ({'the worst final of ' + names[0] if args.target == 'auto' else 'given'})")
    print_table(runs, [("variant", "variant", "s"), ("seed", "seed", "d"), ("final", "final nats/byte", ".4f"),
                       ("steps_to_target", "steps to target", "d"), ("seconds_to_target", "s to target", ".1f"),
                       ("steps_per_s", "steps/s", ".2f")])
    print_table(summary, [("variant", "variant", "s"), ("final_mean", "mean final", ".4f"),
                          ("reached", "seeds reached", "d"), ("steps_median", "median steps", ".0f"),
                          ("seconds_median", "median s", ".1f")])
    if args.json:
        Path(args.json).write_text(json.dumps({"dataset": str(text), "steps": args.steps, "target": target,
                                               "sync_every": args.sync_every, "summary": summary, "runs": runs}, indent=1))
    return runs


def train(text: Path, name: str, seed: int, args, work: Path) -> dict:
    from jaxdp.bench.nanogpt import RECIPE

    metrics = work / f"{name}-{seed}.jsonl"
    metrics.unlink(missing_ok=True)
    warmup = args.warmup_steps if args.warmup_steps is not None else min(RECIPE["warmup_steps"], args.steps // 5)
    flags = ["--model", "gpt", "--dataset", text, "--layers", args.layers, "--heads", args.heads,
             "--d-model", args.d_model, "--seq-len", args.seq_len, "--batch-size", args.batch_size,
             "--lr", args.lr, "--weight-decay", RECIPE["weight_decay"], "--schedule", "warmup-cosine",
             "--warmup-steps", warmup, "--final-lr-fraction", RECIPE["final_lr_fraction"],
             "--clip-norm", RECIPE["clip_norm"], "--steps", args.steps, "--eval-every", args.eval_every,
             "--eval-batches", args.eval_batches, "--seed", seed, "--devices", 1, "--log-every", args.eval_every,
             "--metrics-file", metrics, "--no-progress",
             *[f.format(sync_every=args.sync_every) for f in VARIANTS[name]], *args.train_args.split()]
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jaxdp.train", *map(str, flags)], check=True,
                   env={**os.environ, "XLA_FLAGS": ""})
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r for r in records if r.get("event") in ("eval", "done") and "eval_loss" in r]
    held = {str(r["step"]): r["eval_loss"] for r in evals}
    elapsed = {str(r["step"]): r["elapsed_s"] for r in evals if "elapsed_s" in r}
    rates = [r["steps_per_sec"] for r in records if "event" not in r and "steps_per_sec" in r][1:]
    return {"held_out": held, "elapsed_s": elapsed, "final": evals[-1]["eval_loss"] if evals else None,
            "steps_per_s": statistics.median(rates) if rates else None, "wall_s": time.perf_counter() - started}


def auto_target(runs: list[dict], baseline: str) -> float:
    """The worst (highest) final held-out loss among the baseline's runs."""
    return max(r["final"] for r in runs if r["variant"] == baseline)


def reached(run: dict, target: float) -> dict:
    """The first evaluated step at or below `target`, and the run's elapsed seconds there."""
    for step in sorted(run["held_out"], key=int):
        if run["held_out"][step] <= target:
            return {"steps_to_target": int(step), "seconds_to_target": run["elapsed_s"].get(step)}
    return {"steps_to_target": None, "seconds_to_target": None}


def summarise(runs: list[dict], names: list[str]) -> list[dict]:
    """Per variant: the mean final loss, how many seeds reached the target, and the median steps and
    seconds of those that did."""
    rows = []
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        hit = [r for r in mine if r["steps_to_target"] is not None]
        seconds = [r["seconds_to_target"] for r in hit if r["seconds_to_target"] is not None]
        rows.append({"variant": name, "seeds": len(mine), "final_mean": statistics.mean(r["final"] for r in mine),
                     "reached": len(hit), "steps_median": statistics.median(r["steps_to_target"] for r in hit) if hit else None,
                     "seconds_median": statistics.median(seconds) if seconds else None})
    return rows
