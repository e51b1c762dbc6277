"""`--overlap` rounds with `--shard-params` across workers: round k's average of pseudo-gradients
runs while round k + 1 trains, each worker's state cut over its own devices.

    result = jaxdp.fit(loss_fn, params, tx, data, steps=..., mesh=jaxdp.make_mesh(axis_name=("hosts", "local")),
                       sync=jaxdp.SyncOptions(shard_params=True, sync_every=8, overlap=True, compression="int8"))

The update rule is jaxdp/step/rounds.py's `Overlapped` (one round of delay, the same on every
worker; tests/test_overlap.py's reference loop), with hsdp.py's layout: a worker is one row of the
("hosts", "local") mesh, its replica and inner optimizer state `[workers, *leaf]` rows cut over its
devices (`state.sync.per_device["local_sgd"]`), the global parameters and the outer state cut like
the parameters. Three programs a round, as there:

* the inner steps (`make_inner`), over this process's rows of the mesh only: each worker's
  gradient (its blocks gathered one at a time where the model hands them over) and its `tx` step,
  no collective between workers, so they run while the average is in flight;
* the average (`make_reduce`), over the whole mesh, on a thread of its own: the delta in flight
  (`per_device["overlap"]["delta"]`, rows like the replicas) through the strategy and the codec across
  workers, device (h, l) with the devices (h', l), each sending its slice (hsdp.Workers.mean), the
  loss riding in the first collective; the only program that crosses between workers;
* the apply (`make_apply`), over the whole mesh with nothing across workers: the outer step with
  the average, then every replica restarts from the new global parameters minus its own delta of
  the round just trained, the next delta in flight.

Each worker takes the same H steps a round (`sync_every`); the last round what is left of `steps`.
A checkpoint holds the delta in flight, so a resume is exact. Scope: as `Overlapped`'s (one
fragment, no float model state, a fixed codec; jaxdp/sync/rules.py) and top-k refused as with
`shard_params` everywhere.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp.step import fsdp
from jaxdp.step.hsdp import Workers, row_shardings, rows as stacked_rows
from jaxdp.step.local_sgd import OUTER_NAME, STATE_NAME, default_outer
from jaxdp.step.round_programs import PACE_NAME, outer_step, replicated_to
from jaxdp.step.rounds import OVERLAP_NAME, FixedSteps, InFlight, process_rows
from jaxdp.step.state import TrainState


def init_overlap(params: Any, mesh: Mesh) -> dict:
    """per_device[OVERLAP_NAME] of a new state: nothing in flight (a zero delta per worker, 0 steps,
    0 loss), the delta's rows cut like the replicas."""
    workers = mesh.shape[mesh.axis_names[0]] if len(mesh.axis_names) > 1 else 1
    by_worker = NamedSharding(mesh, P(mesh.axis_names[0] if workers > 1 else None))
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), params)
    return {OVERLAP_NAME: {"delta": stacked_rows(fsdp.place(zeros, mesh), mesh),
                           "steps": jax.device_put(np.zeros(workers, np.int32), by_worker),
                           "loss_sum": jax.device_put(np.zeros(workers, np.float32), by_worker)}}


def own_rows(mesh: Mesh) -> Mesh:
    """This process's rows of `mesh` (its workers), with the mesh's axis names."""
    devices = np.asarray(mesh.devices)
    if devices.ndim == 1:
        return mesh
    mine = [h for h in range(devices.shape[0]) if devices[h, 0].process_index == jax.process_index()]
    return Mesh(devices[mine], mesh.axis_names)


def reseat(tree: Any, mesh: Mesh, shardings: Any) -> Any:
    """Rows `[workers, ...]` re-seated on `mesh` (the whole mesh or this process's rows) with
    `shardings`: the same per-device buffers, no copies; the leading dimension follows the mesh."""
    def one(x: jax.Array, sharding: NamedSharding) -> jax.Array:
        by_device = {s.device: s.data for s in x.addressable_shards}
        rows = mesh.shape[mesh.axis_names[0]] if len(mesh.axis_names) > 1 else 1
        return jax.make_array_from_single_device_arrays((rows, *x.shape[1:]), sharding,
                                                        [by_device[d] for d in sharding.addressable_devices_indices_map(
                                                            (rows, *x.shape[1:]))])

    return jax.tree.map(one, tree, shardings)


def make_inner(workers: Workers, tx: optax.GradientTransformation) -> Callable:
    """`(rows, model_state, rng, step, loss_sum, batch) -> (rows, loss_sum)` over `workers.mesh`
    (this process's rows): each worker's gradient on its rows of the batch and its `tx` step on its
    replica; `loss_sum` [workers] adds each worker's loss. No collective between workers."""
    mesh = workers.mesh

    def inner(rows: dict, model_state: Any, rng: Any, step: Any, loss_sum: jax.Array, batch: Any) -> tuple:
        by_device, model_state = workers.prepared(model_state, batch)
        metrics, _, grads = workers.grads(rows["params"], model_state, by_device, rng, step, True)
        replica, opt_state, _ = workers.inner_step(tx, rows["params"], rows["opt_state"], grads)
        rows = {"params": replica, "opt_state": opt_state}
        rows = jax.lax.with_sharding_constraint(rows, row_shardings(rows, mesh))
        return rows, loss_sum + jnp.mean(metrics["loss"], axis=1)

    return jax.jit(inner, donate_argnums=0)


def make_reduce(workers: Workers) -> Callable:
    """`(coded, delta, steps, loss_sum, step) -> (mean, coded, metrics)` over the whole mesh: the
    mean across workers of the deltas in flight (cut like the parameters) through the strategy and
    codec, the round's loss and steps riding along; `coded` the codec's slot of `state.sync`."""
    def reduce(coded: Any, delta: Any, steps: jax.Array, loss_sum: jax.Array, step: Any) -> tuple:
        mean, coded, extra, riders = workers.mean(delta, coded, step, {"loss_sum": loss_sum,
                                                                       "steps": steps.astype(jnp.float32)})
        taken = riders["steps"]  # (every worker took the same steps)
        metrics = {"loss": riders["loss_sum"] / jnp.maximum(taken, 1.0),
                   "steps_by_device": jnp.full(workers.mesh.size, jnp.round(taken).astype(jnp.int32)), **extra}
        return mean, coded, metrics

    return jax.jit(reduce)


def make_apply(mesh: Mesh, outer_tx: optax.GradientTransformation | None) -> Callable:
    """`(state, mean, moved, coded, anchor, taken, steps, loss_sum) -> state` over the whole mesh,
    nothing across workers: the outer step with `mean` (skipped unless `moved`), then each replica
    (as its round left it) restarts from the new global parameters minus its progress of the round
    (`anchor` - replica), which is the next delta in flight, with its `steps` and `loss_sum`
    ([workers]); the position and `state.step` move on by `taken`, the round counter by one."""
    outer_tx = default_outer(outer_tx)

    def apply(state: TrainState, mean: Any, moved: Any, coded: Any, anchor: Any, taken: Any, steps: jax.Array,
              loss_sum: jax.Array) -> TrainState:
        rows = state.sync.per_device[STATE_NAME]
        params, outer = outer_step(outer_tx, state, mean, moved)
        params = jax.lax.with_sharding_constraint(params, fsdp.shardings(params, mesh))
        outer = jax.lax.with_sharding_constraint(outer, fsdp.shardings(outer, mesh))
        layout = row_shardings(rows["params"], mesh)
        delta = jax.lax.with_sharding_constraint(jax.tree.map(lambda a, r: a - r, anchor, rows["params"]), layout)
        replica = jax.lax.with_sharding_constraint(jax.tree.map(lambda g, d: g[None] - d, params, delta), layout)
        sync = state.sync.replace(
            per_device={**state.sync.per_device, **coded.per_device,
                        STATE_NAME: {"params": replica, "opt_state": rows["opt_state"]},
                        PACE_NAME: {"position": state.sync.per_device[PACE_NAME]["position"] + taken},
                        OVERLAP_NAME: {"delta": delta, "steps": steps, "loss_sum": loss_sum}},
            shared={**state.sync.shared, **coded.shared, OUTER_NAME: (outer,),
                    PACE_NAME: {"round": state.sync.shared[PACE_NAME]["round"] + 1}})
        return state.replace(step=state.step + taken, params=params, sync=sync)

    return jax.jit(apply, donate_argnums=0)


class Overlapped(InFlight):
    """Rounds of H steps whose average is applied one round late, `shard_params` across workers
    (the module docstring); what jaxdp/loop/rounds.py drives, as rounds.py's `Overlapped`, with
    which it shares the average in flight (`InFlight`)."""

    def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, spec: Any, outer_tx: Any,
                 every: int, data: Callable[[int], Any], rows_per_step: int | None, *, stateful: bool,
                 grad_accum: int):
        self.mesh, self.data, self.pace = mesh, data, FixedSteps(every)
        self.whole = Workers(loss_fn, mesh, spec, stateful=stateful, grad_accum=grad_accum)
        self.sub = own_rows(mesh)
        self.mine = Workers(loss_fn, self.sub, spec, stateful=stateful, grad_accum=grad_accum)
        self.inner = make_inner(self.mine, tx)
        self.reduce = make_reduce(self.whole)
        self.apply = make_apply(mesh, outer_tx)
        self.coded = spec.codec is not None
        self.process = jax.process_index()
        self.first_row, self.local_rows = process_rows(mesh, rows_per_step)
        self.steps: int | None = None
        self.stopping: Callable[[], bool] = lambda: False
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxdp-overlap")

    def _batch(self, position: int) -> Any:
        sharding = NamedSharding(self.sub, P(tuple(self.sub.axis_names)))
        return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), self.data(position))

    def _landed(self, state: TrainState, pending: Any) -> tuple[Any, Any, Any, dict]:
        if pending is not None:
            mean, coded, metrics = pending.result()
            return mean, jnp.bool_(True), coded, {**metrics, "landed": True}
        zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p))(state.params)
        return zeros, jnp.bool_(False), state.sync.replace(per_device={}, shared={}), {"landed": False}

    def _by_worker(self, values: Any) -> jax.Array:
        """[workers] on the whole mesh: numpy values (every process's, the same), or this process's
        workers' on its rows."""
        sharding = NamedSharding(self.mesh, P(self.mesh.axis_names[0]) if self.whole.count > 1 else P())
        if isinstance(values, np.ndarray):
            return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])
        return reseat(values, self.mesh, sharding)

    def round(self, state: TrainState, round_index: int, warm: bool, limit: int | None = None
              ) -> tuple[TrainState, dict, int, float]:
        """Average the delta in flight while this round's H (or `limit`) inner steps train, then
        apply it. The metrics are the round before's ("landed" False: none)."""
        pending = self._in_flight(state)
        sub, replicas = self.sub, state.sync.per_device[STATE_NAME]
        anchor = jax.tree.map(jnp.copy, replicas["params"])  # (the inner steps donate the rows)
        rows = reseat(replicas, sub, jax.tree.map(lambda x: NamedSharding(sub, x.sharding.spec), replicas))
        view = replicated_to({"model_state": state.model_state, "rng": state.rng}, sub)
        rng = jax.random.fold_in(view["rng"], self.process)  # each process's own dropout keys
        at = int(np.asarray(state.sync.per_device[PACE_NAME]["position"].addressable_shards[0].data)[0])
        spec = P(sub.axis_names[0]) if len(sub.axis_names) > 1 else P()
        loss_sum = jax.device_put(np.zeros(self.mine.count, np.float32), NamedSharding(sub, spec))
        started = time.perf_counter()
        planned = self.pace.steps if limit is None else min(self.pace.steps, limit)
        for taken in range(planned):
            rows, loss_sum = self.inner(rows, view["model_state"], rng, np.int32(at + taken), loss_sum,
                                        self._batch(at + taken))
        jax.block_until_ready(loss_sum)
        mean, moved, coded, metrics = self._landed(state, pending)
        replicas = reseat(rows, self.mesh, jax.tree.map(lambda x: x.sharding, replicas))
        state = state.replace(sync=state.sync.replace(per_device={**state.sync.per_device, STATE_NAME: replicas}))
        state = self.apply(state, mean, moved, coded, anchor, np.int32(planned),
                           self._by_worker(np.full(self.whole.count, planned, np.int32)), self._by_worker(loss_sum))
        return state, {**metrics, "round": state.sync.shared[PACE_NAME]["round"]}, planned, time.perf_counter() - started

    def flush(self, state: TrainState) -> TrainState:
        """The end of the run: average the last round's delta and apply it with no new progress."""
        pending = self._in_flight(state)
        if pending is None:
            return state
        mean, coded, _ = pending.result()
        anchor = jax.tree.map(jnp.copy, state.sync.per_device[STATE_NAME]["params"])  # progress 0
        flight = state.sync.per_device[OVERLAP_NAME]
        zero = jax.jit(lambda x: x * 0)
        return self.apply(state, mean, jnp.bool_(True), coded, anchor, np.int32(0), zero(flight["steps"]),
                          zero(flight["loss_sum"]))

