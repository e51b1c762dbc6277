"""compression: does `--compression auto` pay where the link is slow, and cost nothing where it is fast?

    python -m jaxdp.bench compression --json compression.json --png docs/perf/compression.png

Slow link (needs root: jaxdp/bench/testbed.py): 2 processes x 1 device in two network namespaces
joined by a `tbf`-shaped link (--rate, default 100mbit), training a GPT on a text file (--dataset;
default a generated corpus) with `--compression none` and with `--compression auto`, evaluating on
the held-out split every --eval-every steps. Reported: the wall-clock time each needs to reach a
target held-out loss (--target-loss; default: the larger of the two final losses, so both reach
it), their ratio auto / none, and the final held-out losses at the same step. The loss-against-time
curves go to --png. By default a 2-step run of each comes first (--no-warm-cache: not), so the
timed runs start as a rerun does, with their programs in JAX's compilation cache; the controller's
own measurements are in auto's time.

Fast link (no root): 1 process x 8 simulated devices, the MLP on digits. The controller decides
on this machine's in-process all-reduce, and the step it picks is timed against plain averaging,
interleaved (median of --repeats, paired ratio).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from jaxdp.bench.report import print_table, write_json
from jaxdp.bench.timing import interleaved, paired_ratio

GPT_FLAGS = ("--model gpt --layers 4 --d-model 256 --heads 4 --seq-len 64 --batch-size 16 --optimizer momentum "
             "--lr 0.3 --clip-norm 1.0 --eval-batches 8 --log-every 10")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("compression", help="--compression auto vs none: time to a loss on a slow link, step time on a fast one")
    p.add_argument("--rate", default="100mbit", help="the slow link's bandwidth (tbf), e.g. 100mbit")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--dataset", help="a text file for the GPT (default: a generated corpus)")
    p.add_argument("--train-args", default=GPT_FLAGS, help="jaxdp.train flags of the slow-link runs")
    p.add_argument("--target-loss", type=float, help="held-out loss to time (default: the larger final loss)")
    p.add_argument("--repeats", type=int, default=7, help="fast link: timed repeats")
    p.add_argument("--warm-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="slow link: a 2-step run of each first, so both timed runs find their programs in JAX's "
                        "compilation cache (a rerun's start-up) and the time is training, not compiling")
    p.add_argument("--skip", choices=("slow", "fast"), help="leave out one half")
    p.add_argument("--png", help="loss-against-time curves of the slow-link runs")
    p.add_argument("--json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> list[dict]:
    results = []
    if args.skip != "slow":
        results += slow_link(args)
    if args.skip != "fast":
        results += fast_link(args)
    write_json(args.json, results)
    return results


# ---------------------------------------------------------------------------------------------
# Slow link: time to a held-out loss.
# ---------------------------------------------------------------------------------------------


def slow_link(args: argparse.Namespace) -> list[dict]:
    import shlex

    from jaxdp.bench import slowlink, testbed

    reason = testbed.unavailable_reason()
    if reason:
        raise SystemExit(f"jaxdp.bench: compression: {reason} (--skip slow runs the fast-link half alone)")
    with tempfile.TemporaryDirectory(prefix="jaxdp-compression-") as scratch:
        dataset = args.dataset or str(write_corpus(Path(scratch) / "corpus.txt"))
        flags = [*shlex.split(args.train_args), "--dataset", dataset, "--steps", str(args.steps),
                 "--eval-every", str(args.eval_every)]
        runs = {}
        with testbed.Testbed(2, rate=args.rate) as bed:
            if args.warm_cache:  # compile every program once, as a rerun of the same command would have
                for choice in ("none", "auto"):
                    slowlink.run_training(bed, [*flags[:-4], "--steps", "2", "--eval-every", "0", "--compression", choice],
                                          timeout=1200)
            for choice in ("none", "auto"):
                training = slowlink.run_training(bed, [*flags, "--compression", choice], timeout=3600)
                if not training.ok:
                    raise SystemExit(f"jaxdp.bench: compression: the {choice} run failed:\n{training.outputs[0][-2000:]}")
                runs[choice] = training.records
    curves = {choice: _eval_curve(records) for choice, records in runs.items()}
    finals = {choice: curve[-1][2] for choice, curve in curves.items()}
    target = args.target_loss or max(finals.values())
    reach = {choice: _time_to(curve, target) for choice, curve in curves.items()}
    decisions = [r for r in runs["auto"] if r.get("event") == "compression"]
    results = []
    for choice in ("none", "auto"):
        steps = [r for r in runs[choice] if "event" not in r and r.get("steps_per_sec")]
        results.append({
            "link": args.rate, "compression": choice, "steps": args.steps,
            "chosen": ",".join(sorted({d["choice"] for d in decisions})) if choice == "auto" else "none",
            "steps_per_s": statistics.median(r["steps_per_sec"] for r in steps),
            "comm_bytes": statistics.median(r["comm_bytes"] for r in steps),
            "target_loss": target, "time_to_target_s": reach[choice],
            "vs_none": reach[choice] / reach["none"] if reach[choice] and reach["none"] else None,
            "final_eval_loss": finals[choice], "final_vs_none": finals[choice] / finals["none"],
            "curve": curves[choice], "decisions": decisions if choice == "auto" else []})
    print(f"slow link: 2 processes x 1 device, {args.rate} tbf, {args.train_args}, {args.steps} steps")
    print_table(results, [("compression", "compression", "s"), ("chosen", "chosen", "s"),
                          ("steps_per_s", "steps/s", ".2f"), ("comm_bytes", "bytes/step", ".0f"),
                          ("time_to_target_s", f"s to loss {target:.3f}", ".1f"), ("vs_none", "x none", ".2f"),
                          ("final_eval_loss", "final loss", ".4f"), ("final_vs_none", "x none", ".3f")])
    for d in decisions:
        print(f"  step {d['step']}: {d['why']}")
    if args.png:
        _plot(curves, target, args)
    return results


def _eval_curve(records: list[dict]) -> list[tuple[int, float, float]]:
    """(step, elapsed seconds, held-out loss) of every evaluation, the final one included."""
    return [(r["step"], r["elapsed_s"], r["eval_loss"]) for r in records
            if r.get("event") in ("eval", "done") and "eval_loss" in r]


def _time_to(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """Seconds until the held-out loss first reaches `target`, linear between evaluations."""
    previous = None
    for step, seconds, loss in curve:
        if loss <= target:
            if previous is None or previous[2] == loss:
                return seconds
            _, t0, l0 = previous
            return t0 + (seconds - t0) * (l0 - target) / (l0 - loss)
        previous = (step, seconds, loss)
    return None


def _plot(curves: dict, target: float, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for choice, curve in curves.items():
        ax.plot([c[1] for c in curve], [c[2] for c in curve], marker="o", markersize=3, label=f"--compression {choice}")
    ax.axhline(target, color="gray", linestyle=":", linewidth=1, label=f"target {target:.3f}")
    ax.set_xlabel("wall-clock seconds (2 processes, CPU)")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"GPT on a {args.rate} link: compression none vs auto")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


def write_corpus(path: Path, sentences: int = 20000, seed: int = 0) -> Path:
    """A text a small GPT learns in a few hundred steps: sentences of a small fixed grammar."""
    import random

    rng = random.Random(seed)
    nouns = "cat dog fox bird horse mouse owl frog".split()
    verbs = "sees chases likes follows hears finds".split()
    adjectives = "quick lazy brown small big old young red".split()
    places = "in the garden|under the tree|by the river|on the hill|near the house".split("|")
    lines = []
    for _ in range(sentences):
        subject, obj = rng.sample(nouns, 2)
        lines.append(f"The {rng.choice(adjectives)} {subject} {rng.choice(verbs)} the {obj} {rng.choice(places)}.")
    path.write_text(" ".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Fast link: auto must pick none, and cost nothing.
# ---------------------------------------------------------------------------------------------


def fast_link(args: argparse.Namespace) -> list[dict]:
    from jaxdp.cluster import distributed
    from jaxdp.config import Config

    distributed.initialize(Config(devices=8, progress=False))

    import jax
    import numpy as np
    import optax

    from jaxdp.mesh import make_mesh, shard_batch
    from jaxdp.models import builtin as models
    from jaxdp.step.state import init_state
    from jaxdp.step.train_step import make_train_step
    from jaxdp.sync.controller import Controller

    mesh = make_mesh(distributed.mesh_devices(8))
    model = models.MLP(hidden=(512, 512), num_classes=10)
    rng = np.random.default_rng(0)
    host = [{"x": rng.standard_normal((256, 784), dtype=np.float32), "y": rng.integers(0, 10, 256).astype(np.int32)}
            for _ in range(4)]
    batches = [shard_batch(b, mesh) for b in host]
    params = model.init(jax.random.PRNGKey(0), host[0]["x"][:1])["params"]

    def loss_fn(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, batch["x"]), batch["y"]).mean()

    tx = optax.adam(1e-3)
    plain_step = make_train_step(loss_fn, tx, mesh, "psum")
    controller = Controller(plain_step.local_grads, mesh, plain_step.strategy, params)
    decision = controller.decide(init_state(params, tx, mesh, compression="auto"), batches, 0)
    cases = {}
    for name, spec, step in (("none", None, plain_step),
                             ("auto", "auto", make_train_step(loss_fn, tx, mesh, "psum", compression=decision.compressor))):
        state = init_state(params, tx, mesh, compression=spec)

        def go(step=step, box=[state]) -> None:  # noqa: B006 - the state carried from repeat to repeat
            for i in range(100):
                box[0], metrics = step(box[0], batches[i % len(batches)])
            jax.block_until_ready(metrics)

        cases[name] = go
    times = interleaved(cases, args.repeats, warmup=1)
    results = [{"link": "8 simulated devices, 1 process", "compression": name,
                "chosen": decision.record["choice"] if name == "auto" else "none",
                "step_s": statistics.median(seconds) / 100, "vs_none": paired_ratio(seconds, times["none"]),
                "why": decision.record["why"] if name == "auto" else ""} for name, seconds in times.items()]
    print("fast link: 8 simulated CPU devices in one process, MLP 784-512-512-10, adam, batch 256, median of "
          f"{args.repeats} x 100 steps")
    print_table(results, [("compression", "compression", "s"), ("chosen", "chosen", "s"), ("step_s", "step ms", ".3f"),
                          ("vs_none", "x none", ".3f")])
    print(f"  auto: {decision.record['why']}")
    return results
