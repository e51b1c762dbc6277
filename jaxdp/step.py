"""`make_train_step`: one jitted data-parallel update around a gradient-sync strategy.

    step = make_train_step(loss_fn, tx, mesh, strategy="ring")
    state, metrics = step(state, batch)

Each device computes the gradient of `loss_fn` on its own slice of the batch; the strategy turns
those into the mean over devices (the gradient of the global-batch mean loss, since every device
holds the same number of rows); every device then applies the same optax update, so the
replicas stay identical. The old state is donated.

`loss_fn` comes in two forms:

* plain: `loss_fn(params, batch) -> loss` or `(loss, aux)`, with `aux` a dict of scalar metrics.
* stateful (`make_train_step(..., stateful=True)`), for models with mutable collections such as
  BatchNorm statistics and for dropout:
  `loss_fn(params, model_state, batch, rng) -> (loss, aux, new_model_state)`.
  `rng` is a raw PRNG key that differs per device and per step (derived from `state.rng`,
  `state.step` and the device's index, so a resumed run draws the same numbers).
  Synchronised BatchNorm: `nn.BatchNorm(axis_name=...)` with the mesh's axis name computes its
  statistics over the global batch, inside the step.
  `new_model_state` is averaged over devices, so the replicas stay identical.

`metrics` holds "loss" and every entry of `aux`, each averaged over the global batch.

`make_train_step` returns a `TrainStep` for every strategy: call it, or `.lower(state, batch)` it
for XLA's cost analysis and the compiled program.

Hazard: inside `shard_map` with the default `check_vma=True`, `jax.grad` with respect to
replicated parameters already sums over devices; a strategy on top would count the gradient N
times. The step maps with `check_vma=False`, so gradients are per-device and the strategy alone
synchronises them; tests compare every strategy with a single-device reference.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp import compression as compression_lib, host, local_sgd, zero
from jaxdp.errors import InputError
from jaxdp.mesh import axis_name as mesh_axis_name, replicate
from jaxdp.state import SyncState, TrainState
from jaxdp.sync import halves as sync_halves, is_on_host, psum_mean, summing as sync_summing

Batch = Any
Metrics = dict[str, Any]


class TrainStep:
    """`step(state, batch) -> (state, metrics)`, the same type for every strategy.

    `lower(state, batch)` returns JAX's `Lowered` of the compiled program (for in-graph
    strategies, the whole step; for `host`, the per-device gradient program it runs before the
    numpy average), for cost analysis and for reading the HLO.
    """

    def __init__(self, run: Callable[[TrainState, Batch], tuple[TrainState, Metrics]],
                 lowerable: Any, tx: optax.GradientTransformation, strategy: Callable, shard_optimizer: bool = False,
                 local: bool = False):
        self._run, self._lowerable, self.tx, self.strategy = run, lowerable, tx, strategy
        self.shard_optimizer, self.local = shard_optimizer, local

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        made_for = state.optimizer.tx
        if made_for is not None and made_for is not self.tx:
            raise ValueError("this state was made by init_state with a different optax transformation than "
                             "the one given to make_train_step; pass the same tx object to both")
        if zero.is_sharded(state.opt_state) != self.shard_optimizer:
            layout = "replicated" if self.shard_optimizer else "sharded"
            raise ValueError(f"this state's optimizer state is {layout} but the step was made with shard_optimizer="
                             f"{self.shard_optimizer}; pass the same shard_optimizer to init_state and make_train_step")
        if local_sgd.is_local(state) != self.local:
            made = "without" if self.local else "with"
            raise ValueError(f"this state was made by init_state {made} local steps (sync_every > 1 or an outer_tx) but "
                             f"the step was not; pass the same sync_every and outer_tx to init_state and make_train_step")
        return self._run(state, batch)

    def lower(self, state: TrainState, batch: Batch) -> Any:
        return self._lowerable.lower(state, batch)


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh,
                    strategy: str | Callable = "psum", *, stateful: bool = False, grad_accum: int = 1,
                    grad_norm: bool = False, shard_optimizer: bool = False, compression: Any = None,
                    sync_every: int = 1, outer_tx: optax.GradientTransformation | None = None,
                    sync_fragments: int = 1) -> TrainStep:
    """A `TrainStep` `(state, batch) -> (state, metrics)` that compiles once per input shape.

    `grad_accum=K` splits each device's slice of the batch into K micro-batches, accumulates their
    gradients on the device (a `lax.scan`, so one micro-batch's activations live at a time) and
    synchronises once per step: the same update as one step on the whole batch, with one
    collective instead of K (PyTorch's `no_sync`). `grad_norm=True` adds `metrics["grad_norm"]`,
    the global norm of the averaged gradient (before clipping), which the NaN guard reads.

    `shard_optimizer=True` is ZeRO-1 (jaxdp/zero.py): the strategy's reduce-scatter, each device's
    update of its own 1/N of the parameters and optimizer state, then the strategy's all-gather.
    The state must come from `init_state(..., shard_optimizer=True)`. Parameters, metrics and
    model state are the same as without it.

    `compression` ("bf16", "powersgd:RANK[:start=STEP]", or a `jaxdp.compression.Compressor`;
    None or "none": off) compresses the gradients on their way through the strategy's collective
    (jaxdp/compression.py): reduce-compatible kinds only, so psum and the ring carry them. Its
    state (error feedback, warm start) lives in `state.sync`: make the state with
    `init_state(..., compression=<the same, or "auto">)`. `metrics` gains "comm_bytes" (what each
    device sends per step) and "compression_ratio".

    `sync_every=H` (> 1) or an `outer_tx` turns on local steps (jaxdp/local_sgd.py, DiLoCo): every
    device trains its own replica with `tx` and no gradient all-reduce; every H steps the devices
    average their pseudo-gradients (global - replica params) through the strategy and
    `compression`, and `outer_tx` (default: `optax.sgd(1.0)`, plain averaging) updates the global
    parameters. Make the state with `init_state(..., sync_every=H, outer_tx=<the same>)`. `metrics`
    gains "synced" (1.0 on a sync step), "comm_bytes" and "comm_bytes_per_step". `sync_fragments=F`
    (Streaming DiLoCo) synchronises 1/F of the parameter arrays every H/F steps instead of all of
    them every H steps.
    """
    from jaxdp.registry import STRATEGIES

    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"make_train_step: grad_accum must be a positive integer, got {grad_accum!r}")
    sync = STRATEGIES[strategy] if isinstance(strategy, str) else strategy
    axis = mesh_axis_name(mesh)
    compressor = compression_lib.resolve(compression)
    if compressor == compression_lib.AUTO:
        raise ValueError("make_train_step: compression='auto' is decided while training (jaxdp.train's controller); "
                         "give the step one choice: none, bf16 or powersgd:RANK (a state made for 'auto' serves each)")
    if compressor is not None:
        _check_in_graph_sum("compression", strategy, sync, shard_optimizer,
                            " yet: compression needs the whole averaged gradient on every device")
    local_grads = _accumulated(_local_grads_fn(loss_fn, stateful, axis), grad_accum)
    sync_every = local_sgd.check_sync_every(sync_every, sync_fragments)
    if sync_every > 1 or outer_tx is not None:
        _check_in_graph_sum("local steps (sync_every)", strategy, sync, shard_optimizer,
                            ": every device keeps its own whole inner optimizer state")
        device_step = local_sgd.make_device_step(local_grads, tx, local_sgd.default_outer(outer_tx), sync, compressor,
                                                 axis, mesh.size, sync_every, grad_norm, sync_fragments)
        return _in_graph_step(device_step, mesh, tx, sync, local_grads, local=True)

    def apply_update(state: TrainState, grads: Any, model_state: Any) -> TrainState:
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state)

    if shard_optimizer:
        if sync_halves(sync) is None:
            name = _strategy_name(strategy)
            why = ("it averages whole gradients in host memory, so there is no device-side update to shard"
                   if is_on_host(sync) else "it has no reduce-scatter and all-gather halves (jaxdp.sync.Halves)")
            raise InputError(f"shard_optimizer does not apply to strategy {name!r}: {why}; use psum or ring",
                             argument="strategy")
        return _sharded_step(local_grads, sync, mesh, tx, grad_norm)
    if is_on_host(sync):
        return _host_step(local_grads, apply_update, sync, mesh, tx, grad_norm)

    def device_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        metrics, model_state, grads = local_grads(state, batch)
        sync_state = state.sync
        if compressor is not None:
            grads, metrics, model_state, sync_state = _compress_together(
                compressor, sync, axis, mesh.size, grads, metrics, model_state, state)
        elif mesh.size > 1:  # on one device the mean is the value; XLA would still run a 1-device all-reduce
            grads, metrics, model_state = _sync_together(sync, axis, grads, metrics, model_state)
        if grad_norm:
            metrics = {**metrics, "grad_norm": optax.global_norm(grads)}
        return apply_update(state, grads, model_state).replace(sync=sync_state), metrics

    return _in_graph_step(device_step, mesh, tx, sync, local_grads, uses_sync=compressor is not None)


def _check_in_graph_sum(feature: str, strategy: Any, sync: Callable, shard_optimizer: bool, why_not_sharded: str) -> None:
    """InputError unless `feature` can run: it needs the strategy's in-graph sum, and no ZeRO-1."""
    if sync_summing(sync) is None:
        raise InputError(f"{feature} does not apply to strategy {_strategy_name(strategy)!r}: it needs an in-graph sum over devices "
                         f"(psum or ring)", argument="strategy")
    if shard_optimizer:
        raise InputError(f"{feature} and shard_optimizer do not combine{why_not_sharded}; use one of them",
                         argument="shard_optimizer")


def _strategy_name(strategy: Any) -> str:
    return strategy if isinstance(strategy, str) else getattr(strategy, "__name__", "this strategy")


def _in_graph_step(device_step: Callable, mesh: Mesh, tx: optax.GradientTransformation, sync: Callable,
                   local_grads: Callable, local: bool = False, uses_sync: bool = True) -> TrainStep:
    """`device_step` mapped over the mesh and jitted; the state replicated but for the per-device
    rows of `state.sync` (sharded over the data axis); the old state donated."""
    axis = mesh_axis_name(mesh)

    def mapped(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        held = None
        if not uses_sync:  # e.g. no compression on a state made for "auto": its rows go around, untouched
            held, state = state.sync, state.replace(sync=SyncState())
        specs = state_specs(state, axis)
        state, metrics = jax.shard_map(device_step, mesh=mesh, in_specs=(specs, P(axis)), out_specs=(specs, P()),
                                       check_vma=False)(state, batch)
        return (state if held is None else state.replace(sync=held)), metrics
    step = jax.jit(mapped, donate_argnums=0)
    # One device runs no collective, so nothing can deadlock and steps may queue freely.
    run = _one_step_in_flight(step) if mesh.devices.flat[0].platform == "cpu" and mesh.size > 1 else step
    train_step = TrainStep(run, step, tx, sync, local=local)
    train_step.local_grads = local_grads  # per device, unsynchronised: what the compression controller times
    return train_step


def state_specs(state: TrainState, axis: str) -> Any:
    """shard_map specs for a (replicated) TrainState: P() everywhere but for the per-device rows
    of `state.sync`, which are split over `axis`."""
    rows = jax.tree.map(lambda _: P(axis), state.sync.per_device)
    return jax.tree.map(lambda _: P(), state.replace(sync=state.sync.replace(per_device={}))).replace(
        sync=state.sync.replace(per_device=rows, shared=jax.tree.map(lambda _: P(), state.sync.shared)))


def _one_step_in_flight(step: Callable) -> Callable:
    """Wait for the previous step to finish before dispatching the next (CPU meshes only).

    Hazard: with several steps queued, XLA's in-process CPU collectives can deadlock until their
    40 s rendezvous timeout aborts the process (seen at 2, 4 and 8 simulated devices). One step
    in flight avoids it, and the caller still prepares the next batch while the current step runs.
    """
    previous = None

    def bounded(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        nonlocal previous
        jax.block_until_ready(previous)
        state, metrics = step(state, batch)
        previous = metrics
        return state, metrics

    return bounded


def _local_grads_fn(loss_fn: Callable, stateful: bool, axis: str) -> Callable:
    """(state, local batch, micro-batch index) -> (metrics, new model_state, grads) on one device,
    unsynchronised."""

    def local_grads(state: TrainState, batch: Batch, micro: Any = None) -> tuple[Metrics, Any, Any]:
        if stateful:
            rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), jax.lax.axis_index(axis))
            if micro is not None:  # with --grad-accum, every micro-batch draws its own keys
                rng = jax.random.fold_in(rng, micro)

            def objective(params):
                loss, aux, model_state = loss_fn(params, state.model_state, batch, rng)
                return loss, (aux, model_state)
        else:
            def objective(params):
                out = loss_fn(params, batch)
                loss, aux = out if isinstance(out, tuple) else (out, {})
                return loss, (aux, state.model_state)

        (loss, (aux, model_state)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        metrics = {name: jnp.asarray(value, jnp.float32) for name, value in {"loss": loss, **aux}.items()}
        return metrics, model_state, grads

    return local_grads


def _accumulated(local_grads: Callable, k: int) -> Callable:
    """`local_grads` over K micro-batches of the device's slice: gradients and metrics averaged over
    them (equal sizes, so the mean of the means is the mean over the slice), the model state
    threaded from one micro-batch to the next. No collective runs inside."""
    if k == 1:
        return local_grads

    def accumulate(state: TrainState, batch: Batch) -> tuple[Metrics, Any, Any]:
        def split(x: jax.Array) -> jax.Array:
            if x.shape[0] % k:
                raise ValueError(f"grad_accum={k} does not divide this device's {x.shape[0]} rows")
            return x.reshape(k, x.shape[0] // k, *x.shape[1:])

        micro_batches = jax.tree.map(split, batch)
        first = jax.tree.map(lambda x: x[0], micro_batches)
        metrics, _, grads = jax.eval_shape(local_grads, state, first, jnp.int32(0))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (metrics, grads))

        def body(carry, i):
            (metric_sum, grad_sum), model_state = carry
            micro = jax.tree.map(lambda x: x[i], micro_batches)
            metrics, model_state, grads = local_grads(state.replace(model_state=model_state), micro, i)
            sums = jax.tree.map(jnp.add, (metric_sum, grad_sum), (metrics, grads))
            return (sums, model_state), None

        ((metric_sum, grad_sum), model_state), _ = jax.lax.scan(body, (zeros, state.model_state), jnp.arange(k))
        metrics, grads = jax.tree.map(lambda total: total / k, (metric_sum, grad_sum))
        return metrics, model_state, grads

    return accumulate


def _compress_together(compressor: Any, sync: Callable, axis: str, n: int, grads: Any, metrics: Metrics,
                       model_state: Any, state: TrainState) -> tuple[Any, Metrics, Any, Any]:
    """`_sync_together` with the gradients compressed: the metrics and model state ride in the
    compressor's first collective (before a PowerSGD start step, in their own). Returns the mean
    gradients, metrics, model state and the new `state.sync`."""
    name = compression_lib.STATE_NAME
    stored = compression_lib.CompressionState(
        error=jax.tree.map(lambda x: x[0], state.sync.per_device.get(name, {})), q=state.sync.shared.get(name, {}))
    floats, rejoin = _float_leaves(model_state)
    extras = (metrics, floats)
    total = sync_summing(sync)
    riding: list[Any] = []

    def sum_with_extras(tree: Any) -> Any:  # the first call also carries the scaled metrics and model state
        if riding:
            return total(tree, axis)
        summed, extras_sum = total((tree, jax.tree.map(lambda x: x / n, extras)), axis)
        riding.append(extras_sum)
        return summed

    separate = n == 1 or getattr(compressor, "start", 0) > 0  # lax.cond branches cannot hand values out
    view = compression_lib.view(compressor, stored, grads)
    grads, new, scalars = compressor.mean(grads, view, (lambda t: total(t, axis)) if separate else sum_with_extras,
                                          n, state.step)
    metrics, synced = sync(extras, axis) if separate and n > 1 else (riding[0] if riding else extras)
    model_state = rejoin(synced)
    merged = compression_lib.merge(stored, new)
    sync_state = state.sync
    if merged.error or merged.q:
        sync_state = sync_state.replace(per_device={**sync_state.per_device, name: jax.tree.map(lambda x: x[None], merged.error)},
                                        shared={**sync_state.shared, name: merged.q})
    payload = compressor.payload_bytes(grads)
    metrics = {**metrics, **scalars,
               "comm_bytes": jnp.float32(compression_lib.bytes_sent(payload, n)),
               "compression_ratio": jnp.float32(compression_lib.uncompressed_bytes(grads) / payload)}
    return grads, metrics, model_state, sync_state


def _sync_together(sync: Callable, axis: str, grads: Any, metrics: Metrics, model_state: Any) -> tuple[Any, Metrics, Any]:
    """Average gradients, metrics and the float leaves of the model state over devices, in one
    call of the strategy: the scalars and BatchNorm statistics ride in the gradients' fused
    buffer instead of paying a collective's latency of their own (across processes on CPU each
    collective is a gloo round trip of milliseconds; README "Performance")."""
    floats, rejoin = _float_leaves(model_state)
    grads, metrics, synced = sync((grads, metrics, floats), axis)
    return grads, metrics, rejoin(synced)


def _float_leaves(model_state: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The model state's float leaves (what is averaged over devices), and the function that puts
    averaged ones back in their places beside the untouched integer leaves (e.g. counters)."""
    leaves, treedef = jax.tree.flatten(model_state)
    is_float = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]

    def rejoin(floats: list[Any]) -> Any:
        floats = iter(floats)
        return jax.tree.unflatten(treedef, [next(floats) if f else x for x, f in zip(leaves, is_float)])

    return [x for x, f in zip(leaves, is_float) if f], rejoin


def _sharded_step(local_grads: Callable, sync: Callable, mesh: Mesh, tx: optax.GradientTransformation,
                  grad_norm: bool) -> TrainStep:
    """ZeRO-1: reduce-scatter -> the update of each device's 1/N -> all-gather, in one jitted step.

    Two `shard_map`s hold the collectives; between them the update runs on global arrays sharded
    over the data axis, so each device updates its own chunk, and XLA adds the all-reduce that a
    global reduction (clip_by_global_norm, the grad_norm metric) needs. Metrics and the model
    state are averaged with the strategy as in the replicated step.
    """
    axis = mesh_axis_name(mesh)
    reduce_scatter, all_gather = sync_halves(sync)
    split = NamedSharding(mesh, P(axis))
    # One collective per buffer where XLA combines them itself (its own collectives, one process);
    # one interleaved buffer per dtype for the ring, and across processes (zero.scatter).
    fuse = sync is not psum_mean or jax.process_count() > 1

    def scatter(state: TrainState, batch: Batch, layout: zero.FlatLayout) -> tuple[Any, Metrics, Any]:
        metrics, model_state, grads = local_grads(state, batch)
        owned = zero.scatter(layout.flatten(grads), reduce_scatter, axis, mesh.size, fuse)
        if mesh.size > 1:
            _, metrics, model_state = _sync_together(sync, axis, {}, metrics, model_state)
        return owned, metrics, model_state

    def gather(owned: zero.FlatBuffers, layout: zero.FlatLayout) -> Any:
        return layout.unflatten(zero.gather(owned, all_gather, axis, mesh.size, fuse))

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        layout = state.opt_state.layout
        if layout.shards != mesh.size:
            raise ValueError(f"the optimizer state is cut into {layout.shards} slices but the mesh has {mesh.size} "
                             f"devices; make the state with init_state on this mesh")
        in_specs = (P(), P(axis))
        grads, metrics, model_state = jax.shard_map(
            functools.partial(scatter, layout=layout), mesh=mesh, in_specs=in_specs,
            out_specs=(P(axis), P(), P()), check_vma=False)(state.replace(opt_state=None), batch)
        owned = jax.lax.with_sharding_constraint(layout.flatten(state.params), split)
        updates, inner = tx.update(grads, state.opt_state.inner, owned)
        owned = jax.lax.with_sharding_constraint(optax.apply_updates(owned, updates), split)
        params = jax.shard_map(functools.partial(gather, layout=layout), mesh=mesh, in_specs=P(axis),
                               out_specs=P(), check_vma=False)(owned)
        if grad_norm:
            metrics = {**metrics, "grad_norm": optax.global_norm(grads)}
        state = state.replace(step=state.step + 1, params=params, model_state=model_state,
                              opt_state=zero.ShardedOptState(inner, layout))
        return state, metrics

    jitted = jax.jit(step, donate_argnums=0)
    run = _one_step_in_flight(jitted) if mesh.devices.flat[0].platform == "cpu" and mesh.size > 1 else jitted
    return TrainStep(run, jitted, tx, sync, shard_optimizer=True)


def _host_step(local_grads: Callable, apply_update: Callable, host_mean: Callable, mesh: Mesh,
               tx: optax.GradientTransformation, grad_norm: bool) -> TrainStep:
    """The on-host path: jitted per-device gradients -> numpy mean on the host -> jitted update.

    Nothing crosses devices inside XLA: every device's gradients (and loss, aux, model state)
    are copied to host memory, averaged there (across processes through the run's own
    `host.process_sum_for(mesh)` transport), and copied back to every device.
    """
    axis = mesh_axis_name(mesh)
    process_sum = host.process_sum_for(mesh)

    def per_device(state: TrainState, batch: Batch) -> Any:
        out = local_grads(state, batch)
        return jax.tree.map(lambda x: x[None], out)  # leading axis: one row per device

    grads_fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(axis)),
                                     out_specs=P(axis), check_vma=False))
    update_fn = jax.jit(apply_update, donate_argnums=0)

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        stacked = grads_fn(state, batch)
        # Host sync point: every local device's values come to host memory.
        leaves, treedef = jax.tree.flatten(stacked)
        shards = [sorted(leaf.addressable_shards, key=lambda s: s.index[0].start) for leaf in leaves]
        host_values = jax.device_get([[s.data for s in leaf_shards] for leaf_shards in shards])
        per_device = [jax.tree.unflatten(treedef, [leaf[d][0] for leaf in host_values]) for d in range(len(shards[0]))]
        metrics, model_state, grads = host_mean(per_device, num_devices=mesh.size, process_sum=process_sum)
        if grad_norm:
            metrics["grad_norm"] = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(grads)))
        grads, model_state = replicate((grads, model_state), mesh)  # host -> every device
        return update_fn(state, grads, model_state), {k: np.float32(v) for k, v in metrics.items()}

    return TrainStep(step, grads_fn, tx, host_mean)


def make_eval_step(eval_fn: Callable, mesh: Mesh) -> Callable[[TrainState, Batch], Any]:
    """`(state, batch) -> sums`: `eval_fn(params, model_state, local_batch)` returns a pytree of
    per-device sums (e.g. correct predictions, summed loss, example count); they are summed over
    all devices."""
    axis = mesh_axis_name(mesh)

    def device_eval(state: TrainState, batch: Batch) -> Any:
        return jax.lax.psum(eval_fn(state.params, state.model_state, batch), axis)

    return jax.jit(jax.shard_map(device_eval, mesh=mesh, in_specs=(P(), P(axis)),
                                 out_specs=P(), check_vma=False))
