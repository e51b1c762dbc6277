"""localsgd: time to a held-out loss over a slow link, synchronous training against local steps
(`--sync-every H`, jaxdp/step/local_sgd.py), 2 processes on 2 hosts of the slow-network testbed
(jaxdp/bench/testbed.py). Needs root and iproute2.

    python -m jaxdp.bench localsgd --json docs/perf/localsgd.json --plot docs/perf/localsgd.png
    python -m jaxdp.bench localsgd --rate 100mbit --sync-every 8 --variants "--outer-optimizer sgd --outer-lr 1 --outer-momentum 0"
    python -m jaxdp.bench localsgd --variants \
        "--outer-optimizer sgd --outer-lr 1 --outer-momentum 0;--sync-every auto --outer-optimizer sgd --outer-lr 1 --outer-momentum 0"

Each run is `python -m jaxdp.train` with the same model, data, schedule and number of steps (so
equal tokens), evaluated every `--eval-every` steps on the same held-out batches. Time is training
time: the run's clock minus its first step (compilation) and its evaluations. The target loss is
the synchronous run's final held-out loss times (1 + `--margin`); each run's time to it is the
first evaluation at or below it. The default model (a 2-layer GPT, d_model 64, on this project's
own source as bytes) has 0.55 MB of float32 gradients: about 0.44 s per all-reduce at 10 Mbit/s
against a few tens of milliseconds of compute per step on one core, so the link dominates
synchronous training. The default corpus is the checkout's own source, so its losses move a
little whenever that source changes; give `--dataset` a fixed file to compare across commits.
Bytes are as the link's counters saw them (`slowlink.Training.wire_bytes_per_step`: what each host
sent per step, evaluations included, start-up not), and the ratio against the synchronous run's.
On a link where the synchronous run would take hours (1 Mbit/s), `--synchronous-from` takes it
from an earlier JSON of the same training flags (its losses and bytes do not depend on the link).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import tempfile
from typing import Any

from jaxdp.bench import slowlink, testbed
from jaxdp.bench.report import print_table, write_json

MODEL_FLAGS = ("--model gpt --layers 2 --d-model 64 --heads 4 --seq-len 64 --batch-size 16 --lr 3e-3 "
               "--schedule warmup-cosine --warmup-steps 20")
# Plain averaging and DiLoCo's outer Nesterov step; every variant gets --sync-every from the command line
# unless it names its own (e.g. "--sync-every auto --outer-optimizer sgd --outer-lr 1 --outer-momentum 0").
VARIANTS = ("--outer-optimizer sgd --outer-lr 1 --outer-momentum 0", "--outer-optimizer nesterov --outer-lr 0.7 --outer-momentum 0.9")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("localsgd", help="time to a held-out loss over a slow link: synchronous vs --sync-every "
                                              "(needs root and iproute2)")
    p.add_argument("--rate", default="10mbit", help="link rate in tc's syntax, or unshaped")
    p.add_argument("--sync-every", type=int, default=16, help="H of the local-step runs")
    p.add_argument("--variants", type=lambda t: t.split(";"), default=list(VARIANTS),
                   help="local-step runs: outer-optimizer flags, one string per run, separated by ';'; a run "
                        "that names its own --sync-every (auto, or another H) keeps it")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--margin", type=float, default=0.03, help="target = synchronous final held-out loss x (1 + margin)")
    p.add_argument("--dataset", help="text file (default: README.md and jaxdp/*.py, concatenated)")
    p.add_argument("--train-args", default=MODEL_FLAGS, help="model and optimizer flags of every run")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--synchronous-from", metavar="JSON",
                   help="take the synchronous run from this earlier localsgd JSON instead of running it (on a link "
                        "where it would take hours): it must have run the same training flags, --dataset included. "
                        "Its held-out losses and bytes do not depend on the link, its time does: from another rate, "
                        "time / sync is left out")
    p.add_argument("--json")
    p.add_argument("--plot", help="PNG of held-out loss against training time (needs matplotlib)")
    p.set_defaults(run=run)


def earlier_synchronous(path: str, train_flags: list[str]) -> tuple[dict, str | None]:
    """The synchronous row of an earlier localsgd JSON and the rate it ran at; SystemExit with one
    line if it has none or ran other training flags."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise SystemExit(f"jaxdp.bench: localsgd: --synchronous-from {path}: {err}") from None
    row = next((r for r in data.get("results", []) if r.get("run") == "synchronous"), None)
    if row is None:
        raise SystemExit(f"jaxdp.bench: localsgd: --synchronous-from {path}: it has no synchronous run")
    if data.get("train_flags") != train_flags:
        raise SystemExit(f"jaxdp.bench: localsgd: --synchronous-from {path}: it ran other training flags "
                         f"({shlex.join(data.get('train_flags') or [])}); give the same --train-args, --dataset (a fixed "
                         f"file, not the default copy of the source), --steps, --eval-every and --eval-batches")
    return row, data.get("rate")


def variant_run(sync_every: int, variant: str) -> tuple[str, list[str]]:
    """(name, flags) of one local-step run: `--sync-every sync_every` and the variant's flags, or
    the variant alone when it names its own --sync-every (auto: the run chooses H, and the results
    record the H it chose)."""
    flags = shlex.split(variant)
    if any(f == "--sync-every" or f.startswith("--sync-every=") for f in flags):
        return variant.strip(), flags
    return f"H={sync_every} {variant}".strip(), ["--sync-every", str(sync_every), *flags]


def curve(training: slowlink.Training) -> list[tuple[int, float, float]]:
    """(step, training seconds, held-out loss) at every evaluation and at the end: the clock
    minus the first step (compilation) and the evaluations before that point."""
    done = next(r for r in training.records if r.get("event") == "done")
    compile_s = done.get("compile_s") or 0.0
    points, eval_s = [], 0.0
    for record in training.records:
        if record.get("event") == "eval":
            eval_s += record["eval_s"]
            points.append((record["step"], record["elapsed_s"] - eval_s - compile_s, record["eval_loss"]))
    last = [r for r in training.steps() if r["step"] == done["step"]][-1]
    points.append((done["step"], last["elapsed_s"] - eval_s - compile_s, done["eval_loss"]))
    return points


def time_to(points: list[tuple[int, float, float]], target: float) -> tuple[int, float] | tuple[None, None]:
    for step, seconds, loss in points:
        if loss <= target:
            return step, seconds
    return None, None


def default_corpus(directory: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(directory, "corpus.txt")
    with open(path, "wb") as out:
        for name in [os.path.join(root, "README.md"), *sorted(glob.glob(os.path.join(root, "jaxdp", "*.py")))]:
            with open(name, "rb") as f:
                out.write(f.read())
    return path


def run(args: argparse.Namespace) -> list[dict]:
    testbed.require("localsgd")
    rate = None if args.rate == slowlink.UNSHAPED else args.rate
    if rate:
        testbed.parse_rate(rate)
    with tempfile.TemporaryDirectory(prefix="jaxdp-localsgd-") as scratch:
        dataset = args.dataset or default_corpus(scratch)
        base = [*shlex.split(args.train_args), "--dataset", dataset, "--steps", str(args.steps),
                "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches), "--log-every", "10"]
        runs = [("synchronous", ["--sync-every", "1"])] + [variant_run(args.sync_every, v) for v in args.variants]
        results, sync_rate = [], args.rate
        if args.synchronous_from:  # its losses and bytes from the earlier run; its time only on the same link
            earlier, sync_rate = earlier_synchronous(args.synchronous_from, base)
            results, runs = [{**earlier, "from": args.synchronous_from}], runs[1:]
        with testbed.Testbed(num_hosts=2, rate=rate) as bed:
            for name, flags in runs:
                training = slowlink.run_training(bed, [*base, *flags], timeout=args.timeout)
                if not training.ok:
                    raise SystemExit(f"jaxdp.bench: localsgd: the {name} run failed (exit codes {training.returncodes}):\n"
                                     f"{training.outputs[0][-3000:]}\n{training.outputs[1][-3000:]}")
                steps = training.steps()
                chosen = [r for r in training.records if r.get("event") == "local_steps"]  # --sync-every auto
                results.append({"run": name, "flags": flags, "curve": curve(training), "wall_s": training.wall_s,
                                "sync_every": chosen[0]["sync_every"] if chosen else None,
                                "sync_every_why": chosen[0]["why"] if chosen else None,
                                "comm_bytes_per_step": steps[-1].get("comm_bytes_per_step"),
                                "wire_bytes_per_step": training.wire_bytes_per_step(),
                                "steps_per_s": sorted(r["steps_per_sec"] for r in steps if r.get("steps_per_sec"))})
    sync_final = results[0]["curve"][-1][2]
    target = sync_final * (1 + args.margin)
    _, sync_time = time_to(results[0]["curve"], target)
    for row in results:
        row["final_loss"] = row["curve"][-1][2]
        row["train_s"] = row["curve"][-1][1]
        row["loss_vs_sync"] = row["final_loss"] / sync_final
        row["step_to_target"], row["s_to_target"] = time_to(row["curve"], target)
        row["time_vs_sync"] = None if row["s_to_target"] is None or sync_rate != args.rate else \
            row["s_to_target"] / sync_time
        wire, sync_wire = row["wire_bytes_per_step"], results[0]["wire_bytes_per_step"]
        row["fewer_bytes"] = sync_wire / wire if wire and sync_wire else None
        rates = row["steps_per_s"]
        row["median_steps_per_s"] = rates[len(rates) // 2] if rates else None
    print(f"2 processes x 1 device over a {args.rate} link; jaxdp.train {args.train_args} --steps {args.steps} "
          f"--eval-every {args.eval_every}; target held-out loss {target:.4f} (synchronous final x {1 + args.margin:g})"
          + (f"; the synchronous run from {args.synchronous_from} (at {sync_rate})" if args.synchronous_from else ""))
    print_table(results, [("run", "run", "s"), ("sync_every", "auto H", "d"), ("median_steps_per_s", "steps/s", ".2f"),
                          ("train_s", "train s", ".1f"),
                          ("final_loss", "final loss", ".4f"), ("loss_vs_sync", "loss / sync", ".3f"),
                          ("s_to_target", "s to target", ".1f"), ("time_vs_sync", "time / sync", ".3f"),
                          ("wire_bytes_per_step", "wire B/step", ".0f"), ("fewer_bytes", "x fewer bytes", ".0f")])
    write_json(args.json, results, rate=args.rate, target=target, margin=args.margin, train_flags=base,
               synchronous_rate=sync_rate)
    if args.plot:
        plot(results, target, args.plot, f"2 processes over {args.rate}: held-out loss against training time")
    return results


def plot(results: list[dict], target: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for row in results:
        _, seconds, losses = zip(*row["curve"])
        ax.plot(seconds, losses, marker="o", markersize=3, label=row["run"])
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("training seconds (compilation and evaluation left out; log scale)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
