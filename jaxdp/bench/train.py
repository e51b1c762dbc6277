"""train: steps/s and examples/s of jaxdp.make_train_step for every strategy and device count,
and, in the same run, two hand-written baselines on the same model and batches: a plain
single-device `jax.jit` step and a `shard_map` + `pmean` step. The time ratios jaxdp/baseline are
jaxdp's overhead. A strategy named NAME+overlap is NAME with `make_train_step(..., overlap=True)`
(jaxdp/step/delayed.py: each step's all-reduce runs while the next step computes); the process then
starts JAX's CPU backend with two worker threads (jaxdp.cluster.runtime.two_cpu_workers), as the CLI does.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any, Callable, Sequence

from jaxdp.bench.report import print_table, write_json
from jaxdp.bench.timing import interleaved, paired_ratio

MLP_HIDDEN = (512, 512)  # MLP 784-512-512-10: the model of the DDP comparison
OVERLAP_SUFFIX = "+overlap"  # --strategies psum+overlap: make_train_step(..., overlap=True)


@dataclasses.dataclass(frozen=True)
class Options:
    """What `run` reads: the `train` command's flags, or what a ddp train-worker sets itself."""

    devices: Sequence[int]              # device counts per process, one measurement each
    steps: int                          # steps per timed repeat
    repeats: int
    batch_size: int                     # global batch size
    strategies: Sequence[str] | None = None   # None: all of jaxdp.registry.STRATEGIES
    json: str | None = None
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the MLP train step's timing, shared by train, ddp and their workers."""
    parser.add_argument("--steps", type=int, default=100, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--json")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="steps/s of jaxdp's step and of hand-written baselines")
    add_step_arguments(p)
    p.add_argument("--strategies", type=lambda t: t.split(","), default=None)
    p.add_argument("--devices", type=int_list, default=[1, 8], help="device counts per process, e.g. 1,2,8")
    p.add_argument("--coordinator-address")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.set_defaults(run=run)


def run(args: argparse.Namespace | Options) -> list[dict]:
    """The `train` command; `args` is its parsed flags or an Options (same names)."""
    from jaxdp.cluster import distributed, runtime
    from jaxdp.config import Config

    # The CLI's own start-up: the simulated device count and jax.distributed come from a Config.
    config = Config(devices=max(args.devices), coordinator_address=args.coordinator_address,
                    num_processes=args.num_processes, process_id=args.process_id, progress=False)
    overlapped = any(s.endswith(OVERLAP_SUFFIX) for s in args.strategies or ())
    with runtime.two_cpu_workers(overlapped):  # the backend starts in here (--overlap: see there)
        distributed.initialize(config)
        import jax

        jax.devices()
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    from jaxdp.mesh import DATA_AXIS, make_mesh, replicate, shard_batch
    from jaxdp.models import builtin as models
    from jaxdp.registry import STRATEGIES
    from jaxdp.step.state import init_state
    from jaxdp.step.train_step import make_train_step

    n_proc, proc = jax.process_count(), jax.process_index()
    model = models.MLP(hidden=MLP_HIDDEN, num_classes=10)
    tx = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    host_batches = [{"x": rng.standard_normal((args.batch_size, 784), dtype=np.float32),
                     "y": rng.integers(0, 10, args.batch_size).astype(np.int32)} for _ in range(4)]
    local = lambda b: jax.tree.map(lambda a: a[proc * len(a) // n_proc:(proc + 1) * len(a) // n_proc], b)  # noqa: E731
    params = model.init(jax.random.PRNGKey(0), host_batches[0]["x"][:1])["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def loop(step: Callable, carry: Any, batches: list, bounded: bool) -> Callable[[], None]:
        """Run --steps steps from the current carry; `bounded`: wait for step k-1 before k."""
        def run():
            nonlocal carry
            previous = None
            for i in range(args.steps):
                if bounded:
                    jax.block_until_ready(previous)
                *carry, loss = step(*carry, batches[i % len(batches)])
                previous = loss
            jax.block_until_ready((carry, previous))
        return run

    def jaxdp_case(strategy: str, mesh) -> Callable[[], None]:
        overlap = strategy.endswith(OVERLAP_SUFFIX)
        step = make_train_step(loss_fn, tx, mesh, strategy.removesuffix(OVERLAP_SUFFIX), overlap=overlap)
        batches = [shard_batch(local(b), mesh) for b in host_batches]
        state = step.prepare(init_state(params, tx, mesh), batches[0])
        wrapped = lambda state, batch: (lambda out: (out[0], out[1]["loss"]))(step(state, batch))  # noqa: E731
        return loop(wrapped, [state], batches, bounded=False)  # make_train_step bounds itself

    def plain_jit_case() -> Callable[[], None]:  # hand-written single-device baseline
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        device = jax.local_devices()[0]
        p = jax.device_put(params, device)
        step = jax.jit(step, donate_argnums=(0, 1))
        batches = [jax.device_put(b, device) for b in host_batches]
        return loop(step, [p, tx.init(p)], batches, bounded=False)

    def shard_map_case(mesh) -> Callable[[], None]:  # hand-written data-parallel baseline
        def device_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # per device (check_vma=False)
            grads, loss = jax.lax.pmean((grads, loss), DATA_AXIS)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        step = jax.jit(jax.shard_map(device_step, mesh=mesh, in_specs=(P(), P(), P(DATA_AXIS)),
                                     out_specs=(P(), P(), P()), check_vma=False), donate_argnums=(0, 1))
        p = replicate(params, mesh)
        opt_state = jax.jit(tx.init, out_shardings=jax.sharding.NamedSharding(mesh, P()))(p)
        batches = [shard_batch(local(b), mesh) for b in host_batches]
        # The same protection as jaxdp's step: with several steps queued, XLA's CPU collectives
        # can deadlock (see jaxdp/step/train_step.py), so a multi-device CPU baseline keeps one step in flight.
        return loop(step, [p, opt_state], batches, bounded=mesh.size > 1 and mesh.devices.flat[0].platform == "cpu")

    cases: dict[tuple, Callable[[], None]] = {}
    for n in args.devices:
        mesh = make_mesh(distributed.mesh_devices(n))
        if args.batch_size % mesh.size:
            raise SystemExit(f"jaxdp.bench: --batch-size {args.batch_size} is not divisible by {mesh.size} devices")
        if mesh.size == 1:
            cases[("jit", "-", 1)] = plain_jit_case()
        cases[("shard_map+pmean", "-", mesh.size)] = shard_map_case(mesh)
        for strategy in args.strategies or list(STRATEGIES):
            cases[("jaxdp", strategy, mesh.size)] = jaxdp_case(strategy, mesh)

    times = interleaved(cases, args.repeats, warmup=1)
    results = []
    for (impl, strategy, n), seconds in times.items():
        step_s = statistics.median(seconds) / args.steps
        results.append({"impl": impl, "strategy": strategy, "devices": n, "processes": n_proc,
                        "global_batch": args.batch_size, "model": "mlp-784-512-512-10", "optimizer": "adam",
                        "step_s": step_s, "steps_per_s": 1 / step_s, "examples_per_s": args.batch_size / step_s,
                        "repeats": args.repeats, "steps_per_repeat": args.steps,
                        "vs_shard_map": paired_ratio(seconds, times["shard_map+pmean", "-", n]),
                        "vs_jit": paired_ratio(seconds, times["jit", "-", 1]) if n == 1 else None})
    if proc == 0:
        print(f"train step, MLP 784-512-512-10, adam, global batch {args.batch_size}, {n_proc} process(es), "
              f"median of {args.repeats} x {args.steps} steps")
        print_table(results, [("impl", "impl", "s"), ("strategy", "strategy", "s"), ("devices", "devices", "d"),
                              ("step_s", "step ms", ".3f"), ("steps_per_s", "steps/s", ".1f"),
                              ("examples_per_s", "examples/s", ".0f"), ("vs_shard_map", "x shard_map", ".3f"),
                              ("vs_jit", "x jit", ".3f")])
        write_json(args.json, results)
    return results
