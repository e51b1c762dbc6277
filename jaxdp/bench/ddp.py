"""ddp: jaxdp's train step in 2 processes x 1 device (gloo) against PyTorch DistributedDataParallel
in 2 processes (gloo, 1 thread each) on the same MLP 784-512-512-10, float32, global batch 256,
Adam, reported as a steps/s ratio. Each side launches its own 2 processes, each pinned to its own
core (--no-pin: not); the launches alternate.

`--launchers`: each side is started by its own launcher at the launcher's defaults instead, nothing
pinned by hand: jaxdp through `python -m jaxdp.launch --nproc-per-node 2` (which binds each process
to its own cores), PyTorch through `torchrun --standalone --nproc-per-node 2` (OMP_NUM_THREADS=1,
no binding).

The two sides are the hidden commands `train-worker` (jaxdp: the train benchmark with 1 device in
2 processes) and `ddp-worker` (PyTorch DDP), started in pairs by launch.launch_pair.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from jaxdp.bench import train
from jaxdp.bench.launch import (add_pin_argument, add_worker_arguments, launch_pair, launch_with_launchers,
                                pin_to_one_core)
from jaxdp.bench.report import print_table, write_json
from jaxdp.bench.timing import interleaved, paired_ratio
from jaxdp.bench.train import MLP_HIDDEN

TORCH_HINT = "PyTorch is not installed; install the benchmark extra: pip install -e '.[bench]' (torch==2.13.0, CPU)"


def register(subparsers: Any) -> None:
    # The workers have no help: argparse then lists them nowhere in --help.
    p = subparsers.add_parser("train-worker")
    train.add_step_arguments(p)
    p.add_argument("--strategies", type=lambda t: t.split(","), default=None)
    add_worker_arguments(p)
    p.set_defaults(run=run_train_worker)

    p = subparsers.add_parser("ddp", help="jaxdp 2-process training vs PyTorch DDP (needs torch)")
    train.add_step_arguments(p)
    p.add_argument("--strategies", type=lambda t: t.split(","), default=["psum", "ring"])
    p.add_argument("--rounds", type=int, default=3, help="alternating jaxdp / DDP launches")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--launchers", action="store_true",
                   help="start jaxdp with python -m jaxdp.launch and DDP with torchrun, both at their defaults")
    add_pin_argument(p)
    p.set_defaults(run=run)

    p = subparsers.add_parser("ddp-worker")
    train.add_step_arguments(p)
    add_worker_arguments(p)
    p.set_defaults(run=run_ddp_worker)


def import_torch() -> Any:
    """torch, or exit 2 with TORCH_HINT on one line: torch is a benchmark-only extra."""
    try:
        import torch
    except ImportError:
        print(f"jaxdp.bench: {TORCH_HINT}", file=sys.stderr)
        raise SystemExit(2)
    return torch


def run(args: argparse.Namespace) -> list[dict]:
    torch = import_torch()
    common = ["--steps", str(args.steps), "--repeats", str(args.repeats), "--batch-size", str(args.batch_size)]
    common += [] if args.pin and not args.launchers else ["--no-pin"]
    start = launch_with_launchers if args.launchers else launch_pair
    runs: dict[tuple[str, str], list[float]] = {}  # (impl, strategy) -> steps/s of each round
    for _ in range(args.rounds):  # alternate, so load changes hit both sides
        for r in start(["train-worker", "--strategies", ",".join(args.strategies), *common], args.timeout)["results"]:
            runs.setdefault((r["impl"], r["strategy"]), []).append(r["steps_per_s"])
        for r in start(["ddp-worker", *common], args.timeout)["results"]:
            runs.setdefault(("pytorch-ddp", "gloo"), []).append(r["steps_per_s"])
    ddp = runs[("pytorch-ddp", "gloo")]
    results = []
    for (impl, strategy), values in runs.items():
        steps_per_s = statistics.median(values)
        results.append({"impl": impl, "strategy": strategy, "processes": 2, "devices": 2, "global_batch": args.batch_size,
                        "model": "mlp-784-512-512-10", "dtype": "float32", "optimizer": "adam",
                        "steps_per_s": steps_per_s, "examples_per_s": steps_per_s * args.batch_size,
                        "step_s": 1 / steps_per_s, "vs_ddp": 1 / paired_ratio(ddp, values), "rounds": values})
    layout = (" started by python -m jaxdp.launch and torchrun at their defaults" if args.launchers
              else " x 1 core" if args.pin else " (not pinned)")
    print(f"2 processes{layout}, MLP 784-512-512-10, adam, float32, global batch {args.batch_size}; median of "
          f"{args.rounds} alternating rounds, each the median of {args.repeats} x {args.steps} steps")
    print_table(results, [("impl", "impl", "s"), ("strategy", "strategy", "s"), ("step_s", "step ms", ".3f"),
                          ("steps_per_s", "steps/s", ".1f"), ("examples_per_s", "examples/s", ".0f"),
                          ("vs_ddp", "x DDP steps/s", ".2f")])
    write_json(args.json, results, torch=torch.__version__, pinned=args.pin and not args.launchers,
               launchers=args.launchers)
    return results


def run_train_worker(args: argparse.Namespace) -> list[dict]:
    """One jaxdp process of the ddp comparison: `bench train` with 1 device in 2 processes."""
    if args.port is None:  # started by python -m jaxdp.launch: the JAX_* environment says who it is
        return train.run(train.Options(devices=(1,), steps=args.steps, repeats=args.repeats, batch_size=args.batch_size,
                                       strategies=args.strategies, json=args.json))
    if args.pin:
        pin_to_one_core(args.rank)
    return train.run(train.Options(devices=(1,), steps=args.steps, repeats=args.repeats, batch_size=args.batch_size,
                                   strategies=args.strategies, json=args.json,
                                   coordinator_address=f"127.0.0.1:{args.port}", num_processes=2, process_id=args.rank))


def run_ddp_worker(args: argparse.Namespace) -> list[dict]:
    """One PyTorch DDP process: gloo, 1 thread, the same MLP, batches and optimizer."""
    import os

    if args.port is None:  # started by torchrun: RANK, MASTER_ADDR, ... and OMP_NUM_THREADS=1 come from it
        args.rank = int(os.environ["RANK"])
    elif args.pin:
        pin_to_one_core(args.rank)
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # 2 processes on the machine's cores, like jaxdp's 2 x 1 device (torchrun's default)
    if args.port is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, MLP_HIDDEN[0]), torch.nn.ReLU(),
                                torch.nn.Linear(*MLP_HIDDEN), torch.nn.ReLU(), torch.nn.Linear(MLP_HIDDEN[1], 10))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    rng, rows = np.random.default_rng(0), slice(args.rank * args.batch_size // 2, (args.rank + 1) * args.batch_size // 2)
    batches = [(torch.from_numpy(rng.standard_normal((args.batch_size, 784), dtype=np.float32)[rows]),
                torch.from_numpy(rng.integers(0, 10, args.batch_size)[rows])) for _ in range(4)]

    def run():
        for i in range(args.steps):
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
        dist.barrier()

    seconds = interleaved({"ddp": run}, args.repeats, warmup=1)["ddp"]
    step_s = statistics.median(seconds) / args.steps
    results = [{"impl": "ddp", "steps_per_s": 1 / step_s, "step_s": step_s}]
    if args.rank == 0:
        write_json(args.json, results, torch=torch.__version__)
    dist.destroy_process_group()
    return results
