"""Overlapped rounds (`--sync-every H --overlap`): round k's average of pseudo-gradients runs while
round k + 1 trains, and is applied one round late, the same on every device. One rule (`Overlapped`),
two layouts: a replica per device (`Replicas`) and, with `--shard-params` across workers, each
worker's state cut over its own devices (`Cut`).

    result = jaxdp.fit(loss_fn, params, tx, data, steps=..., sync=jaxdp.SyncOptions(sync_every=8, overlap=True))

With replicas (`overlap=True` with `sync_every=H`, `Replicas`): every process takes H inner steps per
round, and round k's average (`make_reduce`, the only collective) runs on a thread of its own while
round k + 1 trains; then `make_apply` (no collective) takes the outer step with it and restarts
every replica from the new global parameters minus its own delta of round k + 1, which is the next
delta in flight (`per_device["overlap"]`, checkpointed, so a resume with an average in flight is
exact). The timed rounds' scope (jaxdp/step/rounds.py: an in-graph strategy with a fixed codec, one
fragment, no ZeRO-1, a flat mesh, no float model state), one round of delay, and the end of the run
applies the last average. Why a thread works, and what it needs of the CPU backend: docs/slow-links.md, "Overlap".

With `--shard-params` across workers (`Cut`): the same rule (one round of delay, the
same on every worker; tests/test_overlap.py's reference loop), with hsdp.py's layout: a worker is one row of the
("hosts", "local") mesh, its replica and inner optimizer state `[workers, *leaf]` rows cut over its
devices (`state.sync.per_device["local_sgd"]`), the global parameters and the outer state cut like
the parameters. Three programs a round, as there:

* the inner steps (`sharded_inner`), over this process's rows of the mesh only: each worker's
  gradient (its blocks gathered one at a time where the model hands them over) and its `tx` step,
  no collective between workers, so they run while the average is in flight;
* the average (`sharded_reduce`), over the whole mesh, on a thread of its own: the delta in flight
  (`per_device["overlap"]["delta"]`, rows like the replicas) through the strategy and the codec across
  workers, device (h, l) with the devices (h', l), each sending its slice (hsdp.Workers.mean), the
  loss riding in the first collective; the only program that crosses between workers;
* the apply (`sharded_apply`), over the whole mesh with nothing across workers: the outer step with
  the average, then every replica restarts from the new global parameters minus its own delta of
  the round just trained, the next delta in flight.

Each worker takes the same H steps a round (`sync_every`); the last round what is left of `steps`.
A checkpoint holds the delta in flight, so a resume is exact. Scope: as with replicas (one
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

from jaxdp.mesh import data_axes, state_specs
from jaxdp.step import fsdp
from jaxdp.step.hsdp import Workers, row_shardings, rows as stacked_rows
from jaxdp.step.local_sgd import OUTER_NAME, STATE_NAME, default_outer
from jaxdp.step import rounds as paced
from jaxdp.step.rounds import (OVERLAP_NAME, PACE_NAME, OwnRows, Rounds, outer_step, process_rows, replicated_to,
                               slot_specs)
from jaxdp.step.state import TrainState
from jaxdp.sync.codecs.base import only as codec_slot
from jaxdp.sync.codecs.plain import NoCompression
from jaxdp.sync.collectives import as_collective
from jaxdp.sync.exchange import codec as codec_of, make_exchange


def make_reduce(mesh: Mesh, strategy: Any, compression: Any) -> Callable:
    """`(coded, delta, steps, loss_sum, step) -> (mean, coded, metrics)` over the whole mesh:
    the mean of the round's pseudo-gradients through the strategy (and codec), the loss riding in
    the same collective, and nothing else: the overlapped run's only collective. Every device took
    the same H steps, so unlike `make_sync` no weights need summing first. `coded` is the codec's
    slot of `state.sync` (a SyncState holding only it), returned updated."""
    axis, n = data_axes(mesh), mesh.size
    exchange = make_exchange(as_collective(strategy), axis, n, codec_of(compression) or NoCompression(), pseudo_gradient=True)

    def device_reduce(coded: Any, delta: Any, steps: jax.Array, loss_sum: jax.Array, step: jax.Array):
        total = steps[0].astype(jnp.float32) * n  # every device took the same steps: all weights are 1
        mean, out, _, coded, extra = exchange.mean(jax.tree.map(lambda d: d[0], delta), {"loss_sum": loss_sum[0]}, {},
                                                   coded, step)
        by_device = jnp.full(n, steps[0])
        metrics = {"loss": out["loss_sum"] * n / jnp.maximum(total, 1.0), "steps_by_device": by_device, **extra}
        return mean, coded, metrics

    def mapped(coded: Any, delta: Any, steps: jax.Array, loss_sum: jax.Array, step: jax.Array):
        coded_specs = slot_specs(coded, axis)
        return jax.shard_map(device_reduce, mesh=mesh, in_specs=(coded_specs, P(axis), P(axis), P(axis), P()),
                             out_specs=(P(), coded_specs, P()), check_vma=False)(coded, delta, steps, loss_sum, step)

    return jax.jit(mapped)


def make_apply(mesh: Mesh, outer_tx: optax.GradientTransformation | None) -> Callable:
    """`(state, mean, moved, coded, anchor, taken, steps, loss_sum) -> state` over the whole mesh, with
    no collective: the outer step with the mean of the round before (skipped unless `moved`: nothing
    was in flight), then every replica (the state's rows, as the round left them) restarts from the
    new global parameters plus its own progress of the round (replica - `anchor`, not averaged yet),
    which becomes the delta in flight. The step is the data position, which the inner steps moved
    (every process takes the same steps; `taken` is the cut layout's, `sharded_apply`)."""
    axis = data_axes(mesh)
    outer_tx = default_outer(outer_tx)

    def device_apply(state: TrainState, mean: Any, moved: jax.Array, coded: Any, anchor: Any,
                     steps: jax.Array, loss_sum: jax.Array) -> TrainState:
        rows = state.sync.per_device[STATE_NAME]  # the replicas as the round left them
        params, outer = outer_step(outer_tx, state, mean, moved)
        mine, start = jax.tree.map(lambda x: x[0], rows["params"]), jax.tree.map(lambda x: x[0], anchor)
        delta = jax.tree.map(lambda a, r: a - r, start, mine)  # this round's pseudo-gradient, in flight
        replica = jax.tree.map(lambda g, d: g - d, params, delta)
        position = state.sync.per_device[PACE_NAME]["position"]
        sync = state.sync.replace(
            per_device={**state.sync.per_device, **coded.per_device,
                        STATE_NAME: {"params": jax.tree.map(lambda x: x[None], replica), "opt_state": rows["opt_state"]},
                        OVERLAP_NAME: {"delta": jax.tree.map(lambda x: x[None], delta), "steps": steps,
                                       "loss_sum": loss_sum}},
            shared={**state.sync.shared, **coded.shared, OUTER_NAME: (outer,),
                    PACE_NAME: {"round": state.sync.shared[PACE_NAME]["round"] + 1}})
        return state.replace(step=position[0], params=params, sync=sync)

    def mapped(state: TrainState, mean: Any, moved: jax.Array, coded: Any, anchor: Any, taken: Any,
               steps: jax.Array, loss_sum: jax.Array) -> TrainState:
        specs = state_specs(state, axis)
        coded_specs = slot_specs(coded, axis)
        return jax.shard_map(device_apply, mesh=mesh,
                             in_specs=(specs, P(), P(), coded_specs, P(axis), P(axis), P(axis)),
                             out_specs=specs, check_vma=False)(state, mean, moved, coded, anchor, steps, loss_sum)

    return jax.jit(mapped, donate_argnums=0)


class Replicas(OwnRows):
    """The layout of overlapped rounds with a replica per device: the timed rounds' rows
    (jaxdp/step/rounds.py, `OwnRows`: `start`, `train`, `back`) and the average's two programs."""

    def __init__(self, local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, strategy: Any,
                 compression: Any, outer_tx: Any, data: Callable[[int], Any]):
        paced.check(lambda *_: 0, mesh)  # a flat mesh
        super().__init__(local_grads, tx, mesh, data)
        self.reduce = make_reduce(mesh, strategy, compression)
        self.apply = make_apply(mesh, outer_tx)
        self.coded = codec_of(compression) is not None

    @staticmethod
    def init(params: Any, mesh: Mesh) -> dict:
        """per_device[OVERLAP_NAME] of a new state: nothing in flight (no delta, 0 steps, 0 loss)."""
        rows = NamedSharding(mesh, P(data_axes(mesh)))

        def zeros(shape: tuple, dtype: Any) -> jax.Array:
            host = np.zeros((mesh.size, *shape), dtype)
            return jax.make_array_from_callback(host.shape, rows, lambda index: host[index])

        return {OVERLAP_NAME: {"delta": jax.tree.map(lambda x: zeros(x.shape, x.dtype), params),
                               "steps": zeros((), np.int32), "loss_sum": zeros((), np.float32)}}


# ---------------------------------------------------------------------------------------------
# The same rule with --shard-params across workers: each worker's state cut over its own devices
# ---------------------------------------------------------------------------------------------


def own_rows(mesh: Mesh) -> Mesh:
    """This process's rows of `mesh` (its workers), with the mesh's axis names."""
    devices = np.asarray(mesh.devices)
    if devices.ndim == 1:
        return mesh
    mine = [h for h in range(devices.shape[0]) if devices[h, 0].process_index == jax.process_index()]
    return Mesh(devices[mine], mesh.axis_names, axis_types=mesh.axis_types)


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


def sharded_inner(workers: Workers, tx: optax.GradientTransformation) -> Callable:
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


def sharded_reduce(workers: Workers) -> Callable:
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


def sharded_apply(mesh: Mesh, outer_tx: optax.GradientTransformation | None) -> Callable:
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


class Cut:
    """The layout of overlapped rounds with `shard_params` across workers: each worker's replica cut
    over its own devices (hsdp.py's rows), the three programs, and a round's inner steps on this
    process's rows of the mesh (`start`, `train`, `back`, as `Replicas`')."""

    def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, spec: Any, outer_tx: Any,
                 data: Callable[[int], Any], *, stateful: bool, grad_accum: int):
        self.mesh, self.data, self.sub = mesh, data, own_rows(mesh)
        self.whole = Workers(loss_fn, mesh, spec, stateful=stateful, grad_accum=grad_accum)
        self.mine = Workers(loss_fn, self.sub, spec, stateful=stateful, grad_accum=grad_accum)
        self.inner = sharded_inner(self.mine, tx)
        self.reduce = sharded_reduce(self.whole)
        self.apply = sharded_apply(mesh, outer_tx)
        self.coded = spec.codec is not None
        self.process = jax.process_index()

    @staticmethod
    def init(params: Any, mesh: Mesh) -> dict:
        """per_device[OVERLAP_NAME] of a new state: nothing in flight (a zero delta per worker, 0 steps,
        0 loss), the delta's rows cut like the replicas."""
        workers = mesh.shape[mesh.axis_names[0]] if len(mesh.axis_names) > 1 else 1
        by_worker = NamedSharding(mesh, P(mesh.axis_names[0] if workers > 1 else None))
        zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), params)
        return {OVERLAP_NAME: {"delta": stacked_rows(fsdp.place(zeros, mesh), mesh),
                               "steps": jax.device_put(np.zeros(workers, np.int32), by_worker),
                               "loss_sum": jax.device_put(np.zeros(workers, np.float32), by_worker)}}

    def start(self, state: TrainState) -> tuple[tuple, int]:
        sub, replicas = self.sub, state.sync.per_device[STATE_NAME]
        rows = reseat(replicas, sub, jax.tree.map(lambda x: NamedSharding(sub, x.sharding.spec), replicas))
        view = replicated_to({"model_state": state.model_state, "rng": state.rng}, sub)
        self.model_state, self.rng = view["model_state"], jax.random.fold_in(view["rng"], self.process)
        spec = P(sub.axis_names[0]) if len(sub.axis_names) > 1 else P()
        loss_sum = jax.device_put(np.zeros(self.mine.count, np.float32), NamedSharding(sub, spec))
        return (rows, loss_sum), int(np.asarray(state.sync.per_device[PACE_NAME]["position"].addressable_shards[0].data)[0])

    def train(self, rows: Any, loss_sum: jax.Array, position: int) -> tuple:
        batch = jax.tree.map(lambda x: jax.device_put(np.asarray(x), NamedSharding(self.sub, P(tuple(self.sub.axis_names)))),
                             self.data(position))
        return self.inner(rows, self.model_state, self.rng, np.int32(position), loss_sum, batch)

    def back(self, state: TrainState, carry: tuple, planned: int) -> tuple[TrainState, jax.Array, jax.Array]:
        rows, loss_sum = carry
        replicas = reseat(rows, self.mesh, jax.tree.map(lambda x: x.sharding, state.sync.per_device[STATE_NAME]))
        state = state.replace(sync=state.sync.replace(per_device={**state.sync.per_device, STATE_NAME: replicas}))
        return state, self._by_worker(np.full(self.whole.count, planned, np.int32)), self._by_worker(loss_sum)

    def _by_worker(self, values: Any) -> jax.Array:
        """[workers] on the whole mesh: numpy values (every process's, the same), or this process's
        workers' on its rows."""
        sharding = NamedSharding(self.mesh, P(self.mesh.axis_names[0]) if self.whole.count > 1 else P())
        if isinstance(values, np.ndarray):
            return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])
        return reseat(values, self.mesh, sharding)


_zeros = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))


# ---------------------------------------------------------------------------------------------
# The rule, on either layout
# ---------------------------------------------------------------------------------------------


class Overlapped:
    """Rounds of H steps whose average is applied one round late (`--overlap`, the module docstring),
    on a layout (`Replicas` or `Cut`): round k + 1 trains while round k's pseudo-gradients are
    averaged. The average is the one collective program, dispatched from a thread of its own: on
    JAX's CPU client a program runs on the thread that dispatches it, so from the training thread it
    would wait for the inner steps (and they for it); from a second thread the two run at the same
    time, given two CPU workers (a one-core process: jaxdp.cluster.runtime.two_cpu_workers; docs/slow-links.md).
    The inner steps and the apply run no collective, so no two collective programs are ever in
    flight at once, and every process dispatches them in the same order. What jaxdp/loop/rounds.py
    drives: `round`, then `flush` at the end."""

    def __init__(self, layout: Replicas | Cut, every: int, rows_per_step: int | None):
        self.layout, self.every, self.mesh = layout, every, layout.mesh
        self.first_row, self.local_rows = process_rows(layout.mesh, rows_per_step)
        self.steps: int | None = None
        self.stopping: Callable[[], bool] = lambda: False
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxdp-overlap")

    def close(self) -> None:
        self.thread.shutdown(wait=True)

    def _in_flight(self, state: TrainState) -> Any:
        """Start averaging the delta the state holds (on the thread); None if it holds none."""
        flight = state.sync.per_device[OVERLAP_NAME]
        if not int(np.asarray(flight["steps"].addressable_shards[0].data)[0]):
            return None
        coded = codec_slot(state.sync) if self.layout.coded else state.sync.replace(per_device={}, shared={})
        args = (coded, flight["delta"], flight["steps"], flight["loss_sum"], state.step)
        return self.thread.submit(lambda: jax.block_until_ready(self.layout.reduce(*args)))

    def _landed(self, state: TrainState, pending: Any) -> tuple[Any, Any, Any, dict]:
        """(mean, moved, coded, metrics) of the average in flight, once it has landed; with none in
        flight, a zero mean and no outer step (the codec's slot stays as it is)."""
        if pending is None:
            return _zeros(state.params), jnp.bool_(False), state.sync.replace(per_device={}, shared={}), {"landed": False}
        mean, coded, metrics = pending.result()
        return mean, jnp.bool_(True), coded, {**metrics, "landed": True}

    def round(self, state: TrainState, round_index: int, warm: bool, limit: int | None = None
              ) -> tuple[TrainState, dict, int, float]:
        """Average the delta in flight while this round's H (or `limit`) inner steps train, then apply
        it. The metrics are the round before's (its loss is known now; "landed" False: none)."""
        pending = self._in_flight(state)
        anchor = jax.tree.map(jnp.copy, state.sync.per_device[STATE_NAME]["params"])  # (the inner steps donate the rows)
        carry, at = self.layout.start(state)
        started = time.perf_counter()
        planned = self.every if limit is None else min(self.every, limit)
        for taken in range(planned):
            carry = self.layout.train(*carry, at + taken)
        jax.block_until_ready(carry[-1])
        mean, moved, coded, metrics = self._landed(state, pending)
        state, steps, loss_sum = self.layout.back(state, carry, planned)
        state = self.layout.apply(state, mean, moved, coded, anchor, np.int32(planned), steps, loss_sum)
        return state, {**metrics, "round": state.sync.shared[PACE_NAME]["round"]}, planned, time.perf_counter() - started

    def flush(self, state: TrainState) -> TrainState:
        """The end of the run: average the last round's delta and apply it with no new progress, so
        every replica equals the global parameters and nothing is in flight."""
        pending = self._in_flight(state)
        if pending is None:
            return state
        mean, coded, _ = pending.result()
        anchor = jax.tree.map(jnp.copy, state.sync.per_device[STATE_NAME]["params"])  # progress 0
        flight = state.sync.per_device[OVERLAP_NAME]
        zero = jax.jit(lambda x: x * 0)
        return self.layout.apply(state, mean, jnp.bool_(True), coded, anchor, np.int32(0), zero(flight["steps"]),
                                 zero(flight["loss_sum"]))

    def last_round_limit(self, last: list[int] | None, remaining: int) -> int | None:
        return remaining if remaining < self.every else None

    by_process = Rounds.by_process
