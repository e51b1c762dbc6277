"""zero: ZeRO-1 (`shard_optimizer=True`) against the replicated step, for psum and ring, in one run:
step time (median, and the paired ratio sharded / replicated) and the optimizer-state bytes each
device holds, read from the arrays' shardings.

    python -m jaxdp.bench zero --json zero.json
    python -m jaxdp.bench zero --models gpt --devices 8 --steps 5

Models: the MLP 784-512-512-10 of the other benchmarks (Adam), and the CLI's default `--model gpt`
(4 layers, d_model 256, sequence 128, byte vocabulary; AdamW with global-norm clipping at 1.0).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

from jaxdp.bench.report import print_table, write_json
from jaxdp.bench.timing import interleaved, paired_ratio


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("zero", help="ZeRO-1 (--shard-optimizer) vs the replicated step: time and memory")
    p.add_argument("--models", type=lambda t: t.split(","), default=["mlp", "gpt"], help="mlp, gpt, or both")
    p.add_argument("--strategies", type=lambda t: t.split(","), default=["psum", "ring"])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--steps", type=int, default=0, help="steps per timed repeat (0: 100 for mlp, 5 for gpt)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> list[dict]:
    from jaxdp.cluster import distributed
    from jaxdp.config import Config

    distributed.initialize(Config(devices=args.devices, progress=False))

    import jax
    import numpy as np
    import optax

    from jaxdp.mesh import make_mesh, shard_batch
    from jaxdp.models import builtin as models
    from jaxdp.step import zero
    from jaxdp.step.state import init_state
    from jaxdp.step.train_step import make_train_step

    mesh = make_mesh(distributed.mesh_devices(args.devices))
    rng = np.random.default_rng(0)

    def mlp_case() -> tuple[Any, Any, Callable, list, int]:
        model = models.MLP(hidden=(512, 512), num_classes=10)
        batches = [{"x": rng.standard_normal((256, 784), dtype=np.float32),
                    "y": rng.integers(0, 10, 256).astype(np.int32)} for _ in range(4)]
        params = model.init(jax.random.PRNGKey(0), batches[0]["x"][:1])["params"]

        def loss_fn(params, batch):
            logits = model.apply({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        return params, optax.adam(1e-3), loss_fn, batches, args.steps or 100

    def gpt_case() -> tuple[Any, Any, Callable, list, int]:
        config = Config()  # the CLI's default --layers, --d-model, --heads, --seq-len
        model = models.GPT(vocab_size=256, seq_len=config.seq_len, layers=config.layers, d_model=config.d_model,
                           heads=config.heads)
        batches = [{"tokens": rng.integers(0, 256, (16, config.seq_len + 1)).astype(np.int32)} for _ in range(2)]
        params = model.init(jax.random.PRNGKey(0), batches[0]["tokens"][:1, :-1])["params"]

        def loss_fn(params, batch):
            logits = model.apply({"params": params}, batch["tokens"][:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))
        return params, tx, loss_fn, batches, args.steps or 5

    results = []
    for model_name in args.models:
        params, tx, loss_fn, host_batches, steps = {"mlp": mlp_case, "gpt": gpt_case}[model_name]()
        batches = [shard_batch(b, mesh) for b in host_batches]
        cases: dict[tuple, Callable[[], None]] = {}
        memory: dict[tuple, int] = {}
        for strategy in args.strategies:
            for sharded in (False, True):
                state = init_state(params, tx, mesh, shard_optimizer=sharded)
                memory[strategy, sharded] = zero.bytes_per_device(state.opt_state)
                step = make_train_step(loss_fn, tx, mesh, strategy, shard_optimizer=sharded)
                cases[strategy, sharded] = _loop(step, state, batches, steps)
        times = interleaved(cases, args.repeats, warmup=1)
        n_params = sum(x.size for x in jax.tree.leaves(params))
        for (strategy, sharded), seconds in times.items():
            results.append({"model": model_name, "params": n_params, "strategy": strategy, "devices": mesh.size,
                            "shard_optimizer": sharded, "sharded": "yes" if sharded else "no", "step_s": statistics.median(seconds) / steps,
                            "vs_replicated": paired_ratio(seconds, times[strategy, False]),
                            "opt_bytes_per_device": memory[strategy, sharded],
                            "opt_bytes_fraction": memory[strategy, sharded] / memory[strategy, False],
                            "repeats": args.repeats, "steps_per_repeat": steps})
    print(f"ZeRO-1 vs replicated optimizer state, {mesh.size} {mesh.devices.flat[0].platform} devices, "
          f"median of {args.repeats} repeats")
    print_table(results, [("model", "model", "s"), ("params", "parameters", "d"), ("strategy", "strategy", "s"),
                          ("sharded", "sharded", "s"), ("step_s", "step ms", ".2f"),
                          ("vs_replicated", "x replicated", ".3f"),
                          ("opt_bytes_per_device", "opt bytes/device", "d"), ("opt_bytes_fraction", "fraction", ".3f")])
    write_json(args.json, results)
    return results


def _loop(step: Callable, state: Any, batches: list, steps: int) -> Callable[[], None]:
    import jax

    def go() -> None:
        nonlocal state
        for i in range(steps):
            state, metrics = step(state, batches[i % len(batches)])
        jax.block_until_ready((state, metrics))

    return go
