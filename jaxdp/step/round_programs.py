"""The two programs of a round of local steps (jaxdp/step/rounds.py): an inner step on this process's
devices and the outer sync over the whole mesh, and the moves of per-device rows between the whole mesh
and this process's devices that put them together (no copies: the same buffers).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp.mesh import data_axes
from jaxdp.step.local_sgd import OUTER_NAME, STATE_NAME, default_outer
from jaxdp.step.state import TrainState
from jaxdp.sync.collectives import as_collective
from jaxdp.sync.codecs.plain import NoCompression
from jaxdp.sync.exchange import codec as codec_of, leaf_names, make_exchange

PACE_NAME = "paced"  # per_device[PACE_NAME] = {"position": int32 rows}; shared[PACE_NAME] = {"round": int32}


# ---------------------------------------------------------------------------------------------
# Moving rows between the whole mesh and this process's devices (no copies: the same buffers)
# ---------------------------------------------------------------------------------------------


def local_mesh(mesh: Mesh) -> Mesh:
    """This process's devices of `mesh`, in the mesh's order, with the same axis name."""
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return Mesh(np.array(mine), (data_axes(mesh),))


def _by_row(x: jax.Array) -> list[jax.Array]:
    return [s.data for s in sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)]


def rows_to(tree: Any, mesh: Mesh) -> Any:
    """Per-device rows (leading axis one per device) re-seated on `mesh` (the whole mesh or this
    process's devices): this process's rows, in order, become the rows on its devices there."""
    sharding = NamedSharding(mesh, P(data_axes(mesh)))
    return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
        (mesh.size, *x.shape[1:]), sharding, _by_row(x)), tree)


def replicated_to(tree: Any, mesh: Mesh) -> Any:
    """A replicated array's local copies as a replicated array of `mesh` (this process's devices)."""
    sharding = NamedSharding(mesh, P())

    def one(x: jax.Array) -> jax.Array:
        by_device = {s.device: s.data for s in x.addressable_shards}
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [by_device[d] for d in mesh.devices.flat])

    return jax.tree.map(one, tree)


# ---------------------------------------------------------------------------------------------
# The two programs: an inner step on this process's devices, the outer sync over the whole mesh
# ---------------------------------------------------------------------------------------------


def make_inner(local_grads: Callable, tx: optax.GradientTransformation, local: Mesh) -> Callable:
    """`(rows, view, position, loss_sum, batch) -> (rows, position, loss_sum)` over `local` (this
    process's devices), with no collective: each device's `tx` step on its replica. `view` is a
    replicated TrainState for the loss (model state, rng; params come from the rows, the step
    from the position, so dropout keys follow the data position)."""
    axis = data_axes(local)

    def device_inner(rows: Any, view: TrainState, position: jax.Array, loss_sum: jax.Array, batch: Any):
        mine = jax.tree.map(lambda x: x[0], rows)
        metrics, _, grads = local_grads(view.replace(params=mine["params"], step=position[0]), batch)
        updates, opt_state = tx.update(grads, mine["opt_state"], mine["params"])
        new = {"params": optax.apply_updates(mine["params"], updates), "opt_state": opt_state}
        return jax.tree.map(lambda x: x[None], new), position + 1, loss_sum + metrics["loss"]

    mapped = jax.shard_map(device_inner, mesh=local, in_specs=(P(axis), P(), P(axis), P(axis), P(axis)),
                           out_specs=(P(axis), P(axis), P(axis)), check_vma=False)
    return jax.jit(mapped, donate_argnums=0)  # (not the position and loss: the host waits on the last ones)


def outer_step(outer_tx: optax.GradientTransformation, state: TrainState, mean: Any, moved: jax.Array
                ) -> tuple[Any, Any]:
    """(global params, outer state) after `outer_tx` applies `mean` to `state.params`, or both as
    they were unless `moved` (nobody stepped: momentum would still move the parameters)."""
    names = leaf_names(state.params)
    leaves, treedef = jax.tree.flatten(state.params)
    before, kept = dict(zip(names, leaves)), state.sync.shared[OUTER_NAME][0]
    updates, outer = outer_tx.update(dict(zip(names, jax.tree.leaves(mean))), kept, before)
    after = optax.apply_updates(before, updates)
    params = jax.tree.unflatten(treedef, [jnp.where(moved, after[k], before[k]) for k in names])
    return params, jax.tree.map(lambda new, old: jnp.where(moved, new, old), outer, kept)


def slot_specs(slot: Any, axis: Any) -> Any:
    """shard_map specs of a SyncState: its per-device rows split over `axis`, its shared part replicated."""
    return slot.replace(per_device=jax.tree.map(lambda _: P(axis), slot.per_device),
                        shared=jax.tree.map(lambda _: P(), slot.shared))


def make_sync(mesh: Mesh, strategy: Any, compression: Any, outer_tx: optax.GradientTransformation | None) -> Callable:
    """`(state, steps, loss_sum) -> (state, metrics)` over the whole mesh: the example-weighted mean
    of the pseudo-gradients through the strategy (and codec), the outer step (skipped when no
    device took a step), every replica reset to the new global parameters, `state.step` the
    positions' sum over processes. `steps` and `loss_sum` are per-device rows of the round."""
    from jaxdp.step.train_step import state_specs

    axis, n = data_axes(mesh), mesh.size
    exchange = make_exchange(as_collective(strategy), axis, n, codec_of(compression) or NoCompression(), pseudo_gradient=True)
    outer_tx = default_outer(outer_tx)
    processes = len({d.process_index for d in mesh.devices.flat})

    def device_sync(state: TrainState, steps: jax.Array, loss_sum: jax.Array) -> tuple[TrainState, dict]:
        rows = state.sync.per_device[STATE_NAME]
        replica = jax.tree.map(lambda x: x[0], rows["params"])
        weight = steps[0].astype(jnp.float32)
        total = jax.lax.psum(weight, axis)
        share = weight * n / jnp.maximum(total, 1.0)  # so the exchange's mean is the weighted mean
        delta = jax.tree.map(lambda g, r: ((g - r) * share).astype(g.dtype), state.params, replica)
        mean, out, model_state, sync, extra = exchange.mean(delta, {"loss_sum": loss_sum[0]}, state.model_state,
                                                            state.sync, state.step)
        params, outer = outer_step(outer_tx, state, mean, total > 0)
        position = sync.per_device[PACE_NAME]["position"]
        rounds = sync.shared[PACE_NAME]["round"] + 1
        sync = sync.replace(
            per_device={**sync.per_device, STATE_NAME: {"params": jax.tree.map(lambda x: x[None], params),
                                                        "opt_state": rows["opt_state"]}},
            shared={**sync.shared, OUTER_NAME: (outer,), PACE_NAME: {"round": rounds}})
        # Every device of a process holds its position; with G devices each, the sum over devices is
        # G x the sum over processes, and n = G x processes.
        summed = jax.lax.psum(position[0], axis) * processes // n  # the positions' sum over processes
        done = (summed // processes).astype(jnp.int32)
        metrics = {"loss": out["loss_sum"] * n / jnp.maximum(total, 1.0), "round": rounds,
                   "steps_by_device": jax.lax.all_gather(steps[0], axis),
                   "positions_by_device": jax.lax.all_gather(position[0], axis), **extra}
        return state.replace(step=done, params=params, model_state=model_state, sync=sync), metrics

    def mapped(state: TrainState, steps: jax.Array, loss_sum: jax.Array) -> tuple[TrainState, dict]:
        specs = state_specs(state, axis)
        return jax.shard_map(device_sync, mesh=mesh, in_specs=(specs, P(axis), P(axis)), out_specs=(specs, P()),
                             check_vma=False)(state, steps, loss_sum)

    return jax.jit(mapped, donate_argnums=0)
