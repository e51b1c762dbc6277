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

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from jaxdp.step import delayed, fsdp, hsdp, local_sgd, optim, zero
from jaxdp.sync import host
from jaxdp.sync.codecs.plain import NoCompression
from jaxdp.sync.exchange import codec as codec_of, make_exchange
from jaxdp.errors import InputError
from jaxdp.mesh import data_axes, inside_a_process, replicate, state_specs  # (state_specs: importable from here too)
from jaxdp.step.state import SyncState, TrainState
from jaxdp.sync.collectives import Collective
from jaxdp.sync.spec import StateLayout, SyncSpec

Batch = Any
Metrics = dict[str, Any]


class TrainStep:
    """`step(state, batch) -> (state, metrics)`, the same type for every strategy.

    `lower(state, batch)` returns JAX's `Lowered` of the compiled program (for in-graph
    strategies, the whole step; for `host`, the per-device gradient program it runs before the
    numpy average), for cost analysis and for reading the HLO. `spec` is the step's `SyncSpec`,
    `strategy` its `Collective`, `local_grads` the per-device, unsynchronised gradient function
    (what the compression controller times).
    """

    def __init__(self, run: Callable[[TrainState, Batch], tuple[TrainState, Metrics]], lowerable: Any,
                 tx: optax.GradientTransformation, spec: SyncSpec, local_grads: Callable):
        self._run, self._lowerable, self.tx, self.spec = run, lowerable, tx, spec
        self.strategy: Collective = spec.collective
        self.layout: StateLayout = spec.layout()
        self.local_grads = local_grads
        self.schedule: Callable | None = None  # make_train_step(..., schedule=): metrics gain "lr"
        self.delayed: delayed.Delayed | None = None  # overlap=True (jaxdp/step/delayed.py)
        self.loss_fn: Callable | None = None  # what make_train_step made it from (jaxdp/step/overlap.py, `Cut`, rebuilds)
        self.stateful, self.grad_accum = False, 1
        self.rounds: Any = None  # host-driven rounds an engine runs itself (jaxdp/elastic/timed.py, overlap.py)

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        made_for = state.optimizer.tx
        if made_for is not None and made_for is not self.tx:
            raise ValueError("this state was made by init_state with a different optax transformation than "
                             "the one given to make_train_step; pass the same tx object to both")
        differs = state.layout.serves(self.layout)
        if differs:
            raise ValueError(differs)
        if delayed.is_delayed(state) and self.delayed is None:
            raise ValueError("this state holds a gradient in flight from a step made with overlap=True; step it with "
                             "overlap=True too, or apply it first with that step's flush(state)")
        if self.schedule is None:
            return self._run(state, batch)
        lr = self.schedule(state.step)  # before the step: `state` is donated to it
        state, metrics = self._run(state, batch)
        return state, {**metrics, "lr": lr}

    def lower(self, state: TrainState, batch: Batch) -> Any:
        return self._lowerable.lower(state, batch)

    # overlap=True only (jaxdp/step/delayed.py); the other steps hold nothing between calls.

    def prepare(self, state: TrainState, batch: Batch) -> TrainState:
        """`state` with overlap's slot for the gradient in flight (its shapes come from `batch`):
        what a checkpoint of an overlapped run is restored into. A no-op without overlap."""
        return state if self.delayed is None else self.delayed.prepare(state, batch)

    def flush(self, state: TrainState) -> tuple[TrainState, Metrics]:
        """Apply the gradient in flight (overlap=True): the end of training. Returns the state and
        the metrics of the step that computed it. Without overlap: (state, {})."""
        if self.delayed is None or not delayed.is_delayed(state):
            return state, {}
        return self.delayed.flush(state)

    def close(self) -> None:
        """Stop overlap's thread (it starts again if the step is called again)."""
        if self.delayed is not None:
            self.delayed.close()


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh,
                    strategy: str | Callable = "psum", *, stateful: bool = False, grad_accum: int = 1,
                    grad_norm: bool = False, shard_optimizer: bool = False, compression: Any = None,
                    sync_every: int = 1, outer_tx: optax.GradientTransformation | None = None,
                    sync_fragments: int = 1, schedule: Callable | None = None, overlap: bool = False,
                    shard_params: bool = False, metrics_at_sync: bool = False) -> TrainStep:
    """A `TrainStep` `(state, batch) -> (state, metrics)` that compiles once per input shape.

    `grad_accum=K` splits each device's slice of the batch into K micro-batches, accumulates their
    gradients on the device (a `lax.scan`, so one micro-batch's activations live at a time) and
    synchronises once per step: the same update as one step on the whole batch, with one
    collective instead of K (PyTorch's `no_sync`). `grad_norm=True` adds `metrics["grad_norm"]`,
    the global norm of the averaged gradient (before clipping), which the NaN guard reads.
    `schedule` (the optax schedule inside `tx`) adds `metrics["lr"]`, the learning rate the step used.

    `shard_optimizer=True` is ZeRO-1 (jaxdp/step/zero.py): the strategy's reduce-scatter, each device's
    update of its own 1/N of the parameters and optimizer state, then the strategy's all-gather.
    The state must come from `init_state(..., shard_optimizer=True)`. Parameters, metrics and
    model state are the same as without it.

    `compression` ("bf16", "powersgd:RANK[:start=STEP]", or a `jaxdp.sync.codecs.base.Compressor`;
    None or "none": off) compresses the gradients on their way through the strategy's collective
    (jaxdp/sync/codecs/): reduce-compatible kinds only, so psum and the ring carry them. Its
    state (error feedback, warm start) lives in `state.sync`: make the state with
    `init_state(..., compression=<the same, or "auto">)`. `metrics` gains "comm_bytes" (what each
    device sends per step) and "compression_ratio".

    `sync_every=H` (> 1) or an `outer_tx` turns on local steps (jaxdp/step/local_sgd.py, DiLoCo): every
    device trains its own replica with `tx` and no gradient all-reduce; every H steps the devices
    average their pseudo-gradients (global - replica params) through the strategy and
    `compression`, and `outer_tx` (default: `optax.sgd(1.0)`, plain averaging) updates the global
    parameters. Make the state with `init_state(..., sync_every=H, outer_tx=<the same>)`. `metrics`
    gains "synced" (1.0 on a sync step), "comm_bytes" and "comm_bytes_per_step". `sync_fragments=F`
    (Streaming DiLoCo) synchronises 1/F of the parameter arrays every H/F steps instead of all of
    them every H steps. `metrics_at_sync=True`: the scalar metrics are averaged over devices only on
    sync steps (in the sync's collective); between syncs each device's own are returned, so nothing
    else crosses between devices (each process reads its first device's).

    `overlap=True` (every-step training, jaxdp/step/delayed.py): each step's all-reduce runs while the next
    step computes its gradients, and the average is applied one step late, the same on every device.
    The step's metrics are the step before's; call `flush(state)` at the end to apply the last
    gradient. psum or ring, any fixed compression; not with local steps (jaxdp.fit overlaps their
    rounds) or shard_optimizer.
    """
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"make_train_step: grad_accum must be a positive integer, got {grad_accum!r}")
    codec = codec_of(compression)  # ValueError for "auto": the controller decides it while training
    spec = SyncSpec(strategy=strategy, compression=codec, sync_every=sync_every, sync_fragments=sync_fragments,
                    outer_tx=outer_tx, shard_optimizer=shard_optimizer, overlap=overlap,
                    shard_params=shard_params, metrics_at_sync=metrics_at_sync).validate()
    if spec.rule == "local" and overlap:
        raise ValueError("make_train_step: overlap=True is every-step training; local steps overlap their rounds "
                         "through jaxdp.fit(..., sync_every=H, overlap=True)")
    axis = data_axes(mesh)
    local_grads = _accumulated(_local_grads_fn(loss_fn, stateful, axis), grad_accum)
    if spec.rule == "fsdp":  # one jit over sharded global arrays, from loss_fn itself
        if spec.collective.name == "psum" and spec.codec is None and not spec.local:  # XLA's all-reduce across
            jitted = fsdp.make_step(loss_fn, tx, mesh, stateful=stateful, grad_accum=grad_accum, grad_norm=grad_norm)
        else:  # the strategy, the codec or local steps across workers (jaxdp/step/hsdp.py)
            jitted = hsdp.make_step(loss_fn, tx, mesh, spec, stateful=stateful, grad_accum=grad_accum,
                                    grad_norm=grad_norm)
        step = TrainStep(_bounded(jitted, mesh), jitted, tx, spec, local_grads)
    else:
        step = RULES[spec.rule](local_grads, tx, mesh, spec, grad_norm)
    step.schedule = schedule
    step.loss_fn, step.stateful, step.grad_accum = loss_fn, stateful, grad_accum  # (what the rounds rebuild from)
    return step


# ---------------------------------------------------------------------------------------------
# The update rules: how a step turns per-device gradients into the next state.
# ---------------------------------------------------------------------------------------------


def _replicated(local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, spec: SyncSpec,
                grad_norm: bool) -> TrainStep:
    """Every device averages its gradients through the exchange and applies the same update."""
    exchange = make_exchange(spec.collective, data_axes(mesh), mesh.size, spec.codec)
    split = inside_a_process(mesh)

    def device_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        metrics, model_state, grads = local_grads(state, batch)
        grads, metrics, model_state, sync, extra = exchange.mean(grads, metrics, model_state, state.sync, state.step)
        metrics = {**metrics, **extra}
        if grad_norm:
            metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
        with optim.split_over(*split):  # (every device holds the same update: Muon's work cut over a process's)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state,
                             sync=sync), metrics

    # Without a codec the step keeps no compression state: a state made for "auto" passes its
    # rows around the step untouched.
    return _in_graph(device_step, mesh, tx, spec, local_grads, uses_sync=spec.compression is not None)


def _local(local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, spec: SyncSpec,
           grad_norm: bool) -> TrainStep:
    """Local steps (jaxdp/step/local_sgd.py): the pseudo-gradient averaged every H steps, through the
    collective's sum (pre-scaled by 1/N) and the codec if any."""
    exchange = make_exchange(spec.collective, data_axes(mesh), mesh.size, spec.codec or NoCompression(),
                             pseudo_gradient=True)
    device_step = local_sgd.make_device_step(local_grads, tx, spec.outer_tx, exchange, spec.sync_every,
                                             spec.sync_fragments, grad_norm, metrics_at_sync=spec.metrics_at_sync)
    return _in_graph(device_step, mesh, tx, spec, local_grads)


def _sharded(local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, spec: SyncSpec,
             grad_norm: bool) -> TrainStep:
    """ZeRO-1 (jaxdp/step/zero.py): reduce-scatter, each device's update of its 1/N, all-gather."""
    collective = spec.collective
    jitted = zero.make_step(local_grads, tx, mesh, collective, make_exchange(collective, data_axes(mesh), mesh.size),
                            grad_norm)
    return TrainStep(_bounded(jitted, mesh), jitted, tx, spec, local_grads)


def _in_graph(device_step: Callable, mesh: Mesh, tx: optax.GradientTransformation, spec: SyncSpec,
              local_grads: Callable, uses_sync: bool = True) -> TrainStep:
    """`device_step` mapped over the mesh and jitted; the state replicated but for the per-device
    rows of `state.sync` (sharded over the data axes); the old state donated."""
    axis = data_axes(mesh)

    def mapped(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        held = None
        if not uses_sync:  # e.g. no compression on a state made for "auto": its rows go around, untouched
            held, state = state.sync, state.replace(sync=SyncState())
        specs = state_specs(state, axis)
        state, metrics = jax.shard_map(device_step, mesh=mesh, in_specs=(specs, P(axis)), out_specs=(specs, P()),
                                       check_vma=False)(state, batch)
        return (state if held is None else state.replace(sync=held)), metrics

    step = jax.jit(mapped, donate_argnums=0)
    return TrainStep(_bounded(step, mesh), step, tx, spec, local_grads)


def _bounded(step: Callable, mesh: Mesh) -> Callable:
    """Wait for the previous step to finish before dispatching the next (CPU meshes of several
    devices only; one device runs no collective, so nothing can deadlock and steps may queue).

    Hazard: with several steps queued, XLA's in-process CPU collectives can deadlock until their
    40 s rendezvous timeout aborts the process (seen at 2, 4 and 8 simulated devices). One step
    in flight avoids it, and the caller still prepares the next batch while the current step runs.
    """
    if mesh.devices.flat[0].platform != "cpu" or mesh.size == 1:
        return step
    previous = None

    def bounded(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        nonlocal previous
        jax.block_until_ready(previous)
        state, metrics = step(state, batch)
        previous = metrics
        return state, metrics

    return bounded


def _host_programs(local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh
                   ) -> tuple[Callable, Callable, Callable]:
    """The host path's two programs and its copy to the host: (per-device gradients,
    `update(state, grads, model_state) -> state`, `(state, batch) -> [per-device host tree of
    (metrics, model_state, grads)]`)."""
    axis = data_axes(mesh)

    def apply_update(state: TrainState, grads: Any, model_state: Any) -> TrainState:
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state)

    def per_device(state: TrainState, batch: Batch) -> Any:
        out = local_grads(state, batch)
        return jax.tree.map(lambda x: x[None], out)  # leading axis: one row per device

    grads_fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(axis)),
                                     out_specs=P(axis), check_vma=False))
    update_fn = jax.jit(apply_update, donate_argnums=0)

    def to_host(state: TrainState, batch: Batch) -> list[Any]:
        stacked = grads_fn(state, batch)
        # Host sync point: every local device's values come to host memory.
        leaves, treedef = jax.tree.flatten(stacked)
        shards = [sorted(leaf.addressable_shards, key=lambda s: s.index[0].start) for leaf in leaves]
        host_values = jax.device_get([[s.data for s in leaf_shards] for leaf_shards in shards])
        return [jax.tree.unflatten(treedef, [leaf[d][0] for leaf in host_values]) for d in range(len(shards[0]))]

    return grads_fn, update_fn, to_host


def _host_metrics(metrics: dict, grads: Any, grad_norm: bool) -> dict:
    if grad_norm:
        metrics["grad_norm"] = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(grads)))
    return {k: np.float32(v) for k, v in metrics.items()}


def _host(local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, spec: SyncSpec,
          grad_norm: bool) -> TrainStep:
    """The on-host path: jitted per-device gradients -> numpy mean on the host -> jitted update.

    Nothing crosses devices inside XLA: every device's gradients (and loss, aux, model state)
    are copied to host memory, averaged there (across processes through the run's own
    `host.process_sum_for(mesh)` transport), and copied back to every device.
    """
    process_sum = host.process_sum_for(mesh)
    host_mean = spec.collective.host
    grads_fn, update_fn, to_host = _host_programs(local_grads, tx, mesh)

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        metrics, model_state, grads = host_mean(to_host(state, batch), num_devices=mesh.size, process_sum=process_sum)
        metrics = _host_metrics(metrics, grads, grad_norm)
        grads, model_state = replicate((grads, model_state), mesh)  # host -> every device
        return update_fn(state, grads, model_state), metrics

    return TrainStep(step, grads_fn, tx, spec, local_grads)


def _delayed(local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, spec: SyncSpec,
             grad_norm: bool) -> TrainStep:
    """Every-step overlap (jaxdp/step/delayed.py): the average of the step before's gradients, computed
    on a thread while this step's gradients are, applied one step late."""
    run = delayed.Delayed(local_grads, tx, mesh, spec, grad_norm)
    step = TrainStep(run, run, tx, spec, local_grads)
    step.delayed = run
    return step


RULES = {"replicated": _replicated, "local": _local, "sharded": _sharded, "host": _host, "delayed": _delayed}


# ---------------------------------------------------------------------------------------------
# Per-device gradients (no collective inside).
# ---------------------------------------------------------------------------------------------


def _local_grads_fn(loss_fn: Callable, stateful: bool, axis: str) -> Callable:
    """(state, local batch, micro-batch index) -> (metrics, new model_state, grads) on one device,
    unsynchronised."""

    def local_grads(state: TrainState, batch: Batch, micro: Any = None) -> tuple[Metrics, Any, Any]:
        if stateful:
            rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), jax.lax.axis_index(axis))
            if micro is not None:  # with --grad-accum, every micro-batch draws its own keys
                rng = jax.random.fold_in(rng, micro)

            def objective(params):
                out = loss_fn(params, state.model_state, batch, rng)
                if not isinstance(out, tuple) or len(out) != 3:
                    raise InputError(f"a stateful loss_fn(params, model_state, batch, rng) returns (loss, aux, "
                                     f"new_model_state); got {_shape_of(out)}", argument="loss_fn")
                loss, aux, model_state = out
                return _scalar(loss), (aux, model_state)
        else:
            def objective(params):
                out = loss_fn(params, batch)
                if isinstance(out, tuple) and len(out) != 2:
                    raise InputError(f"loss_fn(params, batch) returns a scalar loss or (loss, aux); got "
                                     f"{_shape_of(out)}", argument="loss_fn")
                loss, aux = out if isinstance(out, tuple) else (out, {})
                return _scalar(loss), (aux, state.model_state)

        (loss, (aux, model_state)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        metrics = {name: jnp.asarray(value, jnp.float32) for name, value in {"loss": loss, **aux}.items()}
        return metrics, model_state, grads

    return local_grads


def _shape_of(out: Any) -> str:
    return f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"


def _scalar(loss: Any) -> Any:
    if jnp.ndim(loss) != 0:
        raise InputError(f"loss_fn's loss must be a scalar (the mean over the batch); got shape {jnp.shape(loss)}",
                         argument="loss_fn")
    return loss


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


def make_eval_step(eval_fn: Callable, mesh: Mesh) -> Callable[[TrainState, Batch], Any]:
    """`(state, batch) -> sums`: `eval_fn(params, model_state, local_batch)` returns a pytree of
    per-device sums (e.g. correct predictions, summed loss, example count); they are summed over
    all devices."""
    axis = data_axes(mesh)

    def device_eval(state: TrainState, batch: Batch) -> Any:
        return jax.lax.psum(eval_fn(state.params, state.model_state, batch), axis)

    return jax.jit(jax.shard_map(device_eval, mesh=mesh, in_specs=(P(), P(axis)),
                                 out_specs=P(), check_vma=False))
