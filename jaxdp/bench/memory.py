"""memory: how big a GPT fits a per-device memory budget, replicated vs ZeRO-1 (--shard-optimizer)
vs ZeRO-3 (--shard-params), from XLA's compiled memory analysis (nothing is trained or allocated:
the step is compiled for abstract arrays with each mode's shardings).

    python -m jaxdp.bench memory --budget-mib 256 --layers 4 --devices 8
    python -m jaxdp.bench memory --d-model 512 --layers 4 --train-steps 30 --json memory.json

Per mode: bytes per device of the parameters, gradients and optimizer state (from the shardings)
and XLA's compiled peak of one step (arguments + outputs - donated + temporaries). With
`--budget-mib`, the largest `d_model` (a multiple of 64, heads of 64) whose peak fits the budget,
for each mode, at the given depth. With `--train-steps N` (no budget), the modes also train N
steps on the same batches: every step's loss against the replicated run's, and the median step
time. AdamW with global-norm clipping at 1.0, float32, byte vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from jaxdp.bench.report import print_table, write_json

MODES = ("replicated", "shard_optimizer", "shard_params")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("memory", help="the largest GPT per device budget: replicated vs ZeRO-1 vs --shard-params")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512, help="the model measured without --budget-mib")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="global rows per step")
    p.add_argument("--budget-mib", type=float, default=0.0, help="search the largest d_model that fits (0: no search)")
    p.add_argument("--max-d-model", type=int, default=8192)
    p.add_argument("--train-steps", type=int, default=0, help="also train this many steps (no search): losses and time")
    p.add_argument("--modes", type=lambda t: t.split(","), default=list(MODES))
    p.add_argument("--json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> list[dict]:
    from jaxdp.cluster import distributed
    from jaxdp.config import Config

    distributed.initialize(Config(devices=args.devices, progress=False))
    from jaxdp.mesh import make_mesh

    mesh = make_mesh(distributed.mesh_devices(args.devices))
    if args.budget_mib:
        results = [search(mesh, args, mode) for mode in args.modes]
        print_table(results, _columns(["mode", "layers", "d_model", "params_m", "peak_mib", "budget_mib"]))
    else:
        results = [measure(mesh, args, args.d_model, mode) for mode in args.modes]
        base = results[0]
        for r in results:
            r["param_ratio"] = r["param_bytes"] / base["param_bytes"]
            r["optimizer_ratio"] = r["optimizer_bytes"] / base["optimizer_bytes"]
            r["peak_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        if args.train_steps:
            train(mesh, args, results)
        print_table(results, _columns(["mode", "d_model", "params_m", "param_ratio", "optimizer_ratio", "peak_mib", "peak_ratio",
                                       *(["step_s", "time_ratio", "max_loss_diff"] if args.train_steps else [])]))
    if args.json:
        write_json(args.json, results)
    return results


def _columns(keys: list[str]) -> list[tuple[str, str, str]]:
    formats = {"param_ratio": ".4f", "optimizer_ratio": ".4f", "peak_ratio": ".3f", "time_ratio": ".3f",
               "step_s": ".2f", "max_loss_diff": ".2e"}
    return [(k, "step ms" if k == "step_s" else k, formats.get(k, "")) for k in keys]


def _case(args: argparse.Namespace, d_model: int) -> tuple[Any, Any, Any]:
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdp.models.builtin import GPT

    model = GPT(vocab_size=256, seq_len=args.seq_len, layers=args.layers, d_model=d_model, heads=max(1, d_model // 64),
                head_bias=False)

    def loss_fn(params: Any, batch: Any) -> Any:
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, args.seq_len), jnp.int32))["params"]
    return model, (loss_fn, tx), abstract


def _abstract_state(abstract_params: Any, tx: Any, mesh: Any, mode: str) -> Any:
    """A TrainState of ShapeDtypeStructs placed as init_state places each mode's arrays."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxdp.step import fsdp, zero
    from jaxdp.step.state import OptimizerTag, TrainState
    from jaxdp.sync.spec import SyncSpec

    whole = NamedSharding(mesh, P())
    put = lambda tree, shardings: jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),  # noqa: E731
                                               tree, shardings)
    if mode == "shard_params":
        params = put(abstract_params, fsdp.shardings(abstract_params, mesh))
        opt_abstract = jax.eval_shape(tx.init, abstract_params)
        opt_state = put(opt_abstract, fsdp.shardings(opt_abstract, mesh))
    else:
        params = put(abstract_params, jax.tree.map(lambda _: whole, abstract_params))
        if mode == "shard_optimizer":
            layout = zero.FlatLayout.of(abstract_params, mesh.size)
            inner = jax.eval_shape(lambda p: tx.init(layout.flatten(p)), abstract_params)
            opt_state = zero.ShardedOptState(put(inner, zero.shardings(inner, mesh)), layout)
        else:
            opt_abstract = jax.eval_shape(tx.init, abstract_params)
            opt_state = put(opt_abstract, jax.tree.map(lambda _: whole, opt_abstract))
    spec = SyncSpec(shard_optimizer=mode == "shard_optimizer", shard_params=mode == "shard_params")
    return TrainState(step=jax.ShapeDtypeStruct((), np.int32, sharding=whole), params=params, opt_state=opt_state,
                      model_state={}, rng=jax.ShapeDtypeStruct((2,), np.uint32, sharding=whole),
                      optimizer=OptimizerTag(tx), layout=spec.layout())


def _bytes(tree: Any, mesh: Any) -> int:
    import math

    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * x.dtype.itemsize
    return total


def measure(mesh: Any, args: argparse.Namespace, d_model: int, mode: str) -> dict:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxdp.mesh import data_axes
    from jaxdp.step import zero
    from jaxdp.step.train_step import make_train_step

    _, (loss_fn, tx), abstract = _case(args, d_model)
    state = _abstract_state(abstract, tx, mesh, mode)
    rows = NamedSharding(mesh, P(data_axes(mesh)))
    batch = {k: jax.ShapeDtypeStruct((args.batch_size, args.seq_len), np.int32, sharding=rows) for k in ("x", "y")}
    step = make_train_step(loss_fn, tx, mesh, shard_optimizer=mode == "shard_optimizer",
                           shard_params=mode == "shard_params")
    stats = step.lower(state, batch).compile().memory_analysis()
    peak = int(stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
    opt_tree = zero.abstract_tree(state.opt_state) if mode == "shard_optimizer" else state.opt_state
    opt_bytes = _bytes(state.opt_state.inner if mode == "shard_optimizer" else opt_tree, mesh)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
    return {"mode": mode, "layers": args.layers, "d_model": d_model, "params_m": round(n_params / 1e6, 2),
            "devices": mesh.size, "param_bytes": _bytes(state.params, mesh), "optimizer_bytes": opt_bytes,
            "peak_bytes": peak, "peak_mib": round(peak / 2**20, 1)}


def search(mesh: Any, args: argparse.Namespace, mode: str) -> dict:
    """The largest d_model (a multiple of 64) whose compiled peak fits the budget: doubling, then bisection."""
    budget = args.budget_mib * 2**20
    fits = lambda d: measure(mesh, args, d, mode)  # noqa: E731
    best, low, high = None, 0, None
    d = 64
    while d <= args.max_d_model:
        r = fits(d)
        if r["peak_bytes"] > budget:
            high = d
            break
        best, low, d = r, d, d * 2
    while high is not None and high - low > 64:
        mid = (low + high) // 2 // 64 * 64
        r = fits(mid)
        if r["peak_bytes"] <= budget:
            best, low = r, mid
        else:
            high = mid
    result = best or {"mode": mode, "layers": args.layers, "d_model": None, "params_m": 0, "peak_mib": None}
    return {**result, "budget_mib": args.budget_mib}


def train(mesh: Any, args: argparse.Namespace, results: list[dict]) -> None:
    """Train every mode `args.train_steps` steps on the same batches: losses and median step time."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdp.mesh import shard_batch
    from jaxdp.step.state import init_state
    from jaxdp.step.train_step import make_train_step

    model, (loss_fn, tx), _ = _case(args, args.d_model)
    params = jax.device_get(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, args.seq_len), jnp.int32))["params"])
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 256, (args.batch_size, args.seq_len + 1)).astype(np.int32) for _ in range(args.train_steps)]
    batches = [shard_batch({"x": t[:, :-1], "y": t[:, 1:]}, mesh) for t in tokens]
    losses = {}
    for r in results:
        mode = r["mode"]
        state = init_state(params, tx, mesh, shard_optimizer=mode == "shard_optimizer", shard_params=mode == "shard_params")
        step = make_train_step(loss_fn, tx, mesh, shard_optimizer=mode == "shard_optimizer",
                               shard_params=mode == "shard_params")
        seconds, history = [], []
        for batch in batches:
            start = time.perf_counter()
            state, metrics = step(state, batch)
            history.append(float(metrics["loss"]))  # (host sync point: the step is done)
            seconds.append(time.perf_counter() - start)
        losses[mode] = np.asarray(history)
        r["step_s"] = round(statistics.median(seconds[1:]), 5)  # (the first step compiles)
    for r in results:
        r["time_ratio"] = round(r["step_s"] / results[0]["step_s"], 3)
        r["max_loss_diff"] = float(np.max(np.abs(losses[r["mode"]] - losses[results[0]["mode"]])))
        r["losses"] = losses[r["mode"]].tolist()
